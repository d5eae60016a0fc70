"""A peer's memory is bounded by what others send it, not by what their frames announce (issue 12).

Hostile clients are raw libp2p streams and raw direct-path (TCP) connections: they send a frame
prefix announcing a 63 MiB payload, a little of it, and then nothing. The victim is an RPCServer in
this process; its memory is measured with tracemalloc (every Python allocation, deterministic) and
the framing layer's own counter of bytes held by incomplete payloads; RSS is printed for scale.
Before the fix, each such stream made the victim allocate the announced 63 MiB at once (1008 MiB
for 16 streams), and a failed read's buffer stayed alive (a reference cycle through the error's
traceback) until the cycle collector ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time
import tracemalloc
from collections.abc import AsyncIterator, Iterator

import pytest
from test_p2p import NAMESPACE, Peers, async_test, frame_bytes, open_frame, served

from hivemind_ext.errors import MessageTooLargeError
from hivemind_ext.p2p import DirectConfig, FrameKind, HandlerConfig, Limits, Message, framing, protocol_name
from hivemind_ext.p2p.direct_records import CALLER
from hivemind_ext.p2p.direct_transport import connect_tcp, seal, start_client_session
from hivemind_ext.p2p.direct_wire import (
    ACCEPTED,
    TICKET_HANDLER,
    encode_handler_name,
    encode_hello,
    parse_ticket_response,
    ticket_request,
)
from hivemind_ext.p2p.receive_budget import ReceiveBudget, receiving_bytes

MB = 1024 * 1024
ANNOUNCED = 63 * MB
HOSTILE_STREAMS = 16
# What 16 stalled streams may cost the victim: each holds at most the first step of its buffer
# (framing.EAGER_PAYLOAD_BYTES, 4 MiB), so 64 MiB, plus slack for everything else in the process.
STALLED_BOUND = HOSTILE_STREAMS * 4 * MB + 24 * MB
LIMITS = Limits(max_payload_bytes=64 * MB, idle_timeout=60.0)


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextlib.contextmanager
def traced_without_gc() -> Iterator[None]:
    """tracemalloc on and the cycle collector off: memory must be freed by reference counting alone."""
    framing.RECEIVE_BUFFERS.clear()
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()
        gc.enable()
        framing.RECEIVE_BUFFERS.clear()


def traced() -> int:
    return tracemalloc.get_traced_memory()[0]


async def open_hostile(peers: Peers, direct: bool) -> tuple[asyncio.StreamWriter, asyncio.StreamReader | None]:
    """A raw stream to the ``sink`` handler, over libp2p or the direct path, with nothing sent yet."""
    if not direct:
        _, reader, writer = await peers.client_p2p.call_binary_stream_handler(
            peers.peer, protocol_name(NAMESPACE, "sink")
        )
        return writer, reader
    request = Message(ticket_request(1))  # encrypted, as every direct caller by default
    ticket = parse_ticket_response((await peers.client.call(peers.peer, TICKET_HANDLER, request, timeout=10)).header)
    reader, writer = await start_client_session(await connect_tcp(ticket.host, ticket.port))
    writer.write(encode_hello(ticket.tokens[0]))
    reader, writer = seal(reader, writer, ticket.keys[0], CALLER)
    writer.write(encode_handler_name("sink"))
    assert await asyncio.wait_for(reader.readexactly(1), 10) == ACCEPTED
    return writer, None


def hostile_bytes(sent: int) -> bytes:
    """OPEN, then a MESSAGE frame that announces ANNOUNCED payload bytes and carries only ``sent``."""
    head = frame_bytes(FrameKind.MESSAGE, {"x": 1})
    prefix = bytearray(head)
    prefix[8:16] = ANNOUNCED.to_bytes(8, "little")  # payload length field of the prefix
    return open_frame(60.0) + bytes(prefix) + os.urandom(sent)


@contextlib.asynccontextmanager
async def victim(direct: bool) -> AsyncIterator[Peers]:
    async with served(HandlerConfig(limits=LIMITS, max_timeout=120.0)) as peers:

        async def sink(requests: AsyncIterator[Message], _context: object) -> AsyncIterator[Message]:
            async for _ in requests:
                pass
            yield Message({"done": True})

        await peers.server.add_stream("sink", sink)
        if direct:
            await peers.server.enable_direct(DirectConfig(host="127.0.0.1"))
        yield peers


async def wait_async(condition, timeout: float, message: str) -> None:
    give_up = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < give_up, f"timed out waiting for {message}"
        await asyncio.sleep(0.05)


async def peak_while(seconds: float) -> int:
    """The highest traced memory seen during ``seconds``."""
    peak, give_up = traced(), time.monotonic() + seconds
    while time.monotonic() < give_up:
        await asyncio.sleep(0.05)
        peak = max(peak, traced())
    return peak


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("direct", [False, True], ids=["libp2p", "direct"])
@async_test
async def test_stalled_frames_announcing_63_mib_cost_a_bounded_amount_and_are_freed(direct: bool) -> None:
    async with victim(direct) as peers:
        with traced_without_gc():
            before, rss_before = traced(), rss_bytes()
            writers = []
            for _ in range(HOSTILE_STREAMS):
                writer, _ = await open_hostile(peers, direct)
                writer.write(hostile_bytes(sent=1024))
                writers.append(writer)
            await wait_async(lambda: peers.server.active_calls >= HOSTILE_STREAMS, 30, "every hostile call")
            grown = await peak_while(2.0) - before
            rss_grown = rss_bytes() - rss_before
            print(
                f"{HOSTILE_STREAMS} x {ANNOUNCED // MB} MiB announced over {'direct' if direct else 'libp2p'}: "
                f"traced +{grown / MB:.1f} MiB, RSS +{rss_grown / MB:.1f} MiB, "
                f"in-flight payload bytes {receiving_bytes() / MB:.1f} MiB"
            )
            assert grown < STALLED_BOUND, f"the victim allocated {grown / MB:.0f} MiB for announced sizes"
            for writer in writers:
                writer.transport.abort()
            # hung up: the buffers go, by reference counting alone (the pool keeps at most its own cap)
            await wait_async(lambda: peers.server.active_calls == 0, 30, "the hostile calls to end")
            framing.RECEIVE_BUFFERS.clear()
            await wait_async(lambda: traced() - before < 16 * MB, 10, "the buffers to be freed")
            await peers.honest_call_works()


@pytest.mark.slow
@pytest.mark.timeout(90)
@async_test
async def test_a_partly_sent_large_payload_is_freed_when_the_sender_hangs_up_without_the_cycle_collector() -> None:
    """4 streams each send 6 MiB of a 63 MiB payload (their buffers grow past the pooled first step),
    then hang up: with gc disabled, the memory must come back at once."""
    async with victim(direct=False) as peers:
        with traced_without_gc():
            before = traced()
            writers = []
            for _ in range(4):
                writer, _ = await open_hostile(peers, direct=False)
                writer.write(hostile_bytes(sent=6 * MB))
                writers.append(writer)
            await wait_async(lambda: traced() - before > 4 * 6 * MB, 30, "the sent bytes to arrive")
            held = traced() - before
            # each buffer grew 4 -> 16 MiB (and the pool keeps the 4 MiB ones): 80 MiB; announced: 252 MiB
            assert held < 112 * MB, f"{held / MB:.0f} MiB held for 24 MiB sent"
            for writer in writers:
                writer.transport.abort()
            await wait_async(lambda: peers.server.active_calls == 0, 30, "the hostile calls to end")
            framing.RECEIVE_BUFFERS.clear()
            await wait_async(lambda: traced() - before < 8 * MB, 10, "the buffers to be freed without gc")


@pytest.mark.slow
@pytest.mark.timeout(60)
@async_test
async def test_a_stream_that_stalls_inside_a_frame_is_cut_off_after_the_idle_timeout() -> None:
    limits = Limits(max_payload_bytes=64 * MB, idle_timeout=1.0)
    async with served(HandlerConfig(limits=limits, max_timeout=120.0)) as peers:

        async def sink(requests: AsyncIterator[Message], _context: object) -> AsyncIterator[Message]:
            async for _ in requests:
                pass
            yield Message({})

        await peers.server.add_stream("sink", sink)
        writer, reader = await open_hostile(peers, direct=False)
        writer.write(hostile_bytes(sent=1024))
        await wait_async(lambda: peers.server.active_calls == 1, 10, "the hostile call")
        started = time.monotonic()
        await wait_async(lambda: peers.server.active_calls == 0, 15, "the idle stream to be closed")
        assert time.monotonic() - started < 8.0  # idle 1 s, then at most the server's linger (2 s)
        assert reader is not None and await asyncio.wait_for(reader.read(), 10) is not None
        writer.transport.abort()


def test_a_peer_budget_admits_one_large_payload_and_caps_the_rest() -> None:
    budget = ReceiveBudget(max_bytes_per_peer=10 * MB)
    first, second, other = budget.account("a"), budget.account("a"), budget.account("b")
    first.charge(40 * MB)  # its only payload in flight: admitted even above the cap
    first.charge(8 * MB)  # the same stream growing is still its only one
    with pytest.raises(MessageTooLargeError):
        second.charge(1)  # a second stream of the same peer is over the cap
    other.charge(10 * MB)  # other peers have their own budget
    assert budget.held_bytes("a") == 48 * MB and second.held == 0
    first.release(40 * MB)
    second.charge(2 * MB)  # 8 + 2 <= 10
    with pytest.raises(MessageTooLargeError):
        second.charge(1 * MB)
    for account in (first, second, other):
        account.release()
    assert budget.held_bytes("a") == budget.held_bytes("b") == 0
