"""Collaborative training time: hivemind_ext.Optimizer next to hivemind.Optimizer, the same swarm in the same run.

For each implementation, a swarm of peer processes on 127.0.0.1 (default 8, of which 3 in client
mode) trains the digits MLP of ``hivemind_ext/demo`` (``hivemind-ext train``) (scikit-learn's bundled digits, one train
shard per peer) with ``target_batch_size`` 128 until the global epoch reaches E. Peers are uneven on
purpose: each step draws its batch size from 4..16 and sleeps 5..50 ms on top of the real work (a
stand-in for a bigger model on mixed hardware), seeded, so both implementations see the same peers.
Both optimizers are driven by the same code with the same keywords (ours is a drop-in).

Printed per implementation:
- wall time from all peers released to train (after every optimizer is built) to the last peer at epoch E;
- the fraction of their training time that peers spend blocked inside ``opt.step()``;
- the held-out accuracy at epoch E (mean over peers), the largest peak RSS of a peer process (its
  libp2p daemon not included), the samples fed per epoch (all peers, divided
  by E: includes samples a peer dropped when it fell behind and downloaded the state) and, for ours,
  the median number of samples that went into an epoch's average (target: 128; hivemind.Optimizer
  does not expose that figure);
then the ratios (speedup = hivemind's time / ours; accuracy difference), and the closing JSON line.
A peer that fails or does not reach epoch E within ``--timeout`` s is reported; the benchmark goes on.

    python benchmarks/optimizer.py
    python benchmarks/optimizer.py --impls hivemind --epochs 10 --peers 4 --clients 1
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Result, emit, higher_is_better, lower_is_better, start

from hivemind_ext.demo.data import load_data
from hivemind_ext.demo.display import ProgressDisplay
from hivemind_ext.demo.local_swarm import run_local_swarm
from hivemind_ext.demo.peer import OPTIMIZERS, PeerConfig, optimizer_class, swarm_configs


@dataclass
class Measurement:
    """One implementation's run; None where the run did not produce the figure."""

    wall_seconds: float | None = None
    blocked_fraction: float | None = None
    accuracy: float | None = None
    samples_per_epoch: float | None = None
    averaged_per_epoch: float | None = None  # median samples in an epoch's average (hivemind_ext only)
    peak_rss_mib: float | None = None  # the largest peak RSS of a peer process (daemons not included)
    total_seconds: float = 0.0
    startup_seconds: float | None = None  # from launching the processes to every optimizer built
    note: str = ""  # why figures are missing: failed peers, a timeout, an import error


def measure(impl: str, args: argparse.Namespace) -> Measurement:
    try:
        optimizer_class(impl)
    except ImportError as e:
        return Measurement(note=f"not available: {e}")
    base = PeerConfig(
        index=0,
        data=load_data(seed=args.seed),
        optimizer=impl,
        run_id=f"bench_{impl}",
        epochs=args.epochs,
        target_batch_size=args.target_batch_size,
        batch_size=tuple(args.batch_size),
        compute_time=tuple(args.compute_time),
        lr=args.lr,
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=args.averaging_timeout,
        seed=args.seed,
    )
    display = ProgressDisplay(args.epochs, sys.stdout, period=15.0)

    def on_event(kind: str, index: int, payload: dict) -> None:
        if kind == "progress":
            display.update(index, payload["epoch"], payload["loss"], payload["swarm"])
        elif kind == "error":
            display.close()
            print(f"{impl} peer {index} failed: {payload['traceback'].strip()}", file=sys.stderr, flush=True)

    started, launched_at = time.monotonic(), time.time()
    try:
        run = run_local_swarm(swarm_configs(base, args.peers, args.clients), timeout=args.timeout, on_event=on_event)
    except RuntimeError as e:  # the swarm did not start
        return Measurement(total_seconds=time.monotonic() - started, note=f"failed to start: {e}")
    finally:
        display.close()
    done = [peer.done for peer in run.finished]
    failed = [peer for peer in run.peers if peer.done is None or peer.error]
    result = Measurement(wall_seconds=run.wall_seconds, total_seconds=time.monotonic() - started)
    if run.started_at is not None:
        result.startup_seconds = run.started_at - launched_at
    if done:
        train = sum(d["train_seconds"] for d in done)
        result.blocked_fraction = sum(d["step_seconds"] for d in done) / train if train > 0 else None
        result.accuracy = statistics.mean(d["accuracy"] for d in done)
        if not failed:  # samples per epoch only make sense when every peer took part to the end
            result.samples_per_epoch = sum(d["samples"] for d in done) / args.epochs
        averaged = [n for d in done for n in d.get("averaged_samples", [])]
        result.averaged_per_epoch = statistics.median(averaged) if averaged else None
        peaks = [d["peak_rss_mib"] for d in done if d.get("peak_rss_mib") is not None]
        result.peak_rss_mib = max(peaks) if peaks else None
    if failed:
        reasons = "; ".join(
            f"peer {p.index}: {(p.error or 'no result').strip().splitlines()[-1][:120]}" for p in failed[:3]
        )
        result.note = f"{len(failed)} of {args.peers} peers did not finish ({reasons})"
    return result


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:{spec}}{suffix}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--impls",
        nargs="+",
        default=["hivemind", "hivemind_ext"],
        choices=OPTIMIZERS,
        help="run these, in order",
    )
    parser.add_argument("--epochs", type=int, default=20, help="global epochs E to reach (default: %(default)s)")
    parser.add_argument("--peers", type=int, default=8, help="peer processes, clients included (default: 8)")
    parser.add_argument("--clients", type=int, default=3, help="of them in client mode (default: 3)")
    parser.add_argument("--target-batch-size", type=int, default=128, help="samples per epoch (default: 128)")
    parser.add_argument(
        "--batch-size", type=int, nargs=2, default=[4, 16], metavar=("LOW", "HIGH"), help="per step (default: 4 16)"
    )
    parser.add_argument(
        "--compute-time",
        type=float,
        nargs=2,
        default=[0.005, 0.05],
        metavar=("LOW", "HIGH"),
        help="seconds slept per step on top of the real work (default: 0.005 0.05)",
    )
    parser.add_argument("--lr", type=float, default=0.01, help="Adam learning rate (default: 0.01)")
    parser.add_argument("--matchmaking-time", type=float, default=1.5, help="(default: 1.5)")
    parser.add_argument("--averaging-timeout", type=float, default=10.0, help="(default: 10)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=180.0,
        help="per implementation: give up on peers not at epoch E this many s after the start (default: 180)",
    )
    parser.add_argument("--seed", type=int, default=0, help="data split, shards, batch sizes, compute times")
    args = start(parser)
    if not 0 <= args.clients < args.peers:
        parser.error("need 0 <= --clients < --peers (the first peer is the bootstrap)")
    low, high = args.batch_size
    case = (
        f"{args.peers} peers ({args.clients} client mode), batch {low}-{high}, "
        f"target {args.target_batch_size}, {args.epochs} epochs"
    )
    print(f"case: {case}, {args.compute_time[0] * 1e3:g}-{args.compute_time[1] * 1e3:g} ms compute per step")
    measured: dict[str, Measurement] = {}
    for impl in args.impls:
        print(f"--- {impl}.Optimizer", flush=True)
        m = measured[impl] = measure(impl, args)
        print(
            f"{impl:13s} time to epoch {args.epochs}: {fmt(m.wall_seconds, '.2f', ' s')} | "
            f"blocked in opt.step(): {fmt(m.blocked_fraction, '.1%')} | "
            f"held-out accuracy: {fmt(m.accuracy, '.4f')} | samples fed per epoch: {fmt(m.samples_per_epoch, '.0f')} "
            f"(target {args.target_batch_size}), median in an epoch's average: {fmt(m.averaged_per_epoch, '.0f')} | "
            f"peak RSS of a peer: {fmt(m.peak_rss_mib, '.0f', ' MiB')} | {m.total_seconds:.0f} s in all, "
            f"start-up {fmt(m.startup_seconds, '.0f', ' s')}" + (f" | {m.note}" if m.note else ""),
            flush=True,
        )
    ours, theirs = measured.get("hivemind_ext", Measurement()), measured.get("hivemind", Measurement())
    if "hivemind_ext" in measured and "hivemind" in measured:
        speedup = theirs.wall_seconds / ours.wall_seconds if ours.wall_seconds and theirs.wall_seconds else None
        difference = ours.accuracy - theirs.accuracy if None not in (ours.accuracy, theirs.accuracy) else None
        print(
            f"speedup (hivemind time / ours): {fmt(speedup, '.2f', 'x')} | "
            f"accuracy difference (ours - hivemind): {fmt(difference, '+.4f')}"
        )

    def rounded(value: float | None, digits: int = 4) -> float | None:
        return None if value is None else round(value, digits)

    blocked, E = "fraction of time blocked in opt.step()", args.epochs
    results: list[Result] = [
        lower_is_better(case, f"s to epoch {E}", rounded(ours.wall_seconds, 3), rounded(theirs.wall_seconds, 3)),
        lower_is_better(case, blocked, rounded(ours.blocked_fraction), rounded(theirs.blocked_fraction)),
        higher_is_better(case, "held-out accuracy", rounded(ours.accuracy), rounded(theirs.accuracy)),
        Result(
            case,
            f"samples fed per epoch (target {args.target_batch_size})",
            rounded(ours.samples_per_epoch, 1),
            rounded(theirs.samples_per_epoch, 1),
            None,
        ),
        Result(case, "median samples in an epoch's average", rounded(ours.averaged_per_epoch, 1), None, None),
        lower_is_better(
            case, "peak RSS of a peer process (MiB)", rounded(ours.peak_rss_mib, 1), rounded(theirs.peak_rss_mib, 1)
        ),
    ]
    emit("optimizer", results)


if __name__ == "__main__":
    main()
