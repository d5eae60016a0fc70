"""Large swarms: rotating groups and sharded matchmaking, with real peers and in simulation.

1. Real peers on 127.0.0.1 (default 8 only; ``--peers 8 16 32``), each a process with its own
   DHT and libp2p daemon and a small tensor (default 1024 floats, peer i holds the value i),
   averaging in groups of ``--group`` (default 4) with rotating groups, the swarm's size passed as
   ``expected_group_size`` (so peers read only their shard's board). Per round: matchmaking time
   (step time minus the all-reduce), all-reduce time, matchmaking reads of the DHT and the bytes of
   records they returned per peer, memory per peer (the peer's process and its children: DHT
   process and daemons), and how far the peers' values are from the global mean after the rounds.
   hivemind's DecentralizedAverager runs the same case (its own matchmaking, no group bits) for the
   step time; it has no counter of its DHT reads.
2. A simulation of the pure matchmaking protocol (hivemind_ext.averaging.matchmaking.simulation):
   1,000 peers with hashed coordinates, DHT lag up to 50 ms, 2% of peers dying after they declare,
   declarations spread over 0.5 s before a common scheduled time: polls until every group is final,
   records per read, and the same at 8 and 64 peers; 64 = 8**2 peers on a grid: the largest
   distance from the global mean after 2 rounds; mixing of 1,000 hashed peers in groups of 8 over
   3 rounds, next to hivemind's rule (random group bits that move as in hivemind's Moshpit
   averaging, reimplemented in group_key.py: hivemind's own matchmaking cannot be simulated).
3. Progress records (:mod:`scale_progress`): what one read of the swarm's progress records costs a
   peer at 8, 16, 32 and 64 peers (simulated writers' signed records in a real DHT, a real
   ProgressTracker reading them); ``--progress-peers`` (none: skip).
4. Digits training (:mod:`scale_training`, ``--digits 16``): 16 peers in rotating groups of
   ``--group`` against one group of 16, same samples: held-out loss and the spread of parameters.

    python benchmarks/scale.py                       # 8 real peers in groups of 4, < 10 min
    python benchmarks/scale.py --peers 8 16 --no-hivemind
    python benchmarks/scale.py --no-real --digits 16   # simulation, progress records, 16-peer digits

The default runs 8 real peers only: on the shared 2-core machine 16 peers overloaded the DHTs
(stores timed out) and 2 of 5 16-peer runs did not finish within 10 minutes; 64 peers (about
130 MB PSS each with their DHT process and daemon) do not fit it at all.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import random
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Result, describe_machine, emit, higher_is_better, lower_is_better

STEP_TIMEOUT = 90.0


# ----- 1. real peers


def tree_memory_bytes(pid: int) -> int:
    """Proportional set size (shared pages split among their users: forked peers share the parent's
    imports) of a process and all its descendants (DHT process, daemons), from /proc; 0 where unavailable."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        todo.extend(children.get(current, []))
        try:
            with open(f"/proc/{current}/smaps_rollup") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
        except (OSError, StopIteration):
            pass
    return total


def make_averager(impl: str, tensor: Any, dht: Any, args: argparse.Namespace) -> Any:
    if impl == "ours":
        from hivemind_ext.averaging import DecentralizedAverager
    else:
        from hivemind.averaging import DecentralizedAverager
    return DecentralizedAverager(
        [tensor],
        dht,
        prefix=f"scale_{impl}",
        target_group_size=args.group,
        min_group_size=2,
        min_matchmaking_time=args.matchmaking_time,
        request_timeout=3.0,
        start=True,
    )


def peer_main(
    index: int, impl: str, peers: int, args: argparse.Namespace, initial: list[str], barrier: Any, results: Any
) -> None:
    """One peer process: join, then run the rounds, reporting one row per round."""
    import hivemind
    import torch

    torch.set_num_threads(1)
    dht = averager = None
    try:
        for attempt in range(3):  # on a loaded machine the bootstrap ping times out now and then
            try:
                dht = hivemind.DHT(initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
                break
            except RuntimeError:
                if attempt == 2:
                    raise
        tensor = torch.full((args.size,), float(index))
        averager = make_averager(impl, tensor, dht, args)
        if impl == "ours":
            from hivemind_ext.averaging.round_stats import round_stats_of

            stats = round_stats_of(averager.runtime)
        for round_index in range(args.rounds + 1):  # round 0 warms up connections (not reported)
            barrier.wait(timeout=300)
            before = stats.snapshot() if impl == "ours" else None
            start = time.perf_counter()
            if impl == "ours":
                averager.step(timeout=STEP_TIMEOUT, expected_group_size=peers)
            else:
                averager.step(timeout=STEP_TIMEOUT)
            seconds = time.perf_counter() - start
            report = getattr(averager, "last_round", None)
            after = stats.snapshot() if impl == "ours" else None
            with averager.get_tensors() as tensors:
                value = float(tensors[0].mean())
            row = dict(
                index=index,
                round=round_index,
                step=seconds,
                allreduce=report.seconds if report is not None else None,
                group=report.group_size if report is not None else None,
                reads=after.board_reads - before.board_reads if after is not None else None,
                bytes=after.board_bytes_read - before.board_bytes_read if after is not None else None,
                value=value,
                rss=tree_memory_bytes(os.getpid()),
            )
            results.put(row)
    except Exception:
        results.put(dict(index=index, round=-1, error=traceback.format_exc()))
    finally:
        if averager is not None:
            averager.shutdown()
        if dht is not None:
            dht.shutdown()


def run_real(impl: str, peers: int, args: argparse.Namespace) -> list[dict]:
    """Every peer's rows for every reported round."""
    import hivemind

    context = mp.get_context("fork")
    bootstrap = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    initial = [str(addr) for addr in bootstrap.get_visible_maddrs()]
    barrier, results = context.Barrier(peers), context.Queue()
    processes = [
        context.Process(target=peer_main, args=(i, impl, peers, args, initial, barrier, results)) for i in range(peers)
    ]
    for process in processes:
        process.start()
    rows = []
    try:
        for _ in range(peers * (args.rounds + 1)):
            row = results.get(timeout=STEP_TIMEOUT + 300)
            if row["round"] == -1:
                raise RuntimeError(f"{impl} peer {row['index']} failed:\n{row['error']}")
            rows.append(row)
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        bootstrap.shutdown()
    return [row for row in rows if row["round"] > 0]


def summarize_real(impl: str, peers: int, rows: list[dict]) -> dict[str, float | None]:
    def median(key: str) -> float | None:
        values = [row[key] for row in rows if row[key] is not None]
        return statistics.median(values) if values else None

    matchmaking = [row["step"] - row["allreduce"] for row in rows if row["allreduce"] is not None]
    last = max(row["round"] for row in rows)
    finals = [row["value"] for row in rows if row["round"] == last]
    mean = (peers - 1) / 2
    summary = dict(
        step=median("step"),
        matchmaking=statistics.median(matchmaking) if matchmaking else None,
        allreduce=median("allreduce"),
        group=median("group"),
        reads=median("reads"),
        bytes=median("bytes"),
        rss_mb=median("rss") / 2**20,
        off_mean=max(abs(v - mean) for v in finals) / max(mean, 1e-9),
    )
    shown = ", ".join(f"{k} {v:.4g}" for k, v in summary.items() if v is not None)
    print(f"{impl}, {peers} peers: {shown}", flush=True)
    return summary


def measure_real(impl: str, peers: int, args: argparse.Namespace) -> dict[str, float | None] | None:
    """:func:`summarize_real` of one run, or None (printed) if a peer failed."""
    try:
        return summarize_real(impl, peers, run_real(impl, peers, args))
    except (RuntimeError, OSError, queue.Empty) as e:
        print(f"{impl}, {peers} peers: FAILED {str(e)[-600:]}", flush=True)
        return None


# ----- 2. simulation


def simulate_polls(count: int, group: int, churn: float, seed: int = 0) -> tuple[float, float, float, float]:
    """(polls until every group is final, records per read, share of live peers grouped, seconds)."""
    from hivemind_ext.averaging.matchmaking.group import MatchmakingConfig
    from hivemind_ext.averaging.matchmaking.rotation import initial_digits
    from hivemind_ext.averaging.matchmaking.simulation import simulate_round, simulated_peer_id

    config = MatchmakingConfig(prefix="sim", target_group_size=group, min_matchmaking_time=1.0, request_timeout=1.0)
    peers = [simulated_peer_id(i) for i in range(count)]
    coordinates = {peer: initial_digits(peer, group) for peer in peers}
    dying = random.Random(seed).sample(peers, int(churn * count))
    started = time.perf_counter()
    result = simulate_round(
        coordinates, config, swarm_size=count, seed=seed, max_lag=0.05, spread=0.5, dying=dying, scheduled_time=1.0
    )
    seconds = time.perf_counter() - started
    grouped = len(result.groups) / (count - len(dying))
    print(
        f"simulation, {count} peers in groups of {group}, {churn:.0%} dying: {result.polls_to_group:.1f} polls "
        f"after the last declaration / scheduled time, {result.records_per_read:.1f} records per read, "
        f"{grouped:.3f} grouped, "
        f"{seconds:.1f} s",
        flush=True,
    )
    return result.polls_to_group, result.records_per_read, grouped, seconds


def simulate_grid(group: int = 8, dims: int = 2) -> float:
    """64 = 8**2 peers on a grid, 2 rounds of the protocol: largest |value - global mean| / mean."""
    from hivemind_ext.averaging.matchmaking.group import MatchmakingConfig
    from hivemind_ext.averaging.matchmaking.rotation import grid_digits, next_digits
    from hivemind_ext.averaging.matchmaking.simulation import simulate_round, simulated_peer_id

    count = group**dims
    config = MatchmakingConfig(prefix="grid", target_group_size=group, min_matchmaking_time=2.0, request_timeout=1.0)
    peers = [simulated_peer_id(i) for i in range(count)]
    coordinates = {peer: grid_digits(i, group, dims) for i, peer in enumerate(peers)}
    values = {peer: float(i) for i, peer in enumerate(peers)}
    for round_index in range(dims):
        result = simulate_round(coordinates, config, swarm_size=count, seed=round_index, max_lag=0.03, spread=0.2)
        for info in {g.group_id: g for g in result.groups.values()}.values():
            members = [m.peer_id for m in info.members]
            mean = sum(values[p] for p in members) / len(members)
            for position, peer in enumerate(members):
                values[peer] = mean
                coordinates[peer] = next_digits(coordinates[peer], info.group_id, position, len(members), group)
    mean = (count - 1) / 2
    return max(abs(v - mean) for v in values.values()) / mean


def mixing(count: int, group: int, rounds: int, rule: str, seed: int = 0) -> float:
    """Spread (std) of the peers' values after ``rounds`` rounds, relative to the start, under our
    rotation or hivemind's rule (random group bits, log2(count / group) of them, moved as hivemind does)."""
    import math

    from hivemind_ext.averaging.matchmaking.group_key import next_group_bits
    from hivemind_ext.averaging.matchmaking.rotation import (
        initial_digits,
        next_digits,
        rotation_groups,
        shard_depth,
        split_evenly,
    )
    from hivemind_ext.averaging.matchmaking.simulation import simulated_peer_id

    rnd = random.Random(seed)
    peers = [simulated_peer_id(i) for i in range(count)]
    values = {peer: rnd.gauss(0, 1) for peer in peers}
    initial = statistics.pstdev(values.values())
    width = max(0, round(math.log2(count / group)))
    bits = {peer: "".join(rnd.choice("01") for _ in range(width)) for peer in peers}
    coordinates = {peer: initial_digits(peer, group) for peer in peers}
    for round_index in range(rounds):
        if rule == "ours":
            groups = rotation_groups(coordinates, base=group, depth=shard_depth(count, group))
        else:  # hivemind: peers of one key group together (its matchmaking splits a key's peers into groups)
            by_key: dict[str, list[str]] = {}
            for peer in peers:
                by_key.setdefault(bits[peer], []).append(peer)
            groups = [g for members in by_key.values() for g in split_evenly(members, -(-len(members) // group))]
        for number, members in enumerate(groups):
            group_id = f"{round_index}/{number}".encode()
            mean = sum(values[p] for p in members) / len(members)
            for position, peer in enumerate(members):
                values[peer] = mean
                coordinates[peer] = next_digits(coordinates[peer], group_id, position, len(members), group)
                bits[peer] = next_group_bits(bits[peer], group_id, position, len(members), group)
    return statistics.pstdev(values.values()) / initial


# ----- 3. progress records and 4. 16-peer digits training (their own modules)


def progress_results(counts: list[int]) -> list[Result]:
    """Issue 14 item 3: what one read of the progress records costs a peer at each swarm size."""
    from scale_progress import measure_progress_reads

    results = []
    for row in measure_progress_reads(tuple(counts)):
        case = f"progress records, {row['peers']} peers"
        results.append(lower_is_better(case, "read ms (median)", row["read_s"] * 1e3, None))
        results.append(lower_is_better(case, "reader CPU ms", row["cpu_s"] * 1e3, None))
        results.append(lower_is_better(case, "bytes per read", float(row["bytes"]), None))
    return results


def digits_results(peers: int, group: int, epochs: int) -> list[Result]:
    """Issue 14: digits training in rotating groups against one group of the whole swarm."""
    from scale_training import compare_groups

    outcomes = compare_groups(peers=peers, group=group, epochs=epochs)
    grouped, whole = outcomes[f"groups of {group}"], outcomes["one group"]
    case = f"digits, {peers} peers, groups of {group} vs one group"
    ratio = grouped["loss"] / whole["loss"]
    print(f"{case}: held-out loss ratio {ratio:.4f} (goal <= 1.02)", flush=True)
    return [
        lower_is_better(case, "held-out loss, groups", grouped["loss"], None),
        lower_is_better(case, "held-out loss, one group", whole["loss"], None),
        lower_is_better(case, "loss ratio groups / one group", ratio, None),
        lower_is_better(case, "parameter spread, groups", grouped["spread"], None),
        lower_is_better(case, "parameter spread, one group", whole["spread"], None),
    ]


# ----- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, nargs="+", default=[8], help="real swarm sizes (e.g. 8 16 32)")
    parser.add_argument("--group", type=int, default=4, help="target_group_size of the real peers")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=1024, help="floats per peer")
    parser.add_argument("--matchmaking-time", type=float, default=5.0)
    parser.add_argument("--sim-peers", type=int, default=1000)
    parser.add_argument("--no-hivemind", action="store_true")
    parser.add_argument("--no-real", action="store_true", help="only the simulation")
    parser.add_argument(
        "--progress-peers", type=int, nargs="*", default=[8, 16, 32, 64], help="the progress-record case's swarm sizes"
    )
    parser.add_argument("--digits", type=int, default=0, metavar="PEERS", help="digits training in groups (e.g. 16)")
    parser.add_argument("--digits-epochs", type=int, default=12)
    args = parser.parse_args()
    print(describe_machine(), "| load", os.getloadavg(), flush=True)
    results: list[Result] = []

    for churn in (0.0, 0.02):
        polls, records, grouped, _ = simulate_polls(args.sim_peers, 8, churn)
        case = f"sim {args.sim_peers} peers, groups of 8, {churn:.0%} dying"
        results.append(lower_is_better(case, "polls to all groups", polls, None))
        results.append(higher_is_better(case, "share grouped", grouped, None))
    results.append(lower_is_better(f"sim {args.sim_peers} peers, groups of 8", "records per read", records, None))
    for count in (8, 64):
        _, records, _, _ = simulate_polls(count, 8, 0.0)
        results.append(lower_is_better(f"sim {count} peers, groups of 8", "records per read", records, None))
    error = simulate_grid()
    print(f"simulation, 64 = 8**2 peers on a grid, 2 rounds: largest relative distance from the mean {error:.2e}")
    results.append(lower_is_better("sim 64 = 8^2 grid, 2 rounds", "max |x - mean| / mean", error, None))
    for rounds in (2, 3):
        ours, theirs = mixing(args.sim_peers, 8, rounds, "ours"), mixing(args.sim_peers, 8, rounds, "hivemind")
        case = f"sim {args.sim_peers} peers, {rounds} rounds"
        print(f"mixing, {case}, groups of 8: spread x{ours:.3g} (hivemind {theirs:.3g})")
        results.append(lower_is_better(case, "spread / initial", ours, theirs))

    if args.progress_peers:
        results.extend(progress_results(args.progress_peers))
    if args.digits:
        results.extend(digits_results(args.digits, args.group, args.digits_epochs))

    if not args.no_real:
        for peers in args.peers:
            ours = measure_real("ours", peers, args)
            theirs = None if args.no_hivemind else measure_real("hivemind", peers, args)
            if ours is None:
                continue
            case = f"{peers} peers, groups of {args.group}"
            results.append(lower_is_better(case, "step s (median)", ours["step"], theirs and theirs["step"]))
            matchmaking = theirs and theirs["matchmaking"]
            results.append(lower_is_better(case, "matchmaking s", ours["matchmaking"], matchmaking))
            results.append(lower_is_better(case, "all-reduce s", ours["allreduce"], theirs and theirs["allreduce"]))
            results.append(lower_is_better(case, "DHT reads/peer/round", ours["reads"], None))
            results.append(lower_is_better(case, "DHT bytes read/peer/round", ours["bytes"], None))
            results.append(lower_is_better(case, "memory/peer MB", ours["rss_mb"], theirs and theirs["rss_mb"]))
            results.append(
                lower_is_better(case, f"off mean after {args.rounds}", ours["off_mean"], theirs and theirs["off_mean"])
            )
    print("load", os.getloadavg(), flush=True)
    emit("scale", results)


if __name__ == "__main__":
    main()
