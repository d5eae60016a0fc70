"""Snapshot, average, apply the delta: how every caller averages tensors that keep changing.

An all-reduce round takes seconds, and training does not stop for it. So a round never averages
the live tensors: it averages a snapshot taken when the round began, and when it ends the live
tensors move by what averaging changed, not to the average itself::

    snapshot = copy(x)                         # when the round begins
    average  = mean over peers of their snapshot
    x       += alpha * (average - snapshot)    # when it ends: local progress made meanwhile is kept

With ``alpha = 1`` and no local progress this is ``x = average``. The averager, the training-state
averager and asynchronous model averaging all do this; they differ only in who holds which lock
and when the delta is applied, so the arithmetic (float32 snapshots, the cast back to the live
tensor's dtype, no temporary when the average is a scratch buffer) lives here once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def take_snapshot(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Detached float32 copies of ``tensors``: the values a round averages. float32 whatever the
    live dtype, so that averaging half-precision tensors does not lose the delta to rounding."""
    return [tensor.detach().to(torch.float32, copy=True) for tensor in tensors]


def average_delta(
    averages: Sequence[torch.Tensor], snapshot: Sequence[torch.Tensor], *, in_place: bool = False
) -> list[torch.Tensor]:
    """``average - snapshot`` per tensor. With ``in_place`` the averages are overwritten with the
    deltas (they must be the round's scratch tensors), which saves one temporary per tensor."""
    if in_place:
        return [average.sub_(before) for average, before in zip(averages, snapshot, strict=True)]
    return [average - before for average, before in zip(averages, snapshot, strict=True)]


def apply_delta(targets: Sequence[torch.Tensor], deltas: Sequence[torch.Tensor], *, alpha: float = 1.0) -> None:
    """``target += alpha * delta``, in the target's dtype and outside autograd (targets may be parameters)."""
    with torch.no_grad():
        for target, delta in zip(targets, deltas, strict=True):
            target.add_(delta.to(target.dtype), alpha=alpha)


def apply_average(
    targets: Sequence[torch.Tensor],
    averages: Sequence[torch.Tensor],
    snapshot: Sequence[torch.Tensor],
    *,
    alpha: float = 1.0,
    in_place: bool = False,
    keep_concurrent_updates: bool = True,
) -> None:
    """``target += alpha * (average - snapshot)``, one tensor at a time (the delta of one tensor is
    applied before the next one is computed, so at most one temporary exists).

    :param in_place: the averages are scratch tensors of the round and may be overwritten.
    :param keep_concurrent_updates: hivemind's option of that name. When False and ``alpha == 1``,
      the targets are set to the average itself (what was written into them since the snapshot is
      dropped), so that every member of the group ends with bit-identical tensors: ``x + (avg - x)``
      may differ from ``avg`` in the last bit.
    """
    with torch.no_grad():
        for target, average, before in zip(targets, averages, snapshot, strict=True):
            if not keep_concurrent_updates and alpha == 1.0:
                target.copy_(average)
                continue
            delta = average.sub_(before) if in_place else average - before
            target.add_(delta.to(target.dtype), alpha=alpha)
