"""A local swarm of the digits demo: one process per peer on this machine, the first peer's DHT as
the bootstrap of the others, started together behind a barrier, watched with deadlines and cleaned
up (the whole process group of each peer, so no DHT or libp2p daemon outlives the run)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hivemind_ext.demo.peer import PeerConfig, PeerStartError, train_peer

# After Ctrl-C the peers' process groups (peer, DHT process, libp2p daemon) are killed at once: a clean
# shutdown of a peer in the middle of a round takes seconds and makes hivemind's DHT process log the calls
# it cut short, and nobody waits for the results of a run that was interrupted.
INTERRUPT_GRACE = 0.0


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
    except PeerStartError as e:  # a setup problem: one line says it all
        report("error", {"message": str(e), "traceback": None})
        sys.exit(1)
    except BaseException as e:
        report("error", {"message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        sys.exit(1)  # the launcher shows the traceback once


@dataclass
class PeerOutcome:
    index: int
    client_mode: bool
    done: dict[str, Any] | None = None  # the peer's "done" payload
    error: str | None = None  # why it failed, in one line: an exception, a crash, a timeout
    traceback: str | None = None  # where it failed, for an unexpected exception


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
    context.set_forkserver_preload(["hivemind_ext.demo.forkserver_preload"])
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
            by_index[index].error, by_index[index].traceback = payload["message"], payload["traceback"]

    def check_processes() -> None:
        for config, process in zip(configs, processes, strict=False):
            outcome = by_index[config.index]
            if not process.is_alive() and outcome.done is None and outcome.error is None:
                outcome.error = f"peer process exited with code {process.exitcode} before reaching the goal"
                on_event("error", config.index, {"message": outcome.error, "traceback": None})

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
        shutdown_grace = min(shutdown_grace, INTERRUPT_GRACE)
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
