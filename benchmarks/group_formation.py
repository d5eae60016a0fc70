"""Group formation time: how long a round of DecentralizedAverager.step takes when the tensors are tiny,
so that forming the group (matchmaking) is most of it; ours next to hivemind's, in the same run.

N averagers in this process (each with its own hivemind DHT and libp2p daemon, on 127.0.0.1) call
``step`` together with the same settings in both libraries (``target_group_size = min_group_size =
N``, ``min_matchmaking_time=30``, so groups form because they are full, ``request_timeout=3``), as in
``benchmarks/robust.py``. A round is timed from the moment every peer has called ``step`` until
every peer holds its result. For ours, the all-reduce's own time (``last_round.seconds``) is
subtracted as well, leaving the time from "asks to average" to "group formed" (plus what runs
between, e.g. the round's setup).

For ours it also reports what matchmaking read from the DHT per peer and round: board reads and the
bytes of the records they returned (signed subkeys and values, ``RoundStats.board_bytes_read``; each
read merges the answers of every node that holds the board, so the link carries a multiple of it).
``--gap`` pauses between rounds: matchmaking records outlive their round, so how many earlier rounds'
records a read returns depends on how far apart rounds are (3-4 s on a 20 Mbit/s link, as in
``benchmarks/wan.py``). hivemind's reads are not counted (null).

    python benchmarks/group_formation.py
    python benchmarks/group_formation.py --peers 4 8 --rounds 8
    python benchmarks/group_formation.py --peers 4 --rounds 4 --gap 3.5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hivemind
import torch

from hivemind_ext.averaging.round_stats import round_stats_of

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


@dataclass
class Run:
    """What one library's rounds measured (board figures: ours only, per peer and round, timed rounds)."""

    times: list[float] = field(default_factory=list)  # s per round
    outside: list[float] = field(default_factory=list)  # ours: each round's slowest time outside the all-reduce
    board_reads: list[float] = field(default_factory=list)
    board_bytes: list[float] = field(default_factory=list)


def board_counts(averagers: list[Any]) -> tuple[int, int]:
    """Ours: matchmaking board reads and their bytes, all peers together so far (0, 0 for hivemind)."""
    reads = read_bytes = 0
    for averager in averagers:
        runtime = getattr(averager, "runtime", None)
        if runtime is not None:
            counts = round_stats_of(runtime).snapshot()
            reads, read_bytes = reads + counts.board_reads, read_bytes + counts.board_bytes_read
    return reads, read_bytes


def run(impl: str, peers: int, rounds: int, gap: float = 0.0) -> Run:
    """``rounds`` timed rounds after a warm-up, ``gap`` seconds apart."""
    dhts = start_swarm(peers)
    averagers = [make_averager(impl, dht, f"formation_{impl}_{peers}", peers) for dht in dhts]
    result = Run()
    try:
        for round_index in range(rounds + 1):  # round 0 warms up connections
            if round_index:
                time.sleep(gap)
            reads_before, bytes_before = board_counts(averagers)
            started = time.perf_counter()
            controls = [a.step(wait=False, timeout=STEP_TIMEOUT) for a in averagers]
            for control in controls:
                control.result(timeout=STEP_TIMEOUT + 30)
            elapsed = time.perf_counter() - started
            if round_index == 0:
                continue
            result.times.append(elapsed)
            reports = [getattr(a, "last_round", None) for a in averagers]
            if all(r is not None for r in reports):
                result.outside.append(elapsed - min(r.seconds for r in reports))
            reads, read_bytes = board_counts(averagers)
            result.board_reads.append((reads - reads_before) / peers)
            result.board_bytes.append((read_bytes - bytes_before) / peers)
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--gap", type=float, default=0.0, help="seconds between rounds")
    args = start(parser)
    results: list[Result] = []
    for peers in args.peers:
        hm_times = run("hivemind", peers, args.rounds, args.gap).times
        mine = run("ours", peers, args.rounds, args.gap)
        ours_times, outside = mine.times, mine.outside
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
        reads, read_bytes = statistics.median(mine.board_reads), statistics.median(mine.board_bytes)
        per_round = [round(b) for b in mine.board_bytes]
        print(f"{peers} peers, ours: {reads:.1f} board reads and {read_bytes:.0f} B per peer and round {per_round}")
        case = f"{peers} peers, {args.gap:g} s between rounds, ours: matchmaking board"
        results.append(Result(case, "B read per peer per round", round(read_bytes), None, None))
        results.append(Result(case, "B per read", round(read_bytes / max(reads, 1e-9)), None, None))
    emit("group_formation", results)


if __name__ == "__main__":
    main()
