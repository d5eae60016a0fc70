"""How long each matchmaking record lives in the DHT: as long as its purpose, not longer.

Every board read returns every live record of the group key (see :mod:`.board`), about 1 KB each once
signed (:mod:`.authenticity`), from every node that holds the key. Records used to live three
``request_timeout`` past their last write whatever they were for, so with rounds a few seconds apart
each read also carried the seals, commits and markers of the two or three rounds before (a board
answer grew from 5.3 KB to 17.6 KB over three rounds of 4 peers on shaped links). A group's records
are read only while the group is being formed, and its last reader is a member still waiting for the
commit, so they now expire with the group:

- a seal lives until its commit time plus :data:`LAG_MARGIN`: looking peers join it only until its
  commit time (:func:`.group.is_open`), and readers believe a commit only together with its seal;
- a commit lives as long as its seal, and at least :data:`LAG_MARGIN` past the moment it is written
  (a leader that commits after its commit time stores its seal again with the commit's expiration);
- a ``joined`` marker lives as long as the seal of the group it joined (its leader counts it as a
  confirmation until it commits), a ``left`` marker :data:`LAG_MARGIN` (leaders that sealed the
  attempt stop waiting for it), and either at least until just after the declaration it replaces,
  which the DHT requires of a record overwriting another;
- a declaration lives one ``request_timeout`` and is refreshed (unchanged, see :mod:`.protocol`).

:data:`LAG_MARGIN` is the DHT lag the protocol tolerates (the property tests draw lags of up to 0.4
``request_timeout``, a record reaching each reader after its own lag): a member whose reads lag more
than that past the commit time may miss the commit, the protocol's documented gap (it then leaves,
and the all-reduce runs without it). A group's records are gone about one and a half
``request_timeout`` after it was sealed, so rounds further apart than that read none of an earlier
round's records; rounds closer together read those of the rounds that ended in the last 1.5 timeouts.
"""

from __future__ import annotations

import math

from hivemind_ext.averaging.matchmaking.board import Write, commit_write, marker_write, sealed_write
from hivemind_ext.averaging.matchmaking.group import Commit, Declaration, MatchmakingConfig, PeerKey, SealedGroup

LAG_MARGIN = 1 / 2
"""Share of ``request_timeout`` that a group's records outlive the moment they stop being needed."""


def seal_expiration(group: SealedGroup, config: MatchmakingConfig) -> float:
    """When a sealed group's record expires: :data:`LAG_MARGIN` past its commit time."""
    return group.commit_by + LAG_MARGIN * config.request_timeout


def seal_record(group: SealedGroup, config: MatchmakingConfig) -> Write:
    """The record of a group its leader seals."""
    return sealed_write(group, seal_expiration(group, config))


def commit_writes(
    group: SealedGroup, members: tuple[PeerKey, ...], now: float, config: MatchmakingConfig
) -> tuple[Write, ...]:
    """The records a leader stores to commit ``group`` with ``members`` (none: it abandons the group):
    the commit, preceded by the seal again if the commit must outlive the seal's expiration (a
    commit is believed only together with its seal; see :mod:`.authenticity`)."""
    sealed = seal_expiration(group, config)
    expiration = max(sealed, now + LAG_MARGIN * config.request_timeout)
    commit = commit_write(Commit(group.group_id, members), expiration)
    return (sealed_write(group, expiration), commit) if expiration > sealed else (commit,)


def marker_expiration(
    declaration: Declaration, group: SealedGroup | None, now: float, config: MatchmakingConfig
) -> float:
    """When the marker that overwrites ``declaration`` expires: with the seal of the ``group`` it
    joined, or :data:`LAG_MARGIN` from ``now`` if it left; never before the declaration (the DHT keeps
    the record that expires last, so the marker must expire strictly after what it replaces)."""
    purpose = now + LAG_MARGIN * config.request_timeout if group is None else seal_expiration(group, config)
    return max(purpose, math.nextafter(declaration.expiration, math.inf))


def marker_record(
    declaration: Declaration, group: SealedGroup | None, now: float, config: MatchmakingConfig
) -> tuple[float, Write]:
    """The expiration and record of the marker that ends ``declaration``'s attempt (``group``: the
    group it joined; None: it left)."""
    expiration = marker_expiration(declaration, group, now, config)
    return expiration, marker_write(declaration.member.key, None if group is None else group.group_id, expiration)
