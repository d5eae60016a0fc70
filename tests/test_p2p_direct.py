"""The direct data path (encrypted by default, plaintext opted into; authenticated through libp2p)
against real daemons on 127.0.0.1.

Hostile callers of the token protocol are simulated by opening raw TCP connections to a plaintext
server's direct port and writing bytes by hand (tests/test_p2p_direct_records.py covers the
encryption: session keys, stolen tokens, false servers, tampering); fallbacks by servers without
the direct path, with their port closed, or with a listener that never answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections.abc import AsyncIterator

import pytest
from hivemind.p2p import P2P, PeerID
from test_p2p import async_test, wait_for_no_p2p_tasks

from hivemind_ext.errors import ConfigurationError, DeadlineExceededError, ProtocolError
from hivemind_ext.p2p import (
    DirectClientConfig,
    DirectConfig,
    HandlerConfig,
    Limits,
    Message,
    RPCClient,
    RPCContext,
    RPCServer,
)
from hivemind_ext.p2p.direct_server import TicketBook, TicketHolder
from hivemind_ext.p2p.direct_transport import DirectStream, open_direct_connection, start_direct_server
from hivemind_ext.p2p.direct_wire import (
    ACCEPTED,
    HELLO,
    HELLO_MAGIC,
    REJECTED,
    TICKET_HANDLER,
    Ticket,
    encode_handler_name,
    encode_hello,
    parse_ticket_response,
    ticket_request,
)

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
NAMESPACE = "direct_test"
MB = 1024 * 1024
LIMITS = Limits(max_payload_bytes=16 * MB)
LOOPBACK_DIRECT = DirectConfig(host="127.0.0.1")
PLAINTEXT_DIRECT = DirectConfig(host="127.0.0.1", plaintext=True)
ALLOW_PLAINTEXT = DirectClientConfig(allow_plaintext=True)


async def whoami(request: Message, context: RPCContext) -> Message:
    return Message({"peer": context.peer_id.to_base58(), "transport": context.transport}, request.payload)


async def sleepy(request: Message, context: RPCContext) -> Message:
    await asyncio.sleep(60)
    return Message({})


async def echo_stream(requests: AsyncIterator[Message], context: RPCContext) -> AsyncIterator[Message]:
    async for request in requests:
        yield Message({"transport": context.transport}, request.payload)


@dataclasses.dataclass
class Pair:
    server_p2p: P2P
    client_p2p: P2P
    server: RPCServer
    client: RPCClient

    @property
    def peer(self) -> PeerID:
        return self.server_p2p.peer_id

    async def whoami(self, payload: bytes = b"hi", timeout: float = 10) -> Message:
        response = await self.client.call(self.peer, "whoami", Message({}, payload), timeout=timeout)
        assert response.header["peer"] == self.client_p2p.peer_id.to_base58()
        assert bytes(response.payload) == payload
        return response

    async def ticket(self) -> Ticket:
        assert self.client.direct is not None
        request = Message(ticket_request(2))
        response = await self.client.call(self.peer, TICKET_HANDLER, request, timeout=5)
        return parse_ticket_response(response.header)


@contextlib.asynccontextmanager
async def pair(
    direct: DirectConfig | None = LOOPBACK_DIRECT,
    client_config: DirectClientConfig | None = None,
    prefer_direct: bool = True,
) -> AsyncIterator[Pair]:
    server_p2p = await P2P.create(host_maddrs=LOOPBACK)
    client_p2p = await P2P.create(host_maddrs=LOOPBACK, initial_peers=await server_p2p.get_visible_maddrs())
    server = RPCServer(server_p2p, NAMESPACE, config=HandlerConfig(limits=LIMITS))
    try:
        await server.add_unary("whoami", whoami)
        await server.add_unary("sleepy", sleepy)
        await server.add_stream("echo_stream", echo_stream)
        if direct is not None:
            await server.enable_direct(direct)
        client = RPCClient(
            client_p2p, NAMESPACE, limits=LIMITS, prefer_direct=prefer_direct, direct_config=client_config
        )
        yield Pair(server_p2p, client_p2p, server, client)
    finally:
        await server.shutdown()
        await client_p2p.shutdown()
        await server_p2p.shutdown()


def hello(token: bytes, handler: str) -> bytes:
    """A plaintext connection's hello: the token, then the handler name in clear."""
    return encode_hello(token) + encode_handler_name(handler)


async def raw_hello(port: int, data: bytes, read_timeout: float = 5.0) -> bytes:
    """Sends ``data`` on a fresh TCP connection; returns what the server answered before closing."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        return await asyncio.wait_for(reader.read(), read_timeout)
    finally:
        writer.close()


# ----- the happy path


@async_test
async def test_direct_unary_call_sees_the_libp2p_peer_id() -> None:
    async with pair() as peers:
        response = await peers.whoami(os.urandom(3 * MB))
        assert response.header["transport"] == "direct"
        assert peers.client.direct is not None and not peers.client.direct.is_failing(peers.peer)
        for _ in range(10):  # more calls than tokens per ticket: tickets are refilled
            assert (await peers.whoami()).header["transport"] == "direct"


@async_test
async def test_direct_streaming_call_carries_large_frames_both_ways() -> None:
    async with pair() as peers:
        payloads = [os.urandom(size) for size in (0, 1, 5 * MB, 70_000, 8 * MB)]
        requests = [Message({"i": i}, data) for i, data in enumerate(payloads)]
        async with peers.client.stream(peers.peer, "echo_stream", requests, timeout=30) as responses:
            received = [response async for response in responses]
        assert [bytes(r.payload) for r in received] == payloads
        assert {r.header["transport"] for r in received} == {"direct"}


@async_test
async def test_without_prefer_direct_calls_use_libp2p() -> None:
    async with pair(prefer_direct=False) as peers:
        assert (await peers.whoami()).header["transport"] == "libp2p"


# ----- tokens


@async_test
async def test_wrong_reused_and_expired_tokens_are_rejected_and_the_server_keeps_serving() -> None:
    async with pair(DirectConfig(host="127.0.0.1", token_ttl=0.5, plaintext=True), ALLOW_PLAINTEXT) as peers:
        ticket = await peers.ticket()
        port, tokens = ticket.port, ticket.tokens
        assert await raw_hello(port, hello(os.urandom(32), "whoami")) == REJECTED  # never issued
        assert (await raw_hello(port, hello(tokens[0], "no_such_handler")))[:1] == REJECTED
        assert await raw_hello(port, hello(tokens[0], "whoami")) == REJECTED  # consumed above
        assert (await raw_hello(port, hello(tokens[1], TICKET_HANDLER)))[:1] == REJECTED
        fresh = (await peers.ticket()).tokens
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(hello(fresh[0], "whoami"))
        assert await reader.readexactly(1) == ACCEPTED
        writer.close()
        assert await raw_hello(port, hello(fresh[0], "whoami")) == REJECTED  # reused
        await asyncio.sleep(0.7)
        assert await raw_hello(port, hello(fresh[1], "whoami")) == REJECTED  # expired
        # the client's cached tickets are void too: it falls back, then the call still succeeds
        assert (await peers.whoami()).header["peer"] == peers.client_p2p.peer_id.to_base58()


def test_ticket_book_issues_redeems_once_and_expires() -> None:
    book = TicketBook(DirectConfig(host="127.0.0.1", token_ttl=10, max_tokens_per_peer=3, max_tokens=5))
    alice, bob = PeerID(b"alice-peer-id"), PeerID(b"bob-peer-id")
    tokens, keys = book.issue(alice, 2, now=0.0)
    assert len(set(tokens)) == 2 and all(len(token) == 32 for token in tokens)
    assert len(set(keys)) == 2 and all(len(key) == 16 for key in keys)  # a fresh session key per token
    assert book.redeem(tokens[0], now=1.0) == TicketHolder(alice, keys[0])
    assert book.redeem(tokens[0], now=1.0) is None  # one-time
    assert book.redeem(tokens[1], now=10.0) is None  # expired
    assert book.redeem(os.urandom(32), now=1.0) is None
    many, _ = book.issue(alice, 5, now=20.0)  # per-peer cap: only the newest 3 survive
    assert [book.redeem(token, now=21.0) for token in many[:2]] == [None, None]
    assert len(book) == 3
    book.issue(bob, 3, now=22.0)  # global cap of 5: alice's oldest go first
    assert len(book) == 5 and book.redeem(many[2], now=23.0) is None
    book.expire(now=100.0)
    assert len(book) == 0
    plaintext = TicketBook(DirectConfig(host="127.0.0.1", plaintext=True))
    tokens, keys = plaintext.issue(alice, 1, now=0.0)
    assert keys is None and plaintext.redeem(tokens[0], now=1.0) == TicketHolder(alice, None)


def test_direct_config_is_validated() -> None:
    for bad in (
        dict(host="localhost"),
        dict(host="0.0.0.0"),  # wildcard without an address to advertise
        dict(host="127.0.0.1", port=70000),
        dict(host="127.0.0.1", token_ttl=0),
        dict(host="127.0.0.1", max_pending_hellos=0),
    ):
        with pytest.raises(ConfigurationError):
            DirectConfig(**bad)
    assert DirectConfig(host="0.0.0.0", advertise_host="127.0.0.1").advertised_host == "127.0.0.1"
    with pytest.raises(ConfigurationError):
        DirectClientConfig(tokens_per_ticket=0)


@async_test
async def test_ticket_handler_name_is_reserved_and_requests_are_validated() -> None:
    async with pair() as peers:
        with pytest.raises(ConfigurationError):
            await peers.server.add_unary(TICKET_HANDLER, whoami)
        with pytest.raises(ConfigurationError):
            await peers.server.enable_direct(DirectConfig(host="127.0.0.1"))
        response = await peers.client.call(peers.peer, TICKET_HANDLER, Message({"count": 10_000}), timeout=5)
        with pytest.raises(ProtocolError):
            parse_ticket_response(response.header)


# ----- fallbacks


@async_test
async def test_server_without_direct_path_falls_back_to_libp2p() -> None:
    async with pair(direct=None) as peers:
        started = time.monotonic()
        assert (await peers.whoami()).header["transport"] == "libp2p"
        assert peers.client.direct is not None and peers.client.direct.is_failing(peers.peer)
        assert (await peers.whoami()).header["transport"] == "libp2p"  # not retried at every call
        assert time.monotonic() - started < 5


@async_test
async def test_closed_direct_port_falls_back_to_libp2p() -> None:
    async with pair() as peers:
        assert (await peers.whoami()).header["transport"] == "direct"
        peers.server.direct_listener.stop_accepting()  # the port is closed; the client still holds tickets
        await asyncio.sleep(0.05)
        assert (await peers.whoami()).header["transport"] == "libp2p"
        assert peers.client.direct.is_failing(peers.peer)


@async_test
async def test_silent_direct_listener_falls_back_within_the_connect_timeout() -> None:
    async with pair(client_config=DirectClientConfig(connect_timeout=0.5)) as peers:
        _, port = peers.server.direct_address
        peers.server.direct_listener.stop_accepting()
        held: list[asyncio.StreamWriter] = []

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            held.append(writer)  # accepts, reads nothing, answers nothing

        impostor = await asyncio.start_server(silent, "127.0.0.1", port, reuse_address=True)
        try:
            started = time.monotonic()
            assert (await peers.whoami()).header["transport"] == "libp2p"
            assert time.monotonic() - started < 3
        finally:
            impostor.close()
            for writer in held:
                writer.transport.abort()


# ----- hostile input and deadlines


@async_test
async def test_garbage_and_idle_connections_do_not_crash_or_hang_the_server() -> None:
    async with pair(DirectConfig(host="127.0.0.1", hello_timeout=0.5, plaintext=True), ALLOW_PLAINTEXT) as peers:
        _, port = peers.server.direct_address
        assert await raw_hello(port, os.urandom(4096)) in (b"", REJECTED)  # bad magic: dropped
        assert await raw_hello(port, HELLO_MAGIC + os.urandom(32) + b"\xff\xff" + b"x" * 100) in (b"", REJECTED)
        assert await raw_hello(port, b"") == b""  # connects, says nothing: dropped at hello_timeout
        assert await raw_hello(port, HELLO.pack(HELLO_MAGIC, os.urandom(32))[:20]) == b""
        tokens = (await peers.ticket()).tokens
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(hello(tokens[0], "whoami") + os.urandom(1000))  # accepted, then garbage frames
        assert await reader.readexactly(1) == ACCEPTED
        tail = await asyncio.wait_for(reader.read(), 15)  # an ERROR frame at most, then closed
        assert len(tail) < 1000
        writer.close()
        assert (await peers.whoami()).header["transport"] == "direct-plaintext"
    await wait_for_no_p2p_tasks()


@async_test
async def test_direct_call_deadline_holds() -> None:
    async with pair() as peers:
        await peers.whoami()
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            await peers.client.call(peers.peer, "sleepy", Message({}), timeout=0.5)
        assert time.monotonic() - started < 2


@async_test
async def test_shutdown_with_direct_calls_in_progress_leaves_no_tasks() -> None:
    async with pair() as peers:
        await peers.whoami()
        call = asyncio.ensure_future(peers.client.call(peers.peer, "sleepy", Message({}), timeout=30))
        await asyncio.sleep(0.3)
        await peers.server.shutdown()
        with pytest.raises(Exception):  # noqa: B017 - the server went away: unreachable or closed
            await asyncio.wait_for(call, 5)
    await wait_for_no_p2p_tasks()


# ----- the direct transport itself


@async_test
async def test_direct_stream_fills_payloads_in_place_and_reports_a_cut_short_stream() -> None:
    received: asyncio.Queue[object] = asyncio.Queue()

    async def on_connection(reader: DirectStream, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readexactly(4)
            first = bytearray(3 * MB)  # arrives partly before the wait starts, partly during it
            await reader.readexactly_into(memoryview(first))
            await received.put((head, bytes(first)))
            second = bytearray(2 * MB)  # the peer closes half-way through
            await reader.readexactly_into(memoryview(second))
            await received.put("not reached")
        except asyncio.IncompleteReadError as e:
            await received.put(e)
        finally:
            writer.close()

    server = await start_direct_server(on_connection, "127.0.0.1", 0)
    try:
        reader, writer = await open_direct_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        payload = os.urandom(3 * MB)
        writer.write(b"head" + payload[:1000])
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(payload[1000:] + b"x" * MB)
        await writer.drain()
        writer.close()
        assert await asyncio.wait_for(received.get(), 10) == (b"head", payload)
        assert isinstance(await asyncio.wait_for(received.get(), 10), asyncio.IncompleteReadError)
        assert await asyncio.wait_for(reader.read(10), 5) == b""  # the server closed its side too
    finally:
        server.close()
