"""What plain DiLoCo (:mod:`.diloco`) and overlapped rounds (:mod:`.streaming`) share: the outer step
and round checks (pure functions of tensors and numbers, the same on every peer), the check of a
downloaded counter, and :class:`OuterRoundsImpl`, the outer state and counters of both."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from hivemind_ext.errors import UntrustedStateError
from hivemind_ext.optim.algorithms.base import AlgorithmContext, AlgorithmImpl

MAX_COUNT = 1 << 23  # phases are float32, which counts +1 exactly up to 2**24


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


def check_count(value: float, what: str, limit: int = MAX_COUNT) -> int:
    """A counter downloaded from a donor as this peer uses it: a whole number in [0, limit]; anything
    else (NaN, negative, fractional, huge: a donor's lie) raises UntrustedStateError (the loader then
    bans the donor and downloads from another)."""
    if not (math.isfinite(value) and 0 <= value <= limit and value == math.floor(value)):
        raise UntrustedStateError(f"the downloaded {what} is {value!r:.40}, not a whole number in [0, {limit}]")
    return int(value)


class OuterRoundsImpl(AlgorithmImpl):
    """The outer state and counters of both DiLoCo implementations.

    The anchors (parameters at the start of the round, float32), the outer momenta and a ``phase``
    (float32 counters, whose layout each implementation defines) are extra tensors of the training
    state: a late joiner downloads them with the parameters, after :meth:`check_downloaded_phase`
    accepted the donor's phase. Counters (for tests, logs and benchmarks): ``inner_steps``, ``rounds``
    (outer steps applied), ``swarm_rounds`` / ``solo_rounds`` (on a swarm average / on the local
    pseudo-gradient, no other peer being around), ``failed_rounds``, ``contributing_rounds`` (swarm
    rounds with a nonzero weight), ``state_loads``; ``history``, a record per round (its fields are the
    implementation's).
    """

    resync_after_failed_round = False  # a failed round is retried, the anchors stay in step (see .diloco)

    def __init__(self, context: AlgorithmContext, algorithm: Any, phase_size: int) -> None:
        super().__init__(context)
        self.algorithm = algorithm
        self._lock = context.state_lock
        self._state = context.state
        self._params: list[torch.Tensor] = list(self._state.opt_params)  # what the inner optimizer updates
        with self._lock:
            self.anchor = [p.detach().float().clone() for p in self._params]
            self.momentum = [torch.zeros_like(a) for a in self.anchor]
            self.phase = torch.zeros(phase_size, dtype=torch.float32)
            self._state.add_extra_tensors([*self.anchor, *self.momentum, self.phase], check=self._check_served)
        self.inner_steps = 0
        self.rounds = 0
        self.swarm_rounds = 0
        self.solo_rounds = 0
        self.failed_rounds = 0
        self.contributing_rounds = 0
        self.state_loads = 0
        self.history: deque[tuple[Any, ...]] = deque(maxlen=1000)

    def _check_served(self, tensors: list[torch.Tensor]) -> None:
        self.check_downloaded_phase([float(v) for v in tensors[-1].tolist()])  # [anchors, momenta, phase]

    def check_downloaded_phase(self, phase: list[float]) -> None:
        """Raises UntrustedStateError if a donor's phase cannot be (default: each entry a counter)."""
        for index, value in enumerate(phase):
            check_count(value, f"phase entry {index}")
