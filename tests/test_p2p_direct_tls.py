"""The direct data path's encryption and its binding to libp2p identities, against real daemons on 127.0.0.1.

On-path attackers sit in a TCP proxy (tests/tcp_proxy.py) between the caller and the server's
direct port; callers with another identity's ticket, or a server with another certificate, are
made with the connector's own seam (the ``ticket_call`` it fetches tickets with).
"""

from __future__ import annotations

import os

import pytest
from allreduce_swarm import Swarm, check_round, config, group_of, make_tensors, run_round
from tcp_proxy import TcpProxy
from test_p2p import async_test
from test_p2p_direct import ALLOW_PLAINTEXT, LIMITS, MB, NAMESPACE, PLAINTEXT_DIRECT, pair

from hivemind_ext.errors import AuthenticationError, ConfigurationError, HivemindExtError, ProtocolError
from hivemind_ext.p2p import DirectClientConfig, DirectConfig, Message, RPCClient
from hivemind_ext.p2p.direct_address import choose_direct_address
from hivemind_ext.p2p.direct_client import DirectConnector
from hivemind_ext.p2p.direct_settings import DirectSettings
from hivemind_ext.p2p.direct_tls import DirectIdentity, ServerContexts, check_certificate
from hivemind_ext.p2p.direct_transport import start_direct_server
from hivemind_ext.p2p.direct_wire import TICKET_HANDLER, parse_ticket_response, ticket_request, ticket_response

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
    """(A TLS server with a caller that allows plaintext: TLS, see the test above.)"""
    async with pair(PLAINTEXT_DIRECT) as peers:  # a default caller refuses a plaintext server
        assert (await peers.whoami()).header["transport"] == "libp2p"
        assert isinstance(peers.client.direct.last_failure(peers.peer), ProtocolError)
        opted_in = RPCClient(
            peers.client_p2p, NAMESPACE, limits=LIMITS, prefer_direct=True, direct_config=ALLOW_PLAINTEXT
        )
        response = await opted_in.call(peers.peer, "whoami", Message({}, b"x"), timeout=10)
        assert response.header["transport"] == "direct-plaintext"


@async_test
async def test_another_identitys_ticket_is_rejected_and_the_server_keeps_serving() -> None:
    async with pair() as peers:
        stolen = await peers.ticket()  # issued for the honest caller's certificate

        async def steal_only(peer, request, deadline):  # never registers its own certificate
            return Message(ticket_response(stolen.host, stolen.port, stolen.ttl, stolen.tokens[:1], stolen.cert))

        async def register_then_steal(peer, request, deadline):  # a valid ticket call of its own, then the stolen token
            await peers.client.call(peer, TICKET_HANDLER, request, deadline=deadline)
            return Message(ticket_response(stolen.host, stolen.port, stolen.ttl, stolen.tokens[1:], stolen.cert))

        for seam in (steal_only, register_then_steal):
            thief = DirectConnector(seam, DirectClientConfig(connect_timeout=2))
            assert thief.identity.fingerprint != peers.client.direct.identity.fingerprint
            assert await thief.connect(peers.peer, "whoami", deadline=_in(5)) is None
            assert isinstance(thief.last_failure(peers.peer), AuthenticationError)
        assert peers.server.direct_refusals == 1  # the second thief got past TLS and was refused at its hello
        assert (await peers.whoami()).header["transport"] == "direct"


@async_test
async def test_a_server_presenting_another_certificate_is_refused() -> None:
    async with pair() as peers:
        impostor_contexts = ServerContexts(DirectIdentity.generate(), capacity=4)
        impostor = await start_direct_server(_hang_up, "127.0.0.1", 0, tls=impostor_contexts.listening)
        try:

            async def redirected(peer, request, deadline):  # the real ticket, pointing at the impostor
                impostor_contexts.expect(request.header["cert"])  # it even accepts the caller's certificate
                real = parse_ticket_response((await peers.client.call(peer, TICKET_HANDLER, request)).header)
                port = impostor.sockets[0].getsockname()[1]
                return Message(ticket_response(real.host, port, real.ttl, real.tokens, real.cert))

            caller = DirectConnector(redirected, DirectClientConfig(connect_timeout=2))
            assert await caller.connect(peers.peer, "whoami", deadline=_in(5)) is None
            assert isinstance(caller.last_failure(peers.peer), AuthenticationError)
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
async def test_malformed_certificates_in_tickets_are_refused() -> None:
    async with pair() as peers:
        for bad in (b"", os.urandom(300), os.urandom(5000), "text"):
            request = Message({"count": 1, "cert": bad})
            response = await peers.client.call(peers.peer, TICKET_HANDLER, request, timeout=5)
            assert "error" in response.header
            with pytest.raises(ProtocolError):
                parse_ticket_response(response.header)
        no_cert = await peers.client.call(peers.peer, TICKET_HANDLER, Message({"count": 1}), timeout=5)
        assert "error" in no_cert.header  # a TLS server needs the caller's certificate
        good = ticket_request(1, DirectIdentity.generate().cert_der)
        assert "error" not in (await peers.client.call(peers.peer, TICKET_HANDLER, Message(good), timeout=5)).header
    with pytest.raises(ProtocolError):
        check_certificate(os.urandom(100))


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
    assert DirectSettings.for_second_listener(given) == DirectConfig(host="127.0.0.1")
    assert not DirectSettings.of(False).enabled and not DirectSettings.of(None).enabled
    for bad in (dict(direct_data_path="localhost"), dict(direct_data_path=5), dict(direct_data_path=True, plaintext=1)):
        with pytest.raises(ConfigurationError):
            DirectSettings.of(**bad)
