"""Group formation time: how long a round of DecentralizedAverager.step takes when the tensors are tiny,
so that forming the group (matchmaking) is most of it; ours next to hivemind's, in the same run.

N averagers in this process (each with its own hivemind DHT and libp2p daemon, on 127.0.0.1) call
``step`` together with the same settings in both libraries (``target_group_size = min_group_size =
N``, ``min_matchmaking_time=30``, so groups form because they are full, ``request_timeout=3``), as in
``benchmarks/robust.py``. A round is timed from the moment every peer has called ``step`` until
every peer holds its result. For ours, the all-reduce's own time (``last_round.seconds``) is
subtracted as well, leaving the time from "asks to average" to "group formed" (plus what runs
between, e.g. the round's setup).

    python benchmarks/group_formation.py
    python benchmarks/group_formation.py --peers 4 8 --rounds 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import hivemind
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Result, emit, full_group_averager, lower_is_better, start

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
STEP_TIMEOUT = 60.0
SIZE = 26_000  # about robust.py's model: the all-reduce is a small share of the round


def start_swarm(peers: int) -> list[Any]:
    dhts = [hivemind.DHT(start=True, host_maddrs=LOOPBACK)]
    initial_peers = [str(a) for a in dhts[0].get_visible_maddrs()]
    for _ in range(peers - 1):  # one at a time: bootstrapping many at once fails on a loaded 2-core box
        dhts.append(hivemind.DHT(start=True, host_maddrs=LOOPBACK, initial_peers=initial_peers))
    return dhts


def make_averager(impl: str, dht: Any, prefix: str, peers: int) -> Any:
    return full_group_averager(impl, [torch.randn(SIZE)], dht, prefix, peers)


def run(impl: str, peers: int, rounds: int) -> tuple[list[float], list[float]]:
    """Round times (s) and, for ours, each round's slowest time outside the all-reduce (s)."""
    dhts = start_swarm(peers)
    averagers = [make_averager(impl, dht, f"formation_{impl}_{peers}", peers) for dht in dhts]
    times, outside = [], []
    try:
        for round_index in range(rounds + 1):  # round 0 warms up connections
            started = time.perf_counter()
            controls = [a.step(wait=False, timeout=STEP_TIMEOUT) for a in averagers]
            for control in controls:
                control.result(timeout=STEP_TIMEOUT + 30)
            elapsed = time.perf_counter() - started
            if round_index == 0:
                continue
            times.append(elapsed)
            reports = [getattr(a, "last_round", None) for a in averagers]
            if all(r is not None for r in reports):
                outside.append(elapsed - min(r.seconds for r in reports))
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()
    return times, outside


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--rounds", type=int, default=8)
    args = start(parser)
    results: list[Result] = []
    for peers in args.peers:
        hm_times, _ = run("hivemind", peers, args.rounds)
        ours_times, outside = run("ours", peers, args.rounds)
        hm, ours = statistics.median(hm_times), statistics.median(ours_times)
        formation = statistics.median(outside) if outside else None
        print(
            f"{peers} peers: round ours {ours * 1000:.0f} ms (range {min(ours_times) * 1000:.0f}-"
            f"{max(ours_times) * 1000:.0f}; outside the all-reduce {formation * 1000:.0f} ms) | hivemind "
            f"{hm * 1000:.0f} ms (range {min(hm_times) * 1000:.0f}-{max(hm_times) * 1000:.0f})"
        )
        results.append(lower_is_better(f"{peers} peers, {SIZE} floats", "s/round", round(ours, 4), round(hm, 4)))
        if formation is not None:
            case = f"{peers} peers, ours outside the all-reduce"
            results.append(Result(case, "s/round", round(formation, 4), None, None))
    emit("group_formation", results)


if __name__ == "__main__":
    main()
