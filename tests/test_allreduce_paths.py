"""Which path a round's streams take (averaging/allreduce/paths.py): the direct data path, except
where the sender or the owner declared a thin link; real peers on 127.0.0.1 serving the direct path."""

from __future__ import annotations

import asyncio

import pytest
from allreduce_swarm import Swarm, check_round, config, group_of, make_tensors, run_round

from hivemind_ext.averaging.allreduce.paths import DIRECT_PATH_MIN_MBIT, direct_path_pays
from hivemind_ext.averaging.matchmaking.group import Member
from hivemind_ext.p2p import DirectConfig

pytestmark = pytest.mark.timeout(60)


def test_thin_links_take_libp2p_and_unknown_or_fast_links_the_direct_path() -> None:
    thin, fast, unknown = (Member(name, "x", bandwidth) for name, bandwidth in [("a", 100.0), ("b", 1e4), ("c", None)])
    assert direct_path_pays(fast, unknown) and direct_path_pays(unknown, unknown)
    assert not direct_path_pays(thin, fast) and not direct_path_pays(fast, thin) and not direct_path_pays(thin, unknown)
    assert direct_path_pays(Member("d", "x", DIRECT_PATH_MIN_MBIT), fast)


def test_a_round_sends_over_libp2p_exactly_where_a_thin_link_is_declared() -> None:
    swarm = Swarm(3, direct=DirectConfig(host="127.0.0.1"))
    try:
        peers = swarm.peers
        # peer 0 declares a thin link; peer 1 a fast one; peer 2 nothing (its first round)
        members = [peers[0].member(bandwidth=50.0), peers[1].member(bandwidth=1000.0), peers[2].member()]
        inputs = [make_tensors([(3000,)], seed) for seed in range(3)]
        started = swarm.loop.run_until_complete(_now())
        outcomes = swarm.run(run_round(peers, group_of(members), inputs, config=config()))
        check_round(peers, inputs, [1.0] * 3, outcomes, honest=range(3))
        assert all(outcome.result.complete for outcome in outcomes)
        owners = {str(part.owner) for part in outcomes[0].result.parts}  # peer 0's part is empty: still JOINed
        for caller, peer in enumerate(peers):
            paths = peer.service.rpc_client.transports_since(started)
            assert {str(owner) for owner in paths} == owners - {str(peer.peer_id)}  # a stream to each other owner
            for owner, path in paths.items():
                thin = caller == 0 or str(owner) == str(peers[0].peer_id)
                assert path == ("libp2p" if thin else "direct"), (caller, owner, path)
    finally:
        swarm.close()


async def _now() -> float:
    return asyncio.get_running_loop().time()


def test_later_rounds_reuse_the_direct_connections_of_earlier_ones() -> None:
    swarm = Swarm(3, direct=DirectConfig(host="127.0.0.1"))
    try:
        peers = swarm.peers
        for round_index in range(3):
            members = [peer.member() for peer in peers]
            inputs = [make_tensors([(3000,)], 10 * round_index + seed) for seed in range(3)]
            outcomes = swarm.run(run_round(peers, group_of(members), inputs, config=config()))
            check_round(peers, inputs, [1.0] * 3, outcomes, honest=range(3))
        connectors = [peer.service.rpc_client.direct for peer in peers]
        assert all(connector is not None for connector in connectors)
        # each peer streams to the 2 other owners: 2 connections opened in the first round, reused since
        assert [connector.opened for connector in connectors] == [2, 2, 2]
        assert [connector.reused for connector in connectors] == [4, 4, 4]
        assert sum(peer.server.direct_listener.accepted for peer in peers) == 6
    finally:
        swarm.close()
