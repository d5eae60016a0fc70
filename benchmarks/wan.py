"""All-reduce on shaped links: hivemind's DecentralizedAverager and ours, each with its default settings,
against the butterfly's physical limit.

Four peers, each in its own network namespace on one bridge, its link limited both ways with
``tc tbf`` (tests/netns.py; root required: without it the benchmark says why and reports nothing),
average 16 MiB of float32 each (``randn`` seeded by the peer's index) with target_group_size 4.
Each case runs a warm-up round (connections; our peers also measure their throughput there) and
then ``--rounds`` timed rounds. A round's time runs from the first peer entering the all-reduce
(its step's stage) to the last peer holding its result, so matchmaking is not counted. Times are
reported as multiples of the butterfly's limit:

- equal links: t_min = 2 (N-1)/N x S x c / B, each peer sending and receiving that many bytes (S
  values of c bytes: 4 uncompressed, 2 for float16, 1 for 8-bit);
- ``hetero`` (one peer at 1/5 of the others' rate) and ``nat`` (one peer in client mode behind a
  NAT router, which owns no part): t_opt = min over part splits of max_i (1 + (N-2) f_i) x S x c / B_i,
  the best partition (``partition.optimal_fractions``): one peer at 20 Mbit/s and three at 100 get
  6.71 s for 16 MiB, against 10.07 s for an even split.

Each round also reads the byte counters of every link's ``tc tbf`` qdiscs (``Topology.link_bytes``) when
the first peer's all-reduce begins and when the round ends: what the shaper charged the busiest link in
between, at its rate, is the round's floor on these links ("link busy", and "bytes on the busiest link
in the all-reduce / limit's bytes" in the JSON line). It is above t_min because the shaper charges
every segment's Ethernet, IP and TCP headers (~4.5% at 1448 payload bytes a segment), the
acknowledgements of the other direction and the transport's framing; the gap between a round's time
and it is time the links were idle or partly used (start skew, pipeline stalls, the drain at the end,
CPU scheduling on a busy machine). The same counters read before the round began also give the bytes
with matchmaking ("with matchmaking": the DHT reads of the matchmaking board, which are not in the
round's time; ours carry signed records of ~1 KB each, see benchmarks/RESULTS.md, Session 10).

Each peer also checks its result against the exact mean of all four inputs: a case is correct when
every peer's max error is within twice the codec's own round-trip error on its input (plus 1e-5):
a lost contribution errs by ~0.5.

Cases are ``LINK:CODEC``: LINK is ``100`` or ``20`` (Mbit/s, all peers), ``hetero`` (20 and 3 x 100)
or ``nat`` (3 x 100 public + 1 x 100 behind NAT, client mode); CODEC is ``none``, ``float16`` or
``8bit`` (ours: MinMaxUInt8; hivemind: Uniform8BitQuantization). hivemind's 8-bit codecs raise
TypeError under numpy 2, so its 8-bit peers run under ``--numpy1-python`` (default /tmp/np1/bin/python,
a venv made with ``python -m venv --system-site-packages /tmp/np1 && /tmp/np1/bin/pip install
'numpy<2'``); without it, hivemind's 8-bit figure is left out.

``loopback:direct`` runs ``benchmarks/direct_path.py`` (no namespaces needed): the direct data
path's throughput on loopback, encrypted (AES-GCM records, the default) against plaintext (the
opt-in) and libp2p streams; its results join this benchmark's JSON line.

Ours runs with its defaults: since session 6 that is the encrypted direct path between peers that
can reach each other (the NAT'd peer's pairs fall back to libp2p where it cannot be dialed); the
output says which paths each round took.

Before each case the benchmark waits (at most ``--max-wait`` s) for the 1-minute load average to drop
below ``--quiet-load``, and records the load beside the case.

    python benchmarks/wan.py                      # 100:none 100:8bit 20:none hetero:none loopback:direct
    python benchmarks/wan.py --cases all          # also 100:float16, 20:float16, 20:8bit, nat:none
    python benchmarks/wan.py --cases 100:none hetero:none --rounds 3
    python benchmarks/wan.py --impls ours --cases 20:none 20:float16 20:8bit
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
from common import Result, describe_machine, emit, lower_is_better  # noqa: E402
from netns import Link, Topology, unavailable_reason  # noqa: E402
from netns_averager import AveragerSwarm, round_seconds  # noqa: E402

from hivemind_ext.averaging.allreduce.partition import MemberRole, optimal_fractions, predicted_time  # noqa: E402

PEERS = 4
CODECS = {  # ours, hivemind's, bytes per value on the wire
    "none": ("NoCompression", "NoCompression", 4),
    "float16": ("Float16Compression", "Float16Compression", 2),
    "8bit": ("MinMaxUInt8", "Uniform8BitQuantization", 1),
}
LINKS = {
    "100": [Link(100)] * PEERS,
    "20": [Link(20)] * PEERS,
    "hetero": [Link(20)] + [Link(100)] * (PEERS - 1),
    "nat": [Link(100)] * (PEERS - 1) + [Link(100, behind_nat=True)],
}
DIRECT_PATH_CASE = "loopback:direct"  # benchmarks/direct_path.py: encrypted vs plaintext direct path
ALL_CASES = [f"{link}:{codec}" for link in ("100", "20") for codec in CODECS] + [
    "hetero:none",
    "nat:none",
    DIRECT_PATH_CASE,
]
# what fits in 10 minutes on a quiet 2-core machine (each case starts 8 peer processes)
DEFAULT_CASES = ["100:none", "100:8bit", "20:none", "hetero:none", DIRECT_PATH_CASE]


def limit_seconds(link: str, numel: int, bytes_per_value: int) -> float:
    """t_min (equal links) or t_opt (the best partition) in seconds, see the module docstring."""
    links = LINKS[link]
    rates = [lk.rate_mbit * 1e6 / 8 for lk in links]  # bytes/s
    size = numel * bytes_per_value
    if link in ("100", "20"):
        return 2 * (PEERS - 1) / PEERS * size / rates[0]
    roles = [MemberRole(rate, client_mode=lk.behind_nat) for rate, lk in zip(rates, links, strict=True)]
    return predicted_time(optimal_fractions(roles), roles) * size


def link_seconds(links: list[Link], before: list[tuple[int, int]], after: list[tuple[int, int]]) -> float:
    """How long the busiest link needed for what it carried between two ``Topology.link_bytes`` readings
    (the more loaded direction of each, at its shaped rate): every header and acknowledgement included,
    so this is the round's floor on these links, which a perfectly pipelined round would reach."""
    return max(
        max(up_after - up_before, down_after - down_before) / (link.rate_mbit * 1e6 / 8)
        for link, (up_before, down_before), (up_after, down_after) in zip(links, before, after, strict=True)
    )


def wait_for_quiet(threshold: float, max_wait: float) -> float:
    """Waits until the 1-minute load average is below ``threshold`` (at most ``max_wait`` s); returns it."""
    deadline = time.monotonic() + max_wait
    while os.getloadavg()[0] >= threshold and time.monotonic() < deadline:
        time.sleep(2.0)
    return os.getloadavg()[0]


def run_case(impl: str, link: str, codec: str, args: argparse.Namespace) -> dict[str, Any] | None:
    """Round times (s), max errors and our peers' part sizes for one implementation and case."""
    ours_name, hivemind_name, _ = CODECS[codec]
    python = sys.executable
    if impl == "hivemind" and codec == "8bit":
        if not Path(args.numpy1_python).exists():
            print(f"  hivemind 8-bit skipped: no numpy<2 interpreter at {args.numpy1_python}", flush=True)
            return None
        python = args.numpy1_python
    links = LINKS[link]
    configs = [
        dict(
            impl=impl,
            codec=ours_name if impl == "ours" else hivemind_name,
            numel=args.numel,
            group_size=PEERS,
            contributors=list(range(PEERS)),
            client_mode=lk.behind_nat,
            prefix=f"wan_{impl}_{link}_{codec}",
        )
        for lk in links
    ]
    rounds = []
    with Topology(links, prefix="hxw") as topology:
        with AveragerSwarm(topology, configs, python=[python] * PEERS, timeout=300.0) as swarm:
            for index in range(args.rounds + 1):
                before, marks = topology.link_bytes(), []
                results = swarm.run_round(at_allreduce=lambda marks=marks: marks.append(topology.link_bytes()))
                after = topology.link_bytes()
                carried = link_seconds(links, marks[0], after)  # the all-reduce's floor
                whole = link_seconds(links, before, after)  # matchmaking's traffic too
                seconds = round_seconds(results)
                errors = [r["max_error"] for r in results]
                failures = [r["error"] for r in results if r["error"]]
                excluded = sum(len(r["excluded"] or {}) for r in results)
                paths = sorted({t for r in results for t in (r.get("transports") or {}).values()})
                bound = 2 * max(r["codec_error"] for r in results) + 1e-5
                parts = results[0]["part_sizes"]
                split = (
                    " parts " + "/".join(f"{size / args.numel:.2f}" for size in parts.values())
                    if isinstance(parts, dict)
                    else ""
                )
                chunk = results[0].get("chunk_bytes")
                split += f" chunks {chunk // 1024} KiB" if chunk else ""
                label = "warm-up" if index == 0 else f"round {index}"
                print(
                    f"  {impl:8s} {label:8s} {seconds:6.2f} s  max error {max(errors):.3g} (bound {bound:.3g})"
                    f" link busy {carried:.2f} s ({whole:.2f} s with matchmaking)"
                    f"{split}{' over ' + '+'.join(paths) if paths else ''}"
                    f"{f'  {excluded} exclusions' if excluded else ''}{'  FAILED: ' + failures[0] if failures else ''}",
                    flush=True,
                )
                if index:
                    rounds.append((seconds, max(errors), bound, bool(failures), carried, whole))
    return {
        "seconds": statistics.median(r[0] for r in rounds),
        "link_seconds": statistics.median(r[4] for r in rounds),
        "round_link_seconds": statistics.median(r[5] for r in rounds),
        "max_error": max(r[1] for r in rounds),
        "correct": all(r[1] <= r[2] and not r[3] for r in rounds),
        "bound": max(r[2] for r in rounds),
    }


def direct_path_results(megabytes: int, load: float) -> list[Result]:
    """Runs benchmarks/direct_path.py (encrypted and plaintext direct path, libp2p, on loopback; it
    needs no namespaces) and returns its results, the load added to their case names."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "direct_path.py"), "--mb", str(megabytes)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = done.stdout.strip().splitlines()
    for line in lines[:-1]:
        print("  " + line, flush=True)
    if done.returncode != 0 or not lines:
        print(f"  direct_path.py failed: {done.stderr[-2000:]}", flush=True)
        return []
    return [Result(**{**r, "case": f"{r['case']} load {load:.1f}"}) for r in json.loads(lines[-1])["results"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES, help="LINK:CODEC (see above), or all")
    parser.add_argument("--impls", nargs="+", default=["hivemind", "ours"], choices=["hivemind", "ours"])
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per case, after a warm-up round")
    parser.add_argument("--numel", type=int, default=2**22, help="float32 values per peer (default 4M = 16 MiB)")
    parser.add_argument("--quiet-load", type=float, default=3.0, help="wait for a 1-minute load average below this")
    parser.add_argument("--max-wait", type=float, default=20.0, help="at most this many seconds per case")
    parser.add_argument("--numpy1-python", default="/tmp/np1/bin/python", help="runs hivemind's 8-bit peers")
    parser.add_argument("--direct-mb", type=int, default=256, help="megabytes per transfer in the loopback case")
    args = parser.parse_args()
    if args.cases == ["all"]:
        args.cases = ALL_CASES
    for case in args.cases:
        link, _, codec = case.partition(":")
        if case != DIRECT_PATH_CASE and (link not in LINKS or codec not in CODECS):
            parser.error(f"unknown case {case!r}: LINK in {list(LINKS)}, CODEC in {list(CODECS)}")
    print(describe_machine(), flush=True)
    missing = unavailable_reason(nat=any(case.startswith("nat:") for case in args.cases))
    if missing is not None:
        print(f"shaped cases skipped: network namespaces are not available here: {missing}", flush=True)
        args.cases = [case for case in args.cases if case == DIRECT_PATH_CASE]
    results: list[Result] = []
    for case in args.cases:
        if case == DIRECT_PATH_CASE:
            load = wait_for_quiet(args.quiet_load, args.max_wait)
            print(f"{case}: benchmarks/direct_path.py --mb {args.direct_mb}, load average {load:.2f}", flush=True)
            results.extend(direct_path_results(args.direct_mb, load))
            continue
        link, _, codec = case.partition(":")
        limit = limit_seconds(link, args.numel, CODECS[codec][2])
        load = wait_for_quiet(args.quiet_load, args.max_wait)
        print(f"{case}: limit {limit:.2f} s, load average {load:.2f}", flush=True)
        measured = {impl: run_case(impl, link, codec, args) for impl in args.impls}
        for impl, m in measured.items():
            if m is not None:
                print(
                    f"  {impl:8s} median {m['seconds']:.2f} s = {m['seconds'] / limit:.2f}x the limit, "
                    f"{'correct' if m['correct'] else 'WRONG'} (error {m['max_error']:.3g}, bound {m['bound']:.3g}); "
                    f"the busiest link carried {m['link_seconds'] / limit:.2f}x the limit's bytes in the all-reduce, "
                    f"{m['round_link_seconds'] / limit:.2f}x with matchmaking",
                    flush=True,
                )
        ours, theirs = measured.get("ours"), measured.get("hivemind")
        name = f"{case} load {load:.1f}"
        results.append(
            lower_is_better(
                name,
                "round time / limit",
                ours["seconds"] / limit if ours else None,
                theirs["seconds"] / limit if theirs else None,
            )
        )
        for key, metric in (
            ("link_seconds", "bytes on the busiest link in the all-reduce / limit's bytes (headers, acks)"),
            ("round_link_seconds", "bytes on the busiest link / limit's bytes (headers, acks, matchmaking)"),
        ):
            results.append(
                Result(name, metric, ours[key] / limit if ours else None, theirs[key] / limit if theirs else None, None)
            )
        results.append(
            Result(
                name,
                "correct mean (1 = every round within the codec's bound)",
                float(ours["correct"]) if ours else None,
                float(theirs["correct"]) if theirs else None,
                None,
            )
        )
    emit("wan", results)


if __name__ == "__main__":
    main()
