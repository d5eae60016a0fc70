"""Gradient averaging in hops: the rules (pure), for ``Optimizer(grad_averaging_hops=...)``.

In rotating groups (``averager_opts=dict(target_group_size=M)``) one gradient round averages only
within groups of ``M``: each group steps on its own mean gradient. With SGD the groups' updates
still average to the global one, but an adaptive optimizer (Adam) is not linear in its gradient,
and the groups drift apart (16 peers training digits in groups of 4: held-out loss 1.065-1.121x
that of one group of 16 in a one-process simulation, 1.000x with SGD).

``grad_averaging_hops=d`` runs ``d`` gradient rounds per epoch instead of one, each on its own
matchmaking board (:func:`hop_prefix`): after the first, each peer holds its group's mean; every
further hop averages those means again, weighted by the samples each one covers, with a group
that the rotation (``averaging.matchmaking.rotation``) draws from different groups of the hop before.
With ``N = M**d`` peers whose groups all fill, every peer holds the global mean after ``d`` hops.
A hop that finds no group within its search window (:func:`hop_plan`: two matchmaking times) is
skipped: the peer steps on what it has, as it does today.

``"auto"`` chooses ``d`` every epoch from the trainers the progress tracker sees
(:func:`hop_count`). The setting is part of the run fingerprint.
"""

from __future__ import annotations

import math
from typing import Any

from hivemind_ext.errors import ConfigurationError

MAX_HOPS = 4
"""At most this many hops: ``4**4 = 256`` peers in groups of 4 reach the global mean; beyond, each
hop costs a matchmaking and an all-reduce for a shrinking gain (the rotation keeps mixing)."""

AUTO = "auto"


def check_hops(value: Any) -> int | str:
    """``value`` if it is a valid ``grad_averaging_hops`` (an int in ``[1, MAX_HOPS]`` or ``"auto"``),
    else ConfigurationError."""
    if value == AUTO and isinstance(value, str):
        return AUTO
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_HOPS:
        raise ConfigurationError(f"grad_averaging_hops must be an integer in [1, {MAX_HOPS}] or 'auto', got {value!r}")
    return value


def hop_count(setting: int | str, *, swarm_size: int, group_size: int | None) -> int:
    """The gradient rounds of one epoch: ``setting`` itself, or for ``"auto"`` the fewest ``d`` with
    ``group_size ** d >= swarm_size`` (1 in one group of the whole swarm, ``group_size`` None or
    below 2), at most :data:`MAX_HOPS`."""
    if setting != AUTO:
        return int(setting)
    if group_size is None or group_size < 2 or swarm_size <= group_size:
        return 1
    hops = 1
    while group_size**hops < swarm_size and hops < MAX_HOPS:
        hops += 1
    return hops


def hop_prefix(grad_prefix: str, hop: int) -> str:
    """The matchmaking prefix of hop ``hop`` (0: the gradient round's own prefix)."""
    return grad_prefix if hop == 0 else f"{grad_prefix}_hop{hop}"


def hop_plan(now: float, *, matchmaking_time: float, averaging_timeout: float) -> tuple[float, float]:
    """``(scheduled_time, deadline)`` of a hop that starts looking at ``now``: as a gradient round that
    expects a group size (:func:`~hivemind_ext.optim.rounds.plan_round`), it looks for a full group for
    at most two ``matchmaking_time`` (the first in its shard, the second on the coarser boards it falls
    back to, where full groups still form at once), then forms whatever group is there, or none: the
    search cut-off. Its all-reduce gets ``averaging_timeout`` from then."""
    scheduled = now + 2 * matchmaking_time
    return scheduled, scheduled + averaging_timeout


def weighted_mean_after_hops(
    values: dict[str, float], weights: dict[str, float], groups: list[list[list[str]]]
) -> dict[str, tuple[float, float]]:
    """The model of hops (for tests and simulations): each peer's value after the rounds ``groups``
    (per hop, the groups formed), each group averaging its members' values weighted by the weights
    they cover; returns ``{peer: (value, covered weight)}``."""
    state = {peer: (float(values[peer]), float(weights[peer])) for peer in values}
    for hop in groups:
        for group in hop:
            total = sum(state[p][1] for p in group)
            if total <= 0 or not math.isfinite(total):
                continue
            mean = sum(state[p][0] * state[p][1] for p in group) / total
            for peer in group:
                state[peer] = (mean, total)
    return state
