"""DiLoCo's outer state averaged within each group, for swarms that average in groups smaller than
themselves (``averager_opts=dict(target_group_size=k)``; rotating groups, see
:mod:`hivemind_ext.averaging.matchmaking.rotation`).

Why: DiLoCo averages pseudo-gradients ``anchor - params`` and every member applies the group's mean
to ITS OWN anchor. In one group of the whole swarm every anchor is the same, so that is the whole
story. In groups, two groups apply two different means, their anchors part, and nothing ever brings
them back: every later round moves each anchor by a group's mean pseudo-gradient, which preserves
the difference between anchors; and groups keep their own pace, so a group often holds peers of two
round indices, which plain DiLoCo treats as a failed round (retry, or a state download). Measured
with 8 peers in groups of 4 (tests/test_optimizer_large_swarm.py, 3 epochs, 5 runs each): before this
module, parameters 0.03-0.18 apart (relative to their largest value) after moving 0.72, with retries
and state downloads in 2 runs; after, 0.02-0.05 apart, every round a swarm round.

What: each round also averages, with the same weights as the pseudo-gradients, a copy of the
anchor and of the outer momentum. The outer step is linear in (anchor, momentum, pseudo-gradient),
so stepping from the group's mean of all three is the group's mean of the members' steps, and every
member of a group ends the round with the same outer state. Rotating groups then mix those states
across the swarm as they mix any tensor: with N = M^d peers in groups of M on the rotation grid,
after d rounds every peer holds the same outer state; with hashed coordinates, churn or uneven N,
the spread shrinks geometrically (the rule's property tests).

Cost: the copies travel uncompressed (float32: a codec's rounding error on the anchor would be an
error on the parameters themselves, not on their difference), so a round carries 8 bytes per
parameter more than the pseudo-gradient alone (2 bytes with the default float16 codec): 5x the
traffic of one group of the whole swarm, still once per H inner steps.

Round indices: with mixed outer states, peers at different round indices (groups keep their own
pace) average into one state like any others, so a group that mixes round indices is not a failed
round here, and a peer below the group's mean needs no state download: the average brings it in.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hivemind_ext.optim.algorithms.base import Bucket, NamedTensor


class OuterStateMixing:
    """Float32 copies of the anchors and outer momenta that a round averages, and their way back.

    :param anchors: the outer parameters (one tensor per model tensor, or per tensor of a fragment)
    :param momenta: the outer momentum buffers, same shapes
    """

    def __init__(self, anchors: Sequence[torch.Tensor], momenta: Sequence[torch.Tensor]) -> None:
        self.anchors = list(anchors)
        self.momenta = list(momenta)
        self.copies = [t.detach().float().clone() for t in (*self.anchors, *self.momenta)]
        self._ids = {id(t) for t in self.copies}

    def named_tensors(self) -> list[NamedTensor]:
        """What a round averages besides the pseudo-gradients (codec None: uncompressed)."""
        count = len(self.anchors)
        return [(f"{'anchor' if i < count else 'momentum'}{i % count}", t) for i, t in enumerate(self.copies)]

    def owns(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self._ids

    def bucket(self, name: str) -> Bucket:
        """One bucket of all copies (for averagers built per fragment)."""
        return Bucket(name, self.named_tensors())

    def load(self, _bucket: Bucket | None = None) -> None:
        """Copies the live outer state into the copies (a bucket's Python operation, before the round;
        the caller holds the training state's lock where the anchors may change concurrently)."""
        with torch.no_grad():
            for copy, live in zip(self.copies, (*self.anchors, *self.momenta), strict=True):
                copy.copy_(live)

    def adopt(self) -> None:
        """After a round that averaged every part: the live outer state becomes the group's mean."""
        with torch.no_grad():
            for copy, live in zip(self.copies, (*self.anchors, *self.momenta), strict=True):
                live.copy_(copy)
