"""What ``hivemind-ext train``, ``hivemind-ext join`` and ``examples/train_digits.py`` do.

``train`` starts a local swarm (``--peers`` processes, the first one the bootstrap) and prints the
command that joins it; ``join`` runs one peer that joins a swarm through ``--initial-peers``. The
example is both in one: it joins when given ``--initial-peers``.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from hivemind_ext.demo.data import MissingExtraError, load_data, require_sklearn
from hivemind_ext.demo.display import ProgressDisplay
from hivemind_ext.demo.local_swarm import SwarmRun, run_local_swarm
from hivemind_ext.demo.options import (
    OneLineErrorParser,
    add_network_options,
    add_swarm_options,
    add_training_options,
    check_args,
    join_command,
    python_command,
)
from hivemind_ext.demo.peer import PeerConfig, PeerStartError, optimizer_class, swarm_configs, train_peer

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    add_swarm_options(parser)
    add_network_options(parser, joining=False, initial_peers_required=False)
    add_training_options(parser)


def add_join_arguments(parser: argparse.ArgumentParser) -> None:
    add_network_options(parser, joining=True, initial_peers_required=True)
    add_training_options(parser)


def add_example_arguments(parser: argparse.ArgumentParser) -> None:
    """The example's single command line: a local swarm, or one joining peer with ``--initial-peers``."""
    add_swarm_options(parser)
    add_network_options(parser, joining=True, initial_peers_required=False)
    add_training_options(parser)


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
        host_maddrs=tuple(args.host_maddrs),
        announce_maddrs=tuple(args.announce_maddrs or ()),
    )


def describe_peer(name: str, client_mode: bool, done: dict[str, Any]) -> str:
    role = " (client mode)" if client_mode else ""
    blocked = done["blocked_fraction"]
    blocked_text = f"{blocked:.0%}" if not math.isnan(blocked) else "-"
    return (
        f"{name}{role}: held-out accuracy {done['accuracy']:.3f} | {done['steps']} steps, "
        f"{done['samples']} samples, {blocked_text} of the time in opt.step()"
    )


def run_swarm(args: argparse.Namespace, join_prefix: Sequence[str]) -> int:
    """A local swarm; prints the command that joins it (``join_prefix`` plus the address and settings)."""
    base = base_config(args)
    configs = swarm_configs(base, args.peers, args.clients)
    peers = f"{args.peers} peers ({args.clients} in client mode)" if args.peers > 1 else "1 peer"
    print(
        f"starting {peers} with {args.optimizer}.Optimizer: {len(base.data.train_y)} training images in "
        f"{args.peers} shard{'s' if args.peers > 1 else ''}, {len(base.data.test_y)} held out; "
        f"{args.epochs} epochs of {args.target_batch_size} samples, batches of {args.batch_size}",
        flush=True,
    )
    display = ProgressDisplay(args.epochs, sys.stdout)
    failures: list[int] = []

    def on_event(kind: str, index: int, payload: dict[str, Any]) -> None:
        if kind == "dht_ready" and index == 0:
            print(f"peer 0 listens on {' '.join(payload['maddrs'])}", flush=True)
            print(f"join with: {join_command(join_prefix, payload['maddrs'], args)}", flush=True)
        elif kind == "progress":
            display.update(index, payload["epoch"], payload["loss"], payload["swarm"], payload.get("accuracy"))
        elif kind == "done":
            display.done(index, payload)
        elif kind == "error":
            display.close()
            failures.append(index)
            print(f"peer {index} failed: {payload['message']}", file=sys.stderr, flush=True)
            if payload.get("traceback"):
                print(payload["traceback"].rstrip(), file=sys.stderr, flush=True)

    started, launched_at = time.monotonic(), time.time()
    try:
        run = run_local_swarm(configs, timeout=args.timeout, on_event=on_event)
    except RuntimeError as e:  # the swarm did not start
        if not failures:  # else the failing peer's error, printed above, says why
            print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        display.close()
    if run.started_at is not None:
        print(f"all {args.peers} peers were up {run.started_at - launched_at:.1f} s after the launch", flush=True)
    report_swarm(run, time.monotonic() - started)
    return EXIT_OK if run.ok else EXIT_FAILED


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


def run_join(args: argparse.Namespace) -> int:
    """One peer, in this process, that joins the swarm at ``args.initial_peers`` and trains to ``args.epochs``."""
    config = replace(base_config(args), client_mode=args.client_mode, alone_timeout=args.alone_timeout)
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
    return EXIT_OK


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # a termination request stops the peers like Ctrl-C does


def run_interruptible(command: Callable[[], int]) -> int:
    """Runs ``command`` with SIGTERM acting as Ctrl-C; an interruption ends in ``EXIT_INTERRUPTED``
    once every peer has stopped.

    SIGINT gets Python's KeyboardInterrupt handler explicitly: a process started with SIGINT ignored (a
    background job of a shell script, ``nohup``-like launchers, some CI runners) inherits the ignored
    disposition, Python then installs no handler, and Ctrl-C or ``kill -INT`` would leave the swarm training
    (``hivemind-ext aux`` overrides it for the same reason)."""
    previous = {
        signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
        signal.SIGTERM: signal.signal(signal.SIGTERM, _interrupt),
    }
    try:
        return command()
    except KeyboardInterrupt:
        print("\ninterrupted; all peers stopped", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def check_optimizer(name: str) -> str | None:
    """Why ``--optimizer name`` cannot run here (one line), or None."""
    try:
        optimizer_class(name)
    except ImportError as e:
        return f"{e}; try --optimizer hivemind"
    return None


def start(args: argparse.Namespace, join_prefix: Sequence[str]) -> int:
    """Runs the checked ``args``: a local swarm, or one joining peer when ``args.initial_peers`` is set."""
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    problem = check_optimizer(args.optimizer)  # fail here, with one clear message, rather than in every peer
    if problem is None:
        try:
            require_sklearn()
        except MissingExtraError as e:
            problem = str(e)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return run_interruptible(
            lambda: run_join(args) if getattr(args, "initial_peers", None) else run_swarm(args, join_prefix)
        )
    except PeerStartError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED


def example_main(argv: Sequence[str] | None = None, description: str | None = None) -> int:
    """``examples/train_digits.py``: a local swarm, or one peer that joins a swarm with ``--initial-peers``."""
    parser = OneLineErrorParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_example_arguments(parser)
    args = check_args(parser, parser.parse_args(argv))
    return start(args, join_prefix=[*python_command(), sys.argv[0]])


def exit_now(code: int) -> None:
    """Ends the process with ``code``. After Ctrl-C, once every peer has stopped and the output is flushed,
    it skips the interpreter's teardown (freeing torch's and hivemind's modules takes seconds on a busy
    machine) so that Ctrl-C ends the command within about a second."""
    if code != EXIT_INTERRUPTED:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
