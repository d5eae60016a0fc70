"""All-reduce round time: hivemind_ext's DecentralizedAverager next to hivemind's, in the same run.

N peer processes on 127.0.0.1 (default 4), each with its own DHT and libp2p daemon and one float32
tensor (default 16M values), average it with target_group_size = N. Both averagers are driven by
the same code through hivemind's API (our class is a drop-in), for each codec in turn. A round is
timed from the moment all peers call ``step`` together (a barrier) until every peer holds its
result; the benchmark prints the median over the rounds, the ratio to hivemind, and the bytes
each of our peers sent against the butterfly minimum 2(N-1)/N x size. By default ours runs with its
default settings (the encrypted direct data path); ``--transports`` adds the opt-in plaintext
direct path and libp2p streams only (like hivemind).

On a shared machine the load changes within minutes, so for each codec every swarm (hivemind's and
ours per transport) runs at once, idle, and they take turns round by round (the order rotating every
round): each median is over rounds that ran under the same load as the others'. The load average is
printed with every codec, and so is the CPU time our peer processes spent per round (all together),
which is steadier than wall time under load (hivemind's averager runs in child processes of its
peers, so there is no such figure for it).

hivemind's 8-bit codecs raise TypeError under numpy 2; run this under numpy 1.26 to compare
MinMaxUInt8 with hivemind's Uniform8BitQuantization (see the README).

    python benchmarks/averaging.py
    python benchmarks/averaging.py --peers 4 --size 16M --rounds 5 --codecs none float16 MinMaxUInt8
    python benchmarks/averaging.py --transports default plaintext libp2p   # ours over each data path
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Result, butterfly_bytes, emit, lower_is_better, start

SIZES = {"1M": 2**20, "4M": 2**22, "16M": 2**24, "64M": 2**26}
# our codec, hivemind's codec (the same where hivemind has one, else its closest 8-bit codec)
CODECS = {
    "none": ("NoCompression", "NoCompression"),
    "float16": ("Float16Compression", "Float16Compression"),
    "MinMaxUInt8": ("MinMaxUInt8", "Uniform8BitQuantization"),
}
STEP_TIMEOUT = 60.0


# how our peers move data: the averager's keywords for each choice of --transports
TRANSPORTS: dict[str, dict[str, Any]] = {
    "default": {},  # the encrypted direct path where reachable (here: always), libp2p otherwise
    "plaintext": {"direct_plaintext": True},  # the opt-in plain TCP direct path (loopback or trusted networks)
    "libp2p": {"direct_data_path": False},  # libp2p streams through the daemons only, like hivemind
}


def make_averager(impl: str, codec: str, tensor: Any, dht: Any, prefix: str, peers: int, transport: str) -> Any:
    extra: dict[str, Any] = {}
    if impl == "ours":
        extra.update(TRANSPORTS[transport])
        import hivemind_ext.compression as compression
        from hivemind_ext.averaging import DecentralizedAverager

        compression_obj = getattr(compression, CODECS[codec][0])()
    else:
        import hivemind.compression as compression
        from hivemind.averaging import DecentralizedAverager

        compression_obj = getattr(compression, CODECS[codec][1])()
    return DecentralizedAverager(
        [tensor],
        dht,
        prefix=prefix,
        target_group_size=peers,
        min_group_size=peers,
        min_matchmaking_time=30.0,  # groups must form because they are full, not because time ran out
        request_timeout=3.0,
        compression=compression_obj,
        start=True,
        **extra,
    )


def peer_main(
    index: int,
    impl: str,
    codec: str,
    transport: str,
    args: argparse.Namespace,
    initial_peers: list[str],
    barrier: Any,
    results: Any,
    turn: Any,
) -> None:
    """One peer process: join the swarm, then run the rounds, each when ``turn`` lets it (a semaphore
    the coordinator releases once per peer and round), reporting (index, round, t0, t1, bytes, ok,
    all-reduce seconds, this process's CPU seconds during the step)."""
    import hivemind
    import torch

    torch.set_num_threads(1)
    dht = averager = None
    try:
        dht = hivemind.DHT(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
        tensor = torch.randn(SIZES[args.size], generator=torch.Generator().manual_seed(index))
        averager = make_averager(impl, codec, tensor, dht, f"bench_{impl}_{codec}", args.peers, transport)
        results.put((index, None, 0.0, 0.0, None, True, None, None))  # ready
        for round_index in range(args.rounds + 1):  # round 0 warms up connections
            turn.acquire(timeout=STEP_TIMEOUT + 600)
            barrier.wait(timeout=120)
            start, cpu_start = time.time(), time.process_time()
            outcome = averager.step(timeout=STEP_TIMEOUT)
            finish, cpu = time.time(), time.process_time() - cpu_start
            report = getattr(averager, "last_round", None)  # ours only: what the step's all-reduce did
            sent = getattr(report, "bytes_sent", None)
            allreduce = getattr(report, "seconds", None)
            results.put((index, round_index, start, finish, sent, outcome is not None, allreduce, cpu))
    except Exception:
        results.put((index, -1, 0.0, 0.0, None, traceback.format_exc(), None, None))
    finally:
        if averager is not None:
            averager.shutdown()
        if dht is not None:
            dht.shutdown()


class Swarm:
    """N peer processes of one implementation (and transport) for one codec, idle between rounds."""

    def __init__(self, impl: str, codec: str, args: argparse.Namespace, transport: str = "default") -> None:
        import hivemind

        self.impl, self.transport, self.peers = impl, transport, args.peers
        context = mp.get_context("fork")  # hivemind starts its own processes with the default start method
        self.bootstrap = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
        initial_peers = [str(addr) for addr in self.bootstrap.get_visible_maddrs()]
        barrier, self.results, self.turn = context.Barrier(args.peers), context.Queue(), context.Semaphore(0)
        self.processes = [
            context.Process(
                target=peer_main,
                args=(i, impl, codec, transport, args, initial_peers, barrier, self.results, self.turn),
            )
            for i in range(args.peers)
        ]
        for process in self.processes:
            process.start()
        self.times: list[float] = []
        self.sent: list[int] = []
        self.allreduce: list[float] = []  # ours: the longest all-reduce of the round (the rest is matchmaking)
        self.cpu: list[float] = []  # the peer processes' CPU seconds in the round, all together
        try:
            self._collect(warm_up=True)  # every peer is ready
        except BaseException:
            self.close()  # the others would wait for their turn
            raise

    def run_round(self, round_index: int) -> None:
        """Lets every peer run round ``round_index`` and waits until all of them have finished it."""
        for _ in range(self.peers):
            self.turn.release()
        rows = self._collect()
        if round_index > 0:  # round 0 warms up connections
            self.times.append(max(r[3] for r in rows) - min(r[2] for r in rows))
            self.sent.extend(r[4] for r in rows if r[4] is not None)
            if all(r[6] is not None for r in rows):
                self.allreduce.append(max(r[6] for r in rows))
            self.cpu.append(sum(r[7] for r in rows))

    def _collect(self, warm_up: bool = False) -> list[tuple]:
        rows = []
        while len(rows) < self.peers:
            record = self.results.get(timeout=STEP_TIMEOUT + 120)
            if record[1] == -1:
                raise RuntimeError(f"{self.impl} peer {record[0]} failed:\n{record[5]}")
            if (record[1] is None) == warm_up:
                rows.append(record)
        return rows

    def close(self) -> None:
        for _ in range(self.peers * 2):  # peers that still wait for a turn (after a failure) go on and exit
            self.turn.release()
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        self.bootstrap.shutdown()


def run_interleaved(
    codec: str, args: argparse.Namespace, swarms: list[tuple[str, str]]
) -> dict[tuple[str, str], Swarm]:
    """Every (impl, transport) swarm for ``codec`` at once, taking turns round by round."""
    started: dict[tuple[str, str], Swarm] = {}
    try:
        for impl, transport in swarms:
            started[impl, transport] = Swarm(impl, codec, args, transport)
        order = list(started.values())
        for round_index in range(args.rounds + 1):
            for swarm in order[round_index % len(order) :] + order[: round_index % len(order)]:
                swarm.run_round(round_index)
    finally:
        for swarm in started.values():
            swarm.close()
    return started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--size", default="16M", choices=list(SIZES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--codecs", nargs="+", default=list(CODECS), choices=list(CODECS))
    parser.add_argument("--impls", nargs="+", default=["ours", "hivemind"], choices=["ours", "hivemind"])
    parser.add_argument(
        "--transports",
        nargs="+",
        default=["default"],
        choices=list(TRANSPORTS),
        help="how our peers move data: default settings (encrypted direct path), the opt-in plaintext direct "
        "path, libp2p streams only (hivemind unchanged)",
    )
    args = start(parser)
    numel = SIZES[args.size]
    minimum = butterfly_bytes(args.peers, numel)
    results: list[Result] = []
    for codec in args.codecs:
        swarms = [("ours", transport) for transport in args.transports] if "ours" in args.impls else []
        swarms += [("hivemind", "default")] if "hivemind" in args.impls else []
        load = os.getloadavg()
        hm_median, note = None, ""
        try:
            finished = run_interleaved(codec, args, swarms)
        except RuntimeError as e:
            if "hivemind" not in args.impls or "hivemind peer" not in str(e):
                raise
            note = f"hivemind failed: {str(e).strip().splitlines()[-1][:160]}"
            finished = run_interleaved(codec, args, [s for s in swarms if s[0] != "hivemind"])
        load = f"load average {load[0]:.1f} before, {os.getloadavg()[0]:.1f} after"
        if ("hivemind", "default") in finished:
            hm_median = statistics.median(finished["hivemind", "default"].times)
        if CODECS[codec][1] != CODECS[codec][0]:
            note = note or f"vs hivemind {CODECS[codec][1]}"
        hm_text = f"{hm_median:.3f} s" if hm_median else "-"
        for transport in args.transports if "ours" in args.impls else []:
            swarm = finished["ours", transport]
            times, sent = swarm.times, swarm.sent
            ours = statistics.median(times)
            ratio = f"{ours / hm_median:.2f}x hivemind's time" if hm_median else "n/a"
            sent_text = f"{statistics.median(sent) / 1e6:.1f} MB" if sent else "n/a"
            label = f"{codec} over {transport}"
            print(f"{label:24s} round: ours {ours:.3f} s | hivemind {hm_text} | ours/hivemind {ratio} {note}")
            theirs = _seconds(finished.get(("hivemind", "default")))
            print(f"{label:24s} rounds: ours {_seconds(times)} | hivemind {theirs}; {load}")
            print(
                f"{label:24s} bytes sent per peer: {sent_text} (uncompressed butterfly minimum {minimum / 1e6:.1f} MB)"
            )
            if swarm.allreduce:  # where our round's time goes: the all-reduce itself, the rest is matchmaking
                allreduce = statistics.median(swarm.allreduce)
                rest = ours - allreduce
                print(f"{label:24s} of which all-reduce {allreduce:.3f} s, matchmaking and the rest {rest:.3f} s")
            # steadier than wall time under load; ours only: hivemind's averager runs in a child process
            print(f"{label:24s} CPU of our {args.peers} peer processes per round: {statistics.median(swarm.cpu):.3f} s")
            case = f"{codec} {args.peers} peers {args.size} {transport}"
            results.append(lower_is_better(case, "s/round", round(ours, 4), hm_median and round(hm_median, 4)))
            if sent:
                results.append(
                    Result(
                        f"{case} bytes sent / butterfly minimum",
                        "ratio",
                        round(statistics.median(sent) / minimum, 4),
                        None,
                        None,
                    )
                )
    emit("averaging", results)


def _seconds(times: Any) -> str:
    times = times.times if isinstance(times, Swarm) else times
    return ", ".join(f"{t:.2f}" for t in times) if times else "-"


if __name__ == "__main__":
    main()
