"""Train a real model with a local swarm of peers: hivemind_ext.Optimizer on scikit-learn's bundled digits.

What it does. By default this starts a swarm of 4 peer processes on this machine (127.0.0.1 only,
nothing leaves it), one of them in client mode (it accepts no incoming connections, like a peer
behind a firewall). The first peer's DHT is the bootstrap of the others. Every peer trains the same
small MLP on its own shard of the digits images (8x8 pixels, 10 classes) with a collaborative
``Optimizer``: each peer feeds batches of 16, the swarm accumulates 256 samples between global
updates (one "epoch"), then averages gradients and takes one Adam step together. After 20 epochs
every peer reports its accuracy on held-out images it never trained on, e.g.::

    epoch 20/20 | samples 0/256 | 1164 samples/s | peers online 4 (1 client mode) | loss 0.837 | held-out accuracy 0.908
    all 4 peers were up 30.6 s after the launch
    peer 0: held-out accuracy 0.914 | 320 steps, 5120 samples, 81% of the time in opt.step()
    ...
    peer 3 (client mode): held-out accuracy 0.914 | 60 steps, 960 samples, 100% of the time in opt.step()
    training took 13.1 s from the start to the last peer at the goal epoch; 44.6 s in all
    held-out accuracy: 0.9083 (mean of 4 peers, min 0.8944, max 0.9139)

(figures of hivemind.Optimizer on two busy CPU cores; most of the minute goes into starting the
peers). The exit code is 0 only if every peer reached the last epoch; peers that crash or hang are
reported and the run exits with 1.

How to run::

    python examples/train_digits.py                              # 4 peers (1 in client mode), 20 epochs
    python examples/train_digits.py --peers 8 --clients 3 --epochs 30
    python examples/train_digits.py --optimizer hivemind         # the same run with hivemind.Optimizer

Join a running swarm as one more peer (from another terminal, or another machine when the swarm
listens on a reachable address): the swarm prints the multiaddrs of its first peer, pass them here::

    python examples/train_digits.py --initial-peers /ip4/127.0.0.1/tcp/41234/p2p/12D3KooW... [--client-mode]

A joining peer downloads the current model and optimizer state from the swarm, trains on a seeded
shuffle of the whole train split until the swarm reaches ``--epochs``, and prints its own
multiaddrs so that further peers can join through it.

Needs scikit-learn (``pip install -e ".[examples]"``). Ctrl-C stops every peer process.
"""

from __future__ import annotations

import argparse
import math
import signal
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from digits_swarm import (
    LOOPBACK,
    OPTIMIZERS,
    PeerConfig,
    ProgressDisplay,
    SwarmRun,
    load_data,
    optimizer_class,
    run_local_swarm,
    swarm_configs,
    train_peer,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    swarm = parser.add_argument_group("the local swarm (default mode)")
    swarm.add_argument("--peers", type=int, default=4, help="peer processes to start (default: %(default)s)")
    swarm.add_argument(
        "--clients", type=int, default=1, help="how many of them run in client mode, the last ones (default: 1)"
    )
    swarm.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="give up on peers not done this many seconds after the start (default: 300)",
    )
    join = parser.add_argument_group("joining an existing swarm as one peer")
    join.add_argument(
        "--initial-peers",
        nargs="+",
        metavar="MULTIADDR",
        help="multiaddrs of peers already in the swarm; run as a single peer that joins them",
    )
    join.add_argument("--client-mode", action="store_true", help="accept no incoming connections (behind NAT)")
    join.add_argument(
        "--host-maddrs",
        nargs="+",
        default=list(LOOPBACK),
        metavar="MULTIADDR",
        help="where this peer listens (default: /ip4/127.0.0.1/tcp/0; /ip4/0.0.0.0/tcp/0 to be reachable from others)",
    )
    training = parser.add_argument_group("training (the same on every peer of a run)")
    training.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="hivemind_ext",
        help="hivemind_ext.Optimizer or hivemind.Optimizer, the same keywords (default: %(default)s)",
    )
    training.add_argument("--run-id", default="digits", help="name of the run, shared by its peers (default: digits)")
    training.add_argument("--epochs", type=int, default=20, help="global epochs to train (default: %(default)s)")
    training.add_argument(
        "--target-batch-size",
        type=int,
        default=256,
        help="samples the swarm accumulates per epoch, i.e. per global optimizer step (default: %(default)s)",
    )
    training.add_argument("--batch-size", type=int, default=16, help="samples per local step (default: 16)")
    training.add_argument("--lr", type=float, default=0.01, help="Adam learning rate (default: %(default)s)")
    training.add_argument(
        "--matchmaking-time", type=float, default=1.5, help="seconds to gather a group (default: %(default)s)"
    )
    training.add_argument(
        "--averaging-timeout",
        type=float,
        default=10.0,
        help="seconds before an averaging round is given up (default: 10)",
    )
    training.add_argument(
        "--compute-time",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="sleep this long per local step on top of the real work, to act like a bigger model (default: 0)",
    )
    training.add_argument("--seed", type=int, default=0, help="data split, shards and batch order (default: 0)")
    training.add_argument("--verbose", action="store_true", help="let the optimizer log its internal events")
    training.add_argument(
        "--log-level",
        default="error",
        choices=["debug", "info", "warning", "error"],
        help="of hivemind's and hivemind_ext's loggers in every peer (default: error; --verbose needs info)",
    )
    args = parser.parse_args(argv)
    if args.initial_peers is None:
        if args.peers < 1 or not 0 <= args.clients < args.peers:
            parser.error("need --peers >= 1 and 0 <= --clients < --peers (the first peer is the bootstrap)")
    if args.epochs < 1 or args.batch_size < 1 or args.target_batch_size < 1 or args.compute_time < 0:
        parser.error("--epochs, --batch-size and --target-batch-size must be positive, --compute-time not negative")
    return args


def base_config(args: argparse.Namespace) -> PeerConfig:
    return PeerConfig(
        index=0,
        data=load_data(seed=args.seed),
        optimizer=args.optimizer,
        run_id=args.run_id,
        epochs=args.epochs,
        target_batch_size=args.target_batch_size,
        batch_size=(args.batch_size, args.batch_size),
        lr=args.lr,
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=args.averaging_timeout,
        compute_time=(args.compute_time, args.compute_time),
        seed=args.seed,
        verbose=args.verbose,
        log_level=args.log_level,
    )


def describe_peer(name: str, client_mode: bool, done: dict[str, Any]) -> str:
    role = " (client mode)" if client_mode else ""
    blocked = done["blocked_fraction"]
    blocked_text = f"{blocked:.0%}" if not math.isnan(blocked) else "-"
    return (
        f"{name}{role}: held-out accuracy {done['accuracy']:.3f} | {done['steps']} steps, "
        f"{done['samples']} samples, {blocked_text} of the time in opt.step()"
    )


def run_swarm(args: argparse.Namespace) -> int:
    base = base_config(args)
    configs = swarm_configs(base, args.peers, args.clients)
    optimizer_name = f"{args.optimizer}.Optimizer"
    print(
        f"starting {args.peers} peers ({args.clients} in client mode) on 127.0.0.1 with {optimizer_name}: "
        f"{len(base.data.train_y)} training images in {args.peers} shards, {len(base.data.test_y)} held out; "
        f"{args.epochs} epochs of {args.target_batch_size} samples, batches of {args.batch_size}",
        flush=True,
    )
    display = ProgressDisplay(args.epochs, sys.stdout)

    def on_event(kind: str, index: int, payload: dict[str, Any]) -> None:
        if kind == "dht_ready" and index == 0:
            print(f"peer 0 listens on {' '.join(payload['maddrs'])}", flush=True)
            print(f"  (join with: python {sys.argv[0]} --initial-peers {payload['maddrs'][0]})", flush=True)
        elif kind == "progress":
            display.update(index, payload["epoch"], payload["loss"], payload["swarm"], payload.get("accuracy"))
        elif kind == "done":
            display.done(index, payload)
        elif kind == "error":
            display.close()
            print(f"peer {index} failed: {payload['traceback'].rstrip()}", file=sys.stderr, flush=True)

    started, launched_at = time.monotonic(), time.time()
    try:
        run = run_local_swarm(configs, timeout=args.timeout, on_event=on_event)
    except RuntimeError as e:  # the swarm did not start; the failing peer's traceback is printed above
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        display.close()
    if run.started_at is not None:
        print(f"all {args.peers} peers were up {run.started_at - launched_at:.1f} s after the launch", flush=True)
    report_swarm(run, time.monotonic() - started)
    return 0 if run.ok else 1


def report_swarm(run: SwarmRun, total_seconds: float) -> None:
    for peer in run.peers:
        if peer.done is not None:
            print(describe_peer(f"peer {peer.index}", peer.client_mode, peer.done), flush=True)
        else:
            print(f"peer {peer.index}: FAILED: {(peer.error or 'unknown').strip().splitlines()[-1]}", flush=True)
    accuracies = [peer.done["accuracy"] for peer in run.finished]
    wall = run.wall_seconds
    print(
        f"training took {wall:.1f} s from the start to the last peer at the goal epoch; {total_seconds:.1f} s in all"
        if wall is not None
        else f"the run did not finish on every peer ({total_seconds:.1f} s in all)",
        flush=True,
    )
    if accuracies:
        print(
            f"held-out accuracy: {statistics.mean(accuracies):.4f} (mean of {len(accuracies)} peers, "
            f"min {min(accuracies):.4f}, max {max(accuracies):.4f})",
            flush=True,
        )


def run_joining_peer(args: argparse.Namespace) -> int:
    base = base_config(args)
    config = replace(base, client_mode=args.client_mode, host_maddrs=tuple(args.host_maddrs))
    display = ProgressDisplay(args.epochs, sys.stdout)

    def report(kind: str, payload: dict[str, Any]) -> None:
        if kind == "dht_ready":
            print(f"this peer's multiaddrs (others can join with --initial-peers): {' '.join(payload['maddrs'])}")
        elif kind == "ready":
            print(f"joined run {args.run_id!r}; training until epoch {args.epochs}", flush=True)
        elif kind == "progress":
            display.update(0, payload["epoch"], payload["loss"], payload["swarm"], payload.get("accuracy"))
        elif kind == "done":
            display.done(0, payload)
            display.close()
            print(describe_peer("this peer", args.client_mode, payload), flush=True)
            print(f"held-out accuracy: {payload['accuracy']:.4f}", flush=True)

    try:
        train_peer(config, args.initial_peers, report)
    finally:
        display.close()
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # a termination request stops the peers like Ctrl-C does


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    sys.stdout.reconfigure(line_buffering=True)
    try:
        optimizer_class(args.optimizer)  # fail here, with one clear message, rather than in every peer
    except ImportError as e:
        print(f"error: {e}; try --optimizer hivemind", file=sys.stderr)
        return 2
    try:
        return run_joining_peer(args) if args.initial_peers else run_swarm(args)
    except KeyboardInterrupt:
        print("\ninterrupted; all peers stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
