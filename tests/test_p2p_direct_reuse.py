"""Reuse of direct connections across calls to the same peer (see direct_wire): sequential calls
share one TCP connection; a connection the server closed while idle is replaced; garbage as the
next handler name closes only that connection; idle connections expire and are bounded on both sides.

Real daemons on 127.0.0.1 (run under the bench lock, like tests/test_p2p_direct.py).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import AsyncIterator

import pytest
from test_p2p import async_test, wait_for_no_p2p_tasks
from test_p2p_direct import ALLOW_PLAINTEXT, LOOPBACK_DIRECT, MB, Pair, pair

from hivemind_ext.errors import HivemindExtError
from hivemind_ext.p2p import DirectClientConfig, DirectConfig, Limits, Message, RPCContext
from hivemind_ext.p2p.deadlines import now
from hivemind_ext.p2p.direct_client import DirectConnector
from hivemind_ext.p2p.direct_server import DirectListener
from hivemind_ext.p2p.direct_transport import DirectStream, open_direct_connection, start_direct_server
from hivemind_ext.p2p.direct_wire import ACCEPTED, REUSE_END_KEY, encode_handler_name, encode_hello
from hivemind_ext.p2p.framing import FrameKind, encode_frame_head, open_header
from hivemind_ext.p2p.stream import WRITE_BUFFER_HIGH, WRITE_BUFFER_LOW, FramedStream


async def nap(request: Message, context: RPCContext) -> Message:
    await asyncio.sleep(0.3)
    return Message({"transport": context.transport})


def parts(peers: Pair) -> tuple[DirectConnector, DirectListener]:
    assert peers.client.direct is not None and peers.server.direct_listener is not None
    return peers.client.direct, peers.server.direct_listener


async def eventually(condition, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


@async_test
async def test_sequential_calls_to_one_peer_share_one_connection() -> None:
    async with pair() as peers:
        connector, listener = parts(peers)
        await peers.whoami(os.urandom(3 * MB))
        for _ in range(10):  # more calls than tokens per ticket: no ticket call is needed either
            assert (await peers.whoami()).header["transport"] == "direct"
        requests = [Message({"i": i}, os.urandom(size)) for i, size in enumerate((0, 2 * MB, 10))]
        for _ in range(2):
            async with peers.client.stream(peers.peer, "echo_stream", requests, timeout=30) as responses:
                received = [bytes(response.payload) async for response in responses]
            assert received == [bytes(r.payload) for r in requests]
        assert (await peers.whoami()).header["transport"] == "direct"
        assert listener.accepted == 1
        assert (connector.opened, connector.reused) == (1, 13)
        assert connector.idle_count(peers.peer) == 1


@async_test
async def test_both_ends_of_a_direct_connection_send_small_frames_at_once() -> None:
    """TCP_NODELAY on both sockets: a reused stream waits for ACCEPTED before its requests, and
    with Nagle's algorithm on the caller's socket its first request then waited for the server's
    delayed ACK of the OPEN frame (about 40 ms a call on Linux)."""
    async with pair() as peers:
        connector, _ = parts(peers)
        await peers.whoami()
        started = time.monotonic()
        for _ in range(10):
            async with peers.client.stream(peers.peer, "echo_stream", [Message({}, b"x")], timeout=10) as responses:
                assert [bytes(r.payload) async for r in responses] == [b"x"]
        assert time.monotonic() - started < 0.3 and connector.reused == 10
        idle = connector.take_idle(peers.peer)
        assert idle is not None
        sock = idle.connection[1].transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        idle.close()


@async_test
async def test_plaintext_connections_are_reused_too() -> None:
    async with pair(DirectConfig(host="127.0.0.1", plaintext=True), ALLOW_PLAINTEXT) as peers:
        _, listener = parts(peers)
        for _ in range(3):
            assert (await peers.whoami()).header["transport"] == "direct-plaintext"
        assert listener.accepted == 1


@async_test
async def test_a_connection_the_server_closed_while_idle_is_replaced() -> None:
    async with pair() as peers:
        connector, listener = parts(peers)
        await peers.whoami()
        assert len(listener.idle) == 1
        listener.idle.drop_all()  # as its idle bound or a restart would
        await asyncio.sleep(0.1)
        assert (await peers.whoami()).header["transport"] == "direct"
        assert listener.accepted == 2 and connector.opened == 2 and connector.reused == 0
        assert (await peers.whoami()).header["transport"] == "direct"
        assert listener.accepted == 2


@async_test
async def test_the_client_forgets_an_idle_connection_as_soon_as_the_server_ends_it() -> None:
    async with pair() as peers:
        connector, listener = parts(peers)
        await peers.whoami()
        await peers.whoami()
        assert connector.idle_count(peers.peer) == 1
        listener.idle.drop_all()
        await eventually(lambda: connector.idle_count() == 0, 1)  # not at its expiry, 20 s later
        assert (await peers.whoami()).header["transport"] == "direct"
        assert connector.reused == 1 and connector.opened == 2


@async_test
async def test_garbage_as_the_next_handler_name_closes_only_that_connection() -> None:
    plaintext = DirectConfig(host="127.0.0.1", plaintext=True)
    for direct, client_config in ((LOOPBACK_DIRECT, None), (plaintext, ALLOW_PLAINTEXT)):
        async with pair(direct, client_config) as peers:
            connector, _ = parts(peers)
            await peers.whoami()
            hostile = connector.take_idle(peers.peer)
            assert hostile is not None
            reader, writer = hostile.connection
            call = asyncio.ensure_future(peers.whoami())  # a call on another connection
            await asyncio.sleep(0)
            writer.write(b"\xff\xff" + os.urandom(300))  # a handler name longer than any allowed
            await asyncio.wait_for(reader.read(1), 5)  # closed by the server, nothing answered
            assert reader.at_eof()
            assert (await call).header["transport"] in ("direct", "direct-plaintext")
            writer.transport.abort()
            # raw bytes outside the records on an encrypted connection: closed the same way
            await peers.whoami()
            hostile = connector.take_idle(peers.peer)
            assert hostile is not None
            reader, writer = hostile.connection
            writer.transport.write(os.urandom(100))
            await asyncio.wait_for(reader.read(1), 5)
            assert reader.at_eof()
            writer.transport.abort()
            assert (await peers.whoami()).header["transport"] in ("direct", "direct-plaintext")
    await wait_for_no_p2p_tasks()


@async_test
async def test_idle_connections_expire_on_both_sides() -> None:
    async with pair(DirectConfig(host="127.0.0.1", idle_timeout=0.8)) as peers:
        connector, listener = parts(peers)
        await peers.whoami()
        assert connector.idle_count() == 1 and len(listener.idle) == 1
        await eventually(lambda: connector.idle_count() == 0, 2)  # the client's: 3/4 of the server's 0.8 s
        await eventually(lambda: len(listener.idle) == 0, 2)  # the server saw it closed
        await peers.whoami()
        held = connector.take_idle(peers.peer)  # kept open by a caller that never calls again
        assert held is not None and len(listener.idle) == 1
        started = time.monotonic()
        await asyncio.wait_for(held.connection[0].read(1), 5)
        assert held.connection[0].at_eof() and 0.6 < time.monotonic() - started < 3
        assert len(listener.idle) == 0
        held.close()
        assert (await peers.whoami()).header["transport"] == "direct"
        assert listener.accepted == 3


@async_test
async def test_idle_connections_are_bounded_per_peer_on_both_sides() -> None:
    async with pair(client_config=DirectClientConfig(max_idle_per_peer=3)) as peers:
        await peers.server.add_unary("nap", nap)
        connector, listener = parts(peers)
        calls = [peers.client.call(peers.peer, "nap", Message({}), timeout=10) for _ in range(5)]
        assert {r.header["transport"] for r in await asyncio.gather(*calls)} == {"direct"}
        assert listener.accepted == 5
        assert connector.idle_count(peers.peer) == 3
        await eventually(lambda: len(listener.idle) == 3)  # the client closed the two beyond its bound
    async with pair(DirectConfig(host="127.0.0.1", max_idle_per_peer=2)) as peers:
        await peers.server.add_unary("nap", nap)
        connector, listener = parts(peers)
        calls = [peers.client.call(peers.peer, "nap", Message({}), timeout=10) for _ in range(5)]
        assert {r.header["transport"] for r in await asyncio.gather(*calls)} == {"direct"}
        assert listener.idle.count(peers.client_p2p.peer_id) == 2  # the server closed its three oldest
        await asyncio.sleep(0.1)
        for _ in range(4):  # the client skips the closed ones and reuses the two left
            assert (await peers.whoami()).header["transport"] == "direct"
        assert listener.accepted == 5
    await wait_for_no_p2p_tasks()


@async_test
async def test_stopping_the_listener_closes_idle_connections() -> None:
    async with pair() as peers:
        connector, listener = parts(peers)
        await peers.whoami()
        listener.stop_accepting()
        await asyncio.sleep(0.05)
        assert (await peers.whoami()).header["transport"] == "libp2p"
        assert connector.idle_count() == 0


async def first_only(requests: AsyncIterator[Message], context: RPCContext) -> AsyncIterator[Message]:
    async for request in requests:
        await asyncio.sleep(0.2)  # the caller's other requests and its END arrive meanwhile, unread
        yield request
        return


@async_test
async def test_a_stream_whose_handler_left_requests_unread_is_not_reused() -> None:
    async with pair() as peers:
        await peers.server.add_stream("first_only", first_only)
        connector, listener = parts(peers)
        requests = [Message({"i": i}, b"x" * 100) for i in range(3)]
        async with peers.client.stream(peers.peer, "first_only", requests, timeout=30) as responses:
            assert [r.header["i"] async for r in responses] == [0]
        assert connector.idle_count() == 0  # the server's END did not offer the connection for reuse
        started = time.monotonic()
        assert (await peers.whoami(timeout=20)).header["transport"] == "direct"
        assert time.monotonic() - started < 2
        assert listener.accepted == 2


@async_test
async def test_closing_the_client_closes_its_idle_connections() -> None:
    async with pair() as peers:
        connector, listener = parts(peers)
        await peers.whoami()
        assert connector.idle_count() == 1
        peers.client.close()
        assert connector.idle_count() == 0
        await eventually(lambda: len(listener.idle) == 0)  # the server saw the caller hang up
        assert (await peers.whoami()).header["transport"] == "direct"
        assert listener.accepted == 2


@async_test
async def test_a_next_call_sent_right_behind_the_last_one_is_served() -> None:
    """The caller may send its next call as soon as it has the server's END: bytes of the next call
    already received when the server ends a call must not make it drop the connection."""
    async with pair(DirectConfig(host="127.0.0.1", plaintext=True), ALLOW_PLAINTEXT) as peers:
        _, listener = parts(peers)
        ticket = await peers.ticket()
        reader, writer = await open_direct_connection("127.0.0.1", ticket.port)
        stream = FramedStream(reader, writer, Limits(max_payload_bytes=MB))

        def call(name: str, payloads: list[bytes]) -> bytes:
            frames = [encode_frame_head(FrameKind.OPEN, open_header(10), 0, Limits())]
            for payload in payloads:
                frames += [encode_frame_head(FrameKind.MESSAGE, {}, len(payload), Limits()), payload]
            frames.append(encode_frame_head(FrameKind.END, {}, 0, Limits()))
            return encode_handler_name(name) + b"".join(frames)

        first, second = [b"a" * 10, b"b" * 20], [b"c" * 30]
        writer.write(encode_hello(ticket.tokens[0]) + call("echo_stream", first) + call("echo_stream", second))
        for payloads in (first, second):
            assert await reader.readexactly(1) == ACCEPTED
            for payload in payloads:
                frame = await stream.receive(now() + 5)
                assert frame.kind is FrameKind.MESSAGE and bytes(frame.payload) == payload
            end = await stream.receive(now() + 5)
            assert end.kind is FrameKind.END and end.header == {REUSE_END_KEY: True}
        assert listener.accepted == 1 and len(listener.idle) == 1
        writer.transport.abort()


@async_test
async def test_a_call_on_a_connection_the_server_closes_as_it_is_reused_succeeds() -> None:
    """The server closes an idle connection (its expiry, its bounds, a restart) while the caller's
    next call on it is already on its way: the call is sent again on a fresh connection."""
    async with pair() as peers:
        connector, listener = parts(peers)
        await peers.whoami()
        listener.idle.drop_all()  # no await before the call: the client has not seen the close yet
        assert (await peers.whoami()).header["transport"] == "direct"
        assert (connector.reused, connector.opened) == (1, 2) and listener.accepted == 2
        requests = [Message({"i": i}, os.urandom(size)) for i, size in enumerate((10, 2 * MB))]
        listener.idle.drop_all()
        async with peers.client.stream(peers.peer, "echo_stream", requests, timeout=30) as responses:
            assert [bytes(r.payload) async for r in responses] == [bytes(r.payload) for r in requests]
        assert (connector.reused, connector.opened) == (2, 3) and listener.accepted == 3
    await wait_for_no_p2p_tasks()


@async_test
async def test_a_call_on_a_reused_connection_to_a_peer_that_is_gone_fails_typed_and_soon() -> None:
    for streaming in (False, True):
        async with pair() as peers:
            connector, listener = parts(peers)
            await peers.whoami()
            await peers.server_p2p.shutdown()  # its daemon is gone: libp2p cannot reach it either
            listener.stop_accepting()  # and its direct path, just as the next call goes out on it
            started = time.monotonic()
            with pytest.raises(HivemindExtError):
                if streaming:
                    await peers.client.open_stream(peers.peer, "echo_stream", timeout=5)
                else:
                    await peers.client.call(peers.peer, "whoami", Message({}), timeout=5)
            assert time.monotonic() - started < 7
            assert connector.reused == 1 and connector.idle_count() == 0
    await wait_for_no_p2p_tasks()


@async_test
async def test_flush_waits_for_the_write_buffer_to_empty_and_no_longer() -> None:
    accepted: asyncio.Queue[tuple[DirectStream, asyncio.StreamWriter]] = asyncio.Queue()

    async def keep(reader: DirectStream, writer: asyncio.StreamWriter) -> None:
        await accepted.put((reader, writer))

    server = await start_direct_server(keep, "127.0.0.1", 0)
    try:
        reader, writer = await open_direct_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        _, server_writer = await accepted.get()
        stream = FramedStream(DirectStream(), server_writer, Limits())
        assert await stream.flush(now() + 1)  # nothing buffered
        server_writer.write(bytes(64 * MB))  # more than the sockets hold: the caller reads none of it
        started = time.monotonic()
        assert not await stream.flush(now() + 0.3)
        assert 0.25 < time.monotonic() - started < 2
        assert server_writer.transport.get_write_buffer_limits() == (WRITE_BUFFER_LOW, WRITE_BUFFER_HIGH)
        flushing = asyncio.ensure_future(stream.flush(now() + 20))
        received = 0
        while received < 64 * MB:
            received += len(await reader.read(MB))
            assert received > 32 * MB or not flushing.done()  # the kernel's socket buffers hold far less
        assert await asyncio.wait_for(flushing, 5)
        assert server_writer.transport.get_write_buffer_size() == 0
        assert server_writer.transport.get_write_buffer_limits() == (WRITE_BUFFER_LOW, WRITE_BUFFER_HIGH)
        server_writer.transport.abort()
        writer.transport.abort()
    finally:
        server.close()
