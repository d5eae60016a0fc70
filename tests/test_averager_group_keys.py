"""hivemind's group bits and scheduled rounds, end to end: real DHTs and libp2p daemons on 127.0.0.1.

The first and last tests are hivemind 1.1.12's ``test_allreduce_grid`` and ``test_averaging_trigger``
(tests/test_averaging.py) with hivemind's bounds, run against our DecentralizedAverager.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import time
from collections.abc import Iterator, Sequence

import hivemind
import pytest
import torch
from hivemind.utils import get_dht_time
from swarm import local_swarm

from hivemind_ext.averaging import AveragingStage, DecentralizedAverager
from hivemind_ext.averaging.matchmaking.rotation import DIGITS, Coordinates, grid_digits
from hivemind_ext.errors import ConfigurationError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

_prefixes = itertools.count()


@pytest.fixture(scope="module")
def swarm() -> Iterator[list[hivemind.DHT]]:
    with local_swarm(8) as dhts:
        yield dhts


def fresh_prefix() -> str:
    return f"group-keys-{next(_prefixes)}"


def mean_std(averagers: Sequence[DecentralizedAverager]) -> tuple[torch.Tensor, torch.Tensor]:
    values = []
    for averager in averagers:
        with averager.get_tensors() as (tensor,):
            values.append(tensor.clone())
    stacked = torch.stack(values)
    return stacked.mean(dim=0), stacked.std(dim=0)


def shutdown_all(averagers: Sequence[DecentralizedAverager]) -> None:
    for averager in averagers:
        averager.shutdown()


def test_allreduce_grid(swarm: list[hivemind.DHT]) -> None:
    """hivemind's test: 8 peers in pairs on a 2-bit grid reach the exact mean in 3 rounds."""
    prefix = fresh_prefix()
    averagers = [
        DecentralizedAverager(
            averaged_tensors=[torch.randn(3)],
            dht=dht,
            target_group_size=2,
            prefix=prefix,
            initial_group_bits=bin(i // 2)[2:].rjust(2, "0"),
            start=True,
        )
        for i, dht in enumerate(swarm)
    ]
    try:
        means0, stds0 = mean_std(averagers)
        assert not torch.allclose(stds0, torch.zeros_like(stds0))
        prev_means, prev_stds = means0, stds0
        for i in range(5):
            step_futures = [averager.step(wait=False, timeout=60) for averager in averagers]
            groups = [future.result(timeout=90) for future in step_futures]
            means, stds = mean_std(averagers)
            assert torch.allclose(means, prev_means, atol=1e-6, rtol=0)
            assert all(len(group) == 2 for group in groups)
            if i <= 2:
                assert torch.all(torch.le(stds, prev_stds))
            else:
                assert torch.allclose(stds, torch.zeros_like(stds), atol=1e-6, rtol=0)
            prev_means, prev_stds = means, stds
    finally:
        shutdown_all(averagers)


def test_group_bits_keep_peers_apart_and_a_2x2_grid_reaches_the_mean(swarm: list[hivemind.DHT]) -> None:
    """Rows, then columns, set with set_group_bits: each round pairs exactly the peers of one row
    (column), never peers that the bits keep apart, and two rounds give every peer the exact mean."""
    prefix = fresh_prefix()
    rows = [i // 2 for i in range(4)]
    columns = [i % 2 for i in range(4)]
    averagers = [
        DecentralizedAverager(
            [torch.tensor([float(i**2), -3.0 * i])],
            dht,
            prefix=prefix,
            target_group_size=2,
            min_matchmaking_time=30.0,  # only groups by key: a full pair forms at once
            request_timeout=1.0,
            initial_group_bits=f"{rows[i]}0",
            start=True,
        )
        for i, dht in enumerate(swarm[:4])
    ]
    try:
        expected_mean, _ = mean_std(averagers)
        ids = [averager.peer_id for averager in averagers]
        for layout in (rows, columns):
            for averager, line in zip(averagers, layout, strict=True):
                averager.set_group_bits(f"{line}0")
                assert averager.get_group_bits() == f"{line}0"
            futures = [averager.step(wait=False, timeout=30) for averager in averagers]
            gathered = [future.result(timeout=60) for future in futures]
            for i, members in enumerate(gathered):
                assert set(members) == {ids[j] for j in range(4) if layout[j] == layout[i]}
        for averager in averagers:
            with averager.get_tensors() as (tensor,):
                assert torch.allclose(tensor, expected_mean, atol=1e-6, rtol=0)
    finally:
        shutdown_all(averagers)


def peer_pairs(swarm: Sequence[hivemind.DHT], pairs: Sequence[tuple[int, int]]) -> list[set[str]]:
    return sorted(({str(swarm[i].peer_id), str(swarm[j].peer_id)} for i, j in pairs), key=sorted)


def rounds_on_two_prefixes(
    swarm: Sequence[hivemind.DHT], rotations: Sequence[Sequence[Coordinates]]
) -> list[list[frozenset[str]]]:
    """4 peers, each with two averagers in rotating groups of 2 (prefix A with ``rotations[0]``, then
    prefix B with ``rotations[1]``, one round each, the whole swarm looking): each round's groups (sets
    of peer ids), sorted."""
    rounds = []
    for prefix, prefix_rotations in zip((fresh_prefix(), fresh_prefix()), rotations, strict=True):
        averagers = [
            DecentralizedAverager(
                [torch.tensor([float(i)])],
                dht,
                prefix=prefix,
                target_group_size=2,
                min_matchmaking_time=30.0,  # the whole swarm is expected: groups form once the 4 are looking
                request_timeout=1.0,
                rotation=rotation,
                start=True,
            )
            for i, (dht, rotation) in enumerate(zip(swarm, prefix_rotations, strict=True))
        ]
        try:
            futures = [averager.step(wait=False, timeout=30, expected_group_size=4) for averager in averagers]
            gathered = [future.result(timeout=60) for future in futures]
            rounds.append(sorted({frozenset(str(peer) for peer in members) for members in gathered}, key=sorted))
        finally:
            shutdown_all(averagers)
    return rounds


def test_averagers_that_share_a_rotation_mix_across_each_others_groups(swarm: list[hivemind.DHT]) -> None:
    """The Optimizer's gradient round, then its parameter round, in rotating groups: with one rotation
    per peer (Coordinates shared by both averagers, as the Optimizer does) the second round pairs
    peers that the first kept apart; with each averager's own coordinates (from the same start, as two
    averagers that each start from the peer id's) it met the same pairs again, which mixes nothing
    across them. The peers start on a 2x2 grid: hashed starts can put 3 of 4 peers in one shard, and
    then who pairs with whom depends on timing, in both cases."""

    def grid() -> list[Coordinates]:
        return [Coordinates(grid_digits(i, 2, 2), 2) for i in range(4)]

    first, second = rounds_on_two_prefixes(swarm[:4], [grid(), grid()])
    assert first == [frozenset(ids) for ids in peer_pairs(swarm, [(0, 1), (2, 3)])], first
    assert second == first  # why the averagers must share: the same pairs again
    shared = grid()
    first, second = rounds_on_two_prefixes(swarm[:4], [shared, shared])
    assert len(first) == len(second) == 2 and all(len(group) == 2 for group in first + second), (first, second)
    for group in second:  # one member from each of the first round's groups
        assert all(len(group & earlier) == 1 for earlier in first), (first, second)


def test_averagers_that_share_a_rotation_need_one_group_size(swarm: list[hivemind.DHT]) -> None:
    rotation = Coordinates()
    averager = DecentralizedAverager(
        [torch.zeros(1)], swarm[0], prefix=fresh_prefix(), target_group_size=2, rotation=rotation, start=True
    )
    try:
        assert rotation.base == 2 and len(rotation.digits) == DIGITS
        with pytest.raises(ConfigurationError):
            rotation.start(str(averager.peer_id), 4)
    finally:
        averager.shutdown()


def test_get_set_group_bits(swarm: list[hivemind.DHT]) -> None:
    """hivemind's test_getset_bits, plus the futures of wait=False and the refusal of non-bits."""
    averager = DecentralizedAverager(
        [torch.randn(3)], dht=swarm[0], start=True, prefix=fresh_prefix(), target_group_size=2
    )
    try:
        assert averager.get_group_bits() == ""
        averager.set_group_bits("00101011101010")
        assert averager.get_group_bits() == "00101011101010"
        future = averager.set_group_bits("1", wait=False)
        assert isinstance(future, concurrent.futures.Future) and future.result(timeout=5) is None
        assert averager.get_group_bits(wait=False).result(timeout=5) == "1"
        with pytest.raises(ConfigurationError):
            averager.set_group_bits("0b1")
        with pytest.raises(ConfigurationError):
            DecentralizedAverager([torch.randn(3)], dht=swarm[0], start=False, prefix="x", initial_group_bits="2")
    finally:
        averager.shutdown()


def test_averaging_trigger(swarm: list[hivemind.DHT]) -> None:
    """hivemind's test: a round scheduled 0.5 s ahead is running its all-reduce 0.6 s after the steps
    (the peers that require a trigger wait for it), and finishes within 0.5 s of the triggers."""
    prefix = fresh_prefix()
    averagers = [
        DecentralizedAverager(
            averaged_tensors=[torch.randn(3)],
            dht=dht,
            min_matchmaking_time=0.5,
            request_timeout=0.3,
            prefix=prefix,
            initial_group_bits="",
            start=True,
        )
        for dht in swarm[:4]
    ]
    try:
        controls = []
        for i, averager in enumerate(averagers):
            controls.append(
                averager.step(
                    wait=False,
                    scheduled_time=get_dht_time() + 0.5,
                    weight=1.0,
                    require_trigger=i in (1, 2),
                )
            )
        time.sleep(0.6)
        c0, c1, c2, c3 = controls
        assert not any(c.done() for c in controls)
        assert c0.stage == AveragingStage.RUNNING_ALLREDUCE
        assert c1.stage == AveragingStage.AWAITING_TRIGGER
        assert c2.stage == AveragingStage.AWAITING_TRIGGER
        assert c3.stage == AveragingStage.RUNNING_ALLREDUCE

        c1.allow_allreduce()
        c2.allow_allreduce()
        time.sleep(0.5)
        assert all(c.stage == AveragingStage.FINISHED for c in controls)
        assert all(c.done() for c in controls)
        c0.allow_allreduce()  # setting the trigger twice does not raise
    finally:
        shutdown_all(averagers)
