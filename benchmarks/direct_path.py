"""Throughput of the direct data path on loopback: encrypted (AES-GCM records, the default) against
plaintext (the opt-in).

Two processes (a server and a caller, each with its own libp2p daemon and a uvloop event loop, as
the peer runtime has) on 127.0.0.1. The caller streams ``--mb`` MB in 2 MiB messages (the
all-reduce's chunk size) to a handler that receives each message into a fresh buffer, in turn over
the encrypted direct path, the plaintext direct path and libp2p streams through the daemons; each
``--repeats`` times, alternating, and the median is reported. The figure this benchmark exists for
is the encrypted path's throughput as a fraction of plaintext's (the goal: at least 0.8). hivemind
has no direct path; its transport is the libp2p daemon's streams, which the libp2p case measures
with our framing, so that column is the libp2p case.

On a loaded machine wall-clock throughput swings by several times between runs, so the benchmark
also reports the CPU time that the caller's and the server's processes spent per GB moved, together
and each (the daemons' processes are not counted, so this is for the direct paths only): where CPU is the limit,
throughput is inversely proportional to it, and it is far steadier under load. Its ratio
(plaintext CPU / encrypted CPU) estimates the throughput ratio on an otherwise idle machine.

    python benchmarks/direct_path.py
    python benchmarks/direct_path.py --mb 1024 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Result, emit, higher_is_better, start

MB = 1024 * 1024
MESSAGE = 2 * MB
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
# namespace -> (server's direct settings, the caller's prefer_direct, allow_plaintext)
PATHS = {
    "encrypted": ("bench_sealed", True, False),
    "plaintext": ("bench_plain", True, True),
    "libp2p": ("bench_p2p", False, False),
}


def _loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


async def _sink(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
    from hivemind_ext.p2p import Message

    total, started = 0, None
    async for request in requests:
        started = time.process_time() if started is None else started
        total += len(request.payload)
    cpu = time.process_time() - started if started is not None else 0.0  # from the first message on
    yield Message({"bytes": total, "transport": context.transport, "cpu": cpu})


async def _serve(connection: Any) -> None:
    from hivemind.p2p import P2P

    from hivemind_ext.p2p import DirectConfig, HandlerConfig, Limits, RPCServer

    p2p = await P2P.create(host_maddrs=LOOPBACK)
    config = HandlerConfig(limits=Limits(max_payload_bytes=4 * MB))
    root = RPCServer(p2p, "bench_root", config=config)
    for name, (namespace, direct, _) in PATHS.items():
        server = root.scope(namespace, config=config)
        await server.add_stream("sink", _sink)
        if direct:
            await server.enable_direct(DirectConfig(host="127.0.0.1", plaintext=name == "plaintext"))
    connection.send([str(m) for m in await p2p.get_visible_maddrs()])
    await asyncio.get_running_loop().run_in_executor(None, connection.recv)  # until the caller is done
    await root.shutdown()
    await p2p.shutdown()


def serve(connection: Any) -> None:
    _loop().run_until_complete(_serve(connection))


async def _measure(
    maddrs: list[str], args: argparse.Namespace
) -> tuple[dict[str, list[float]], dict[str, list[tuple[float, float]]]]:
    """(MB/s per path, (caller's, server's) process CPU seconds per GB per path)."""
    from hivemind.p2p import P2P

    from hivemind_ext.p2p import DirectClientConfig, Limits, Message, RPCClient

    p2p = await P2P.create(host_maddrs=LOOPBACK, initial_peers=maddrs)
    server_id = (await p2p.list_peers())[0].peer_id
    clients = {
        name: RPCClient(
            p2p,
            namespace,
            limits=Limits(max_payload_bytes=4 * MB),
            prefer_direct=direct,
            direct_config=DirectClientConfig(allow_plaintext=plaintext),
        )
        for name, (namespace, direct, plaintext) in PATHS.items()
    }
    payload = bytes(MESSAGE)
    count = max(1, args.mb * MB // MESSAGE)
    rates: dict[str, list[float]] = {name: [] for name in PATHS}
    cpu: dict[str, list[tuple[float, float]]] = {name: [] for name in PATHS}
    for repeat in range(args.repeats + 1):  # the first round warms connections and tickets up
        for name, client in clients.items():
            started, cpu_started = time.perf_counter(), time.process_time()
            requests = (Message({}, payload) for _ in range(count))
            async with client.stream(server_id, "sink", requests, timeout=600) as responses:
                answer = [response async for response in responses][-1]
            elapsed, caller_cpu = time.perf_counter() - started, time.process_time() - cpu_started
            expected = "direct" if name == "encrypted" else "direct-plaintext" if name == "plaintext" else "libp2p"
            if answer.header["transport"] != expected or answer.header["bytes"] != count * MESSAGE:
                raise RuntimeError(f"{name}: {answer.header} instead of {count * MESSAGE} bytes over {expected}")
            if repeat:
                rates[name].append(count * MESSAGE / elapsed / 1e6)
                gigabytes = count * MESSAGE / 1e9
                cpu[name].append((caller_cpu / gigabytes, answer.header["cpu"] / gigabytes))
    await p2p.shutdown()
    return rates, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=512, help="megabytes per transfer")
    parser.add_argument("--repeats", type=int, default=3)
    args = start(parser)
    context = mp.get_context("spawn")
    ours, theirs = context.Pipe()
    server = context.Process(target=serve, args=(theirs,))
    server.start()
    try:
        maddrs = ours.recv()
        rates, cpu = _loop().run_until_complete(_measure(maddrs, args))
    finally:
        ours.send("done")
        server.join(timeout=30)
        if server.is_alive():
            server.kill()
    medians = {name: statistics.median(values) for name, values in rates.items()}
    for name, values in rates.items():
        print(f"{name:10s} {medians[name]:8.1f} MB/s  (runs: {', '.join(f'{v:.0f}' for v in values)})")
    print(f"encrypted / plaintext throughput: {medians['encrypted'] / medians['plaintext']:.3f}")
    cpu_medians = {name: statistics.median(sum(pair) for pair in values) for name, values in cpu.items()}
    for name in ("encrypted", "plaintext"):
        caller = statistics.median(pair[0] for pair in cpu[name])
        server = statistics.median(pair[1] for pair in cpu[name])
        print(
            f"{name:10s} {cpu_medians[name]:8.3f} CPU-s per GB, caller + server processes"
            f" (medians: caller {caller:.3f}, server {server:.3f})"
        )
    cpu_ratio = cpu_medians["plaintext"] / cpu_medians["encrypted"]
    print(f"plaintext CPU / encrypted CPU per byte: {cpu_ratio:.3f}")
    results = [
        higher_is_better("direct path, encrypted", "MB/s", round(medians["encrypted"], 1), round(medians["libp2p"], 1)),
        higher_is_better("direct path, plaintext", "MB/s", round(medians["plaintext"], 1), round(medians["libp2p"], 1)),
        Result(
            "encrypted throughput / plaintext throughput",
            "ratio",
            round(medians["encrypted"] / medians["plaintext"], 4),
            None,
            None,
        ),
        Result("plaintext CPU per byte / encrypted CPU per byte", "ratio", round(cpu_ratio, 4), None, None),
    ]
    emit("direct_path", results)


if __name__ == "__main__":
    main()
