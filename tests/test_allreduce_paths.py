"""Which path a round's streams take (averaging/allreduce/paths.py): the direct data path, except
where the sender or the owner declared a thin link and the stream carries more than a small slice;
real peers on 127.0.0.1 serving the direct path."""

from __future__ import annotations

import asyncio

import pytest
from allreduce_swarm import Swarm, check_round, config, group_of, make_tensors, run_round

from hivemind_ext.averaging.allreduce.paths import DIRECT_PATH_MIN_MBIT, SMALL_SLICE_BYTES, direct_path_pays
from hivemind_ext.averaging.matchmaking.group import Member
from hivemind_ext.p2p import DirectConfig

pytestmark = pytest.mark.timeout(60)


def test_thin_links_take_libp2p_and_unknown_or_fast_links_the_direct_path() -> None:
    thin, fast, unknown = (Member(name, "x", bandwidth) for name, bandwidth in [("a", 100.0), ("b", 1e4), ("c", None)])
    assert direct_path_pays(fast, unknown) and direct_path_pays(unknown, unknown)
    assert not direct_path_pays(thin, fast) and not direct_path_pays(fast, thin) and not direct_path_pays(thin, unknown)
    assert direct_path_pays(Member("d", "x", DIRECT_PATH_MIN_MBIT), fast)
    # the sizes of the slices: a small one takes the direct path whatever the links, a large one as above
    assert direct_path_pays(thin, fast, SMALL_SLICE_BYTES) and direct_path_pays(thin, thin, 0)
    assert not direct_path_pays(thin, fast, SMALL_SLICE_BYTES + 1) and direct_path_pays(fast, unknown, 2**30)


def _paths_of_a_round(numel: int) -> tuple[dict[tuple[int, str], tuple[str, int]], str]:
    """Peer 0 declares a thin link, peer 1 a fast one, peer 2 nothing (its first round): (caller,
    owner) -> (the path its stream took, the bytes of values it carried) in one round of ``numel``
    floats, and peer 0's name."""
    swarm = Swarm(3, direct=DirectConfig(host="127.0.0.1"))
    try:
        peers = swarm.peers
        members = [peers[0].member(bandwidth=50.0), peers[1].member(bandwidth=1000.0), peers[2].member()]
        inputs = [make_tensors([(numel,)], seed) for seed in range(3)]
        started = swarm.loop.run_until_complete(_now())
        outcomes = swarm.run(run_round(peers, group_of(members), inputs, config=config(part_size_bytes=2**20)))
        check_round(peers, inputs, [1.0] * 3, outcomes, honest=range(3))
        assert all(outcome.result.complete for outcome in outcomes)
        sizes = {str(part.owner): 4 * (part.end - part.start) for part in outcomes[0].result.parts}
        found = {}
        for caller, peer in enumerate(peers):
            paths = peer.service.rpc_client.transports_since(started)
            # a stream to each other owner (peer 0's part may be empty: it is still JOINed)
            assert {str(owner) for owner in paths} == set(sizes) - {str(peer.peer_id)}
            found.update({(caller, str(owner)): (path, sizes[str(owner)]) for owner, path in paths.items()})
        return found, peers[0].name
    finally:
        swarm.close()


def test_a_round_sends_over_libp2p_exactly_where_a_thin_link_carries_a_large_slice() -> None:
    found, thin_peer = _paths_of_a_round(1_000_000)  # 4 MB: peers 1 and 2 own over 1 MiB each
    for (caller, owner), (path, nbytes) in found.items():
        thin = caller == 0 or owner == thin_peer
        assert path == ("libp2p" if thin and nbytes > SMALL_SLICE_BYTES else "direct"), (caller, owner, path, nbytes)
    assert sum(path == "libp2p" for path, _ in found.values()) >= 2  # peer 0's streams to peers 1 and 2


def test_a_small_round_takes_the_direct_path_even_where_a_thin_link_is_declared() -> None:
    # a measured bandwidth is a lower bound that short rounds hold far below the link (paths.py): at
    # 256 KiB per peer, scale.py's peers declared ~20 Mbit/s on loopback and went over libp2p for good
    found, _ = _paths_of_a_round(3000)
    assert {path for path, _ in found.values()} == {"direct"}, found


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
