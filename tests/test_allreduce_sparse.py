"""Butterfly all-reduce between 3 real peers on 127.0.0.1 with the sparse codec (SparseTopK).

Each owner decodes every sender's sparse slice to a dense chunk and adds it to the weighted sum; the
average goes back re-sparsified by the same codec (see SparseTopK's docstring). With ErrorFeedback on
both sides, what either step dropped is sent in later rounds.
"""

from __future__ import annotations

import pytest
import torch
from allreduce_swarm import Swarm, check_round, config, flat, group_of, run_round, swarm_fixtures

from hivemind_ext.compression import ErrorFeedback, SparseTopK

pytestmark = pytest.mark.timeout(90)
swarm, no_leftover_tasks = swarm_fixtures(3)

SHAPES = [(40, 50), (1000,), (37,)]  # 3037 values: several codec chunks per part, and short tails
PATIENT = dict(next_chunk_timeout=5.0, allreduce_timeout=20.0)  # rounds must not fail on a loaded machine


def shared_support_inputs(seed: int) -> list[list[torch.Tensor]]:
    """Every 64th value is nonzero on every peer (magnitudes in [1, 2], random signs), all others are 0:
    each codec chunk of 256 values keeping 8 (tail of t: ceil(t / 32)) keeps the whole support."""
    generator = torch.Generator().manual_seed(seed)
    inputs = []
    for _ in range(3):
        tensors = []
        for shape in SHAPES:
            values = torch.zeros(shape).view(-1)
            support = values[::64]
            signs = torch.randint(0, 2, support.shape, generator=generator) * 2 - 1
            support.copy_((1 + torch.rand(support.shape, generator=generator)) * signs)
            tensors.append(values.view(shape))
        inputs.append(tensors)
    return inputs


def test_sparse_contributions_average_within_the_codec_bound(swarm: Swarm) -> None:
    """Each value is off by at most half a level twice (a sender's slice, then the owner's average), where a
    level is at most max|x| / 8 with 4 bits; a dropped or misweighted value would be off by 1 or more."""
    peers = swarm.peers
    inputs, weights = shared_support_inputs(seed=1), [1.0, 2.0, 3.0]
    codec = SparseTopK(density=1 / 32, bits=4, chunk_size=256)
    bound = 2 * max(float(flat(x).abs().max()) for x in inputs) / 2**codec.bits
    cfg = config(compression=codec, part_size_bytes=2048, **PATIENT)
    outcomes = swarm.run(run_round(peers, group_of([p.member() for p in peers]), inputs, weights=weights, config=cfg))
    check_round(peers, inputs, weights, outcomes, honest=range(3), atol=bound, rtol=0)  # identical on every peer too
    for outcome in outcomes:
        assert outcome.result.all_averaged and not outcome.result.excluded


def test_error_feedback_on_both_sides_converges_to_the_mean_while_parts_move(swarm: Swarm) -> None:
    """Dense inputs, the same every round: one round of 25% top-k is far from the mean, but what the
    senders and the owners dropped is sent later, so the average of the rounds' results approaches it.
    The members' bandwidths change every round, and so do the part sizes and where every chunk lies:
    error feedback keeps each residual with its values (by offset), not with a chunk number."""
    peers = swarm.peers
    generator = torch.Generator().manual_seed(7)
    inputs = [[torch.randn(shape, generator=generator) for shape in SHAPES] for _ in range(3)]
    mean = sum(flat(x) for x in inputs) / 3
    codecs = [ErrorFeedback(SparseTopK(density=0.25, bits=4, chunk_size=64)) for _ in peers]  # a residual each
    configs = [config(compression=codec, **PATIENT) for codec in codecs]
    # three layouts under the round-time-optimal split: even, peer 0 owns nothing, peer 0 owns all
    bandwidths = [(1.0, 1.0, 1.0), (1.0, 10.0, 10.0), (5.0, 1.0, 1.5)]
    total, errors, layouts = torch.zeros_like(mean), [], set()
    for rounds in range(1, 17):
        members = [p.member(bandwidth=b) for p, b in zip(peers, bandwidths[rounds % 3], strict=True)]
        outcomes = swarm.run(run_round(peers, group_of(members), inputs, config=configs))
        results = [flat(outcome.result.tensors) for outcome in outcomes]
        assert all(outcome.result.all_averaged for outcome in outcomes)
        assert all(torch.equal(result, results[0]) for result in results), "members got different averages"
        layouts.add(tuple(part.end for part in outcomes[0].result.parts))
        total += results[0]
        errors.append(float((total / rounds - mean).norm() / mean.norm()))
    assert len(layouts) == 3
    assert errors[0] > 0.5, errors  # one round sends a quarter of the values
    assert errors[-1] < errors[0] / 3, errors
