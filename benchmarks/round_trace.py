"""Where the time of a small all-reduce round goes: scale.py's real peers, traced stage by stage.

A diagnostic, not a benchmark: it runs ``--peers`` averagers in ONE process the way
``benchmarks/scale.py`` lays them out by default (``--per-host 8``: hosted DHT nodes on one shared
loop thread, each averager on its own loop thread, all under one GIL), wraps internal functions of
the all-reduce (monkeypatched, nothing in the library changes) and prints, per round:

- the time of each stage relative to the round's first trigger (median / max over peers):
  ``a_trigger`` (the step's thread gives the trigger), ``b_run_round_start``, ``c_first_send_start``
  (this peer's first JOIN goes out: context, layout and connection taken), ``e_own_part_reduced``
  (the part it owns is averaged), ``f_last_average_in`` (its last average from any owner),
  ``g_own_part_delivered`` (every sender of its part hung up), ``h_jobs_done``, ``i_closed``,
  ``z_run_round_end``, ``zz_thread_result`` (the step's result reaches the thread);
- each averager loop's largest lag (a 5 ms sleep that overshoots), direct connections opened /
  reused and ``open_stream`` times, the handler's waits for a caller's END (CALLER_END_GRACE);
- the process's CPU seconds in the all-reduce window (first trigger to last result, /proc, 10 ms
  ticks), the DHT requests served in that window (rpc_find / rpc_store) and when the matchmaking's
  store-without-waiting calls (members' markers, the leader's commit) were issued and finished.

    python benchmarks/round_trace.py [peers=8] [floats per peer=1024] [rounds=5] [group=8, 0: one group]

Session 17 (8 peers, 4 KiB, groups of 8, 2-core machine, 4 rounds): all 56 streams ride reused
direct connections from round 1 on (``open_stream`` < 0.3 ms) and no fixed wait is on the path
(no CALLER_END_GRACE wait at all; jobs end ~1 ms after the last average). A round is bound by CPU
on the one GIL: the last peer's first JOIN leaves 65-90 ms after the first trigger (its loop
waits for the GIL: loop lags 15-60 ms), the slowest part is averaged ~115-160 ms in, and the last
average arrives right after. Rounds in which the matchmaking's 8 store-without-waiting calls
(issued 10-300 ms before the trigger; each a DHT search whose every answer carries the whole board,
validated, then 3-5 rpc_store) finish inside the window took 0.11-0.16 s and 120-160 ms of CPU;
rounds where they had finished before took 0.06-0.08 s and 50-70 ms of CPU. With one group and
65536 floats per peer (``8 65536 4 0``), the trace showed every round after the first on libp2p
(the declared bandwidth, measured in a round bound by latency and CPU, was ~20 Mbit/s; fixed in
averaging/allreduce/paths.py); in that case the stores land in every round's window (the group
forms as soon as everyone is there, 5-60 ms after they were issued).
"""

import asyncio
import collections
import concurrent.futures
import statistics
import sys
import threading
import time

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
import hivemind
import scale
from hosted_dht import DHTHost

from hivemind_ext.averaging.allreduce import owner as owner_mod
from hivemind_ext.averaging.allreduce import run as run_mod
from hivemind_ext.averaging.allreduce import sender as sender_mod
from hivemind_ext.averaging.allreduce import service as service_mod
from hivemind_ext.p2p import serving as serving_mod

peers_n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
size = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
group = int(sys.argv[4]) if len(sys.argv) > 4 else 8

T = collections.defaultdict(dict)  # (round, peer name) -> stage -> perf_counter
current_round = [0]
lock = threading.Lock()


def stamp(peer, stage, first=True):
    key = (current_round[0], str(peer)[-6:])
    with lock:
        if first and stage in T[key]:
            return
        T[key][stage] = time.perf_counter()


def me_of(context):
    return context.peers[context.me]


_orig_run_round = service_mod.AllreduceService.run_round


async def run_round(self, group, tensors, **kw):
    stamp(self.peer_id, "b_run_round_start")
    try:
        return await _orig_run_round(self, group, tensors, **kw)
    finally:
        stamp(self.peer_id, "z_run_round_end")


service_mod.AllreduceService.run_round = run_round

_orig_exchange = sender_mod._exchange


async def _exchange(context, client, owner):
    me = me_of(context)
    t0 = time.perf_counter()
    try:
        return await _orig_exchange(context, client, owner)
    finally:
        with lock:
            T[(current_round[0], str(me)[-6:])].setdefault("exchanges", []).append(time.perf_counter() - t0)


sender_mod._exchange = _exchange
_orig_open = None

_orig_send = sender_mod._send


async def _send(context, stream, message):
    stamp(me_of(context), "c_first_send_start")
    await _orig_send(context, stream, message)
    stamp(me_of(context), "d_first_send_done")


sender_mod._send = _send

_orig_recv_avg = sender_mod._receive_average


async def _receive_average(context, stream, owner, lead):
    r = await _orig_recv_avg(context, stream, owner, lead)
    stamp(me_of(context), "f_last_average_in", first=False)
    return r


sender_mod._receive_average = _receive_average

_orig_part_run = owner_mod.OwnedPart.run


async def part_run(self):
    r = await _orig_part_run(self)
    stamp(me_of(self.context), "e_own_part_reduced")
    return r


owner_mod.OwnedPart.run = part_run

_orig_wfd = run_mod.RoundRun._wait_for_delivery


async def wfd(self):
    await _orig_wfd(self)
    stamp(me_of(self.context), "g_own_part_delivered")


run_mod.RoundRun._wait_for_delivery = wfd

_orig_rr_run = run_mod.RoundRun.run


async def rr_run(self):
    r = await _orig_rr_run(self)
    stamp(me_of(self.context), "h_jobs_done")
    return r


run_mod.RoundRun.run = rr_run

_orig_close = run_mod.RoundRun.close


async def rr_close(self):
    await _orig_close(self)
    stamp(me_of(self.context), "i_closed")


run_mod.RoundRun.close = rr_close

grace_hits = collections.Counter()
_orig_ace = serving_mod._await_caller_end


async def ace(requests):
    t0 = time.perf_counter()
    await _orig_ace(requests)
    grace_hits[round(time.perf_counter() - t0, 2)] += 1


serving_mod._await_caller_end = ace

# thread side: trigger and result
_orig_timed = scale.timed_step


def timed_step(averager, case):
    extra = dict(expected_group_size=case.peers)
    start = time.perf_counter()
    control = averager.step(wait=False, require_trigger=True, timeout=scale.STEP_TIMEOUT, **extra)
    while control.stage.name != "AWAITING_TRIGGER" and not control.done():
        time.sleep(scale.STAGE_POLL)
    found = time.perf_counter()
    name = averager.peer_id
    stamp(name, "a_trigger")
    with lock:
        if current_round[0] not in CPU_AT:
            CPU_AT[current_round[0]] = thread_cpu()
    control.allow_allreduce()
    gathered = control.result(timeout=scale.STEP_TIMEOUT)
    stamp(name, "zz_thread_result")
    return found - start, time.perf_counter() - found, len(gathered)


import hosted_dht  # noqa: E402
from hivemind.dht import protocol as dht_protocol  # noqa: E402

DHT_EVENTS = []
_orig_request = hosted_dht.HostedDHT._request


def _request(self, make, return_future):
    DHT_EVENTS.append((time.perf_counter(), "request", current_round[0]))
    return _orig_request(self, make, return_future)


hosted_dht.HostedDHT._request = _request
_orig_rpc_find = dht_protocol.DHTProtocol.rpc_find
_orig_rpc_store = dht_protocol.DHTProtocol.rpc_store


@__import__("functools").wraps(_orig_rpc_find)
async def rpc_find(self, request, context):
    DHT_EVENTS.append((time.perf_counter(), "rpc_find", current_round[0]))
    return await _orig_rpc_find(self, request, context)


@__import__("functools").wraps(_orig_rpc_store)
async def rpc_store(self, request, context):
    DHT_EVENTS.append((time.perf_counter(), "rpc_store", current_round[0]))
    return await _orig_rpc_store(self, request, context)


dht_protocol.DHTProtocol.rpc_find = rpc_find
dht_protocol.DHTProtocol.rpc_store = rpc_store

from hivemind_ext.p2p import client as client_mod  # noqa: E402

OPEN_TIMES = collections.defaultdict(list)
_orig_open_stream = client_mod.RPCClient.open_stream


async def open_stream(self, peer_id, name, **kw):
    t = time.perf_counter()
    try:
        return await _orig_open_stream(self, peer_id, name, **kw)
    finally:
        if name == "allreduce":
            OPEN_TIMES[current_round[0]].append(time.perf_counter() - t)


client_mod.RPCClient.open_stream = open_stream

import os  # noqa: E402

CPU_AT = {}


def thread_cpu():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                parts = f.read().rsplit(")", 1)[1].split()
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
            out[tid] = (name, (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK"))
        except OSError:
            pass
    return out


from hivemind_ext.averaging.matchmaking import matchmaker as mm_mod  # noqa: E402

NOWAIT = []
_orig_snw = mm_mod.Matchmaker._store_nowait


def _store_nowait(self, write, key):
    NOWAIT.append(
        (
            time.perf_counter(),
            current_round[0],
            type(write.value).__name__
            if not isinstance(write.value, (bytes, dict, list, tuple))
            else str(write.subkey)[:20],
        )
    )
    return _orig_snw(self, write, key)


mm_mod.Matchmaker._store_nowait = _store_nowait
_orig_str = mm_mod._store_then_read
STR_DONE = []


async def _store_then_read(*a, **k):
    t = time.perf_counter()
    try:
        return await _orig_str(*a, **k)
    finally:
        STR_DONE.append((t, time.perf_counter(), current_round[0], a[2] if len(a) > 2 else None))


mm_mod._store_then_read = _store_then_read
_orig_direct = getattr(mm_mod, "_store_direct", None)  # the stores without a search (when the library has them)


async def _store_direct(*a, **k):
    t = time.perf_counter()
    try:
        return await _orig_direct(*a, **k)
    finally:
        STR_DONE.append((t, time.perf_counter(), current_round[0], "direct"))


if _orig_direct is not None:
    mm_mod._store_direct = _store_direct
# loop lag probes
lags = collections.defaultdict(list)


async def probe(name):
    while True:
        t = time.perf_counter()
        await asyncio.sleep(0.005)
        lags[name].append(time.perf_counter() - t - 0.005)


def main():
    import torch

    torch.set_num_threads(1)
    case = scale.RealCase(
        impl="ours",
        peers=peers_n,
        group=group or None,
        size=size,
        rounds=rounds,
        per_host=peers_n,
        matchmaking_time=5.0,
    )
    bootstrap = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    initial = [str(a) for a in bootstrap.get_visible_maddrs()]
    host = DHTHost()
    peers = [scale.start_peer(i, case, initial, host) for i in range(peers_n)]
    for _, av, _ in peers:
        av._runtime._loop_thread.submit(probe(str(av.peer_id)[-6:]))
    allr = collections.defaultdict(list)
    try:
        with concurrent.futures.ThreadPoolExecutor(peers_n) as pool:
            for r in range(rounds + 1):
                current_round[0] = r
                for k in lags:
                    lags[k].clear()
                steps = [pool.submit(timed_step, av, case) for _, av, _ in peers]
                res = [s.result() for s in steps]
                after = thread_cpu()
                before = CPU_AT.get(r, {})
                per = collections.Counter()
                for tid, (nm, c) in after.items():
                    per[nm[:12]] += c - before.get(tid, (nm, 0.0))[1] if tid in before else 0.0
                wall = max(x[1] for x in res)
                print(f"  process CPU s in the all-reduce window: {sum(per.values()):.3f}, wall {wall:.3f}")
                dc = [av.rpc_client.direct for _, av, _ in peers]
                opens = OPEN_TIMES[r]
                bands = sorted(round(av.declared_bandwidth or 0) for _, av, _ in peers)
                paths = collections.Counter(t for _, av, _ in peers for t in (av.last_round.transports or {}).values())
                print(f"  declared bandwidth (Mbit/s) {bands}; transports of the round {dict(paths)}")
                print(
                    f"  direct opened {sum(d.opened for d in dc)} reused {sum(d.reused for d in dc)}; "
                    f"open_stream ms median {1000 * statistics.median(opens):.1f} max {1000 * max(opens):.1f}"
                )
                allr[r] = [x[1] for x in res]
                lagmax = {k: max(v) if v else 0 for k, v in lags.items()}
                print(
                    f"round {r}: allreduce median {statistics.median(allr[r]):.4f} max {max(allr[r]):.4f}; "
                    f"loop lag max per peer (ms) {sorted(round(1000 * v) for v in lagmax.values())}"
                )
                time.sleep(0.3)
    finally:
        for dht, av, _ in peers:
            av.shutdown()
            dht.shutdown()
        host.close()
        bootstrap.shutdown()
    # breakdown: per round, stages relative to the round's first trigger
    stages = sorted({s for v in T.values() for s in v if s != "exchanges"})
    per_stage = collections.defaultdict(list)
    for r in range(1, rounds + 1):
        keys = [k for k in T if k[0] == r]
        t0 = min(T[k]["a_trigger"] for k in keys if "a_trigger" in T[k])
        print(f"-- round {r} (ms after first trigger; median / max over peers)")
        for s in stages:
            vals = [1000 * (T[k][s] - t0) for k in keys if s in T[k]]
            if vals:
                per_stage[s].append(statistics.median(vals))
                print(f"   {s:24s} {statistics.median(vals):7.1f} {max(vals):7.1f}  min {min(vals):7.1f}")
        t_end = max(T[k].get("zz_thread_result", 0) for k in keys)
        inwin = collections.Counter(e[1] for e in DHT_EVENTS if t0 <= e[0] <= t_end)
        before = collections.Counter(e[1] for e in DHT_EVENTS if e[2] == r and e[0] < t0)
        print(f"   DHT during all-reduce window: {dict(inwin)}; in the round before the first trigger: {dict(before)}")
        nw = [1000 * (e[0] - t0) for e in NOWAIT if e[1] == r]
        kinds = collections.Counter(e[2][:2] for e in NOWAIT if e[1] == r)
        print(f"   store_nowait issued (ms rel. first trigger): {sorted(round(x) for x in nw)} subkeys {dict(kinds)}")
        sd = [(round(1000 * (a - t0)), round(1000 * (b - t0)), rd) for a, b, rr, rd in STR_DONE if rr == r]
        overlapping = [x for x in sd if x[1] > 0]
        print(f"   DHT store_then_read / store_direct (start, end ms, read? or direct) in window: {overlapping}")
        ex = [1000 * x for k in keys for x in T[k].get("exchanges", [])]
        print(f"   exchanges: median {statistics.median(ex):.1f} max {max(ex):.1f} ms")
    print("median over rounds of per-round median stage time (ms):")
    for s in stages:
        print(f"   {s:24s} {statistics.median(per_stage[s]):7.1f}")
    print("caller-END grace waits (s -> count):", dict(grace_hits))
    print(
        "allreduce s median over measured rounds:", statistics.median(x for r in range(1, rounds + 1) for x in allr[r])
    )


main()
