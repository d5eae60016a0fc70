"""The ``hivemind-ext`` command.

``hivemind-ext aux`` runs an auxiliary peer: a CPU-only helper with no model and no data that joins a
run's gradient averaging rounds, reduces its share of the all-reduce and contributes nothing (weight 0).
It stops cleanly on Ctrl-C (SIGINT) or SIGTERM, or after ``--max-rounds`` rounds.

``hivemind-ext train`` and ``hivemind-ext join`` run the digits demo (:mod:`hivemind_ext.demo`): a
swarm that prints the command to join it, and one peer that joins a swarm from another machine.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from hivemind_ext.demo import commands as demo
from hivemind_ext.demo.options import OneLineErrorParser, check_args
from hivemind_ext.monitoring.cli import add_monitor_parser, run_monitor

DEFAULT_HOST_MADDRS = ["/ip4/0.0.0.0/tcp/0"]
DHT_START_TIMEOUT = 60.0  # seconds for the DHT to start (its daemon, then the bootstrap)
DHT_CALL_TIMEOUT = 30.0  # seconds for each question to the running DHT process
EXIT_OK, EXIT_ERROR = 0, 1


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hivemind-ext")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="hivemind-ext",
        description="Tools for hivemind_ext collaborative training runs.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_demo_commands(commands)
    aux = commands.add_parser(
        "aux",
        help="run an auxiliary peer that helps a run average gradients",
        description=(
            "Run an auxiliary peer for one training run: a CPU-only helper with no model and no data. It "
            "follows the run's progress in the DHT, joins every gradient averaging round, reduces its share "
            "of the all-reduce and contributes no gradients (weight 0). It must accept incoming connections "
            "(no client mode). Stop it with Ctrl-C or SIGTERM."
        ),
        epilog=(
            "example: hivemind-ext aux --initial-peers /ip4/10.0.0.1/tcp/31337/p2p/Qm... "
            "--run-id my_run --target-batch-size 4096"
        ),
    )
    aux.add_argument(
        "--initial-peers",
        nargs="+",
        required=True,
        metavar="MADDR",
        help="multiaddrs of running peers of the swarm to bootstrap the DHT from",
    )
    aux.add_argument(
        "--run-id", required=True, metavar="RUN", help="the run_id the trainers pass to hivemind_ext.Optimizer"
    )
    aux.add_argument(
        "--target-batch-size",
        required=True,
        type=_positive_int,
        metavar="N",
        help="the trainers' target_batch_size (samples the swarm processes per epoch)",
    )
    aux.add_argument(
        "--host-maddrs",
        nargs="+",
        default=DEFAULT_HOST_MADDRS,
        metavar="MADDR",
        help="multiaddrs to listen on (default: /ip4/0.0.0.0/tcp/0, all interfaces, a random port)",
    )
    aux.add_argument(
        "--announce-maddrs", nargs="+", default=None, metavar="MADDR", help="multiaddrs to announce to other peers"
    )
    aux.add_argument(
        "--matchmaking-time",
        type=_positive_float,
        default=5.0,
        metavar="S",
        help="seconds to look for a group before a round (default: %(default)s; match the trainers')",
    )
    aux.add_argument(
        "--averaging-timeout",
        type=_positive_float,
        default=60.0,
        metavar="S",
        help="give up on a round after this many seconds (default: %(default)s)",
    )
    aux.add_argument(
        "--max-rounds",
        type=_positive_int,
        default=None,
        metavar="K",
        help="exit after helping with K rounds (default: run until stopped)",
    )
    aux.add_argument(
        "--identity-path",
        default=None,
        metavar="PATH",
        help="file with this peer's private key, for a stable peer id (created if missing)",
    )
    aux.add_argument(
        "--status-interval",
        type=_positive_float,
        default=60.0,
        metavar="S",
        help="print a status line at least this often, and whenever the epoch changes (default: %(default)s)",
    )
    aux.add_argument("--verbose", action="store_true", help="log the details of every round")
    add_monitor_parser(commands)
    return parser


def add_demo_commands(commands: Any) -> None:
    train = commands.add_parser(
        "train",
        help="train the digits demo: start a swarm (or its first peer) and print the command that joins it",
        description=(
            "Train a digit classifier with hivemind_ext.Optimizer: start --peers peer processes on this machine "
            "(the first is the bootstrap) and print the command that joins the run from another terminal or "
            'machine. Needs scikit-learn (pip install "hivemind-ext[examples]"). Ctrl-C stops every peer.'
        ),
        epilog="example: hivemind-ext train --peers 1 --host-maddrs /ip4/0.0.0.0/tcp/45555 --epochs 200",
    )
    demo.add_train_arguments(train)
    train.set_defaults(handler=lambda args: demo.start(check_args(train, args), join_prefix=["hivemind-ext", "join"]))
    join = commands.add_parser(
        "join",
        help="join a digits demo run as one more peer (from another machine: pass --initial-peers)",
        description=(
            "Join a run of the digits demo as one peer: download the current model from the swarm and train "
            "until it reaches --epochs. Use the command that `hivemind-ext train` prints: every setting that "
            "must match is in it. Add --client-mode behind NAT."
        ),
    )
    demo.add_join_arguments(join)
    join.set_defaults(handler=lambda args: demo.start(check_args(join, args), join_prefix=()))


def _print(line: str) -> None:
    print(line, flush=True)


def _configure_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("hivemind_ext")
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)


def _stop_on_signals(stop: threading.Event) -> dict[int, Any]:
    """Makes SIGINT and SIGTERM set ``stop`` (the main loop then shuts everything down); returns the old handlers."""

    def handler(signum: int, frame: Any) -> None:
        if stop.is_set():  # a second Ctrl-C: give up on the clean shutdown
            raise KeyboardInterrupt
        _print(f"received {signal.Signals(signum).name}: shutting down")
        stop.set()

    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, handler)
    return previous


def run_aux(args: argparse.Namespace) -> int:
    import hivemind

    from hivemind_ext.optim.auxiliary import run_auxiliary_peer
    from hivemind_ext.p2p.dht_calls import dht_client_mode, dht_peer_id, start_dht, visible_maddrs

    stop = threading.Event()
    previous = _stop_on_signals(stop) if threading.current_thread() is threading.main_thread() else {}
    dht_kwargs: dict[str, Any] = {"host_maddrs": args.host_maddrs}
    if args.announce_maddrs:
        dht_kwargs["announce_maddrs"] = args.announce_maddrs
    if args.identity_path:
        dht_kwargs["identity_path"] = args.identity_path
    dht = None
    try:
        # every wait on the DHT has a deadline: a daemon, bootstrap or DHT process that hangs ends the
        # command with a DeadlineExceededError instead of holding it for ever
        dht = hivemind.DHT(initial_peers=args.initial_peers, start=False, **dht_kwargs)
        start_dht(dht, timeout=DHT_START_TIMEOUT)
        _print("auxiliary peer is listening on:")
        for maddr in visible_maddrs(dht, timeout=DHT_CALL_TIMEOUT):
            _print(f"  {maddr}")
        # asked once here with a deadline; the DHT keeps the answers for the components that read them
        dht_peer_id(dht, timeout=DHT_CALL_TIMEOUT)
        dht_client_mode(dht, timeout=DHT_CALL_TIMEOUT)
        _print(f"helping run {args.run_id!r} (target batch size {args.target_batch_size})")
        rounds = run_auxiliary_peer(
            dht,
            run_id=args.run_id,
            target_batch_size=args.target_batch_size,
            matchmaking_time=args.matchmaking_time,
            averaging_timeout=args.averaging_timeout,
            max_rounds=args.max_rounds,
            stop=stop,
            status_interval=args.status_interval,
            on_status=_print,
            alone_hint="check --run-id and --initial-peers",
        )
        _print(f"helped with {rounds} averaging rounds; exiting")
        return EXIT_OK
    finally:
        if dht is not None:
            dht.shutdown()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def main(argv: Sequence[str] | None = None) -> int:
    """The console script; after Ctrl-C of ``train`` / ``join`` the process ends at once (see ``exit_now``)."""
    code = run(argv)
    if code == demo.EXIT_INTERRUPTED and argv is None:
        demo.exit_now(code)
    return code


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.verbose)
    if args.command == "monitor":
        return run_monitor(args)
    if args.command in ("train", "join"):
        return args.handler(args)
    if args.command == "aux":
        try:
            return run_aux(args)
        except KeyboardInterrupt:
            return 130
        except Exception as e:
            _print(f"hivemind-ext aux failed: {type(e).__name__}: {e}")
            return EXIT_ERROR
    raise AssertionError(f"unknown command {args.command!r}")  # argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
