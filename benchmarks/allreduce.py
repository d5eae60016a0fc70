"""One butterfly all-reduce round (no matchmaking): round time and bytes sent per peer, per codec.

N peers (default 4) on 127.0.0.1, each with its own libp2p daemon and one float32 tensor (default
16M values), average with :class:`hivemind_ext.averaging.allreduce.service.AllreduceService` on a group
built directly (no DHT). Two modes:

- ``--mode process`` (default): one OS process per peer, as in a real swarm; rounds start together
  (a barrier) and a round lasts from the start until the last peer holds its result;
- ``--mode inline``: all peers in this process on one event loop (pessimistic: one GIL and one loop
  carry every peer's work), handy for profiling.

The figure: the median round time per codec, and each peer's payload bytes sent against the
butterfly minimum 2(N-1)/N x size (uncompressed). hivemind's averager has no round-only mode;
benchmarks/averaging.py compares full steps (matchmaking included) with it.

    python benchmarks/allreduce.py --mode process --peers 4 --size 16M --rounds 5
    python benchmarks/allreduce.py --mode inline --part-size 262144 1048576 4194304
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Result, butterfly_bytes, emit, start

from hivemind_ext.averaging.allreduce.service import DEFAULT_PART_SIZE_BYTES

SIZES = {"1M": 2**20, "4M": 2**22, "16M": 2**24, "64M": 2**26}
CODECS = ("none", "float16", "MinMaxUInt8")
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
NAMESPACE = "bench"


def make_codec(name: str) -> Any:
    from hivemind_ext import compression

    return {"none": compression.NoCompression, "float16": compression.Float16Compression}.get(
        name, compression.MinMaxUInt8
    )()


def make_group(peer_ids: list[Any], round_index: int) -> Any:
    from hivemind_ext.averaging.matchmaking.group import GroupInfo, Member

    members = tuple(Member(peer.to_base58(), f"attempt{round_index}") for peer in peer_ids)
    return GroupInfo(f"bench-{round_index}".encode(), members)


async def start_peer(initial_peers: list[Any] | None, codec_threads: int) -> tuple[Any, Any]:
    from hivemind.p2p import P2P

    from hivemind_ext.averaging.allreduce.service import AllreduceService
    from hivemind_ext.p2p import RPCClient, RPCServer

    p2p = await P2P.create(host_maddrs=LOOPBACK, initial_peers=initial_peers or [])
    service = AllreduceService(RPCServer(p2p, NAMESPACE), RPCClient(p2p, NAMESPACE), codec_threads=codec_threads)
    await service.start()
    return p2p, service


async def stop_peer(p2p: Any, service: Any) -> None:
    await service.shutdown()
    await service.rpc_server.shutdown()
    await p2p.shutdown()


def config_for(codec: str, part_size: int, offload: bool) -> Any:
    from hivemind_ext.averaging.allreduce.service import AllreduceConfig

    return AllreduceConfig(compression=make_codec(codec), part_size_bytes=part_size, offload_codecs=offload)


# ----- inline mode: every peer in this process


async def run_inline(args: argparse.Namespace, codec: str, part_size: int) -> tuple[list[float], list[int]]:
    import torch

    first = await start_peer(None, args.threads)
    maddrs = await first[0].get_visible_maddrs()
    peers = [first] + [await start_peer(maddrs, args.threads) for _ in range(args.peers - 1)]
    tensors = [torch.randn(SIZES[args.size], generator=torch.Generator().manual_seed(i)) for i in range(args.peers)]
    config = config_for(codec, part_size, args.offload)
    times, sent = [], []
    try:
        for round_index in range(args.rounds + 1):  # round 0 warms up connections
            group = make_group([p2p.peer_id for p2p, _ in peers], round_index)
            start = time.perf_counter()
            results = await asyncio.gather(
                *(service.run_round(group, [t], config=config) for (_, service), t in zip(peers, tensors, strict=True))
            )
            elapsed = time.perf_counter() - start
            if not all(r.all_averaged for r in results):
                raise RuntimeError(f"round {round_index} was incomplete: {[r.excluded for r in results]}")
            if round_index:
                times.append(elapsed)
                sent.extend(r.bytes_sent for r in results)
    finally:
        for p2p, service in peers:
            await stop_peer(p2p, service)
    return times, sent


# ----- process mode: one process per peer


def peer_process(index: int, args: argparse.Namespace, codec: str, part_size: int, pipe: Any, barrier: Any) -> None:
    try:
        import uvloop

        uvloop.run(_peer_process(index, args, codec, part_size, pipe, barrier))
    except Exception as e:
        pipe.send(("error", f"{type(e).__name__}: {e}"))


async def _peer_process(index: int, args: argparse.Namespace, codec: str, part_size: int, pipe: Any, barrier) -> None:
    import torch
    from hivemind.p2p import PeerID

    torch.set_num_threads(1)
    initial = pipe.recv()
    p2p, service = await start_peer(initial, args.threads)
    pipe.send(("ready", p2p.peer_id.to_base58(), [str(a) for a in await p2p.get_visible_maddrs()]))
    peer_ids = [PeerID.from_base58(name) for name in pipe.recv()]
    tensor = torch.randn(SIZES[args.size], generator=torch.Generator().manual_seed(index))
    config = config_for(codec, part_size, args.offload)
    loop = asyncio.get_running_loop()
    try:
        for round_index in range(args.rounds + 1):
            group = make_group(peer_ids, round_index)
            await loop.run_in_executor(None, barrier.wait)
            start = time.time()
            result = await service.run_round(group, [tensor], config=config)
            problems = {str(peer): reason for peer, reason in result.excluded.items()}
            pipe.send(("round", round_index, start, time.time(), result.bytes_sent, result.all_averaged, problems))
    finally:
        await stop_peer(p2p, service)


def run_processes(args: argparse.Namespace, codec: str, part_size: int) -> tuple[list[float], list[int]]:
    context = mp.get_context("spawn")
    barrier = context.Barrier(args.peers)
    pipes, processes = [], []
    for index in range(args.peers):
        ours, theirs = context.Pipe()
        process = context.Process(target=peer_process, args=(index, args, codec, part_size, theirs, barrier))
        process.start()
        pipes.append(ours)
        processes.append(process)
    try:
        pipes[0].send(None)
        first = _expect(pipes[0], "ready")
        names = [first[1]]
        for pipe in pipes[1:]:
            pipe.send(first[2])
            names.append(_expect(pipe, "ready")[1])
        for pipe in pipes:
            pipe.send(names)
        records = [_expect(pipe, "round") for _ in range(args.rounds + 1) for pipe in pipes]
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    times, sent = [], []
    for round_index in range(1, args.rounds + 1):
        rows = [r for r in records if r[1] == round_index]
        if not all(r[5] for r in rows):
            raise RuntimeError(f"round {round_index} was incomplete: {[r[6] for r in rows]}")
        times.append(max(r[3] for r in rows) - min(r[2] for r in rows))
        sent.extend(r[4] for r in rows)
    return times, sent


def _expect(pipe: Any, kind: str) -> tuple[Any, ...]:
    if not pipe.poll(300):
        raise RuntimeError(f"a peer sent nothing for 300 s (waiting for {kind})")
    message = pipe.recv()
    if message[0] != kind:
        raise RuntimeError(f"peer failed: {message}")
    return message


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["process", "inline"], default="process")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--size", default="16M", choices=list(SIZES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--codecs", nargs="+", default=list(CODECS), choices=list(CODECS))
    parser.add_argument(
        "--part-size", type=int, nargs="+", default=[DEFAULT_PART_SIZE_BYTES], help="part_size_bytes values to try"
    )
    parser.add_argument("--threads", type=int, default=2, help="codec worker threads per peer")
    parser.add_argument("--offload", action="store_true", help="run codec work in worker threads")
    args = start(parser)
    print(f"mode {args.mode}, {args.peers} peers x {args.size} float32")
    numel = SIZES[args.size]
    minimum = butterfly_bytes(args.peers, numel)
    results: list[Result] = []
    for part_size in args.part_size:
        for codec in args.codecs:
            if args.mode == "inline":
                import uvloop

                times, sent = uvloop.run(run_inline(args, codec, part_size))
            else:
                times, sent = run_processes(args, codec, part_size)
            median = statistics.median(times)
            sent_median = statistics.median(sent)
            print(
                f"{codec:12s} part_size {part_size >> 10:5d} KiB: round {median:.3f} s "
                f"(min {min(times):.3f}, max {max(times):.3f}); sent per peer {sent_median / 1e6:.1f} MB = "
                f"{sent_median / minimum:.3f} x the uncompressed butterfly minimum ({minimum / 1e6:.1f} MB)"
            )
            case = f"{codec} {args.peers} peers {args.size} {args.mode} part {part_size >> 10} KiB"
            results.append(Result(case, "s/round", round(median, 4), None, None))
            results.append(Result(case, "bytes sent / butterfly minimum", round(sent_median / minimum, 4), None, None))
    emit("allreduce", results)


if __name__ == "__main__":
    main()
