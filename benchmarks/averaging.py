"""All-reduce round time: hivemind_ext's DecentralizedAverager next to hivemind's, in the same run.

N peer processes on 127.0.0.1 (default 4), each with its own DHT and libp2p daemon and one float32
tensor (default 16M values), average it with target_group_size = N. Both averagers are driven by
the same code through hivemind's API (our class is a drop-in), for each codec in turn. A round is
timed from the moment all peers call ``step`` together (a barrier) until every peer holds its
result; the benchmark prints the median over the rounds, the ratio to hivemind, and the bytes
each of our peers sent against the butterfly minimum 2(N-1)/N x size. By default ours runs with its
default settings (the encrypted direct data path); ``--transports`` adds the opt-in plaintext
direct path and libp2p streams only (like hivemind).

hivemind's 8-bit codecs raise TypeError under numpy 2; run this under numpy 1.26 to compare
MinMaxUInt8 with hivemind's Uniform8BitQuantization (see the README).

    python benchmarks/averaging.py
    python benchmarks/averaging.py --peers 4 --size 16M --rounds 5 --codecs none float16 MinMaxUInt8
    python benchmarks/averaging.py --transports default plaintext libp2p   # ours over each data path
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Result, butterfly_bytes, emit, gather_from_peers, lower_is_better, start

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
) -> None:
    """One peer process: join the swarm, then run the rounds, reporting (index, round, t0, t1, bytes)."""
    import hivemind
    import torch

    torch.set_num_threads(1)
    dht = averager = None
    try:
        dht = hivemind.DHT(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
        tensor = torch.randn(SIZES[args.size], generator=torch.Generator().manual_seed(index))
        averager = make_averager(impl, codec, tensor, dht, f"bench_{impl}_{codec}", args.peers, transport)
        for round_index in range(args.rounds + 1):  # round 0 warms up connections
            barrier.wait(timeout=120)
            start = time.time()
            outcome = averager.step(timeout=STEP_TIMEOUT)
            finish = time.time()
            sent = getattr(getattr(averager, "last_round", None), "bytes_sent", None)
            results.put((index, round_index, start, finish, sent, outcome is not None))
    except Exception:
        results.put((index, -1, 0.0, 0.0, None, traceback.format_exc()))
    finally:
        if averager is not None:
            averager.shutdown()
        if dht is not None:
            dht.shutdown()


def run_swarm(
    impl: str, codec: str, args: argparse.Namespace, transport: str = "default"
) -> tuple[list[float], list[int]]:
    """Round times (s) and bytes sent per peer per round for one implementation and codec."""
    import hivemind

    context = mp.get_context("fork")  # hivemind starts its own processes with the default start method
    bootstrap = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    initial_peers = [str(addr) for addr in bootstrap.get_visible_maddrs()]
    barrier, results = context.Barrier(args.peers), context.Queue()
    processes = [
        context.Process(target=peer_main, args=(i, impl, codec, transport, args, initial_peers, barrier, results))
        for i in range(args.peers)
    ]
    try:
        records = gather_from_peers(
            processes,
            results,
            args.peers * (args.rounds + 1),
            STEP_TIMEOUT + 120,
            lambda record: f"{impl} peer {record[0]} failed:\n{record[5]}" if record[1] == -1 else None,
        )
    finally:
        bootstrap.shutdown()
    times, sent = [], []
    for round_index in range(1, args.rounds + 1):
        rows = [r for r in records if r[1] == round_index]
        times.append(max(r[3] for r in rows) - min(r[2] for r in rows))
        sent.extend(r[4] for r in rows if r[4] is not None)
    return times, sent


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
        hm_median, note = None, ""
        if "hivemind" in args.impls:
            try:
                hm_median = statistics.median(run_swarm("hivemind", codec, args)[0])
            except RuntimeError as e:
                note = f"hivemind failed: {str(e).strip().splitlines()[-1][:160]}"
        if CODECS[codec][1] != CODECS[codec][0]:
            note = note or f"vs hivemind {CODECS[codec][1]}"
        hm_text = f"{hm_median:.3f} s" if hm_median else "-"
        for transport in args.transports if "ours" in args.impls else []:
            times, sent = run_swarm("ours", codec, args, transport)
            ours = statistics.median(times)
            ratio = f"{ours / hm_median:.2f}x hivemind's time" if hm_median else "n/a"
            sent_text = f"{statistics.median(sent) / 1e6:.1f} MB" if sent else "n/a"
            label = f"{codec} over {transport}"
            print(f"{label:24s} round: ours {ours:.3f} s | hivemind {hm_text} | ours/hivemind {ratio} {note}")
            print(
                f"{label:24s} bytes sent per peer: {sent_text} (uncompressed butterfly minimum {minimum / 1e6:.1f} MB)"
            )
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


if __name__ == "__main__":
    main()
