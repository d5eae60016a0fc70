"""A small swarm that trains a digit classifier with a collaborative Optimizer: model, data, peer loop, launcher.

This module holds everything that ``examples/train_digits.py`` (the command line) and
``benchmarks/optimizer.py`` (hivemind_ext next to hivemind) share, so that both run exactly the
same training:

- the data: scikit-learn's bundled ``load_digits`` (1797 images of 8x8 pixels, 10 classes), split
  into a train and a held-out test part with a fixed seed, the train part dealt into one shard per peer;
- the model: a two-layer MLP (64 -> 128 -> 10), the same initial weights on every peer;
- one peer (:func:`train_peer`): a hivemind DHT, an ``Optimizer`` (``hivemind_ext.Optimizer`` or
  ``hivemind.Optimizer``, same keywords) and the usual loop ``loss.backward(); opt.step(); opt.zero_grad()``
  until the swarm's global epoch (``opt.local_epoch``) reaches the goal, then the held-out accuracy;
- a local swarm (:func:`run_local_swarm`): peer processes on 127.0.0.1 only, the first peer's DHT as
  the bootstrap of the others, started together behind a barrier, watched with deadlines and cleaned
  up (the whole process group of each peer, so no DHT or libp2p daemon outlives the run).
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing as mp
import os
import queue
import random
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)
OPTIMIZERS = ("hivemind_ext", "hivemind")
PROGRESS_PERIOD = 0.5  # seconds between a peer's progress reports


# ----------------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class DigitsData:
    """Inputs scaled to [0, 1] as float32 rows of 64 pixels, labels as int64."""

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray

    def shard(self, index: int, count: int, seed: int) -> DigitsData:
        """The ``index``-th of ``count`` disjoint train shards (a seeded shuffle dealt round-robin); same test part."""
        order = np.random.default_rng(seed).permutation(len(self.train_y))[index::count]
        return replace(self, train_x=self.train_x[order], train_y=self.train_y[order])


def load_data(seed: int = 0, test_fraction: float = 0.2) -> DigitsData:
    """scikit-learn's bundled digits, split into train and held-out test parts (stratified, seeded)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    train_x, test_x, train_y, test_y = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)
    return DigitsData(train_x, train_y, test_x, test_y)


# ---------------------------------------------------------------------------------------------- model


def make_model(seed: int = 0) -> Any:
    """The MLP every peer trains; the seed fixes its initial weights, so all peers start from the same point."""
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def peak_rss_mib() -> float | None:
    """This process's peak resident memory in MiB (the libp2p daemon, a child process, is not included);
    None where the platform has no ``resource`` module (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    scale = 1 / 1024 if sys.platform != "darwin" else 1 / 2**20  # Linux reports KiB, macOS bytes
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def accuracy(model: Any, x: np.ndarray, y: np.ndarray) -> float:
    import torch

    with torch.no_grad():
        predicted = model(torch.from_numpy(x)).argmax(dim=1)
    return float((predicted == torch.from_numpy(y)).float().mean())


def optimizer_class(name: str) -> type:
    """``hivemind_ext.Optimizer`` or ``hivemind.Optimizer``; both take the same keywords (ours is a drop-in).

    hivemind_ext is imported only here, so the hivemind path works whatever state hivemind_ext is in.
    """
    if name == "hivemind":
        import hivemind

        return hivemind.Optimizer
    if name == "hivemind_ext":
        import hivemind_ext

        found = getattr(hivemind_ext, "Optimizer", None)
        if found is None:
            try:
                from hivemind_ext.optim import Optimizer as found
            except ImportError as e:
                raise ImportError("hivemind_ext.Optimizer is not available in this checkout") from e
        return found
    raise ValueError(f"unknown optimizer {name!r}: expected one of {OPTIMIZERS}")


# ----------------------------------------------------------------------------------------------- peer


@dataclass(frozen=True)
class PeerConfig:
    """What one peer does. Every field but ``index``, ``client_mode``, ``batch_size``, ``compute_time`` and
    ``seed`` must be the same on all peers of a run (``run_id``, the model, the optimizer settings)."""

    index: int
    data: DigitsData
    optimizer: str = "hivemind_ext"
    run_id: str = "digits"
    epochs: int = 20
    target_batch_size: int = 256
    batch_size: tuple[int, int] = (16, 16)  # each step draws its batch size uniformly from [low, high]
    compute_time: tuple[float, float] = (0.0, 0.0)  # seconds slept per step on top of the real work
    lr: float = 0.01
    matchmaking_time: float = 1.5
    averaging_timeout: float = 10.0
    client_mode: bool = False
    host_maddrs: tuple[str, ...] = LOOPBACK
    model_seed: int = 0
    seed: int = 0  # this peer's batch order, batch sizes and compute times
    verbose: bool = False
    log_level: str = "ERROR"  # of the hivemind and hivemind_ext loggers in this peer


@dataclass
class PeerStats:
    """Measured by one peer from its first step until the swarm reached the goal epoch."""

    steps: int = 0
    samples: int = 0
    train_seconds: float = 0.0
    step_seconds: float = 0.0  # time spent inside opt.step(): waiting for peers, averaging, updating
    # per epoch this peer ended: the samples its group averaged (hivemind_ext's opt.last_epoch_samples)
    averaged_samples: list[int] = field(default_factory=list)
    loss: float = math.nan  # exponential moving average of the training loss

    @property
    def blocked_fraction(self) -> float:
        return self.step_seconds / self.train_seconds if self.train_seconds > 0 else math.nan


Report = Callable[[str, dict[str, Any]], None]


def global_progress(opt: Any) -> dict[str, Any]:
    """The swarm-wide progress that the optimizer's tracker last saw, as plain values."""
    progress = getattr(getattr(opt, "tracker", None), "global_progress", None)
    names = ("epoch", "samples_accumulated", "target_batch_size", "num_peers", "num_clients", "eta_next_epoch")
    names += ("samples_per_second",)  # the swarm's (hivemind_ext only: None with hivemind.Optimizer)
    return {name: getattr(progress, name, None) for name in names}


def train_peer(
    config: PeerConfig,
    initial_peers: Sequence[str],
    report: Report,
    wait_for_start: Callable[[], bool] = lambda: True,
    keep_alive: Callable[[], bool] = lambda: False,
    stop_requested: Callable[[], bool] = lambda: False,
) -> PeerStats:
    """Runs one peer: joins the swarm, trains until ``opt.local_epoch`` reaches ``config.epochs``, evaluates.

    ``report(kind, payload)`` receives ``"dht_ready"`` (this peer's multiaddrs), ``"ready"`` (optimizer
    built), ``"progress"`` (every ``PROGRESS_PERIOD`` s) and ``"done"`` (accuracy and the measurements).
    ``wait_for_start()`` blocks until the swarm may start (False: give up). Once done, the peer stays
    online (serving its state to laggards) while ``keep_alive()`` is True, then shuts down. Training
    ends early, without "done", when ``stop_requested()`` (checked between steps) turns True.
    """
    import hivemind
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    for name in ("hivemind", "hivemind_ext"):
        logging.getLogger(name).setLevel(config.log_level.upper())
    rng = random.Random(config.seed)
    model = make_model(config.model_seed)
    data = config.data
    train_x, train_y = torch.from_numpy(data.train_x), torch.from_numpy(data.train_y)
    dht = opt = None
    try:
        dht = hivemind.DHT(
            initial_peers=list(initial_peers),
            host_maddrs=list(config.host_maddrs),
            client_mode=config.client_mode,
            start=True,
        )
        report("dht_ready", {"maddrs": [str(addr) for addr in dht.get_visible_maddrs()]})
        low, high = config.batch_size
        opt = optimizer_class(config.optimizer)(
            dht=dht,
            run_id=config.run_id,
            target_batch_size=config.target_batch_size,
            batch_size_per_step=(low + high) // 2,
            optimizer=lambda params: torch.optim.Adam(params, lr=config.lr),
            params=model.parameters(),
            matchmaking_time=config.matchmaking_time,
            averaging_timeout=config.averaging_timeout,
            client_mode=config.client_mode,
            verbose=config.verbose,
        )
        report("ready", {})
        if not wait_for_start():
            return PeerStats()

        shuffle = torch.Generator().manual_seed(config.seed)
        stats, order, position = PeerStats(), torch.randperm(len(train_y), generator=shuffle), 0
        started = last_report = time.perf_counter()
        evaluated: tuple[int, float] | None = None  # (epoch, held-out accuracy) at the last progress report
        while opt.local_epoch < config.epochs:
            batch_size = rng.randint(low, high)
            if position + batch_size > len(order):  # next pass over this peer's shard
                order, position = torch.randperm(len(train_y), generator=shuffle), 0
            rows = order[position : position + batch_size]
            position += batch_size

            loss = F.cross_entropy(model(train_x[rows]), train_y[rows])
            loss.backward()
            if config.compute_time[1] > 0:  # stands in for a bigger model or a slower device
                time.sleep(rng.uniform(*config.compute_time))
            step_started, epoch_before = time.perf_counter(), opt.local_epoch
            opt.step(batch_size=batch_size)
            stats.step_seconds += time.perf_counter() - step_started
            averaged = getattr(opt, "last_epoch_samples", None)  # hivemind.Optimizer has no such figure
            if opt.local_epoch == epoch_before + 1 and averaged:
                stats.averaged_samples.append(int(averaged))
            opt.zero_grad()

            stats.steps += 1
            stats.samples += batch_size
            stats.loss = loss.item() if math.isnan(stats.loss) else 0.9 * stats.loss + 0.1 * loss.item()
            now = time.perf_counter()
            if now - last_report >= PROGRESS_PERIOD:
                last_report = now
                if evaluated is None or evaluated[0] != opt.local_epoch:  # once per epoch: a few ms
                    evaluated = (opt.local_epoch, accuracy(model, data.test_x, data.test_y))
                payload = {"epoch": opt.local_epoch, "loss": stats.loss, "swarm": global_progress(opt)}
                report("progress", {**payload, "accuracy": evaluated[1]})
                if stop_requested():
                    return stats
        stats.train_seconds = time.perf_counter() - started

        model.eval()
        report(
            "done",
            {
                "time": time.time(),
                "epoch": opt.local_epoch,
                "swarm": global_progress(opt),
                "accuracy": accuracy(model, data.test_x, data.test_y),
                "steps": stats.steps,
                "samples": stats.samples,
                "averaged_samples": stats.averaged_samples,
                "train_seconds": stats.train_seconds,
                "step_seconds": stats.step_seconds,
                "blocked_fraction": stats.blocked_fraction,
                "loss": stats.loss,
                "peak_rss_mib": peak_rss_mib(),
            },
        )
        while keep_alive():
            time.sleep(0.1)
        return stats
    finally:
        if opt is not None:
            opt.shutdown()
        if dht is not None:
            dht.shutdown()


def swarm_configs(base: PeerConfig, peers: int, clients: int) -> list[PeerConfig]:
    """One config per peer of a local swarm: its own train shard and seed; the last ``clients`` in client mode."""
    return [
        replace(
            base,
            index=i,
            data=base.data.shard(i, peers, base.seed),
            client_mode=i >= peers - clients,
            seed=base.seed * 1000 + i,
        )
        for i in range(peers)
    ]


# -------------------------------------------------------------------------------------- peer processes


@dataclass(frozen=True)
class _Channels:
    events: Any  # multiprocessing queue of (kind, peer index, payload)
    start: Any  # event: all peers are ready, train
    stop: Any  # event: the run is over, shut down


def _peer_process(config: PeerConfig, initial_peers: Sequence[str], channels: _Channels) -> None:
    """Entry point of a peer process. Leads its own process group so that the launcher can end
    the peer together with everything it started (hivemind's DHT process, the libp2p daemon)."""
    os.setpgrp()  # also keeps the terminal's Ctrl-C for the launcher, which then stops the peers in order
    if "fork" in mp.get_all_start_methods():  # hivemind starts its averagers with the default method, which
        mp.set_start_method("fork", force=True)  # must be fork: they do not survive pickling for spawn/forkserver

    def report(kind: str, payload: dict[str, Any]) -> None:
        channels.events.put((kind, config.index, payload))

    parent_pid = os.getppid()  # the fork server, which exits with the launcher

    def orphaned() -> bool:
        return os.getppid() != parent_pid

    def wait_for_start() -> bool:
        while not channels.start.wait(timeout=0.5):
            if channels.stop.is_set() or orphaned():
                return False
        return True

    def keep_alive() -> bool:
        return not channels.stop.is_set() and not orphaned()

    try:
        train_peer(config, initial_peers, report, wait_for_start, keep_alive, stop_requested=lambda: not keep_alive())
    except KeyboardInterrupt:
        pass
    except BaseException:
        report("error", {"traceback": traceback.format_exc()})
        sys.exit(1)  # the launcher shows the traceback once


@dataclass
class PeerOutcome:
    index: int
    client_mode: bool
    done: dict[str, Any] | None = None  # the peer's "done" payload
    error: str | None = None  # why it failed: a traceback, a crash, a timeout


@dataclass
class SwarmRun:
    peers: list[PeerOutcome]
    started_at: float | None = None  # time.time() when all peers were released to train
    timed_out: bool = False

    @property
    def finished(self) -> list[PeerOutcome]:
        return [peer for peer in self.peers if peer.done is not None]

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(peer.done is not None and peer.error is None for peer in self.peers)

    @property
    def wall_seconds(self) -> float | None:
        """From all peers released to the last peer at the goal epoch; None unless every peer got there."""
        if self.started_at is None or len(self.finished) != len(self.peers):
            return None
        return max(peer.done["time"] for peer in self.peers) - self.started_at


def _end_process_group(process: Any, grace: float) -> None:
    """Waits up to ``grace`` s for a peer to exit, then kills its whole process group (peer, DHT, daemon)."""
    process.join(timeout=grace)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)  # leftovers of a peer that exited, or the peer itself
    if process.is_alive():
        process.kill()
    process.join(timeout=5)


def _process_context() -> Any:
    """A fork server that imported torch and hivemind once: peers start in a second, not after their own
    imports (several seconds of CPU each), and from a clean process, not a copy of the launcher."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "hivemind", __name__])
    return context


def run_local_swarm(
    configs: Sequence[PeerConfig],
    timeout: float,
    on_event: Callable[[str, int, dict[str, Any]], None] = lambda kind, index, payload: None,
    start_timeout: float = 180.0,
    shutdown_grace: float = 20.0,
) -> SwarmRun:
    """Runs one peer process per config on 127.0.0.1 and waits until every peer reached its goal epoch,
    failed, or ``timeout`` s passed since the start. ``configs[0]`` is the bootstrap peer (not client mode).

    Peers start training together (once every optimizer is built), so the timings exclude process start.
    Every process is gone when this returns, also after an exception or Ctrl-C.
    """
    if configs[0].client_mode:
        raise ValueError("the first peer bootstraps the others and cannot be in client mode")
    context = _process_context()
    channels = _Channels(context.Queue(), context.Event(), context.Event())
    run = SwarmRun([PeerOutcome(config.index, config.client_mode) for config in configs])
    by_index = {config.index: outcome for config, outcome in zip(configs, run.peers, strict=True)}
    processes: list[Any] = []
    ready: set[int] = set()

    def start_peer(config: PeerConfig, initial_peers: Sequence[str]) -> None:
        process = context.Process(target=_peer_process, args=(config, list(initial_peers), channels), daemon=False)
        process.start()
        processes.append(process)

    def record(kind: str, index: int, payload: dict[str, Any]) -> None:
        if kind == "dht_ready" and index == configs[0].index:
            bootstrap.extend(payload["maddrs"])
        elif kind == "ready":
            ready.add(index)
        elif kind == "done" and by_index[index].done is None:
            by_index[index].done = payload
        elif kind == "error" and by_index[index].error is None:
            by_index[index].error = payload["traceback"]

    def check_processes() -> None:
        for config, process in zip(configs, processes, strict=False):
            outcome = by_index[config.index]
            if not process.is_alive() and outcome.done is None and outcome.error is None:
                outcome.error = f"peer process exited with code {process.exitcode} before reaching the goal"
                on_event("error", config.index, {"traceback": outcome.error})

    def pump(until: Callable[[], bool], deadline: float) -> bool:
        """Handles events until ``until()`` holds (True) or the deadline passes (False)."""
        next_check = 0.0
        while not until():
            now = time.monotonic()
            if now > deadline:
                return False
            if now >= next_check:  # also while events keep coming: a crashed peer sends nothing
                check_processes()
                next_check = now + 1.0
            with contextlib.suppress(queue.Empty):
                event = channels.events.get(timeout=0.2)
                record(*event)
                on_event(*event)
        return True

    def failed() -> bool:
        return any(outcome.error for outcome in run.peers)

    def finished() -> bool:
        return all(outcome.done is not None or outcome.error is not None for outcome in run.peers)

    bootstrap: list[str] = []
    try:
        start_peer(configs[0], ())
        if not pump(lambda: bool(bootstrap) or failed(), time.monotonic() + start_timeout) or failed():
            raise RuntimeError(f"the bootstrap peer did not start: {by_index[configs[0].index].error or 'timeout'}")
        for config in configs[1:]:
            start_peer(config, bootstrap)
        if not pump(lambda: len(ready) == len(configs) or failed(), time.monotonic() + start_timeout):
            raise RuntimeError(f"only {len(ready)} of {len(configs)} peers started within {start_timeout} s")
        if failed():
            raise RuntimeError("a peer failed while starting")
        run.started_at = time.time()
        channels.start.set()
        run.timed_out = not pump(finished, time.monotonic() + timeout)
        for outcome in run.peers:
            if outcome.done is None and outcome.error is None:
                outcome.error = f"did not reach the goal epoch within {timeout} s"
        return run
    except BaseException:  # Ctrl-C or a launcher error: the peers get a short grace, no one waits for their results
        shutdown_grace = min(shutdown_grace, 5.0)
        raise
    finally:
        channels.stop.set()
        # Keep reading while the peers shut down: a process exits only once its queued events are in the pipe.
        grace_until = time.monotonic() + shutdown_grace
        while any(process.is_alive() for process in processes) and time.monotonic() < grace_until:
            with contextlib.suppress(queue.Empty, OSError, ValueError):
                record(*channels.events.get(timeout=0.2))
        for process in processes:
            _end_process_group(process, grace=0.0)
        with contextlib.suppress(queue.Empty, OSError, ValueError):
            while True:
                record(*channels.events.get_nowait())
        channels.events.close()
        channels.events.cancel_join_thread()


# ------------------------------------------------------------------------------------------- progress


class ProgressDisplay:
    """Shows the swarm's progress: one updating line on a terminal, a line per epoch (or every ``period`` s)
    otherwise, so that logs stay readable. The line ends on the final epoch: :meth:`done` shows each
    peer's last epoch and accuracy."""

    def __init__(self, epochs: int, stream: Any, period: float = 10.0) -> None:
        self.epochs, self.stream, self.period = epochs, stream, period
        self.tty = stream.isatty()
        self.losses: dict[int, float] = {}
        self.accuracy: float | None = None  # the held-out accuracy last measured (by any peer: they share the model)
        self.swarm: dict[str, Any] = {}
        self.epoch = -1
        self.last_line = ""
        self.last_print = 0.0
        self.totals: list[tuple[float, int]] = []  # (time, samples the swarm processed since the start)
        self.rates: dict[int, float] = {}  # samples/s of each peer that finished, over its whole run

    def update(self, index: int, epoch: int, loss: float, swarm: dict[str, Any], accuracy: float | None = None) -> None:
        self.losses[index] = loss
        if accuracy is not None:
            self.accuracy = accuracy
        if swarm.get("epoch") is not None and (not self.swarm or swarm["epoch"] >= self.swarm.get("epoch", -1)):
            self.swarm = swarm
            self._count_samples(swarm)
        self._show(epoch)

    def done(self, index: int, payload: dict[str, Any]) -> None:
        """Peer ``index`` reached the goal (``payload``: its "done" report)."""
        epoch, self.accuracy, swarm = payload["epoch"], payload["accuracy"], payload.get("swarm") or {}
        if payload.get("train_seconds"):
            self.rates[index] = payload["samples"] / payload["train_seconds"]
        if swarm.get("epoch") is not None and swarm["epoch"] >= self.swarm.get("epoch", -1):
            self.swarm = swarm
        self._show(epoch, force=self.tty)  # a log gets the line of the final epoch once, from the first peer done

    def _show(self, epoch: int, force: bool = False) -> None:
        new_epoch = epoch > self.epoch
        self.epoch = max(self.epoch, epoch)
        line = self.line()
        now = time.monotonic()
        if self.tty:
            if line != self.last_line and (force or now - self.last_print >= 0.2):
                self.stream.write("\r" + line.ljust(len(self.last_line)))
                self.stream.flush()
                self.last_line, self.last_print = line, now
        elif (new_epoch or force or now - self.last_print >= self.period) and line != self.last_line:
            print(line, file=self.stream, flush=True)
            self.last_line, self.last_print = line, now

    def _count_samples(self, swarm: dict[str, Any]) -> None:
        """Keeps the swarm's total samples over the last 10 s, for samples/s where the tracker has no figure."""
        target, samples = swarm.get("target_batch_size"), swarm.get("samples_accumulated")
        if target is None or samples is None:
            return
        now = time.monotonic()
        self.totals.append((now, swarm["epoch"] * target + min(samples, target)))
        while len(self.totals) > 2 and now - self.totals[0][0] > 10.0:
            self.totals.pop(0)

    def samples_per_second(self) -> float | None:
        speed = self.swarm.get("samples_per_second")
        if speed is not None:
            return float(speed)
        if len(self.totals) < 2 or self.totals[-1][0] - self.totals[0][0] < 1.0:
            return sum(self.rates.values()) if self.rates else None  # a run too short to measure live
        (start, first), (end, last) = self.totals[0], self.totals[-1]
        return max(0.0, (last - first) / (end - start))

    def line(self) -> str:
        swarm = self.swarm
        finite = [value for value in self.losses.values() if not math.isnan(value)]
        loss = f"{sum(finite) / len(finite):.3f}" if finite else "-"
        epoch = max(swarm.get("epoch") or 0, self.epoch) if swarm.get("epoch") is not None or self.epoch >= 0 else None
        samples, target = swarm.get("samples_accumulated"), swarm.get("target_batch_size")
        peers, clients = swarm.get("num_peers"), swarm.get("num_clients")
        speed = self.samples_per_second()
        accuracy = f" | held-out accuracy {self.accuracy:.3f}" if self.accuracy is not None else ""
        eta = swarm.get("eta_next_epoch")
        in_seconds = eta - time.time() if eta is not None else math.inf  # hivemind says "unknown" with ~1e22
        eta_text = (
            f" | next epoch in {max(0.0, in_seconds):.1f} s" if in_seconds < 3600 and self.epoch < self.epochs else ""
        )
        return (
            f"epoch {'-' if epoch is None else epoch}/{self.epochs} | samples {samples if samples is not None else '-'}"
            f"/{target or '-'} | {'-' if speed is None else f'{speed:.0f}'} samples/s"
            f" | peers online {peers if peers is not None else '-'} ({clients or 0} client mode)"
            f" | loss {loss}{accuracy}{eta_text}"
        )

    def close(self) -> None:
        if self.tty and self.last_line:
            self.stream.write("\n")
            self.stream.flush()
            self.last_line = ""
