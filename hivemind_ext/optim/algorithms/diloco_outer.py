"""DiLoCo's outer step and round checks, shared by plain DiLoCo (:mod:`.diloco`) and overlapped
rounds (:mod:`.streaming`): pure functions of tensors and numbers, the same on every peer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch


class OuterSettings(Protocol):
    """The outer optimizer's hyperparameters (a :class:`~.diloco.DiLoCo`)."""

    outer_lr: float
    outer_momentum: float
    nesterov: bool


def round_offset(group_mean: float, round_index: int) -> int:
    """-1, 0 or 1: whether this peer's round index is below, at or above the group's weighted mean of
    round indices (a float32 average of integers: equal within its rounding error, not ``round()``,
    which would put a group of rounds 5 and 6 (mean 5.5) at round 6)."""
    tolerance = 1e-3 + 1e-6 * abs(round_index)
    if group_mean < round_index - tolerance:
        return 1
    if group_mean > round_index + tolerance:
        return -1
    return 0


def outer_step(
    algorithm: OuterSettings,
    anchors: Sequence[torch.Tensor],
    momenta: Sequence[torch.Tensor],
    pseudo_grads: Sequence[torch.Tensor],
) -> None:
    """The outer SGD step, in place: ``m = mu * m + pg``; ``anchor -= lr * (pg + mu * m)`` with
    Nesterov (``lr * m`` without). The same arithmetic on every peer, so equal anchors stay equal."""
    mu = algorithm.outer_momentum
    with torch.no_grad():
        for anchor, momentum, pg in zip(anchors, momenta, pseudo_grads, strict=True):
            momentum.mul_(mu).add_(pg)
            update = pg.add(momentum, alpha=mu) if algorithm.nesterov else momentum
            anchor.sub_(update, alpha=algorithm.outer_lr)


def averaged_by_group(report: Any, me: str, contributing: bool) -> bool:
    """Whether a round's report says that this peer holds the group's average of every part: each
    member that received a part's average holds the same values for it; a part that only one member
    reduced (this peer kept its own values), or one that left out this contributing peer's values,
    makes its pseudo-gradient differ from the group's."""
    return all(len(c) >= 2 and (not contributing or me in c) for c in report.contributors)
