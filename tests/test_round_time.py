"""The round's predicted duration and the whole-round deadline it sets (allreduce/round_time.py).

Pure functions first (the model against hand-computed figures, hostile declarations); then real
rounds slowed by a RoundHooks seam, whose duration the prediction must match within a factor of 3.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from allreduce_swarm import Swarm, config, group_of, run_round, swarm_fixtures
from hivemind.p2p import PeerID

from hivemind_ext.averaging.allreduce.api import RoundHooks
from hivemind_ext.averaging.allreduce.layout import member_roles, plan_layout
from hivemind_ext.averaging.allreduce.round_time import (
    DEFAULT_MULTIPLE,
    MAX_ROUND_SECONDS,
    predict_round_seconds,
    round_timeout,
)
from hivemind_ext.averaging.matchmaking.group import Member
from hivemind_ext.averaging.tensor_layout import TensorSpec
from hivemind_ext.p2p import Message

pytestmark = pytest.mark.timeout(60)
swarm, no_leftover_tasks = swarm_fixtures(2)

MB = 1024 * 1024
VECTOR = [TensorSpec((4 * MB,), torch.float32)]  # 16 MiB


def members(*bandwidths: float | None) -> list[Member]:
    return [Member(f"peer{i}", "attempt", bandwidth) for i, bandwidth in enumerate(bandwidths)]


def predicted(group: list[Member]) -> float | None:
    return predict_round_seconds(plan_layout(VECTOR, member_roles(group), 2 * MB), group)


def test_the_prediction_is_the_partition_model_in_seconds() -> None:
    # four equal peers: each moves (1 + 2/4) x 16 MiB each way at 100 Mbit/s
    assert predicted(members(100, 100, 100, 100)) == pytest.approx(1.5 * 16 * MB * 8 / 100e6)
    # nobody declared anything (everyone's first round): no prediction, the floor holds
    assert predicted(members(None, None, None)) is None
    assert round_timeout(None, 60.0) == 60.0
    # a peer that declared nothing counts as the mean of those that did
    assert predicted(members(20, None)) == pytest.approx(16 * MB * 8 / 20e6)
    assert round_timeout(10.0, 60.0) == 60.0  # never shorter than the floor
    assert round_timeout(100.0, 60.0) == DEFAULT_MULTIPLE * 100.0
    assert round_timeout(1e9, 60.0) == MAX_ROUND_SECONDS


def test_a_lying_throughput_cannot_shrink_an_honest_peers_deadline() -> None:
    honest_alone = 16 * MB * 8 / 20e6  # an honest peer at 20 Mbit/s moves its own vector once, whatever the split
    for liar in (1e3, 1e9, 1e300):
        prediction = predicted(members(20, 20, 20, liar))
        assert prediction is not None and prediction >= honest_alone
        assert round_timeout(prediction, 60.0) >= max(60.0, DEFAULT_MULTIPLE * honest_alone)
    for liar in (1e-300, 0.0):  # lying low lengthens the deadline, up to the cap only
        assert round_timeout(predicted(members(20, 20, 20, liar)), 60.0) <= MAX_ROUND_SECONDS
    assert round_timeout(predicted(members(1e300, 1e300)), 60.0) == 60.0  # all lie high: the floor


class Slowed(RoundHooks):
    """Every chunk, both ways, waits ``seconds`` before it is sent: a link of chunk / seconds."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def before_send_chunk(self, owner: PeerID, part: int, index: int, message: Message) -> Message:
        await asyncio.sleep(self.seconds)
        return message

    async def before_send_result(self, sender: PeerID, part: int, index: int | None, message: Message) -> Message:
        if index is not None:
            await asyncio.sleep(self.seconds)
        return message


def test_a_slowed_rounds_duration_is_predicted_and_sets_its_deadline(swarm: Swarm) -> None:
    peers = swarm.peers
    inputs = [[torch.randn(1 << 17, generator=torch.Generator().manual_seed(i))] for i in range(2)]  # 512 KiB
    mean = (inputs[0][0] + inputs[1][0]) / 2
    hooks = {0: Slowed(0.05), 1: Slowed(0.05)}  # 8 chunks of 32 KiB each way: about 0.8 s per round
    slow = dict(part_size_bytes=32 * 1024, next_chunk_timeout=2.0)

    def round_(group: list[Member], **overrides: object) -> list:
        cfg = config(**{**slow, **overrides})
        return swarm.run(run_round(peers, group_of(group), inputs, config=cfg, hooks=hooks), timeout=30)

    first = round_([p.member() for p in peers], allreduce_timeout=8.0)  # nobody declared: the floor
    assert all(o.result.predicted_seconds is None and o.result.timeout_seconds == 8.0 for o in first)
    # each declares the throughput it measured, as averagers do; the floor is now below the round's length
    declared = [p.member(bandwidth=o.result.receive_rate * 8 / 1e6) for p, o in zip(peers, first, strict=True)]
    second = round_(declared, allreduce_timeout=0.5)
    for outcome in second:
        result = outcome.result
        assert all(part.averaged for part in result.parts)  # not cut at the 0.5 s floor
        torch.testing.assert_close(result.tensors[0], mean)
        # within a factor of 3 (the deadline's multiple): this machine's load moves round times that much
        assert 1 / 3 < outcome.seconds / result.predicted_seconds < 3, (outcome.seconds, result.predicted_seconds)
        assert result.timeout_seconds == pytest.approx(DEFAULT_MULTIPLE * result.predicted_seconds)
    fixed = round_(declared, allreduce_timeout=0.5, adaptive_deadline=False)  # what the fixed deadline did
    assert not all(part.averaged for o in fixed for part in o.result.parts)
    assert all(o.result.timeout_seconds == 0.5 for o in fixed)
