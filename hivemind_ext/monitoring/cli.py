"""``hivemind-ext monitor``: joins a run as a passive DHT peer (client mode: it accepts no connections
and stores nothing), reads the metrics records the run's peers publish (``Optimizer(...,
metrics_period=...)``) and serves a dashboard and a Prometheus ``/metrics`` endpoint.

:func:`add_monitor_parser` registers the subcommand on the ``hivemind-ext`` parser; :func:`run_monitor`
runs it until Ctrl-C / SIGTERM (or ``--duration``). Heavy imports wait until it runs.
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from typing import Any

EXIT_OK, EXIT_ERROR = 0, 1
DHT_START_TIMEOUT = 60.0  # seconds for the DHT to start (its daemon, then the bootstrap)


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (0 for any free port), got {text}")
    return value


def add_monitor_parser(commands: Any) -> None:
    """Adds ``monitor`` to the subparsers ``commands`` of the ``hivemind-ext`` parser."""
    monitor = commands.add_parser(
        "monitor",
        help="serve a live dashboard and Prometheus metrics of a run",
        description=(
            "Join a run as a passive DHT peer (client mode), read the metrics that its peers publish "
            "(hivemind_ext.Optimizer(..., metrics_period=5)) and serve a web dashboard at / and Prometheus "
            "metrics at /metrics. Stop it with Ctrl-C or SIGTERM."
        ),
        epilog="example: hivemind-ext monitor --initial-peers /ip4/10.0.0.1/tcp/31337/p2p/Qm... --run-id my_run",
    )
    monitor.add_argument(
        "--initial-peers", nargs="+", required=True, metavar="MADDR", help="multiaddrs of the run's peers"
    )
    monitor.add_argument("--run-id", required=True, metavar="RUN", help="the run_id the peers pass to the Optimizer")
    monitor.add_argument("--host", default="127.0.0.1", help="address to serve on (default: %(default)s; 0.0.0.0: all)")
    monitor.add_argument("--port", type=_port, default=8000, help="port to serve on (default: %(default)s; 0: any)")
    monitor.add_argument(
        "--poll-interval", type=_positive_float, default=2.0, metavar="S", help="read the DHT every S seconds"
    )
    monitor.add_argument(
        "--history", type=int, default=900, metavar="N", help="polls the charts keep (default: %(default)s)"
    )
    monitor.add_argument("--duration", type=_positive_float, default=None, metavar="S", help="exit after S seconds")
    monitor.add_argument("--verbose", action="store_true", help="log every failed poll")


def run_monitor(args: argparse.Namespace) -> int:
    """Runs the monitor until stopped; a failure ends it with one line on stdout (exit status 1)."""
    try:
        return _serve(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        print(f"hivemind-ext monitor failed: {type(e).__name__}: {e}", flush=True)
        return EXIT_ERROR


def _serve(args: argparse.Namespace) -> int:
    import hivemind

    from hivemind_ext.monitoring.poller import MetricsPoller, install_validators
    from hivemind_ext.monitoring.server import MonitorServer
    from hivemind_ext.monitoring.swarm_state import SwarmState
    from hivemind_ext.p2p.dht_calls import start_dht

    stop = threading.Event()
    previous = _stop_on_signals(stop) if threading.current_thread() is threading.main_thread() else {}
    give_up = time.monotonic() + args.duration if args.duration is not None else None
    dht = poller = server = None
    try:
        dht = hivemind.DHT(initial_peers=args.initial_peers, client_mode=True, start=False)
        start_dht(dht, timeout=DHT_START_TIMEOUT)  # DHT(start=True) waited for ever on a bootstrap that hangs
        install_validators(dht)
        state = SwarmState(args.run_id, history=max(1, args.history))
        server = MonitorServer(state, host=args.host, port=args.port)
        poller = MetricsPoller(dht, state, period=args.poll_interval)
        server.start()
        poller.start()
        print(f"monitoring run {args.run_id!r}", flush=True)
        print(f"dashboard: {server.url}", flush=True)
        print(f"prometheus metrics: {server.url}metrics", flush=True)
        while not stop.wait(0.2):
            if give_up is not None and time.monotonic() >= give_up:
                break
        return EXIT_OK
    finally:
        for component in (server, poller, dht):
            if component is not None:
                component.shutdown()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _stop_on_signals(stop: threading.Event) -> dict[int, Any]:
    def handler(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        print(f"received {signal.Signals(signum).name}: shutting down", flush=True)
        stop.set()

    return {signum: signal.signal(signum, handler) for signum in (signal.SIGINT, signal.SIGTERM)}


__all__ = ["add_monitor_parser", "run_monitor"]
