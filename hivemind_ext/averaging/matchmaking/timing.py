"""Sealing ahead of the scheduled time, so that a scheduled all-reduce starts on time: pure rules.

The grouping rule (:func:`.group.plan_groups`) lets a group smaller than ``target_group_size`` form
only once a looking peer's scheduled time has come. Forming it then takes the protocol's four DHT
round trips (seal, confirm, commit, read the commit), so the all-reduce of a scheduled round used to
start 0.1-0.3 s after its scheduled time on a loaded loopback, where hivemind, whose followers join
their leader before the scheduled time, starts it at once (hivemind's ``test_averaging_trigger``:
all four peers of a round scheduled 0.5 s ahead are running the all-reduce 0.6 s after the step).

So peers plan *ahead*: from :func:`seal_time` on (a little before a declaration's scheduled time),
a peer plans as if that declaration were already due, and the leader seals and commits the group
early; the group's all-reduce then starts at :func:`group_start`, the moment the unshifted rule
would have formed it. Every peer that declared before the lead window is in the group, and the
group is final when the scheduled time comes. Full groups still form at once and start at once
(:func:`plan_ahead` tries the unshifted rule first); only what the unshifted rule leaves waiting is
planned ahead.

The price: a peer that starts looking within the lead window of a sealed group's scheduled time
misses that group (it looks on, with its own scheduled time). The lead is short (at most
``SEAL_AHEAD_POLLS`` poll intervals, 0.5 s by default) and at most three quarters of the
declaration's own wait, so peers that start looking a little apart with a short
``min_matchmaking_time`` still meet.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from hivemind_ext.averaging.matchmaking.group import Declaration, MatchmakingConfig, plan_groups

SEAL_AHEAD_POLLS = 10
"""At most this many poll intervals before its scheduled time, a declaration is planned as due:
enough for the seal, the confirmations and the commit (seven DHT calls and the polls between them,
30-60 ms each on a loaded loopback, plus a read that stalls now and then) to be done by the
scheduled time."""

SEAL_AHEAD_SHARE = 0.75
"""...and at most this share of the time between its declaration and its scheduled time, so that
peers which start looking a little later than the first still make the group."""


def seal_time(declaration: Declaration, config: MatchmakingConfig) -> float:
    """When a declaration starts counting as due for planning: a little before its scheduled time."""
    wait = max(0.0, declaration.ready_at - declaration.declared_at)
    return declaration.ready_at - min(SEAL_AHEAD_POLLS * config.poll_interval, SEAL_AHEAD_SHARE * wait)


def plan_ahead(
    now: float, looking: Sequence[Declaration], config: MatchmakingConfig
) -> list[tuple[tuple[Declaration, ...], float]]:
    """The groups to form now, each with the time its all-reduce starts.

    The groups of :func:`.group.plan_groups` at ``now`` if it forms any (they start at once);
    otherwise its groups with every declaration due from its :func:`seal_time` on, which start at
    :func:`group_start`. Declarations in the result are those of ``looking``.
    """
    groups = plan_groups(now, looking, config)
    if groups:
        return [(group, now) for group in groups]
    by_key = {d.member.key: d for d in looking}
    early = [replace(d, ready_at=min(d.ready_at, seal_time(d, config))) for d in looking]
    start = group_start(now, looking)
    return [(tuple(by_key[d.member.key] for d in group), start) for group in plan_groups(now, early, config)]


def group_start(now: float, looking: Sequence[Declaration]) -> float:
    """When a group planned ahead from ``looking`` starts: when the first of them is due, never before now."""
    return max(now, min((d.ready_at for d in looking), default=-math.inf))
