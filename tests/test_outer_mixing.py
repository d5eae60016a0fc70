"""DiLoCo's outer state averaged within a group (optim/algorithms/outer_mixing.py), without a network:
the averaging the all-reduce does is replaced by the weighted mean it computes."""

from __future__ import annotations

import torch

from hivemind_ext.optim.algorithms import DiLoCo
from hivemind_ext.optim.algorithms.diloco_outer import outer_step
from hivemind_ext.optim.algorithms.outer_mixing import OuterStateMixing


def test_groupmates_step_from_one_outer_state_the_mean_of_their_own_steps() -> None:
    settings = DiLoCo(4, outer_lr=0.7, outer_momentum=0.9)
    generator = torch.Generator().manual_seed(0)
    peers, weights = 3, torch.tensor([1.0, 2.0, 5.0])
    anchors = [[torch.randn(5, generator=generator), torch.randn(2, 3, generator=generator)] for _ in range(peers)]
    momenta = [[torch.randn_like(t) for t in a] for a in anchors]
    grads = [[0.1 * torch.randn_like(t) for t in a] for a in anchors]
    # what each peer would reach on its own, and their weighted mean
    alone = [[t.clone() for t in a] for a in anchors]
    alone_m = [[t.clone() for t in m] for m in momenta]
    for a, m, g in zip(alone, alone_m, grads, strict=True):
        outer_step(settings, a, m, g)
    expected = [sum(w * a[i] for w, a in zip(weights, alone, strict=True)) / weights.sum() for i in range(2)]

    mixings = [OuterStateMixing(a, m) for a, m in zip(anchors, momenta, strict=True)]
    for mixing in mixings:
        mixing.load()
    means = [sum(w * m.copies[k] for w, m in zip(weights, mixings, strict=True)) / weights.sum() for k in range(4)]
    mean_grads = [sum(w * g[i] for w, g in zip(weights, grads, strict=True)) / weights.sum() for i in range(2)]
    for mixing, a, m in zip(mixings, anchors, momenta, strict=True):
        for copy, mean in zip(mixing.copies, means, strict=True):
            copy.copy_(mean)  # what the round writes back into the copies
        mixing.adopt()
        outer_step(settings, a, m, mean_grads)
    for a in anchors:
        for tensor, want in zip(a, expected, strict=True):
            torch.testing.assert_close(tensor, want, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(anchors[0][i], anchors[p][i]) for p in range(peers) for i in range(2))


def test_the_copies_are_what_a_round_averages_and_nothing_else() -> None:
    anchor, momentum = [torch.ones(3)], [torch.zeros(3)]
    mixing = OuterStateMixing(anchor, momentum)
    assert [name for name, _ in mixing.named_tensors()] == ["anchor0", "momentum0"]
    assert all(mixing.owns(t) for _, t in mixing.named_tensors()) and not mixing.owns(anchor[0])
    anchor[0].fill_(4.0)
    mixing.load()
    mixing.copies[0].fill_(2.0)  # a round that did not finish leaves the live state alone
    assert torch.equal(anchor[0], torch.full((3,), 4.0))
    mixing.adopt()
    assert torch.equal(anchor[0], torch.full((3,), 2.0)) and torch.equal(momentum[0], torch.zeros(3))
    assert mixing.bucket("f0outer").flat.numel() == 6
