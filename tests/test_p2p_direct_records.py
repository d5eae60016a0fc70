"""The direct data path's encryption (AEAD records) and its binding to libp2p identities.

Against real daemons on 127.0.0.1: on-path attackers sit in a TCP proxy (tests/tcp_proxy.py)
between the caller and the server's direct port; callers holding another identity's token, and
servers without the token's key, are made with the connector's own seam (the ``ticket_call`` it
fetches tickets with). The record layer itself is tested over a loopback TCP connection whose
one end writes records (well-formed or hostile) by hand.
"""

from __future__ import annotations

import asyncio
import os
import tracemalloc

import pytest
from allreduce_swarm import Swarm, check_round, config, group_of, make_tensors, run_round
from tcp_proxy import TcpProxy
from test_p2p import async_test
from test_p2p_direct import ALLOW_PLAINTEXT, LIMITS, MB, NAMESPACE, PLAINTEXT_DIRECT, pair

from hivemind_ext.errors import (
    AuthenticationError,
    ConfigurationError,
    HivemindExtError,
    ProtocolError,
)
from hivemind_ext.p2p import DirectClientConfig, DirectConfig, Message, RPCClient, RPCContext
from hivemind_ext.p2p.direct_address import choose_direct_address
from hivemind_ext.p2p.direct_client import DirectConnector
from hivemind_ext.p2p.direct_records import (
    CALLER,
    FREE_RECORD_BUFFERS,
    KEY_BYTES,
    LENGTH,
    MAX_RECORD_BYTES,
    SERVER,
    RecordOpener,
    RecordSealer,
    new_session_key,
)
from hivemind_ext.p2p.direct_settings import DirectSettings
from hivemind_ext.p2p.direct_transport import DirectStream, open_direct_connection, seal, start_direct_server
from hivemind_ext.p2p.direct_wire import (
    ACCEPTED,
    REJECTED,
    TICKET_HANDLER,
    encode_handler_name,
    encode_hello,
    parse_ticket_response,
    read_hello,
    ticket_response,
)

pytestmark = pytest.mark.timeout(60)


def recognizable(size: int) -> bytes:
    return (b"hivemind_ext plaintext marker " * (size // 30 + 1))[:size]


@async_test
async def test_direct_calls_are_encrypted_and_plaintext_shows_on_the_wire() -> None:
    payload = recognizable(MB)
    for plaintext in (False, True):
        proxy = await TcpProxy(record=True).start()
        config = DirectConfig(host="127.0.0.1", advertise_port=proxy.port, plaintext=plaintext)
        try:
            async with pair(config, ALLOW_PLAINTEXT) as peers:
                proxy.target_port = peers.server.direct_listener.port
                response = await peers.whoami(payload)
                assert response.header["transport"] == ("direct-plaintext" if plaintext else "direct")
                assert len(proxy.captured) > len(payload)  # the call did cross the proxy
                assert (payload[:64] in proxy.captured) is plaintext
        finally:
            await proxy.close()


@async_test
async def test_plaintext_is_used_only_when_both_sides_opt_in() -> None:
    """(An encrypted server with a caller that allows plaintext: encrypted, see the test above.)"""
    async with pair(PLAINTEXT_DIRECT) as peers:  # a default caller refuses a plaintext server
        assert (await peers.whoami()).header["transport"] == "libp2p"
        assert isinstance(peers.client.direct.last_failure(peers.peer), ProtocolError)
        opted_in = RPCClient(
            peers.client_p2p, NAMESPACE, limits=LIMITS, prefer_direct=True, direct_config=ALLOW_PLAINTEXT
        )
        response = await opted_in.call(peers.peer, "whoami", Message({}, b"x"), timeout=10)
        assert response.header["transport"] == "direct-plaintext"


@async_test
async def test_another_identitys_token_is_refused_without_its_key_and_the_server_keeps_serving() -> None:
    async with pair() as peers:
        stolen = await peers.ticket()  # tokens (and keys) issued to the honest caller's PeerID

        async def steal_only(peer, request, deadline):  # the tokens seen on the wire, keys guessed
            guessed = [new_session_key() for _ in stolen.tokens[:1]]
            return Message(ticket_response(stolen.host, stolen.port, stolen.ttl, stolen.tokens[:1], guessed))

        async def register_then_steal(peer, request, deadline):  # its own valid keys, another's token
            own = parse_ticket_response((await peers.client.call(peer, TICKET_HANDLER, request)).header)
            return Message(ticket_response(stolen.host, stolen.port, stolen.ttl, stolen.tokens[1:], own.keys[:1]))

        for seam in (steal_only, register_then_steal):
            thief = DirectConnector(seam, DirectClientConfig(connect_timeout=2))
            assert await thief.connect(peers.peer, "whoami", deadline=_in(5)) is None
            assert isinstance(thief.last_failure(peers.peer), AuthenticationError)
        assert peers.server.direct_refusals == 2  # each thief's first record failed to authenticate
        assert (await peers.whoami()).header["transport"] == "direct"


async def _false_server(answer: bytes) -> asyncio.AbstractServer:
    """A server that reads a hello, then sends ``answer`` and hangs up: it has no token's key."""

    async def serve(reader: DirectStream, writer: asyncio.StreamWriter) -> None:
        try:
            await read_hello(reader, _in(5))
            writer.write(answer)
            await writer.drain()
        finally:
            writer.close()

    return await start_direct_server(serve, "127.0.0.1", 0)


@async_test
async def test_a_server_without_the_key_cannot_answer_and_the_caller_detects_it() -> None:
    async with pair() as peers:
        sealed_elsewhere = RecordSealer(new_session_key(), SERVER).seal(ACCEPTED)  # another key
        for answer, error in ((sealed_elsewhere, AuthenticationError), (ACCEPTED, ProtocolError)):
            impostor = await _false_server(answer)
            impostor_port = impostor.sockets[0].getsockname()[1]
            try:

                async def redirected(peer, request, deadline, port=impostor_port):
                    # the real ticket (with its keys), pointing at the impostor
                    real = parse_ticket_response((await peers.client.call(peer, TICKET_HANDLER, request)).header)
                    return Message(ticket_response(real.host, port, real.ttl, real.tokens, real.keys))

                caller = DirectConnector(redirected, DirectClientConfig(connect_timeout=2))
                assert await caller.connect(peers.peer, "whoami", deadline=_in(5)) is None
                assert isinstance(caller.last_failure(peers.peer), error)
            finally:
                impostor.close()


@async_test
async def test_tampered_ciphertext_fails_that_call_with_a_typed_error_only() -> None:
    proxy = await TcpProxy(flip_at=200_000).start()
    try:
        config = DirectConfig(host="127.0.0.1", advertise_port=proxy.port)
        async with pair(config) as peers:
            proxy.target_port = peers.server.direct_listener.port
            with pytest.raises(HivemindExtError):
                await peers.client.call(peers.peer, "whoami", Message({}, os.urandom(MB)), timeout=10)
            assert proxy.flipped == 1
            assert (await peers.whoami(os.urandom(1000))).header["transport"] == "direct"  # short: not altered
    finally:
        await proxy.close()


def test_a_tampered_connection_excludes_that_owner_only_and_the_round_completes() -> None:
    """Every connection to peer 2's direct port is altered in flight: peers 0 and 1 exclude it and
    keep their own values on its part, and every part holds the exact mean of what arrived."""
    swarm = Swarm(2, direct=DirectConfig(host="127.0.0.1"))
    proxy = swarm.run(TcpProxy(flip_at=40_000).start())
    try:
        tampered = swarm.run(swarm.new_peer(DirectConfig(host="127.0.0.1", advertise_port=proxy.port)))
        proxy.target_port = tampered.server.direct_listener.port
        peers = [*swarm.peers, tampered]
        inputs = [make_tensors([(64 * 1024,)], seed) for seed in range(3)]
        group = group_of([p.member() for p in peers])
        outcomes = swarm.run(run_round(peers, group, inputs, config=config(next_chunk_timeout=5.0)))
        check_round(peers, inputs, [1.0] * 3, outcomes, honest=[0, 1, 2])
        assert proxy.flipped >= 1
        for me in (0, 1):
            result = outcomes[me].result
            assert tampered.peer_id in result.excluded
            averaged = {part.owner: set(part.contributors) for part in result.parts if part.averaged}
            assert tampered.peer_id not in averaged  # its part could not be averaged: the connection broke
            assert averaged[peers[0].peer_id] >= {peers[0].peer_id, peers[1].peer_id}
            assert averaged[peers[1].peer_id] >= {peers[0].peer_id, peers[1].peer_id}
    finally:
        swarm.run(proxy.close())
        swarm.close()


@async_test
async def test_malformed_ticket_keys_are_refused() -> None:
    async with pair() as peers:
        good = await peers.ticket()
        assert good.keys is not None and len(good.keys) == len(good.tokens) == 2
        for keys in (good.keys[:1], [b"k" * 15, b"k" * 15], [b"k" * 24, b"k" * 24], ["text", "text"], b"k" * 64):
            with pytest.raises(ProtocolError):
                parse_ticket_response(ticket_response(good.host, good.port, good.ttl, good.tokens, keys))
        for bad in ({"count": 0}, {"count": 17}, {"count": "1"}, {}):
            response = await peers.client.call(peers.peer, TICKET_HANDLER, Message(bad), timeout=5)
            assert "error" in response.header


async def _hello_answer(host: str, port: int, token: bytes, key: bytes, handler: str) -> bytes:
    """The server's answer to a caller presenting ``token`` (sealed with ``key``) for ``handler``."""
    reader, writer = await open_direct_connection(host, port)
    try:
        writer.write(encode_hello(token))
        reader, writer = seal(reader, writer, key, CALLER)
        writer.write(encode_handler_name(handler))
        return await asyncio.wait_for(reader.readexactly(1), 5)
    finally:
        writer.transport.abort()


@async_test
async def test_servers_sharing_one_listener_open_only_their_own_handlers() -> None:
    async def here(request: Message, context: RPCContext) -> Message:
        return Message({"transport": context.transport})

    async with pair() as peers:
        other = peers.server.scope(f"{NAMESPACE}_other")
        await other.add_unary("only_here", here)
        assert await other.share_direct(peers.server) == peers.server.direct_address
        client = RPCClient(peers.client_p2p, other.namespace, limits=LIMITS, prefer_direct=True)
        assert (await client.call(peers.peer, "only_here", Message({}), timeout=10)).header["transport"] == "direct"
        assert (await peers.whoami()).header["transport"] == "direct"
        host, port = peers.server.direct_address
        for namespace, foreign in ((other.namespace, "whoami"), (NAMESPACE, "only_here")):
            caller = RPCClient(peers.client_p2p, namespace, limits=LIMITS)
            response = await caller.call(peers.peer, TICKET_HANDLER, Message({"count": 1}), timeout=5)
            ticket = parse_ticket_response(response.header)
            assert ticket.port == port and ticket.keys is not None
            # a token opens its own namespace's handlers only, though the port is the same
            assert await _hello_answer(host, port, ticket.tokens[0], ticket.keys[0], foreign) == REJECTED
        with pytest.raises(ConfigurationError):
            await other.share_direct(peers.server)  # once
        with pytest.raises(ConfigurationError):
            await peers.server.scope(f"{NAMESPACE}_third").share_direct(other)  # only a listener's owner shares it
        await other.shutdown()
        assert (await peers.whoami()).header["transport"] == "direct"  # the owner keeps its port


# ----- the record layer over one loopback TCP connection, with a hand-written caller side


class Sealed:
    """A loopback connection: the server end reads records sealed with ``key``; the test writes raw bytes."""

    def __init__(self) -> None:
        self.key = new_session_key()
        self.sealer = RecordSealer(self.key, CALLER)

    async def __aenter__(self) -> Sealed:
        accepted: asyncio.Future[DirectStream] = asyncio.get_running_loop().create_future()

        async def on_connection(reader: DirectStream, writer: asyncio.StreamWriter) -> None:
            reader, self.server_writer = seal(reader, writer, self.key, SERVER)  # kept: a dropped writer closes
            accepted.set_result(reader)

        self.server = await start_direct_server(on_connection, "127.0.0.1", 0)
        self.client_reader, self.writer = await open_direct_connection(
            "127.0.0.1", self.server.sockets[0].getsockname()[1]
        )
        self.reader = await asyncio.wait_for(accepted, 5)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.writer.transport.abort()
        self.server_writer.transport.abort()
        self.server.close()


@async_test
async def test_records_carry_bytes_exactly_across_record_and_read_boundaries() -> None:
    data = os.urandom(2 * MAX_RECORD_BYTES + 12345)
    async with Sealed() as connection:
        for piece in (data[:10], data[10 : MAX_RECORD_BYTES + 7], data[MAX_RECORD_BYTES + 7 :]):
            for start in range(0, len(piece), MAX_RECORD_BYTES):
                connection.writer.write(connection.sealer.seal(piece[start : start + MAX_RECORD_BYTES]))
        received = bytearray(len(data))
        received[:3] = await asyncio.wait_for(connection.reader.readexactly(3), 5)
        with memoryview(received) as view:  # reads that start and end inside records
            await asyncio.wait_for(connection.reader.readexactly_into(view[3 : 3 + MAX_RECORD_BYTES]), 5)
            await asyncio.wait_for(connection.reader.readexactly_into(view[3 + MAX_RECORD_BYTES :]), 5)
        assert received == data


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_reused_send_buffers_never_alter_records_still_queued(loop: str) -> None:
    # The sealing writer reuses its record buffers once the transport has sent them; records written
    # faster than the reader takes them stay queued (uvloop queues the buffers themselves) and must
    # leave unchanged.
    import uvloop

    (uvloop.run if loop == "uvloop" else asyncio.run)(_reused_send_buffers())


async def _reused_send_buffers() -> None:
    chunks = [os.urandom(MAX_RECORD_BYTES - i) for i in range(24)]
    async with Sealed() as connection:
        _, writer = seal(connection.client_reader, connection.writer, connection.key, CALLER)

        for chunk in chunks:  # more than the kernel's socket buffers hold: most records wait in the transport
            writer.write(chunk)
        assert writer.transport.get_write_buffer_size() > 4 * MAX_RECORD_BYTES
        received = bytearray(sum(map(len, chunks)))
        await asyncio.wait_for(connection.reader.readexactly_into(memoryview(received)), 20)
        await asyncio.wait_for(writer.drain(), 5)
        for chunk in chunks[:3]:  # reusing the now idle buffers
            writer.write(chunk)
        again = await asyncio.wait_for(connection.reader.readexactly(3 * len(chunks[0]) - 3), 20)
        assert received == b"".join(chunks) and again == b"".join(chunks[:3])


@async_test
async def test_a_closed_connections_sent_buffers_seal_the_next_connections_records() -> None:
    # Every all-reduce round opens new connections: record buffers are shared by the process's
    # connections, so that a new connection does not pay for fresh megabytes; only buffers the
    # transport has sent are reused, and what a reused buffer carries arrives intact.
    chunks = [os.urandom(MAX_RECORD_BYTES - i) for i in range(6)]
    for connection_index in range(2):
        async with Sealed() as connection:
            _, writer = seal(connection.client_reader, connection.writer, connection.key, CALLER)
            pooled = len(FREE_RECORD_BUFFERS)
            for chunk in chunks:
                writer.write(chunk)
                if connection_index == 1 and chunk is chunks[0]:  # sealed into a buffer of the last connection
                    assert pooled >= 1 and len(FREE_RECORD_BUFFERS) == pooled - 1
            received = await asyncio.wait_for(connection.reader.readexactly(sum(map(len, chunks))), 20)
            assert received == b"".join(chunks)
            await asyncio.wait_for(writer.drain(), 5)
            assert writer.transport.get_write_buffer_size() == 0
            writer.close()  # everything was sent: every buffer goes back
            assert 1 <= len(FREE_RECORD_BUFFERS) <= FREE_RECORD_BUFFERS.max_buffers


def _length(value: int) -> bytes:
    return LENGTH.pack(value)


async def _fails_with(connection: Sealed, raw: bytes, error: type[HivemindExtError], close: bool = False) -> None:
    connection.writer.write(raw)
    if close:
        connection.writer.write_eof()
    with pytest.raises(error):
        await asyncio.wait_for(connection.reader.readexactly(64 * 1024), 5)


@async_test
async def test_hostile_records_are_typed_errors() -> None:
    first = RecordSealer(new_session_key(), CALLER)
    cases = {
        "too short for a tag": (_length(15) + bytes(15), ProtocolError, False),
        "oversized": (_length(MAX_RECORD_BYTES + 17) + bytes(64), ProtocolError, False),
        "largest u32": (_length(2**32 - 1), ProtocolError, False),
        "truncated": (bytes(first.seal(os.urandom(1000)))[:500], ProtocolError, True),
        "garbage": (_length(1000) + os.urandom(1000), AuthenticationError, False),
    }
    for name, (raw, error, close) in cases.items():
        async with Sealed() as connection:
            tracemalloc.start()
            try:
                await _fails_with(connection, raw, error, close)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert peak < MAX_RECORD_BYTES // 2, name  # refused before a record buffer is allocated for it


def test_session_keys_are_aes_128_and_aes_256_keys_of_older_peers_still_open_records() -> None:
    assert len(new_session_key()) == KEY_BYTES == 16
    for key in (new_session_key(), os.urandom(32)):  # ours; an older peer's AES-256 key
        record = bytes(RecordSealer(key, CALLER).seal(b"payload" * 1000))
        opener = RecordOpener(key, CALLER)
        opener.buffer()[: len(record)] = record
        opener.received(len(record))
        size = opener.next_record()
        assert size == 7000 and bytes(opener.open(size)) == b"payload" * 1000
    for size in (0, 15, 24, 33):  # AES-192 is valid for AES-GCM, but no peer of ours issues it
        with pytest.raises(ProtocolError):
            RecordSealer(b"k" * size, CALLER)


@async_test
async def test_altered_replayed_reordered_and_reflected_records_fail_to_authenticate() -> None:
    for attack in ("flip", "replay", "reorder", "reflect", "other key"):
        async with Sealed() as connection:
            sealer = connection.sealer
            records = [bytes(sealer.seal(os.urandom(100_000))) for _ in range(2)]
            if attack == "flip":
                altered = bytearray(records[0])
                altered[-1] ^= 1  # the tag
                raw = bytes(altered)
            elif attack == "replay":
                raw = records[0] + records[0]
            elif attack == "reorder":
                raw = records[1] + records[0]
            elif attack == "reflect":  # the server's own direction, same key
                raw = bytes(RecordSealer(connection.key, SERVER).seal(b"x" * 100))
            else:
                raw = bytes(RecordSealer(new_session_key(), CALLER).seal(b"x" * 100))
            if attack == "replay":  # the first copy is genuine
                connection.writer.write(raw)
                assert len(await asyncio.wait_for(connection.reader.readexactly(100_000), 5)) == 100_000
                with pytest.raises(AuthenticationError):
                    await asyncio.wait_for(connection.reader.readexactly(1), 5)
                continue
            await _fails_with(connection, raw, AuthenticationError)


@async_test
async def test_a_hostile_caller_with_a_valid_key_cannot_hurt_the_server() -> None:
    async with pair(DirectConfig(host="127.0.0.1", hello_timeout=1.0)) as peers:
        ticket = await peers.ticket()
        for token, key, attack in zip(ticket.tokens, ticket.keys, ("oversized", "reflected"), strict=True):
            reader, writer = await open_direct_connection(ticket.host, ticket.port)
            writer.write(encode_hello(token))
            if attack == "oversized":
                writer.write(_length(2**31) + bytes(100))
            else:  # a record sealed as if by the server: refused, no answer
                writer.write(RecordSealer(key, SERVER).seal(encode_handler_name("whoami")))
            assert await asyncio.wait_for(reader.read(1), 5) == b""  # closed without an answer
            writer.close()
        assert peers.server.direct_refusals == 1  # the reflected record; the oversized one is a protocol error
        assert (await peers.whoami(os.urandom(3 * MB))).header["transport"] == "direct"


def test_the_offered_address_follows_host_and_announce_maddrs() -> None:
    wildcard, public = ["/ip4/0.0.0.0/tcp/0"], ["/ip4/203.0.113.7/tcp/31337"]
    seen = ["/ip4/127.0.0.1/tcp/4/p2p/Qm", "/ip4/10.0.0.5/tcp/4/p2p/Qm", "/ip4/93.184.216.34/tcp/4"]
    assert choose_direct_address(wildcard, public, seen) == ("0.0.0.0", "203.0.113.7")  # announced
    assert choose_direct_address(wildcard, [], seen) == ("0.0.0.0", "93.184.216.34")  # public before private
    assert choose_direct_address(wildcard, [], seen[:2]) == ("0.0.0.0", "10.0.0.5")  # private before loopback
    assert choose_direct_address(["/ip4/127.0.0.1/tcp/0"], [], seen) == ("127.0.0.1", "127.0.0.1")
    assert choose_direct_address(["/ip4/10.0.0.5/tcp/0"], ["/ip4/0.0.0.0/tcp/1"], []) == ("10.0.0.5", "10.0.0.5")
    assert choose_direct_address(wildcard, ["/dns4/example.org/tcp/1"], ["/ip4/0.0.0.0/tcp/1"]) is None


async def _hang_up(reader, writer) -> None:
    writer.close()


def _in(seconds: float) -> float:
    import asyncio

    return asyncio.get_running_loop().time() + seconds


def test_the_averager_keywords_become_direct_path_settings() -> None:
    auto = DirectSettings.of(True)
    assert auto.enabled and auto.server is None and not auto.client_config.allow_plaintext
    assert DirectSettings.of("0.0.0.0") == auto  # every interface: the offered address is chosen at start
    fixed = DirectSettings.of("127.0.0.1")  # the keyword's value before the direct path was on by default
    assert fixed.server == DirectConfig(host="127.0.0.1")
    plain = DirectSettings.of("127.0.0.1", plaintext=True)
    assert plain.server.plaintext and plain.client_config.allow_plaintext
    given = DirectConfig(host="127.0.0.1", port=47000, advertise_port=47001)
    assert DirectSettings.of(given).server == given
    assert not DirectSettings.of(False).enabled and not DirectSettings.of(None).enabled
    for bad in (dict(direct_data_path="localhost"), dict(direct_data_path=5), dict(direct_data_path=True, plaintext=1)):
        with pytest.raises(ConfigurationError):
            DirectSettings.of(**bad)
