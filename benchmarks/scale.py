"""Large swarms: rotating groups and sharded matchmaking, with real peers and in simulation.

1. Real peers on 127.0.0.1, each with its own DHT node and its own libp2p daemon, several peers
   per Python process (``--per-host``, default 8; see ``hosted_dht.py``: our peers' DHT nodes share
   the process's event loop instead of each being a process of its own; hivemind's peers keep a
   ``hivemind.DHT`` process each, since its averager is a forked process that reaches its DHT over
   a pipe). Peer ``i`` averages ``--size`` floats (default 1024) holding the value ``i``.
   ``--our-dht process`` gives each of our peers a ``hivemind.DHT`` process too; with ``--per-host 1``
   our peers are then laid out as hivemind's are (an averager process and a DHT process each). In the
   default layout one GIL serves 8 averagers and 8 DHT nodes, and the matchmaking's last DHT stores
   (issued without waiting) run during the all-reduce: a stage-by-stage trace (benchmarks/RESULTS.md,
   session 17) showed a 4 KiB round taking 0.06-0.08 s when they had finished before it and
   0.11-0.16 s when they had not.

   a. Rotating groups of ``--group`` (default 8) at each ``--peers`` (default 8 16): ours with the
      swarm's size as ``expected_group_size`` (peers read only their shard's board); hivemind's
      ``DecentralizedAverager`` with the same ``target_group_size`` and Moshpit group bits laid out
      as the same grid (``initial_group_bits`` of ``i // group``). One warm-up round, after which every
      peer sets its value back to ``i``, then ``--rounds`` measured rounds. Per peer and round:
      matchmaking time (until the group is found: each step waits for a trigger, given as soon as
      its thread sees the group) and all-reduce time (from the trigger to the result), the
      requests the peer made of its DHT (get / store / run_coroutine) and the bytes of records they
      returned (msgpack size, the same measure for both); per peer: memory (PSS of the host process
      and its descendants: DHT processes, daemons, hivemind's averager processes, split over its
      peers) and CPU seconds per round (Python processes and daemons apart). After each measured
      round: the largest distance of any peer's value from the global mean, relative to the mean.
   b. One group of everyone (``target_group_size`` None) at each ``--big-peers`` (default 8) with
      ``--big-size`` floats per peer (default 65536: equal bytes per peer whatever N): the
      butterfly's round time and the group size formed.
2. A simulation of the pure matchmaking protocol (hivemind_ext.averaging.matchmaking.simulation):
   1,000 peers with hashed coordinates, DHT lag up to 50 ms, 2% of peers dying after they declare,
   declarations spread over 0.5 s before a common scheduled time: polls until every group is final,
   records per read, and the same at 8 and 64 peers; 64 = 8**2 peers on a grid: the largest
   distance from the global mean after 2 rounds; mixing of 1,000 hashed peers in groups of 8 over
   3 rounds, next to hivemind's rule (random group bits that move as in hivemind's Moshpit
   averaging, reimplemented in group_key.py: hivemind's own matchmaking cannot be simulated).
3. Progress records (:mod:`scale_progress`): what one read of the swarm's progress records costs a
   peer at 8, 16, 32 and 64 peers (simulated writers' signed records in a real DHT, a real
   ProgressTracker reading them); ``--progress-peers 8 16 32 64`` (not run by default).
4. Digits training (:mod:`scale_training`, ``--digits 16``, not run by default): 16 peers in rotating
   groups of ``--digits-group`` (4) with ``grad_averaging_hops=--digits-hops`` (default auto: 2 for
   16 peers in groups of 4; 1 is one gradient round per epoch) against one group of 16, the same
   samples per peer and epoch (the peers train in lockstep): held-out loss and the spread of parameters.

    python benchmarks/scale.py                                   # the default: < 10 min
    python benchmarks/scale.py --no-sim --peers 8 16 32 64 --big-peers      # rotating groups up to 64
    python benchmarks/scale.py --no-sim --peers --big-peers 8 32 64         # one group of everyone
    python benchmarks/scale.py --no-sim --peers --big-peers --progress-peers 8 16 32 64 --digits 16

All peers share this machine's cores: a swarm's CPU per round grows with N here, where each peer
of a real swarm brings its own, so wall times at 32 and 64 peers on 2 shared cores measure the
machine as much as the protocol; the CPU seconds per peer and round are the figure that should
not grow with N. 64 peers (ours and hivemind's one after the other) take about 15-20 minutes on a
loaded 2-core machine, which is why the default stops at 16.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import math
import multiprocessing as mp
import os
import queue
import random
import statistics
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Result, describe_machine, emit, higher_is_better, lower_is_better

STEP_TIMEOUT = 120.0  # one round of one peer, matchmaking included
STAGE_POLL = 0.02  # how often a step's thread checks whether its group is found (adds at most this)
START_TIMEOUT = 600.0  # every host has started its peers (64 DHT nodes bootstrap one after another)


# ----- 1. real peers, several per process


@dataclass(frozen=True)
class RealCase:
    """One run of real peers: ``peers`` of them averaging ``size`` floats in groups of ``group``
    (None: one group of everyone), ``rounds`` measured rounds after one warm-up round."""

    impl: str  # "ours" or "hivemind"
    peers: int
    group: int | None
    size: int
    rounds: int
    matchmaking_time: float
    per_host: int  # peers per host process
    # ours: "hosted" (DHT nodes on the host process's shared loop, see hosted_dht.py) or "process"
    # (a hivemind.DHT process per peer, as hivemind's peers have)
    our_dht: str = "hosted"

    @property
    def name(self) -> str:
        grouping = f"groups of {self.group}" if self.group else "one group"
        return f"{self.peers} peers, {grouping}, {self.size * 4 // 1024} KiB"


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (DHT processes, daemons, hivemind's averager processes), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    return tree


def tree_memory_bytes(pid: int) -> int:
    """Proportional set size (shared pages split among their users: forked processes share the
    parent's imports) of a process and all its descendants; 0 where unavailable."""
    total = 0
    for current in process_tree(pid):
        try:
            with open(f"/proc/{current}/smaps_rollup") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
        except (OSError, StopIteration):
            pass
    return total


def tree_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by a process and its descendants, by command name
    (``python``, ``p2pd``): where a swarm on one machine spends its cores."""
    ticks = os.sysconf("SC_CLK_TCK")
    used: dict[str, float] = {}
    for current in process_tree(pid):
        try:
            with open(f"/proc/{current}/stat") as f:
                name, rest = f.read().split("(", 1)[1].rsplit(")", 1)
        except OSError:
            continue
        fields = rest.split()
        kind = "p2pd" if name == "p2pd" else "python"
        used[kind] = used.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return used


def hivemind_grid_bits(index: int, case: RealCase) -> str:
    """hivemind's Moshpit set-up for the same grid: peer ``index`` starts with the group bits of
    ``index // group`` (log2(peers / group) bits), so its first round groups peers
    ``k * group .. k * group + group - 1`` as ours does on a grid."""
    if not case.group or case.peers <= case.group:
        return ""
    width = int(math.log2(case.peers // case.group))
    return format((index // case.group) % 2**width, f"0{width}b") if width else ""


def start_peer(index: int, case: RealCase, initial: list[str], host: Any) -> tuple[Any, Any, Any]:
    """(dht, averager, DHT counters) of peer ``index``, whose tensor holds the value ``index``."""
    import torch
    from hosted_dht import CountingDHT, DHTCounters, HostedDHT, wait_created

    counters = DHTCounters()
    # both libraries' daemons get 60 s to start (hivemind's default of 15 s fails at 64 peers under load)
    loopback = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], startup_timeout=60)
    if case.impl == "ours":
        from hivemind_ext.averaging import DecentralizedAverager

        if case.our_dht == "process":
            dht = wait_created(lambda: CountingDHT(initial_peers=initial, counters=counters, start=True, **loopback))
        else:
            dht = wait_created(lambda: HostedDHT(host, initial, counters=counters, **loopback))
        bits = ""
    else:
        from hivemind.averaging import DecentralizedAverager

        dht = wait_created(lambda: CountingDHT(initial_peers=initial, counters=counters, start=True, **loopback))
        bits = hivemind_grid_bits(index, case)
    averager = DecentralizedAverager(
        [torch.full((case.size,), float(index))],
        dht,
        prefix=f"scale_{case.impl}",
        target_group_size=case.group,
        min_group_size=2,
        initial_group_bits=bits,
        min_matchmaking_time=case.matchmaking_time,
        request_timeout=3.0,
        allow_state_sharing=False,  # both libraries: no state advertisements, only averaging in the DHT
        start=True,
    )
    return dht, averager, counters


def timed_step(averager: Any, case: RealCase) -> tuple[float, float, int]:
    """(matchmaking s, all-reduce s, group size) of one step, the same way for both libraries: the
    step waits for a trigger once its group is found, which this thread gives as soon as it sees it."""
    extra = dict(expected_group_size=case.peers) if case.impl == "ours" else {}
    start = time.perf_counter()
    control = averager.step(wait=False, require_trigger=True, timeout=STEP_TIMEOUT, **extra)
    while control.stage.name != "AWAITING_TRIGGER" and not control.done():
        if time.perf_counter() - start > STEP_TIMEOUT + 30:
            raise TimeoutError("no group and no error within the step's timeout")
        time.sleep(STAGE_POLL)
    found = time.perf_counter()
    control.allow_allreduce()
    gathered = control.result(timeout=STEP_TIMEOUT)
    return found - start, time.perf_counter() - found, len(gathered)


def round_row(
    index: int, round_index: int, peer: tuple[Any, Any, Any], step: concurrent.futures.Future, before: tuple[int, int]
) -> dict[str, Any]:
    """Peer ``index``'s row of one round: its step's times (or error), DHT traffic and value."""
    _, averager, counters = peer
    row: dict[str, Any] = dict(index=index, round=round_index)
    try:
        row["matchmaking"], row["allreduce"], row["group"] = step.result()
    except Exception as e:  # a failed step is a result: counted, the peer goes on
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    after = counters.snapshot()
    row["requests"], row["bytes"] = after[0] - before[0], after[1] - before[1]
    with averager.get_tensors() as tensors:
        row["value"] = float(tensors[0].mean())
        if round_index == 0:  # measured rounds start from the initial values again
            tensors[0].fill_(float(index))
    return row


def host_main(case: RealCase, indices: list[int], initial: list[str], barrier: Any, results: Any) -> None:
    """One host process: starts its peers, then runs every round with all of them at once (one
    thread per peer) and reports one row per peer and round."""
    import torch
    from hosted_dht import DHTHost

    torch.set_num_threads(1)
    host = DHTHost() if case.impl == "ours" and case.our_dht == "hosted" else None
    peers: list[tuple[Any, Any, Any]] = []
    cpu_before: dict[str, float] = {}
    try:
        for index in indices:
            peers.append(start_peer(index, case, initial, host))
        with concurrent.futures.ThreadPoolExecutor(len(indices)) as pool:
            for round_index in range(case.rounds + 1):  # round 0 warms up connections and shards
                barrier.wait(timeout=START_TIMEOUT)
                if round_index == 1:
                    cpu_before = tree_cpu_seconds(os.getpid())
                before = [counters.snapshot() for _, _, counters in peers]
                steps = [pool.submit(timed_step, averager, case) for _, averager, _ in peers]
                for index, peer, step, counts in zip(indices, peers, steps, before, strict=True):
                    results.put(round_row(index, round_index, peer, step, counts))
        memory = tree_memory_bytes(os.getpid()) / len(indices)
        cpu = {kind: seconds - cpu_before.get(kind, 0.0) for kind, seconds in tree_cpu_seconds(os.getpid()).items()}
        results.put(dict(index=indices[0], round=-1, memory=memory, cpu=cpu))
    except BaseException:
        results.put(dict(index=indices[0], round=-2, error=traceback.format_exc()[-2000:]))
        barrier.abort()
    finally:
        for dht, averager, _ in peers:
            with contextlib.suppress(Exception):
                averager.shutdown()
            with contextlib.suppress(Exception):
                dht.shutdown()
        if host is not None:
            host.close()


def run_real(case: RealCase) -> tuple[list[dict], list[dict], float]:
    """(every peer's rows of every round, each host's row (memory per peer, CPU seconds of the
    measured rounds), seconds to start the peers)."""
    import hivemind

    context = mp.get_context("fork")
    started = time.perf_counter()
    bootstrap = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    initial = [str(addr) for addr in bootstrap.get_visible_maddrs()]
    hosts = [list(range(i, min(i + case.per_host, case.peers))) for i in range(0, case.peers, case.per_host)]
    barrier, results = context.Barrier(len(hosts) + 1), context.Queue()
    processes = [context.Process(target=host_main, args=(case, h, initial, barrier, results)) for h in hosts]
    for process in processes:
        process.start()
    rows: list[dict] = []
    memory: list[dict] = []
    startup = 0.0

    def receive() -> None:
        row = results.get(timeout=STEP_TIMEOUT + 60)
        if row["round"] == -2:
            raise RuntimeError(f"{case.impl} host of peer {row['index']} failed:\n{row['error']}")
        if row["round"] == -1:
            memory.append(row)
        else:
            rows.append(row)

    try:
        for round_index in range(case.rounds + 1):
            barrier.wait(timeout=START_TIMEOUT)  # every host is ready for this round
            if round_index == 0:
                startup = time.perf_counter() - started
            while sum(row["round"] == round_index for row in rows) < case.peers:
                receive()
            print(f"  {case.impl} round {round_index}: {describe_round(rows, round_index)}", flush=True)
        while len(memory) < len(hosts):
            receive()
    except threading.BrokenBarrierError:  # a host failed and broke the barrier: its error is queued
        for _ in range(len(hosts)):
            receive()  # raises the host's error
        raise
    finally:
        barrier.abort()
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
        bootstrap.shutdown()
    return rows, memory, startup


def describe_round(rows: list[dict], round_index: int) -> str:
    """A progress line: how many steps of the round failed, the slowest matchmaking, the group sizes."""
    of_round = [row for row in rows if row["round"] == round_index]
    ok = [row for row in of_round if "error" not in row]
    slowest = max((row["matchmaking"] for row in ok), default=float("nan"))
    groups = sorted(Counter(row.get("group") for row in ok).items(), key=str)
    return f"{len(of_round) - len(ok)} failed, slowest matchmaking {slowest:.2f} s, group sizes {groups}"


def summarize_real(case: RealCase, rows: list[dict], memory: list[dict], startup: float) -> dict[str, Any]:
    """Medians over the measured rounds (round 0 is the warm-up), and how far the peers are from
    the global mean after each measured round."""
    measured = [row for row in rows if row["round"] > 0]
    ok = [row for row in measured if "error" not in row]

    def median(key: str, selected: list[dict]) -> float | None:
        values = [row[key] for row in selected if row.get(key) is not None]
        return statistics.median(values) if values else None

    mean = (case.peers - 1) / 2
    off_mean = {
        r: max(abs(row["value"] - mean) for row in measured if row["round"] == r) / max(mean, 1e-9)
        for r in range(1, case.rounds + 1)
    }
    rounds = [[row for row in ok if row["round"] == r] for r in range(1, case.rounds + 1)]
    summary: dict[str, Any] = dict(
        matchmaking=median("matchmaking", ok),
        # the slowest member's matchmaking of each round: when the round's last group is found
        matchmaking_last=statistics.median(max(row["matchmaking"] for row in r) for r in rounds if r) if ok else None,
        allreduce=median("allreduce", ok),
        group=median("group", ok),
        requests=median("requests", measured),
        bytes=median("bytes", measured),
        memory_mb=statistics.mean(host["memory"] for host in memory) / 2**20 if memory else None,
        **{
            f"cpu_{kind}": sum(host["cpu"].get(kind, 0.0) for host in memory) / case.peers / case.rounds
            for kind in ("python", "p2pd")
        },
        failed=len(measured) - len(ok),
        startup=startup,
        off_mean=off_mean,
        warmup_groups=sorted(Counter(row.get("group") for row in rows if row["round"] == 0).items(), key=str),
    )
    shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items())
    print(f"{case.impl}, {case.name}: {shown}", flush=True)
    errors = [row["error"] for row in measured if "error" in row]
    if errors:
        print(f"  first failure: {errors[0]}", flush=True)
    return summary


def measure_real(case: RealCase) -> dict[str, Any] | None:
    """:func:`summarize_real` of one run, or None (printed) if a host failed."""
    started = time.perf_counter()
    try:
        summary = summarize_real(case, *run_real(case))
    except (RuntimeError, OSError, queue.Empty, threading.BrokenBarrierError) as e:
        print(f"{case.impl}, {case.name}: FAILED {type(e).__name__} {str(e)[-1500:]}", flush=True)
        return None
    print(f"  ({time.perf_counter() - started:.0f} s wall, load {os.getloadavg()[0]:.1f})", flush=True)
    return summary


def real_results(case_of: Any, args: argparse.Namespace, sizes: list[int]) -> dict[int, tuple[Any, Any]]:
    """Ours and (unless --no-hivemind) hivemind for each swarm size, one after the other."""
    measured = {}
    for peers in sizes:
        ours = None if args.no_ours else measure_real(case_of("ours", peers))
        theirs = None if args.no_hivemind else measure_real(case_of("hivemind", peers))
        measured[peers] = (ours, theirs)
    return measured


def grouped_rows(args: argparse.Namespace) -> list[Result]:
    """Rotating groups of ``--group`` at each ``--peers``: matchmaking, DHT traffic, memory, mixing."""

    def case_of(impl: str, peers: int) -> RealCase:
        return RealCase(
            impl, peers, args.group, args.size, args.rounds, args.matchmaking_time, args.per_host, args.our_dht
        )

    results = []
    for peers, (ours, theirs) in real_results(case_of, args, args.peers).items():
        if ours is None:
            continue
        case = case_of("ours", peers).name

        def pick(key: str, summary: dict | None = theirs) -> Any:
            return None if summary is None else summary[key]

        results.append(lower_is_better(case, "matchmaking s (median peer)", ours["matchmaking"], pick("matchmaking")))
        results.append(
            lower_is_better(case, "matchmaking s (last group)", ours["matchmaking_last"], pick("matchmaking_last"))
        )
        results.append(lower_is_better(case, "all-reduce s", ours["allreduce"], pick("allreduce")))
        results.append(lower_is_better(case, "DHT requests/peer/round", ours["requests"], pick("requests")))
        results.append(lower_is_better(case, "DHT bytes read/peer/round", ours["bytes"], pick("bytes")))
        results.append(lower_is_better(case, "memory/peer MB", ours["memory_mb"], pick("memory_mb")))
        for kind in ("python", "p2pd"):
            metric = f"CPU s/peer/round ({kind})"
            results.append(lower_is_better(case, metric, ours[f"cpu_{kind}"], pick(f"cpu_{kind}")))
        results.append(lower_is_better(case, "failed steps", ours["failed"], pick("failed")))
        for r in sorted(ours["off_mean"]):
            theirs_off = None if theirs is None else theirs["off_mean"].get(r)
            results.append(lower_is_better(case, f"max |x - mean| / mean after {r}", ours["off_mean"][r], theirs_off))
    return results


def big_group_rows(args: argparse.Namespace) -> list[Result]:
    """One group of everyone (target_group_size None) at ``--big-size`` floats per peer (equal bytes
    per peer whatever N): the butterfly round time at each ``--big-peers``."""

    def case_of(impl: str, peers: int) -> RealCase:
        return RealCase(
            impl, peers, None, args.big_size, args.big_rounds, args.matchmaking_time, args.per_host, args.our_dht
        )

    results = []
    for peers, (ours, theirs) in real_results(case_of, args, args.big_peers).items():
        if ours is None:
            continue
        case = case_of("ours", peers).name
        results.append(lower_is_better(case, "all-reduce s", ours["allreduce"], theirs and theirs["allreduce"]))
        results.append(higher_is_better(case, "group size", ours["group"], theirs and theirs["group"]))
        matchmaking = theirs and theirs["matchmaking"]
        results.append(lower_is_better(case, "matchmaking s (median peer)", ours["matchmaking"], matchmaking))
    return results


# ----- 2. simulation


def simulate_polls(count: int, group: int, churn: float, seed: int = 0) -> tuple[float, float, float, int]:
    """(polls until every group is final, records per read, share of live peers grouped, live peers in no
    group)."""
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
        f"{grouped:.3f} grouped, {len(result.ungrouped)} live peers in no group {list(result.ungrouped)}, "
        f"{seconds:.1f} s",
        flush=True,
    )
    return result.polls_to_group, result.records_per_read, grouped, len(result.ungrouped)


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


def digits_results(
    peers: int, group: int, epochs: int, hops: int | str = "auto", timeout: float = 200.0
) -> list[Result]:
    """Issue 14: digits training in rotating groups (``grad_averaging_hops=hops``) against one group of
    the whole swarm."""
    from scale_training import compare_groups

    outcomes = compare_groups(peers=peers, group=group, epochs=epochs, hops=hops, timeout=timeout)
    grouped, whole = outcomes[f"groups of {group}"], outcomes["one group"]
    case = f"digits, {peers} peers, groups of {group}" + (f" ({hops} hops)" if hops != 1 else "") + " vs one group"
    # a case cut short, or samples that differ, compares nothing
    complete = all(o["epochs"][0] >= epochs and o["samples"] == o["target_samples"] for o in (grouped, whole))
    ratio = grouped["loss"] / whole["loss"] if complete else None
    print(
        f"{case}: held-out loss ratio {ratio} (goal <= 1.02; None: a case did not reach {epochs} epochs "
        "with every peer's samples)"
    )
    return [
        lower_is_better(case, "held-out loss, groups", grouped["loss"], None),
        lower_is_better(case, "held-out loss, one group", whole["loss"], None),
        lower_is_better(case, "loss ratio groups / one group", ratio, None),
        lower_is_better(case, "parameter spread, groups", grouped["spread"], None),
        lower_is_better(case, "parameter spread, one group", whole["spread"], None),
    ]


# ----- main


def simulation_rows(args: argparse.Namespace) -> list[Result]:
    """The pure protocol: 1,000 peers' polls to form all groups, records per read, grid and mixing."""
    results: list[Result] = []
    for churn in (0.0, 0.02):
        polls, records, grouped, ungrouped = simulate_polls(args.sim_peers, 8, churn)
        case = f"sim {args.sim_peers} peers, groups of 8, {churn:.0%} dying"
        results.append(lower_is_better(case, "polls to all groups", polls, None))
        results.append(higher_is_better(case, "share grouped", grouped, None))
        results.append(lower_is_better(case, "live peers in no group", ungrouped, None))
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
    return results


def hops_argument(text: str) -> int | str:
    """``--digits-hops``: "auto" or a number of hops."""
    return text if text == "auto" else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, nargs="*", default=[8, 16], help="real swarm sizes (e.g. 8 16 32 64)")
    parser.add_argument("--group", type=int, default=8, help="target_group_size of the real peers")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (after one warm-up round)")
    parser.add_argument("--size", type=int, default=1024, help="floats per peer")
    parser.add_argument("--big-peers", type=int, nargs="*", default=[8], help="one group of everyone: swarm sizes")
    parser.add_argument("--big-size", type=int, default=65536, help="floats per peer in one group of everyone")
    parser.add_argument("--big-rounds", type=int, default=2)
    parser.add_argument("--per-host", type=int, default=8, help="real peers per Python process")
    parser.add_argument(
        "--our-dht",
        choices=("hosted", "process"),
        default="hosted",
        help="our peers' DHT nodes: on their host process's shared loop, or a hivemind.DHT process each",
    )
    parser.add_argument("--matchmaking-time", type=float, default=5.0)
    parser.add_argument("--sim-peers", type=int, default=1000)
    parser.add_argument("--no-hivemind", action="store_true")
    parser.add_argument("--no-ours", action="store_true", help="hivemind's real peers only (no JSON rows for them)")
    parser.add_argument("--no-real", action="store_true", help="only the simulation")
    parser.add_argument("--no-sim", action="store_true", help="only the real peers")
    parser.add_argument("--progress-peers", type=int, nargs="*", default=[], help="progress records: swarm sizes")
    parser.add_argument("--digits", type=int, default=0, metavar="PEERS", help="digits training in groups (e.g. 16)")
    parser.add_argument("--digits-group", type=int, default=4)
    parser.add_argument("--digits-epochs", type=int, default=12)
    parser.add_argument("--digits-timeout", type=float, default=200.0, help="seconds per digits case")
    parser.add_argument(
        "--digits-hops",
        type=hops_argument,
        default="auto",
        help="grad_averaging_hops of the peers in groups: 1 (one round per epoch, as before), 2, ... or auto",
    )
    args = parser.parse_args()
    print(describe_machine(), "| load", os.getloadavg(), flush=True)
    results: list[Result] = []

    if not args.no_sim:
        results.extend(simulation_rows(args))
    if args.progress_peers:
        results.extend(progress_results(args.progress_peers))
    if args.digits:
        results.extend(
            digits_results(args.digits, args.digits_group, args.digits_epochs, args.digits_hops, args.digits_timeout)
        )
    if not args.no_real:
        results.extend(grouped_rows(args))
        if args.big_peers:
            results.extend(big_group_rows(args))
    print("load", os.getloadavg(), flush=True)
    emit("scale", results)


if __name__ == "__main__":
    main()
