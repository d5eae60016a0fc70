"""Throughput of the p2p layer against raw daemon streams, measured in the same run.

Run as a script for the figures (``python tests/test_p2p_throughput.py [--uvloop] [--mb 64]``); under
pytest, one loose check that framing keeps most of the raw stream's throughput.

What is measured, between two daemons on 127.0.0.1, one direction:
- one large message: a unary call carrying ``--mb`` MB (response: a tiny message), against a raw
  stream whose receiver drops the bytes and against one that keeps them in a fresh buffer (as any
  real receiver must: first-touching fresh pages costs ~0.5 ms per MB here);
- a stream of 1 MB frames totalling ``--mb`` MB (response: one tiny message at the end);
- four such streams at once;
each next to a raw binary stream moving the same bytes with no framing at all.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from hivemind.p2p import P2P

from hivemind_ext.p2p import HandlerConfig, Limits, Message, RPCClient, RPCContext, RPCServer

MB = 1024 * 1024
FRAME = 1 * MB
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


async def _pair() -> tuple[P2P, P2P]:
    server = await P2P.create(host_maddrs=LOOPBACK)
    client = await P2P.create(host_maddrs=LOOPBACK, initial_peers=await server.get_visible_maddrs())
    return server, client


async def _raw_handler(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, keep: bool = False) -> None:
    """Reads a u64 length, then that many bytes (dropped, or kept in one fresh buffer if ``keep``),
    then answers one byte; no framing, no checks."""
    try:
        total = int.from_bytes(await reader.readexactly(8), "little")
        buffer = memoryview(bytearray(total)) if keep else None
        received = 0
        while received < total:
            chunk = await reader.read(min(total - received, 4 * MB))
            if not chunk:
                return
            if buffer is not None:
                buffer[received : received + len(chunk)] = chunk
            received += len(chunk)
        writer.write(b"k")
        await writer.drain()
    finally:
        writer.close()


async def _raw_keep_handler(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _raw_handler(info, reader, writer, keep=True)


async def _raw_send(client: P2P, server: P2P, data: memoryview, handler: str = "bench_raw") -> None:
    _, reader, writer = await client.call_binary_stream_handler(server.peer_id, handler)
    writer.write(data.nbytes.to_bytes(8, "little"))
    for start in range(0, data.nbytes, FRAME):
        writer.write(data[start : start + FRAME])
        await writer.drain()
    await reader.readexactly(1)
    writer.close()


async def _sink_unary(request: Message, context: RPCContext) -> Message:
    return Message({"n": len(request.payload)})


async def _sink_stream(requests: AsyncIterator[Message], context: RPCContext) -> AsyncIterator[Message]:
    total = 0
    async for request in requests:
        total += len(request.payload)
    yield Message({"n": total})


async def _best_times(
    framed: Callable[[], Awaitable[object]], raw: Callable[[], Awaitable[object]], repeats: int
) -> tuple[float, float]:
    """Best (framed, raw) seconds over ``repeats`` alternating runs, after one warm-up run of each
    (yamux grows its windows on a new connection); alternating keeps a noisy machine fair to both."""
    await raw()
    await framed()
    best_framed = best_raw = float("inf")
    for _ in range(repeats):
        for run, is_framed in ((raw, False), (framed, True)):
            start = time.perf_counter()
            await run()
            elapsed = time.perf_counter() - start
            if is_framed:
                best_framed = min(best_framed, elapsed)
            else:
                best_raw = min(best_raw, elapsed)
    return best_framed, best_raw


async def measure(total_mb: int = 64, repeats: int = 3) -> dict[str, tuple[float, float]]:
    """{scenario: (framed MB/s, raw MB/s)} for the three scenarios in the module docstring."""
    server_p2p, client_p2p = await _pair()
    limits = Limits(max_payload_bytes=total_mb * MB)
    server = RPCServer(server_p2p, "bench")
    try:
        await server_p2p.add_binary_stream_handler("bench_raw", _raw_handler)
        await server_p2p.add_binary_stream_handler("bench_raw_keep", _raw_keep_handler)
        await server.add_unary("sink", _sink_unary, config=HandlerConfig(limits=limits))
        await server.add_stream("sink_stream", _sink_stream)
        client = RPCClient(client_p2p, "bench", limits=limits, default_timeout=120)
        data = memoryview(bytearray(total_mb * MB))
        peer = server_p2p.peer_id

        async def framed_one() -> None:
            await client.call(peer, "sink", Message({}, data))

        async def framed_stream(part: memoryview = data) -> None:
            frames = [Message({"i": i}, part[i : i + FRAME]) for i in range(0, part.nbytes, FRAME)]
            async with client.stream(peer, "sink_stream", frames) as responses:
                async for _ in responses:
                    pass

        quarter = data[: data.nbytes // 4]

        async def framed_four() -> None:
            await asyncio.gather(*(framed_stream(quarter) for _ in range(4)))

        async def raw_four() -> None:
            await asyncio.gather(*(_raw_send(client_p2p, server_p2p, quarter) for _ in range(4)))

        async def raw_one() -> None:
            await _raw_send(client_p2p, server_p2p, data)

        async def raw_one_kept() -> None:
            await _raw_send(client_p2p, server_p2p, data, "bench_raw_keep")

        def rates(seconds: tuple[float, float]) -> tuple[float, float]:
            return total_mb * MB / seconds[0] / 1e6, total_mb * MB / seconds[1] / 1e6

        results = {
            "one large message": rates(await _best_times(framed_one, raw_one, repeats)),
            "  vs raw, kept in RAM": rates(await _best_times(framed_one, raw_one_kept, repeats)),
            "stream of 1 MB frames": rates(await _best_times(framed_stream, raw_one, repeats)),
            "4 concurrent streams": rates(await _best_times(framed_four, raw_four, repeats)),
        }
        return results
    finally:
        await server.shutdown()
        await server_p2p.remove_binary_stream_handler("bench_raw")
        await server_p2p.remove_binary_stream_handler("bench_raw_keep")
        await client_p2p.shutdown()
        await server_p2p.shutdown()


def report(results: dict[str, tuple[float, float]]) -> None:
    for scenario, (framed, raw) in results.items():
        ratio = framed / raw
        print(f"{scenario:>22}: hivemind_ext.p2p {framed:5.0f} MB/s | raw stream {raw:5.0f} MB/s | ratio {ratio:.2f}")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_framing_keeps_most_of_raw_throughput() -> None:
    # Loose bounds: this machine is shared and has 2 cores, so timings are noisy; a framing layer
    # that copied payloads repeatedly or stalled on small writes would fall far below them. The
    # first scenario also pays for a fresh buffer that its raw baseline never allocates.
    results = asyncio.run(measure(total_mb=32, repeats=2))
    report(results)
    for scenario, (framed, raw) in results.items():
        min_ratio = 0.4 if scenario == "one large message" else 0.5
        assert framed >= min_ratio * raw, f"{scenario}: {framed:.0f} MB/s framed vs {raw:.0f} MB/s raw"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=64, help="megabytes per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop instead of asyncio's default loop")
    args = parser.parse_args()
    if args.uvloop:
        import uvloop

        uvloop.install()
    report(asyncio.run(measure(args.mb, args.repeats)))
