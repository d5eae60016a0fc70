"""Range checks of a training state downloaded from a peer, before it is adopted.

Chunk digests only prove that a donor sent what its own manifest says; agreement between donors
(``StateSharingConfig.require_agreement``) covers a hostile minority of donors while several donors
exist. These checks cover the values themselves, whoever served them: every tensor finite, the
learning rates within ``max_lr_ratio`` of this peer's own, the epoch at most ``max_epochs_ahead``
past the swarm's progress, step counters non-negative integers below ``max_step``, and every other
number in the parameter groups finite. A state that fails raises
:class:`~hivemind_ext.errors.UntrustedStateError`; the loader then bans the donors that served it
and downloads from others.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hivemind_ext.errors import ConfigurationError, UntrustedStateError
from hivemind_ext.optim.training_state import SCALAR_MARK


@dataclass(frozen=True, kw_only=True)
class StateBounds:
    """What a downloaded training state may hold.

    :param max_lr_ratio: a parameter group's downloaded ``lr`` may be at most this many times this
      peer's own (its ``initial_lr`` when a scheduler set one, else its ``lr``); None: no bound.
    :param max_lr: an absolute bound on every downloaded ``lr`` (None: none).
    :param max_epochs_ahead: the downloaded epoch may exceed the swarm's epoch (as this peer's
      progress tracker sees it, or its own if larger) by at most this many epochs; None: no bound.
    :param max_step: bound on optimizer step counters (``step`` entries of the optimizer state).
    """

    max_lr_ratio: float | None = 100.0
    max_lr: float | None = None
    max_epochs_ahead: int | None = 100
    max_step: int = 2**40

    def __post_init__(self) -> None:
        for name in ("max_lr_ratio", "max_lr"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int | float) or not 0 < value < math.inf):
                raise ConfigurationError(f"{name} must be None or a positive finite number, got {value!r}")
        ahead = self.max_epochs_ahead
        if ahead is not None and (isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0):
            raise ConfigurationError(f"max_epochs_ahead must be None or a non-negative int, got {ahead!r}")
        if isinstance(self.max_step, bool) or not isinstance(self.max_step, int) or self.max_step < 1:
            raise ConfigurationError(f"max_step must be a positive int, got {self.max_step!r}")


def check_state_values(
    metadata: Any,
    tensors: Sequence[torch.Tensor],
    *,
    bounds: StateBounds,
    local_groups: Sequence[dict[str, Any]],
    max_epoch: int | None,
) -> None:
    """Raises UntrustedStateError if the downloaded ``(metadata, tensors)`` of a training state (see
    ``TrainingState.snapshot``) holds a value out of ``bounds``.

    :param local_groups: this peer's optimizer param groups (their learning rates are the reference)
    :param max_epoch: the largest epoch the swarm's progress allows (None: no bound)
    """
    for index, tensor in enumerate(tensors):
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise UntrustedStateError(f"tensor {index} of the downloaded state holds NaN or Inf")
    if not isinstance(metadata, dict):
        raise UntrustedStateError("the downloaded state's metadata is not a map")
    epoch = metadata.get("epoch")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise UntrustedStateError(f"the downloaded state has an invalid epoch {epoch!r:.40}")
    if max_epoch is not None and epoch > max_epoch:
        raise UntrustedStateError(f"the downloaded state is of epoch {epoch}, the swarm's progress allows {max_epoch}")
    groups = metadata.get("param_groups")
    if not isinstance(groups, list):
        raise UntrustedStateError("the downloaded state has no parameter groups")
    for index, (theirs, mine) in enumerate(zip(groups, local_groups, strict=False)):
        _check_group(index, theirs, mine, bounds)
    for path, value in _scalars(metadata.get("state")):
        if path[-1] == "step" and not _is_count(value, bounds.max_step):
            raise UntrustedStateError(f"the downloaded optimizer state has step {value!r:.40} at {path}")
        if isinstance(value, float) and not math.isfinite(value):
            raise UntrustedStateError(f"the downloaded optimizer state holds {value} at {path}")


def _check_group(index: int, theirs: Any, mine: dict[str, Any], bounds: StateBounds) -> None:
    if not isinstance(theirs, dict):
        raise UntrustedStateError(f"parameter group {index} of the downloaded state is not a map")
    for path, value in _scalars(theirs):
        if isinstance(value, float) and not math.isfinite(value):
            raise UntrustedStateError(f"parameter group {index} holds {value} at {path}")
    lr = theirs.get("lr")
    if lr is None:
        return
    lr = _number(lr)
    if lr is None or lr < 0:
        raise UntrustedStateError(f"parameter group {index} has learning rate {theirs.get('lr')!r:.40}")
    if bounds.max_lr is not None and lr > bounds.max_lr:
        raise UntrustedStateError(f"parameter group {index} has learning rate {lr}, above max_lr={bounds.max_lr}")
    reference = _number(mine.get("initial_lr", mine.get("lr")))
    if bounds.max_lr_ratio is not None and reference is not None:
        limit = bounds.max_lr_ratio * max(reference, _number(mine.get("lr")) or 0.0)
        if lr > limit:
            raise UntrustedStateError(
                f"parameter group {index} has learning rate {lr}, more than {bounds.max_lr_ratio} times this "
                f"peer's {reference}"
            )


def _scalars(value: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every number in a packed optimizer state (0-d tensors as their value), with its path."""
    if isinstance(value, dict):
        if SCALAR_MARK in value:
            yield path, value[SCALAR_MARK]
            return
        for key, item in value.items():
            yield from _scalars(item, (*path, str(key)))
    elif isinstance(value, list):
        for position, item in enumerate(value):
            yield from _scalars(item, (*path, str(position)))
    elif isinstance(value, int | float) and not isinstance(value, bool):
        yield path or ("value",), value


def _number(value: Any) -> float | None:
    if isinstance(value, dict) and SCALAR_MARK in value:
        value = value[SCALAR_MARK]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _is_count(value: Any, limit: int) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return False
    return 0 <= value <= limit and float(value).is_integer()
