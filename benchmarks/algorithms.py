"""Training algorithms side by side: bytes sent per sample, wall time, final loss and accuracy.

N peers (default 4) train the same MLP on sklearn's digits (1497 training images, 300 held out)
with synchronous averaging (the standard hivemind_ext.Optimizer) and with each pluggable
algorithm; hivemind.Optimizer runs the synchronous case too, as the comparison row. Peers are
threads of this process, each with its own hivemind.DHT (and libp2p daemon) on 127.0.0.1. Every
peer starts from the same parameters and reads its own deterministic stream of batches, the same
stream in every case; each case processes about ``--samples`` samples over the swarm:

- epoch-based algorithms (sync, QAdam, PowerSGD) run until the swarm has ended
  ``samples / target_batch_size`` epochs (samples actually processed are counted and reported);
- local-step algorithms (decentralized SGD, async model averaging, DiLoCo) run
  ``samples / (peers x batch)`` steps on every peer.

Bytes sent are the sum over peers of the payload bytes each peer sent in averaging rounds (every
round of every averager: gradients, parameters, factors, pseudo-gradients, and the state averaging
the Optimizer does every epoch on the standard path), read from each round's report, plus the
pushes of decentralized SGD (``DecentralizedSGDImpl.bytes_pushed``; the one-off full-model
snapshot a neighbour sends when a peer subscribes is not counted). For hivemind the same is
counted by wrapping its all-reduce runner (tensor parts sent to owners and averaged parts sent
back). Wall time runs from the first step to the last peer's last step; held-out loss and
accuracy are the mean over the peers' final models.

    python benchmarks/algorithms.py
    python benchmarks/algorithms.py --algorithms sync diloco --samples 16384 --peers 4
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import multiprocessing as mp
import secrets
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import hivemind
import torch
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Digits, Result, digits_mlp, emit, higher_is_better, load_digits, lower_is_better, start

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
FAST_TRACKER = dict(min_refresh_period=0.05, max_refresh_period=0.5, default_refresh_period=0.2)
ALGORITHMS = ["sync", "qadam", "decentralized", "async", "diloco", "powersgd"]
EPOCH_BASED = {"sync", "qadam", "powersgd"}
HIDDEN = 512


# ----- the problem


def make_model() -> torch.nn.Module:
    return digits_mlp(HIDDEN, seed=0)  # every peer, every case: the same initial parameters


class BatchStream:
    """Peer ``index``'s batches: its own seeded shuffles of the training set, the same in every case."""

    def __init__(self, data: Digits, index: int, batch: int) -> None:
        self.data, self.batch = data, batch
        self.generator = torch.Generator().manual_seed(1000 + index)
        self.order = torch.empty(0, dtype=torch.long)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self.order) < self.batch:
            self.order = torch.cat([self.order, torch.randperm(len(self.data.train_x), generator=self.generator)])
        indices, self.order = self.order[: self.batch], self.order[self.batch :]
        return self.data.train_x[indices], self.data.train_y[indices]


def evaluate(model: torch.nn.Module, data: Digits) -> tuple[float, float]:
    with torch.no_grad():
        logits = model(data.test_x)
        loss = torch.nn.functional.cross_entropy(logits, data.test_y).item()
        accuracy = (logits.argmax(dim=1) == data.test_y).float().mean().item()
    return loss, accuracy


# ----- byte counters


class WarningCounter(logging.Handler):
    """Counts the warnings hivemind_ext logs during a case (failed rounds and the like)."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def summary(self) -> str:
        if not self.messages:
            return "no library warnings"
        first = self.messages[0]
        return f"{len(self.messages)} library warnings, first: {first[:140]}"


class OurBytes:
    """Sums ``last_round.bytes_sent`` of every hivemind_ext DecentralizedAverager round in this process:
    ``last_round`` becomes a property whose setter adds each new report's bytes (harness-only patch)."""

    total = 0
    by_kind: dict[str, int] = {}  # "grad_averager" / "state_averager" / the algorithm's averagers
    rounds = 0
    _lock = threading.Lock()

    @classmethod
    def install(cls) -> None:
        from hivemind_ext.averaging.averager import DecentralizedAverager

        if isinstance(DecentralizedAverager.__dict__.get("last_round"), property):
            return

        def get(self: Any) -> Any:
            return self.__dict__.get("_bench_last_round")

        def set_(self: Any, report: Any) -> None:
            self.__dict__["_bench_last_round"] = report
            if report is not None:
                kind = next((k for k in ("grad_averager", "state_averager") if k in self.prefix), "algorithm")
                with cls._lock:
                    cls.total += int(report.bytes_sent)
                    cls.by_kind[kind] = cls.by_kind.get(kind, 0) + int(report.bytes_sent)
                    cls.rounds += 1

        DecentralizedAverager.last_round = property(get, set_)


class HivemindBytes:
    """Payload bytes that hivemind's all-reduce sends: tensor parts to their owners and averaged parts
    back. hivemind averages in forked processes, so the counter lives in shared memory; the patch is
    installed before any hivemind averager process starts."""

    counter = mp.get_context("fork").Value("q", 0)

    @classmethod
    def install(cls) -> None:
        from hivemind.averaging.allreduce import AllReduceRunner

        if getattr(AllReduceRunner, "_bench_patched", False):
            return
        counter = cls.counter

        def counted(method: Callable[..., Any]) -> Callable[..., Any]:
            async def wrapper(*args: Any, **kwargs: Any) -> Any:
                async for message in method(*args, **kwargs):
                    size = len(message.tensor_part.buffer) if message.HasField("tensor_part") else 0
                    with counter.get_lock():
                        counter.value += size
                    yield message

            return wrapper

        AllReduceRunner._generate_input_for_peer = counted(AllReduceRunner._generate_input_for_peer)
        AllReduceRunner._accumulate_parts_streaming = counted(AllReduceRunner._accumulate_parts_streaming)
        AllReduceRunner._bench_patched = True

    @classmethod
    def read(cls) -> int:
        with cls.counter.get_lock():
            return int(cls.counter.value)


# ----- the swarm


def wait_until_connected(dhts: list[hivemind.DHT], timeout: float = 30.0) -> None:
    """Every DHT must read what every other stored (four local peers can form two DHTs, hivemind #624)."""
    key = f"bench-swarm-{secrets.token_hex(4)}"
    for index, dht in enumerate(dhts):
        dht.store(key, index, get_dht_time() + 120, subkey=index)
    give_up = time.monotonic() + timeout
    for dht in dhts:
        while (found := dht.get(key, latest=True)) is None or len(found.value) != len(dhts):
            if time.monotonic() > give_up:
                raise RuntimeError("the local swarm is not connected")
            time.sleep(0.1)


@contextlib.contextmanager
def local_swarm(size: int, **dht_options: Any) -> Iterator[list[hivemind.DHT]]:
    """``size`` DHTs on loopback, connected; ``dht_options`` go to every ``hivemind.DHT`` (e.g. a longer
    ``startup_timeout`` for the libp2p daemons of a large swarm on a busy machine)."""
    dhts = [hivemind.DHT(start=True, host_maddrs=LOOPBACK, **dht_options)]
    try:
        initial_peers = [str(maddr) for maddr in dhts[0].get_visible_maddrs()]
        for _ in range(1, size):
            dhts.append(
                hivemind.DHT(
                    start=True, await_ready=False, host_maddrs=LOOPBACK, initial_peers=initial_peers, **dht_options
                )
            )
        for dht in dhts:
            dht.wait_until_ready(timeout=30)
        wait_until_connected(dhts)
        yield dhts
    finally:
        for dht in dhts:
            dht.shutdown()


def make_algorithm(name: str, args: argparse.Namespace, epochs: int) -> Any:
    from hivemind_ext.optim.algorithms import AsyncModelAverage, DiLoCo, PowerSGD, QAdam
    from hivemind_ext.optim.algorithms.decentralized import DecentralizedSGD

    if name == "sync":
        return None
    if name == "qadam":
        return QAdam(warmup_steps=args.qadam_warmup or max(1, epochs // 4))
    if name == "decentralized":
        return DecentralizedSGD(num_neighbours=2)  # MinMaxUInt8 differences
    if name == "async":
        return AsyncModelAverage(sync_interval_seconds=args.async_interval)
    if name == "diloco":
        return DiLoCo(inner_steps=args.diloco_inner_steps)  # float16 pseudo-gradients
    if name == "powersgd":
        return PowerSGD(rank=args.powersgd_rank)
    raise ValueError(name)


@dataclasses.dataclass
class Outcome:
    seconds: float
    samples: int
    bytes_sent: int
    loss: float
    accuracy: float
    detail: str = ""
    note: str = ""

    @property
    def bytes_per_sample(self) -> float:
        return self.bytes_sent / max(self.samples, 1)


def run_case(
    impl: str, name: str, args: argparse.Namespace, data: Digits, dhts: list[hivemind.DHT], keys: list[RSAPrivateKey]
) -> Outcome:
    """The swarm's peers train with algorithm ``name`` (impl: "ours" or "hivemind") under a new run id.

    ``keys``: one signing key per DHT for the progress tracker (in one process every DHT would share
    hivemind's process-wide key; a DHT keeps the first key it is given, so each case passes the same)."""
    target_batch_size = args.peers * args.batch * args.steps_per_epoch
    epochs = max(1, round(args.samples / target_batch_size))
    steps = max(1, args.samples // (args.peers * args.batch))
    algorithm = make_algorithm(name, args, epochs) if impl == "ours" else None
    run_id = f"bench_{impl}_{name}_{secrets.token_hex(3)}"
    models = [make_model() for _ in dhts]
    optimizers: list[Any] = []
    warnings_seen = WarningCounter()
    logging.getLogger("hivemind_ext").addHandler(warnings_seen)
    try:
        for dht, model, key in zip(dhts, models, keys, strict=True):
            kwargs: dict[str, Any] = dict(
                dht=dht,
                run_id=run_id,
                target_batch_size=target_batch_size,
                batch_size_per_step=args.batch,
                optimizer=lambda p: torch.optim.Adam(p, lr=args.lr),
                params=model.parameters(),
                matchmaking_time=args.matchmaking_time,
                averaging_timeout=args.averaging_timeout,
                shutdown_timeout=2.0,
                tracker_opts={**FAST_TRACKER, "private_key": key},
            )
            if impl == "ours":
                import hivemind_ext

                optimizers.append(hivemind_ext.Optimizer(algorithm=algorithm, **kwargs))
            else:
                optimizers.append(hivemind.Optimizer(**kwargs))
        ours_before, theirs_before = OurBytes.total, HivemindBytes.read()
        kinds_before, rounds_before = dict(OurBytes.by_kind), OurBytes.rounds
        samples = [0] * len(dhts)
        errors: list[str] = []
        stop = threading.Event()

        def train(index: int) -> None:
            opt, model = optimizers[index], models[index]
            stream = BatchStream(data, index, args.batch)
            try:
                for step in range(10**9):
                    if stop.is_set():
                        return
                    if name in EPOCH_BASED and opt.local_epoch >= epochs:
                        return
                    if name not in EPOCH_BASED and step >= steps:
                        return
                    x, y = stream.next_batch()
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    opt.step()
                    opt.zero_grad()
                    samples[index] += len(x)
                    time.sleep(args.step_seconds)  # the rest of a step's compute, GIL released
            except Exception:
                errors.append(f"peer {index}: {traceback.format_exc()}")
                stop.set()

        threads = [threading.Thread(target=train, args=(i,), daemon=True) for i in range(len(dhts))]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(1.0, started + args.case_timeout - time.monotonic()))
        seconds = time.monotonic() - started
        note = ""
        if any(thread.is_alive() for thread in threads):
            stop.set()
            note = f"stopped after {args.case_timeout:.0f} s"
            for thread in threads:
                thread.join(30)
        if errors:
            note = errors[0].strip().splitlines()[-1][:200]
        epoch_text = f"epochs {min(opt.local_epoch for opt in optimizers)}-{max(o.local_epoch for o in optimizers)}"
        if impl == "ours":
            sent = OurBytes.total - ours_before
            parts = {k: v - kinds_before.get(k, 0) for k, v in OurBytes.by_kind.items()}
            pushed = sum(int(getattr(opt.algorithm_impl, "bytes_pushed", 0) or 0) for opt in optimizers)
            if pushed:
                parts["neighbour pushes"] = pushed
            sent += pushed
            detail = ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in parts.items() if v)
            runners = [getattr(opt, "_runner", None) for opt in optimizers]
            if any(runner is not None and runner.bytes_sent for runner in runners):  # cross-check
                counted = sum(runner.bytes_sent for runner in runners if runner is not None)
                detail += f" (AlgorithmRunner.bytes_sent: {counted / 1e6:.2f} MB)"
            detail = f"{epoch_text}, {OurBytes.rounds - rounds_before} peer-rounds; {detail}; {warnings_seen.summary()}"
        else:
            sent = HivemindBytes.read() - theirs_before
            detail = epoch_text
        scores = [evaluate(model, data) for model in models]
    finally:
        logging.getLogger("hivemind_ext").removeHandler(warnings_seen)
        for opt in optimizers:
            with contextlib.suppress(Exception):
                opt.shutdown()
    return Outcome(
        seconds=seconds,
        samples=sum(samples),
        bytes_sent=sent,
        loss=statistics.mean(s[0] for s in scores),
        accuracy=statistics.mean(s[1] for s in scores),
        detail=detail,
        note=note,
    )


def report(label: str, outcome: Outcome) -> None:
    print(
        f"{label:22s} {outcome.samples:6d} samples | {outcome.bytes_per_sample:10.1f} B/sample "
        f"({outcome.bytes_sent / 1e6:8.2f} MB) | {outcome.seconds:7.2f} s | held-out loss {outcome.loss:.4f} "
        f"| accuracy {outcome.accuracy:.4f}" + (f" | {outcome.note}" if outcome.note else ""),
        flush=True,
    )
    print(f"{'':22s} ({outcome.detail})", flush=True)


def finite(value: float | None, digits: int) -> float | None:
    """Rounded, or None for NaN / inf (a diverged run), which JSON cannot carry."""
    return None if value is None or not math.isfinite(value) else round(value, digits)


def results_for(name: str, ours: Outcome, theirs: Outcome | None, args: argparse.Namespace) -> list[Result]:
    case = f"{name} {args.peers} peers digits MLP"
    hm = theirs
    return [
        lower_is_better(
            case, "bytes sent/sample", round(ours.bytes_per_sample, 1), hm and round(hm.bytes_per_sample, 1)
        ),
        lower_is_better(case, "s wall time", round(ours.seconds, 3), hm and round(hm.seconds, 3)),
        lower_is_better(case, "held-out loss", finite(ours.loss, 4), hm and finite(hm.loss, 4)),
        higher_is_better(case, "held-out accuracy", round(ours.accuracy, 4), hm and round(hm.accuracy, 4)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", nargs="+", default=ALGORITHMS, choices=ALGORITHMS)
    parser.add_argument("--samples", type=int, default=8192, help="samples over the whole swarm per case")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps-per-epoch", type=int, default=8, help="target_batch_size = peers x batch x this")
    parser.add_argument("--lr", type=float, default=2e-3, help="Adam's learning rate (every case)")
    parser.add_argument("--step-seconds", type=float, default=0.05, help="simulated compute per step (sleep)")
    parser.add_argument("--matchmaking-time", type=float, default=1.0)
    parser.add_argument("--averaging-timeout", type=float, default=10.0)
    parser.add_argument("--async-interval", type=float, default=0.5, help="AsyncModelAverage sync_interval_seconds")
    parser.add_argument("--qadam-warmup", type=int, default=0, help="QAdam warmup_steps (0: a quarter of the epochs)")
    parser.add_argument("--diloco-inner-steps", type=int, default=8)
    parser.add_argument("--powersgd-rank", type=int, default=4)
    parser.add_argument("--case-timeout", type=float, default=150.0)
    parser.add_argument("--no-hivemind", action="store_true", help="skip hivemind.Optimizer's sync row")
    args = start(parser)
    logging.getLogger("hivemind").setLevel(logging.WARNING)
    # a DHT process logs a FileNotFoundError traceback when a hivemind averager that shared its
    # daemon has shut down (harmless here; the DHTs outlive hivemind's optimizers)
    logging.getLogger("hivemind.dht.dht").setLevel(logging.CRITICAL)
    data = load_digits()
    params = sum(p.numel() for p in make_model().parameters())
    target = args.peers * args.batch * args.steps_per_epoch
    print(
        f"problem: digits MLP 64-{HIDDEN}-{HIDDEN}-10 ({params} params, {params * 4 / 1e6:.2f} MB float32), "
        f"{args.peers} peers, batch {args.batch}, target_batch_size {target}, ~{args.samples} samples per case, "
        f"Adam lr {args.lr}, matchmaking {args.matchmaking_time} s"
    )
    HivemindBytes.install()
    OurBytes.install()
    results: list[Result] = []
    started = time.monotonic()
    with local_swarm(args.peers) as dhts:  # one swarm for every case: each case has its own run id
        print(f"swarm of {len(dhts)} DHTs ready in {time.monotonic() - started:.0f} s")
        keys = [RSAPrivateKey() for _ in dhts]
        for name in args.algorithms:
            theirs = None
            if name == "sync" and not args.no_hivemind:
                theirs = run_case("hivemind", name, args, data, dhts, keys)
                report("sync (hivemind)", theirs)
            ours = run_case("ours", name, args, data, dhts, keys)
            report(name, ours)
            if theirs is not None and ours.seconds:
                print(f"{'':22s} hivemind time / ours: {theirs.seconds / ours.seconds:.2f}x")
            results.extend(results_for(name, ours, theirs, args))
    print(f"total: {time.monotonic() - started:.0f} s")
    emit("algorithms", results)


if __name__ == "__main__":
    main()
