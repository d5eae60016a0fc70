"""One peer's side of the matchmaking protocol as a pure state machine.

:func:`step` takes the peer's state, the clock and one parsed read of the DHT, and returns the next
state, the records to store, and the group once it is final. The I/O loop in
:mod:`hivemind_ext.averaging.matchmaking.matchmaker` only reads, calls :func:`step`, writes and sleeps; tests
run the same function over simulated, lagging DHT views. The protocol itself (phases, why it makes
members agree, and its failure modes) is described in that module's docstring.

States: :class:`Looking` (declared, waiting for a group), :class:`Leading` (sealed a group, waiting
for confirmations), :class:`Following` (confirmed a sealed group, waiting for its commit).

Windows counted in poll intervals (``*_POLLS``, margins of ``poll_interval``) are counted in the
``poll_interval`` of the configuration a step gets: the I/O layer hands in the peer's *pace*
(:func:`.pace.paced`: ``max(poll_interval, its reads' duration)``, at most ``request_timeout / 4``),
so that on a slow DHT a window still holds the reads it was meant to.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace

from hivemind_ext.averaging.matchmaking.board import Write, declaration_write
from hivemind_ext.averaging.matchmaking.group import (
    Board,
    Declaration,
    GroupInfo,
    MatchmakingConfig,
    Member,
    PeerKey,
    SealedGroup,
    all_auxiliary,
    group_id_for,
    is_open,
    is_viable,
    looking_peers,
    plausible,
)
from hivemind_ext.averaging.matchmaking.lifetimes import commit_writes, marker_record, seal_record
from hivemind_ext.averaging.matchmaking.rotation import coarser, shard_depth, sibling
from hivemind_ext.averaging.matchmaking.timing import plan_ahead, seal_time

REFRESH_FRACTION = 2 / 3  # refresh a declaration once less than this share of its lifetime is left
IGNORE_TIMEOUTS = 3  # request timeouts for which a peer that failed this one is left out of its plans
URGENT_POLL_FRACTION = 0.2  # share of poll_interval to wait between reads while a group is being formed

DEPUTY_FRACTION = 1 / 4
"""A member of a planned group that has waited this share of ``request_timeout`` for the group's
leader to seal, times its position in the group, seals the group itself without the members before
it (see :func:`_deputy`). A live leader seals within a read or two of its members planning it; a
dead one (a peer that died after declaring) held its group until its declaration expired, one
``request_timeout`` (1,000 simulated peers, 2% dying: 12-13 polls to group everyone, against a goal
of 10). Sealing early is safe: if the leader was only slow and seals too, the lower leader's seal
wins and the deputy gives way (:func:`_step_leading`), at the cost of a few reads, never of ignoring
an honest peer."""

STALE_LEFT = 1 / 5
"""A looking peer refreshes its declaration once less than ``REFRESH_FRACTION`` of its lifetime is
left; one with less than this share left missed its refresh by 7/15 of ``request_timeout``. A member
that joined a group stops refreshing too, and writes its marker instead: the leader takes it for gone
only if that marker lags by more than about 7/15 of ``request_timeout``, less a poll. It was 1/3
(the refresh missed by a third): with markers lagging up to 0.4 of a timeout, live members that had
joined were left out of their commit, and two of six simulated peers waited 8 s for a group; 1/4
still did that in 1 of 2,500 random swarms, 1/5 in none, and the 1,000-peer simulation below
stays within 3.2-6.9 polls (2% dying, seeds 0-7). A
leader stops waiting for a member of its sealed group that shows such a declaration (it has not
marked its attempt, so it is still looking, and not refreshing: dead or cut off) and remembers it
(:attr:`Leading.gone`: the declaration expires next, and a member with no record at all is waited
for, since a member of a direct group that marked itself on the board but has not called yet shows
none). It waited until the group's commit time, one ``request_timeout`` after the seal
(1,000 simulated peers, 2% dying: groups sealed ahead with a member that had died were final 11-13
polls after the scheduled time, against a goal of 10). Only the leader's wait uses it: planning
with such a declaration as usual (session 7 stopped planning with it, and a DHT lagging past
``request_timeout`` then grouped nobody)."""

HOLD_POLLS = 2
"""A group sealed ahead with room on a sharded swarm's board (see :func:`_holds`) commits this many
poll intervals before it starts, not as soon as its members confirmed."""
HOP_WAIT_POLLS = 4
"""A stray that came to a sibling shard's board moves on once it has been in no planned group for
this many poll intervals and reads there: enough for a group with room to take it in (the leader reads
it, seals anew, the stray reads that seal); after ``HOP_EMPTY_POLLS`` where the board shows nothing
that could take it (no open group with room, nobody else looking)."""
HOP_EMPTY_POLLS = 1
EAGER_POLLS = 5  # for this many poll intervals after it starts looking, a peer reads at the urgent pace
SHARD_WAIT_POLLS = 10
"""A peer that is in no planned group this many poll intervals and reads after it arrived on a
shard's board (the shard holds fewer than ``target_group_size`` peers) moves to the coarser shard
(see :mod:`.rotation`). Reads count too: on a loaded machine a read can take several poll
intervals, and a peer that left before it could see its shard's peers would stall them."""


Ignored = tuple[tuple[str, float], ...]  # (peer id, DHT time until which it is left out of plans)
Dead = tuple[tuple[PeerKey, float], ...]  # (attempt, the expiration its declaration had when seen dead)


@dataclass(frozen=True)
class Looking:
    """Declared (or about to be) and waiting for a group.

    ``waiting_on``: the leader of the group this peer is planned into, and since when; ``ignored``:
    (peer id, until when) of peers that stayed planned leaders for ``request_timeout`` without
    sealing, did not confirm a group this peer sealed, or sealed one and never committed it (dead, or
    a hostile peer that declares and never acts), left out of this peer's plans for
    ``IGNORE_TIMEOUTS`` request timeouts. Without it, a peer that keeps refreshing a declaration
    could hold a group back for ever (a Sybil that declares on every shard's board, for instance);
    with it, such a peer costs each group it is planned into one ``request_timeout`` at most once per
    ``IGNORE_TIMEOUTS``, and an honest peer that lagged is planned with again afterwards.

    ``shunned``: (peer id, until when) of leaders that failed this peer after it joined their group
    (no commit until one ``request_timeout`` past the commit time, or a direct answer that was a lie:
    :func:`leader_failed`), whose seals it does not join for ``IGNORE_TIMEOUTS`` request timeouts
    (it also leaves them out of its plans, as ``ignored``). Such a leader used to seal the peer's next
    attempt at once and hold it again, attempt after attempt, until its deadline. Only these: a peer
    that merely failed to seal in time, or to confirm, may be an honest one that lagged, and skipping
    its seals too left honest peers ignoring each other under load.
    """

    declaration: Declaration
    waiting_on: tuple[str, float] | None = None
    ignored: Ignored = ()
    arrived: float | None = None  # when it came to this shard's board (None: when it declared)
    reads: int = 0  # boards read since then
    shunned: Ignored = ()
    dead: Dead = ()  # members of a group this peer led that missed their refresh: see :func:`_forget_dead`
    reopened: frozenset[str] = frozenset()  # peers this peer abandoned a group it led for: see :func:`_strays`
    leader_until: float = -math.inf  # when the planned leader's declaration expires, as last seen (_step_looking)
    hops: int = 0  # sibling shards this search visited as a stray (see "Strays" in .rotation)


@dataclass(frozen=True)
class Leading:
    """Sealed ``group`` as its leader; waiting for members to confirm, then commits.

    ``full_until``: the group was sealed full before any member's scheduled time (only full groups
    form then, see :func:`.group.plan_groups`); until this time it commits only if every member
    confirmed, and is abandoned otherwise. Committing the rest would leave the peers it was meant to
    pair them with short of a full group until their scheduled time (seen under load: two leaders
    with different views sealed overlapping groups of 4 out of 8 peers, both committed 3, and the
    last 2 waited out their deadline)."""

    declaration: Declaration
    group: SealedGroup
    ignored: Ignored = ()  # carried over from Looking: see there
    full_until: float = -math.inf
    gone: frozenset[PeerKey] = frozenset()  # members seen with a declaration that missed its refresh (STALE_LEFT)
    shunned: Ignored = ()  # carried over from Looking: see there
    dead: Dead = ()  # carried over from Looking, plus the gone members' attempts (see :func:`_forget_dead`)
    reopened: frozenset[str] = frozenset()  # carried over from Looking: see there


@dataclass(frozen=True)
class Following:
    """Confirmed ``group``; waiting for its leader's commit."""

    declaration: Declaration
    group: SealedGroup
    ignored: Ignored = ()
    shunned: Ignored = ()  # carried over from Looking: see there
    dead: Dead = ()  # carried over from Looking: see there
    reopened: frozenset[str] = frozenset()  # carried over from Looking: see there


State = Looking | Leading | Following


@dataclass(frozen=True)
class Step:
    """What one step decided: the next state, records to store first (in this order), the group once
    it is final, and whether the board is about to change (a group is being formed with this peer),
    so that the next read should come sooner than ``poll_interval``. A final group's all-reduce
    starts no earlier than ``start_at`` (a group sealed ahead of its scheduled time). ``fall_back``:
    this peer's shard is too empty, it should look on the coarser shard's board (:func:`fall_back`);
    ``hop``: with ``fall_back``, on the next sibling shard's board instead, its ``hop``-th visit there."""

    state: State
    writes: tuple[Write, ...] = ()
    group: GroupInfo | None = None
    urgent: bool = False
    start_at: float = -math.inf
    fall_back: bool = False
    hop: int = 0


def step(state: State, now: float, board: Board, config: MatchmakingConfig, *, direct: bool = False) -> Step:
    """Advance one peer's matchmaking by one read of the DHT.

    ``direct``: this peer serves direct confirmations (:mod:`.confirmation`), so a group it seals
    is confirmed by calls to it; the I/O layer then hands in, as the board's markers of its group's
    members, the confirmations it received that way."""
    if isinstance(state, Looking):
        return _step_looking(state, now, board, config, direct)
    if isinstance(state, Leading):
        return _step_leading(state, now, board, config)
    return _step_following(state, now, board, config)


def withdrawal(state: State, now: float, config: MatchmakingConfig) -> tuple[Write, ...]:
    """Records that take a peer out of matchmaking when it stops early (cancelled, deadline, error).

    A looking or following peer marks its attempt as left: leaders stop counting on it. A leader also
    commits its group as abandoned, so its followers look again at once instead of timing out.
    """
    _, left = _mark(state.declaration, None, now, config)
    if isinstance(state, Leading):
        return (left, *commit_writes(state.group, (), now, config))
    return (left,)


def fall_back(
    me: Declaration, now: float, config: MatchmakingConfig, hop: int = 0
) -> tuple[MatchmakingConfig, Looking, Write]:
    """A looking peer moves to the coarser shard (see :mod:`.rotation`), or with ``hop`` (a
    :attr:`Step.hop`) to the next sibling shard as a stray: the configuration to use from now on, its
    new state (a fresh attempt that keeps its seniority and times, declared by its next step), and the
    marker that withdraws the old attempt, to store on the old shard's board."""
    _, left = _mark(me, None, now, config)
    if hop:
        moved = replace(config, digits=sibling(config.digits, config.shard_depth, config.target_group_size or 1, hop))
    else:
        moved = replace(config, shard_depth=coarser(config.shard_depth))
    member = replace(me.member, attempt=next_attempt(me.member.attempt))
    fresh = replace(me, member=member, prefix=moved.group_key, expiration=-math.inf, digits=moved.digits)
    return moved, Looking(fresh, None, (), arrived=now, hops=hop), left


def next_attempt(attempt: str) -> str:
    """The token of a peer's next attempt: derived, so the state machine needs no randomness, and
    unguessable to others as long as the first token was random."""
    return hashlib.sha256(attempt.encode()).hexdigest()[:16]


def _step_looking(state: Looking, now: float, board: Board, config: MatchmakingConfig, direct: bool) -> Step:
    me = state.declaration
    ignored = _current(state.ignored, now)
    # A group sealed for me wins over my own plan: joining it is what keeps views from diverging.
    offers = _offers(me, now, board, config, state.shunned)
    if offers:
        return _join(me, min(offers, key=_lowest_leader), now, config, state)
    if me.expiration == -math.inf:
        # A new attempt only declares; it plans (and may seal) from its next step on. Sealing on its first
        # read, before anyone had seen it, took members out of groups planned without it (a lower leader's
        # seal wins), and a peer that died right after held them two request timeouts (1,000 simulated
        # peers, 2% dying). The matchmaker's first step sees an empty board anyway; the rule lives here so
        # that every driver (the simulation too) runs the protocol the peers run.
        me, declare = _refresh(me, now, config)
        return Step(replace(state, declaration=me), declare, urgent=True)
    me, refresh = _refresh(me, now, config)
    mine, start_at, company = _my_plan(me, now, board, config, ignored, dict(state.dead))
    if mine is None and ignored and company < config.min_group_size and config.shard_depth == 0:
        # alone on the prefix's board, the last one (nowhere to fall back): better with the peers I ignore.
        # Not where others are looking: before the scheduled time a peer is in no group while it waits
        # for a full one, and planning with a hostile leader it had left then held three honest peers
        # until their deadline (test_matchmaking_dht, LyingDesk)
        mine, start_at, _ = _my_plan(me, now, board, config, set(), dict(state.dead))
    arrived = me.declared_at if state.arrived is None else state.arrived
    waited = state.reads >= SHARD_WAIT_POLLS and now >= arrived + SHARD_WAIT_POLLS * config.poll_interval
    deputy = _deputy(state, me, mine, now, config)
    if deputy:
        return _lead(state, me, deputy, now, config, start_at, direct)
    stranded = mine is None or deputy == ()  # planned only with overdue peers: as good as no group
    # Not on a read that shows no record at all of the leader that the read before planned it with: a read
    # may lag more than the one before and show less (reads go to different replicas). A peer that fell
    # back on such a read left the leader that had just sealed it alone on the shard's board; that one
    # fell back last, after the prefix's board had committed its groups: the last live peer in no group
    # (1,000 simulated peers, 0% dying, seeds 9 and 20). The next read comes a poll later, when the lag
    # has passed. Only then: a peer that waited on every read that lost its plan (its planned leader had
    # gone elsewhere, or died and its declaration expired) came too late to the prefix's board itself
    # (2% dying, seed 10).
    lost = (
        mine is None
        and state.waiting_on is not None
        and now < state.leader_until  # its declaration did not simply expire (a leader that died)
        and _vanished(state.waiting_on[0], board)
    )
    if stranded and config.shard_depth > 0 and not lost:
        hop = _hop(state, me, now, board, config, waited)
        if hop is not None:  # my shard is too empty: no group for me here
            return Step(Looking(me), refresh, fall_back=True, hop=hop)
    if mine is None or mine[0].member != me.member:
        # In a planned group: its leader seals soon. Just started looking: peers that start at the same
        # moment (as in synchronous training) are declaring right now. Either way, read again soon.
        eager = now < me.declared_at + EAGER_POLLS * config.poll_interval
        return Step(_waiting(state, me, mine, now, config), refresh, urgent=mine is not None or eager)
    return _lead(state, me, mine, now, config, start_at, direct)


def _hop(
    state: Looking, me: Declaration, now: float, board: Board, config: MatchmakingConfig, waited: bool
) -> int | None:
    """Where a peer in no planned group on a shard's board moves (see "Strays" in :mod:`.rotation`):
    None: nowhere yet; 0: to the coarser shard; ``k``: to the next sibling shard, its ``k``-th visit.

    On its own shard, a peer moves to a sibling once it would have been planned ahead
    (:func:`.timing.seal_time`: a shard that can place it has sealed its group with it by then), or
    to the coarser shard if ``SHARD_WAIT_POLLS`` come before that; on a
    sibling it visits, after ``HOP_WAIT_POLLS`` (a group with room there takes it in meanwhile), or
    ``HOP_EMPTY_POLLS`` where nothing there could. It visits the siblings in turn, round the ring and
    its own shard again (a peer there may be looking for it by then: stopping after one round left one
    alone, 32 simulated peers in groups of 4, seed 8), until its scheduled time, then falls back as
    every peer did (and waits on the coarser shards as they do)."""
    polls = HOP_EMPTY_POLLS if _nothing_for(me, now, board, config) else HOP_WAIT_POLLS
    if state.hops:
        arrived = me.declared_at if state.arrived is None else state.arrived
        if state.reads < polls or now < arrived + polls * config.poll_interval:
            return None
        return state.hops + 1 if now < me.ready_at else 0
    # not on the first reads after a group it was in broke up (it looks again under a new attempt, and
    # reads 0): the shard's other peers of that group plan again with it. One that left at once was
    # the last live peer in no group (1,000 simulated peers, 0% dying, seed 1)
    # Long before its seal time, a peer in no group after SHARD_WAIT_POLLS falls back to the coarser shard
    # as before, where the rests of the shards form full groups at once: visiting the siblings then (real
    # peers wait seconds, min_matchmaking_time 5 s) split full groups up, into groups of 2 and 3 (16
    # simulated peers in groups of 4, per-peer scheduled times 5 s on: 18 groups of 2 in 20 seeds)
    if _first_shard(config):
        if state.reads < polls:
            return None
        if now >= seal_time(me, config):
            return 1 if now < me.ready_at else 0
        return 0 if waited else None
    return 0 if waited or now >= me.ready_at else None


def _nothing_for(me: Declaration, now: float, board: Board, config: MatchmakingConfig) -> bool:
    """Whether ``board`` shows nothing that could place a stray: no open group with room (it takes the
    stray in, or abandons its seal to plan again with it: see :func:`_step_leading`), and nobody else
    looking."""
    target = config.target_group_size
    room = any(is_open(g, now, board) and (target is None or len(g.members) < target) for g in board.sealed.values())
    others = [d for d in looking_peers(now, board, config) if d.member.peer_id != me.member.peer_id]
    return not room and not others


def _first_shard(config: MatchmakingConfig) -> bool:
    """Whether ``config`` is the finest shard of its swarm: the one its peers declare on first."""
    target, expected = config.target_group_size, config.expected_group_size
    if not config.shard_depth or target is None:
        return False
    return config.shard_depth == min(shard_depth(expected, target), len(config.digits))


def _current(entries: Ignored, now: float) -> set[str]:
    """The peer ids of ``entries`` (``ignored`` or ``shunned``: peer id, until when) still in force at ``now``."""
    return {peer for peer, until in entries if until > now}


def _vanished(peer_id: str, board: Board) -> bool:
    """Whether ``board`` shows no record of ``peer_id``: no declaration, marker, or seal it leads. A
    live peer's records stay on the board while it looks or joins, and a dead one's until they
    expire, so a read that shows none of them lags behind the read that did."""
    keys = (*board.declarations, *board.markers)
    return all(key[0] != peer_id for key in keys) and all(g.leader.peer_id != peer_id for g in board.sealed.values())


def _my_plan(
    me: Declaration,
    now: float,
    board: Board,
    config: MatchmakingConfig,
    ignored: set[str],
    dead: dict[PeerKey, float],
) -> tuple[tuple[Declaration, ...] | None, float, int]:
    """The group planned with this peer (None: none), when it starts, and how many peers it planned
    from (itself included): the board's looking peers less those ``ignored`` and the ``dead``
    declarations that were not refreshed since (see :func:`_forget_dead`)."""
    overlay = {
        key: d
        for key, d in board.declarations.items()
        if d.member.peer_id not in ignored and d.expiration > dead.get(key, -math.inf)
    }
    overlay[me.member.key] = me  # my own declaration, even before the DHT shows it
    peers = looking_peers(now, replace(board, declarations=overlay), config)
    planned = plan_ahead(now, peers, config)
    mine, start_at = next(((group, start) for group, start in planned if me in group), (None, now))
    return mine, start_at, len(peers)


def _lead(
    state: Looking,
    me: Declaration,
    mine: tuple[Declaration, ...],
    now: float,
    config: MatchmakingConfig,
    start_at: float,
    direct: bool,
) -> Step:
    """Seal ``mine`` (this peer first in it) as its leader and mark this attempt as joined."""
    sealed = _seal(mine, now, config, start_at, direct)
    joined, confirm = _mark(me, sealed, now, config)
    writes = (seal_record(sealed, config), confirm)
    due = min(d.ready_at for d in mine)
    full_until = due if due > now and start_at <= now else -math.inf  # a full group, not one sealed ahead
    leading = Leading(
        joined, sealed, state.ignored, full_until, shunned=state.shunned, dead=state.dead, reopened=state.reopened
    )
    return Step(leading, writes, urgent=True)


def _deputy(
    state: Looking, me: Declaration, mine: tuple[Declaration, ...] | None, now: float, config: MatchmakingConfig
) -> tuple[Declaration, ...] | None:
    """The group this peer seals as a deputy, if its planned group's leader is overdue.

    The member at position ``k`` of its planned group (leader at 0) that has waited ``k`` times
    :data:`DEPUTY_FRACTION` of ``request_timeout`` on the same leader seals the group from itself
    on: the same members as planned, less the ``k`` before it (they are silent, dead or hostile), so
    the groups around it stay as everyone planned them. None: no leader is overdue; ``()``: one is,
    but the rest could not run (fewer than ``min_group_size``, or not viable), so this peer is as
    good as in no group (in a shard, it falls back at its scheduled time instead of waiting there
    until the overdue declarations expire)."""
    if mine is None or state.waiting_on is None or state.waiting_on[0] != mine[0].member.peer_id:
        return None
    position = next(i for i, d in enumerate(mine) if d.member == me.member)
    if position == 0 or now - state.waiting_on[1] <= position * DEPUTY_FRACTION * config.request_timeout:
        return None
    rest = mine[position:]
    return rest if len(rest) >= config.min_group_size and is_viable(d.member for d in rest) else ()


def _waiting(
    state: Looking, me: Declaration, mine: tuple[Declaration, ...] | None, now: float, config: MatchmakingConfig
) -> Looking:
    """The next looking state of a peer that does not lead ``mine`` (its planned group, if any)."""
    state = replace(state, reads=state.reads + 1)
    if mine is None:
        return replace(state, declaration=me, waiting_on=None)
    leader = mine[0].member.peer_id
    state = replace(state, leader_until=mine[0].expiration)
    if state.waiting_on is None or state.waiting_on[0] != leader:
        return replace(state, declaration=me, waiting_on=(leader, now))
    if now - state.waiting_on[1] > config.request_timeout:  # it should have sealed long ago
        return replace(state, declaration=me, waiting_on=None, ignored=_ignore(state.ignored, {leader}, now, config))
    return replace(state, declaration=me)


def _ignore(ignored: Ignored, peers: set[str], now: float, config: MatchmakingConfig) -> Ignored:
    """``ignored`` without what has expired, plus ``peers`` for the next ``IGNORE_TIMEOUTS``."""
    until = now + IGNORE_TIMEOUTS * config.request_timeout
    kept = tuple((peer, end) for peer, end in ignored if end > now and peer not in peers)
    return kept + tuple((peer, until) for peer in sorted(peers))


def _step_leading(state: Leading, now: float, board: Board, config: MatchmakingConfig) -> Step:
    group, me = state.group, state.declaration.member
    offers = _offers(state.declaration, now, board, config, state.shunned, group.group_id)
    senior = [g for g in offers if g.leader.key < me.key]
    if senior:
        # Two leaders with different views sealed groups that share members: the lowest leader keeps
        # its group and the others join it (a leader does not confirm other groups while it leads,
        # so both groups used to commit short, and the peers that neither took were left over).
        abandoned = commit_writes(group, (), now, config)
        joined = _join(state.declaration, min(senior, key=lambda g: g.group_id), now, config, state)
        return replace(joined, writes=(*abandoned, *joined.writes))
    others = [m for m in group.members if m != me]
    confirmed = {me.key} | {m.key for m in others if board.markers.get(m.key) == group.group_id}
    # once seen not refreshing, a member is not waited for again: its declaration then expires, and a
    # member without any record on the board is waited for (in a direct group it may be calling)
    stale = {m.key for m in others if m.key not in board.markers and _stale(board.declarations.get(m.key), now, config)}
    seen_dead = {key: board.declarations[key].expiration for key in stale}
    state = replace(state, gone=state.gone | stale, dead=_forget_dead(state.dead, seen_dead, now))
    # a member that another group dropped is on its way here too (see _dropped)
    waiting = any(
        m.key not in state.gone and (_coming(m, group, me, now, board) or _dropped(m, group, board)) for m in others
    ) or _rivals(group, state, now, board, config)
    if waiting and now < group.commit_by and not _deserted(group, state, now, board, config):
        # on a shard's board, a group that waits for a member takes a stray in meanwhile: a member that died
        # held it until its declaration went stale, and the stray had moved on by then, to be left in no
        # group (1,000 simulated peers, 2% dying, seed 4)
        strays = _strays(group, state, state.declaration, now, board, config) if config.shard_depth else ()
        if strays and all(d.member.key > me.key for d in strays):
            return _taking_in(state, strays, now, config)
        return Step(state, urgent=True)
    members = tuple(m for m in group.members if m.key in confirmed)
    # a group sealed with only auxiliary members may commit as such; a mixed group whose contributors
    # dropped out is abandoned (its auxiliary members look again, for a group that has work)
    viable = is_viable(members) or all_auxiliary(group.members)
    # short: a full group that lost a live member before its scheduled time; a member gone dead does not count
    short = now < state.full_until and any(m.key not in confirmed and m.key not in state.gone for m in others)
    if len(members) < config.min_group_size or not viable or short:
        members = ()
    strays = _strays(group, state, state.declaration, now, board, config)
    if members and strays and all(d.member.key > me.key for d in strays):  # take them in (see _take_in)
        return _taking_in(state, strays, now, config)
    settled = all(d.expiration - config.request_timeout <= now - config.poll_interval for d in strays)
    if members and strays and settled:
        # A stray below me would be the leader of the group that takes it in, which no seal of mine can
        # make it (a stray below that sealed the group with itself let a lying leader take every honest group
        # over: LyingDesk), and left alone it was the last live peer in no group (1,000 simulated peers, 0%
        # dying, seeds 15 and 17). So the group is abandoned, and its members plan again with the stray:
        # once per stray peer (reopened), as a take-in; a stray this leader ignores (one that failed it) is
        # no stray (_strays). Its members do not ignore me: they look again at once (_step_following). Only
        # a stray that declared a poll ago at least: one that had just abandoned a group was about to plan
        # one, and abandoning for it set off a cascade of abandoned groups (4 peers, one board, per-record
        # lag: test_a_round_reads_no_records_of_the_rounds_before).
        abandoned = commit_writes(group, (), now, config)
        reopened = state.reopened | {d.member.peer_id for d in strays}
        return _retry(state.declaration, now, config, abandoned, state.ignored, replace(state, reopened=reopened))
    if members and _holds(group, now, config):
        return Step(state)
    commits = commit_writes(group, tuple(m.key for m in members), now, config)
    if not members:
        # whoever did not confirm is left out of my next plans (an honest one went to another group). Not
        # only those without a marker: a hostile member writes markers too, and honest peers that kept it
        # in their plans failed to regroup around a lying leader (test_matchmaking_dht, LyingDesk, 2 of 8)
        # Not those seen not refreshing: the declaration of a dead one expires before the ignore would end,
        # and one that only looked dead (a lagging DHT shows a live member's declaration before its refresh)
        # would be ignored by this leader while it plans this leader (8 peers in pairs, DHT lag 0.4 s: two
        # honest peers ignored each other until the deadline)
        # Nor, on a shard's board, one that left it (its marker says so): it moved to another shard's board,
        # and may come back there as a stray (see _hop); ignored, it was not taken in, and was left in no
        # group (32 simulated peers in groups of 4, seed 8)
        moved = {m.key for m in others if config.shard_depth and board.markers.get(m.key, "") is None}
        silent = {m.peer_id for m in others if m.key not in confirmed and m.key not in state.gone | moved}
        ignored = _ignore(state.ignored, silent, now, config)
        return _retry(state.declaration, now, config, commits, ignored, state)
    return Step(state, commits, GroupInfo(bytes.fromhex(group.group_id), members), start_at=group.start_at)


def _deserted(group: SealedGroup, state: Leading, now: float, board: Board, config: MatchmakingConfig) -> bool:
    """Whether a full group sealed before its scheduled time (:attr:`Leading.full_until`) on a shard's
    board has lost a member for good: its marker names another group that it does not come back from
    (:func:`_coming`, :func:`_dropped`), or that it left. Such a group commits short, which before the
    scheduled time it does not (it is abandoned), so its leader abandons it at once instead of waiting
    for the other members first: one that waited for a member that had died (until its declaration went
    stale, most of ``request_timeout``) while the rest joined a lower leader's rival seal looked again
    only after the shards' groups with room had committed, and was the last live peer in no group
    (1,000 simulated peers, 2% dying, seeds 12 and 13)."""
    if not config.shard_depth or now >= state.full_until:
        return False
    me = state.declaration.member
    return any(
        m.key in board.markers
        and board.markers[m.key] != group.group_id
        and not _coming(m, group, me, now, board)
        and not _dropped(m, group, board)
        for m in group.members
        if m != me
    )


def _taking_in(state: Leading, strays: tuple[Declaration, ...], now: float, config: MatchmakingConfig) -> Step:
    """The leader seals its group anew with ``strays`` (see :func:`_take_in`) and abandons the old seal."""
    group = state.group
    taken = _take_in(group, strays, now, config, group.direct)
    joined, confirm = _mark(state.declaration, taken, now, config)
    writes = (seal_record(taken, config), *commit_writes(group, (), now, config), confirm)
    reopened = state.reopened | {d.member.peer_id for d in strays}
    return Step(
        replace(state, declaration=joined, group=taken, full_until=-math.inf, reopened=reopened), writes, urgent=True
    )


def _holds(group: SealedGroup, now: float, config: MatchmakingConfig) -> bool:
    """Whether the leader of ``group``, sealed ahead with room on a board of a sharded swarm, holds its
    commit until :data:`HOLD_POLLS` poll intervals before the group starts, so that a stray that comes
    to the board until then (a sibling shard's, see "Strays" in :mod:`.rotation`) finds it open and is
    taken in (:func:`_strays`). Committed as soon as its members confirmed, such a group was final
    long before the scheduled time, and the stray that came a moment later was the last live peer in
    no group (64 simulated peers in groups of 8, 14 of 20 seeds). Its start does not change: a group
    sealed ahead starts at its scheduled time anyway."""
    target, expected = config.target_group_size, config.expected_group_size
    if target is None or expected is None or not config.digits or len(group.members) >= target:
        return False
    sharded = config.shard_depth > 0 or shard_depth(expected, target) > 0
    return sharded and now < group.start_at - HOLD_POLLS * config.poll_interval


def _lowest_leader(group: SealedGroup) -> tuple[PeerKey, str]:
    """Which of several open seals that list a looking peer it joins: the lowest leader's (then the
    lowest group id). The leader it leaves is above the one it joins, so that one can take it in if it
    ends alone (:func:`_rivals`); by group id alone, a member joined the higher of two leaders that
    had sealed it, and the lower one, which no open group takes in, was the last live peer in no group
    (1,000 simulated peers, 0% dying, seed 12)."""
    return (group.leader.key, group.group_id)


def _rivals(group: SealedGroup, state: Leading, now: float, board: Board, config: MatchmakingConfig) -> bool:
    """Whether the leader of ``group``, open with room, waits before it commits for the leader of
    another open seal that lists one of its members: a leader above it, which abandons that seal once
    it reads the member's marker, and looks again as a stray that this group takes in
    (:func:`_strays`). Two leaders that had sealed the last peers of the prefix's board around one peer
    each used to commit the lower group as soon as its members confirmed, a read before the higher one
    abandoned: that one was then the last live peer in no group (1,000 simulated peers, 0% dying, seed
    8). On a shard's board too: two strays that came to a sibling shard's board at once sealed its one
    peer (which had died) each, took in a third stray that joined the lower seal, and waited for the
    dead member until its declaration went stale; the lower group then committed on the read where the
    higher leader abandoned, and that leader fell back alone to the prefix's board (2% dying, seed 10).
    Only for a member that joined this group: one that joined the rival seal keeps it open, and a lower
    group on a shard's board that waited for it until it committed was then left with its leader alone
    (0% dying, seed 8 again). Bounded by ``commit_by``, as the wait for a silent member: a hostile leader that
    keeps such a seal open costs this group what a silent member costs."""
    target, me = config.target_group_size, state.declaration.member
    if target is not None and len(group.members) >= target:
        return False
    members = group.keys - {me.key}
    left_out = _current(state.ignored, now) | state.reopened
    return any(
        other.group_id != group.group_id
        and other.leader.key > me.key
        and other.leader.peer_id not in left_out
        and is_open(other, now, board)
        and any(board.markers.get(key) == group.group_id for key in other.keys & members)
        for other in board.sealed.values()
    )


def _strays(
    group: SealedGroup, state: Looking | Leading, me: Declaration, now: float, board: Board, config: MatchmakingConfig
) -> tuple[Declaration, ...]:
    """The looking peers (``me`` among them if it is looking) that the open ``group`` on the prefix's
    board takes in (see :func:`_take_in`): fewer than ``min_group_size`` of them besides the group,
    so that no plan places them, and room for them in the group. Empty: none, or the group does not."""
    target, members = config.target_group_size, {m.peer_id for m in group.members}
    if not is_open(group, now, board) or (target is not None and len(members) >= target):
        return ()
    ignored = _current(state.ignored, now)
    if isinstance(state, Looking) and ignored & members:
        return ()
    if config.shard_depth and isinstance(state, Leading):
        # on a shard's board, a stray above this leader is taken in even if this leader ignores it: what
        # bounds a hostile stray's cost is reopened (once per stray peer). A member that joined a lower
        # leader's rival seal is ignored by the leader it left, for the round; when its group broke up and
        # it was left over, the one group with room on its shard, that leader's, did not take it in, and it
        # fell back alone to the prefix's board (1,000 simulated peers, 0% dying, seeds 11 and 17)
        ignored = {peer for peer in ignored if peer < me.member.peer_id}
    # a member that looks again under a new attempt is a stray too: this group lists its old one, which
    # never confirms (see _take_in)
    moved = {d.member.peer_id for d in board.declarations.values() if d.member.key not in group.keys} & members
    left_out = ignored | (members - moved) | state.reopened
    dead = dict(state.dead)
    # nor a declaration that missed its refresh (STALE_LEFT): the peer died. Counted, it and a stray made
    # two, as if they could form a group of their own, and the group did not take the stray in: the last
    # live peer in no group (1,000 simulated peers, 2% dying, seed 0)
    overlay = {
        key: d
        for key, d in board.declarations.items()
        if d.member.peer_id not in left_out
        and d.expiration > dead.get(key, -math.inf)
        and not _stale(d, now, config)
        and (not config.shard_depth or _fresh(d, now, config))
    }
    if isinstance(state, Looking):
        overlay[me.member.key] = me
    looking = looking_peers(now, replace(board, declarations=overlay), config)
    if not looking or len(looking) >= config.min_group_size:
        return ()
    if target is not None and len(members | {d.member.peer_id for d in looking}) > target:
        return ()
    return tuple(looking)


def _take_in(
    group: SealedGroup, strays: tuple[Declaration, ...], now: float, config: MatchmakingConfig, direct: bool
) -> SealedGroup:
    """``group`` with ``strays`` added, to be sealed anew by its leader.

    The prefix's board is the last one: a peer left alone there waits out its deadline in no group.
    After the scheduled time peers come there one by one as they fall back, and a leader that sealed
    what it saw a moment before a late one came left that one alone, the last live peer in no group
    (1,000 simulated peers, 0% or 2% dying: one in 10 of 24 seeds each). So an open group with room
    takes it in: its leader seals the group with the stray and abandons the old one, whose members
    join the new seal that lists them (:func:`_step_following`). Only a stray above the leader: a stray
    below it that sealed the group with itself (the leader gives way to a lower seal) let a leader
    that lies to its members take every honest group over (test_matchmaking_dht, LyingDesk, 2 of 3
    runs). Nobody looks again
    under a new attempt: abandoning the group and planning anew with the stray instead set off a
    cascade of abandoned groups (seed 4, 2% dying: 11.6 polls). A leader does it once per stray peer
    (:attr:`Looking.reopened`): a hostile peer that declares and never confirms costs a group that
    once, and the request timeout that any silent member costs. A member that looks again under a new
    attempt (it abandoned a group it led while this one was sealed with its old attempt) is taken in
    the same way, its new attempt in place of the old: left out as a member, it was left alone there
    (1,000 simulated peers, 0% dying, seed 12)."""
    again = {d.member.peer_id for d in strays}  # members that look again: their new attempt replaces the old
    kept = (m for m in group.members if m.peer_id not in again)
    members = tuple(sorted((*kept, *(d.member for d in strays)), key=lambda m: m.key))
    commit_by = min(group.commit_by, min(d.deadline for d in strays) - config.poll_interval)
    # a group sealed ahead starts when its first member is due (.timing.group_start): a stray due earlier
    # than the group's start took the seal for one it would not join (.group.plausible), and the leader
    # waited for it until commit_by (44 simulated peers in groups of 4, one dead: 17.5 polls)
    start_at = min(group.start_at, *(d.ready_at for d in strays))
    return SealedGroup(group_id_for(members), members, commit_by, start_at if start_at > now else -math.inf, direct)


def _step_following(state: Following, now: float, board: Board, config: MatchmakingConfig) -> Step:
    group, me = state.group, state.declaration
    commit = board.commits.get(group.group_id)
    if commit is not None:
        keys = set(commit.members)
        if me.member.key in keys:
            members = tuple(m for m in group.members if m.key in keys)
            return Step(state, (), GroupInfo(bytes.fromhex(group.group_id), members), start_at=group.start_at)
        others = _offers(me, now, board, config, state.shunned, group.group_id)  # e.g. the group its leader gave way to
        if others:
            # the same leader's new seal first: it took a stray in (see _take_in); another open seal that
            # listed me too is an older plan, and joining it left that leader alone (0% dying, seed 4)
            chosen = min(others, key=lambda g: (g.leader.key != group.leader.key, g.group_id))
            return _join(me, chosen, now, config, state)
        return _retry(me, now, config, (), state.ignored, state)
    if now > group.commit_by + config.request_timeout:  # the leader is gone: leave, so a late commit skips me
        return leader_failed(state, now, config)
    # a group held open (_holds) commits a while from now: read at the usual pace until then
    return Step(state, urgent=not _holds(group, now + 2 * config.poll_interval, config))


def leader_failed(state: Following, now: float, config: MatchmakingConfig) -> Step:
    """A member leaves its group's leader: it never committed, or it answered a direct confirmation
    with something that is not a commit of the sealed group (see :mod:`.confirmation`). The member
    marks its attempt as left (so a late commit skips it), looks again under a new attempt, and
    leaves the leader out of its plans for a while, as it does a dead one."""
    me, leader = state.declaration, {state.group.leader.peer_id}
    _, left = _mark(me, None, now, config)
    ignored, shunned = _ignore(state.ignored, leader, now, config), _ignore(state.shunned, leader, now, config)
    return _retry(me, now, config, (left,), ignored, state, shunned)


def _offers(
    me: Declaration, now: float, board: Board, config: MatchmakingConfig, shunned: Ignored, mine: str | None = None
) -> list[SealedGroup]:
    """The open sealed groups that list this attempt of mine (other than ``mine``), sealed by a leader
    this peer does not shun (see :class:`Looking`: one that left this peer waiting, or whose direct
    answer was a lie, would otherwise hold it again with every new seal), and :func:`.group.plausible`."""
    left_out = _current(shunned, now)
    sealed = (g for g in board.sealed.values() if g.group_id != mine and g.leader.peer_id not in left_out)
    return [g for g in sealed if me.member.key in g.keys and is_open(g, now, board) and plausible(g, me, now, config)]


def _join(me: Declaration, group: SealedGroup, now: float, config: MatchmakingConfig, state: State) -> Step:
    """Confirm ``group``: mark this attempt as joined (the other leaders that listed it see it leave);
    whom ``state`` ignores and shuns, and its memory of dead members and reopened groups, carry over."""
    joined, confirm = _mark(me, group, now, config)
    following = Following(joined, group, state.ignored, shunned=state.shunned, dead=state.dead, reopened=state.reopened)
    return Step(following, (confirm,), urgent=True)


def _coming(member: Member, group: SealedGroup, me: Member, now: float, board: Board) -> bool:
    """Whether the leader ``me`` of ``group`` should still wait for ``member``: it has not marked its
    attempt yet (it has not seen the group, or its marker is not visible yet), or it joined a group
    whose leader is a junior member of this one, which gives way to this group (see
    :func:`_step_leading`), so that the member looks for another group that lists it: this one."""
    if member.key not in board.markers:
        return True
    joined = board.markers[member.key]
    other = board.sealed.get(joined) if joined is not None and joined != group.group_id else None
    if other is not None and other.leader == me:
        # it joined my seal before this one, which I abandoned to take a stray in (_take_in): it joins this
        # one once it reads that. A read of mine that did not show that abandonment yet showed the old seal
        # open, and the group (full with the stray) committed without it (1,000 simulated peers, seed 7).
        # Bounded by commit_by: one that died after it confirmed costs what a silent member costs
        return True
    if other is None or not is_open(other, now, board):
        return False
    return other.leader.key in group.keys and other.leader.key > me.key


def _stale(declaration: Declaration | None, now: float, config: MatchmakingConfig) -> bool:
    """Whether a declaration missed its refresh (see :data:`STALE_LEFT`); one that reached its peer's
    deadline is not refreshed any more, and is not stale."""
    if declaration is None:
        return False
    left = declaration.expiration - now
    return declaration.expiration < declaration.deadline and left < STALE_LEFT * config.request_timeout


def _fresh(declaration: Declaration, now: float, config: MatchmakingConfig) -> bool:
    """Whether a declaration was refreshed lately, as a live looking peer's is (see :data:`REFRESH_FRACTION`),
    give or take the lag of a read. On a shard's board only such a peer is a stray to take in, or to
    abandon a group for (:func:`_strays`): a peer that died after declaring there stays on the board until
    its declaration expires, and a group that abandoned its seal for one below its leader then waited for
    it as its planned leader (1,000 simulated peers, 2% dying, seed 18: 11.8 polls)."""
    return declaration.expiration - now >= REFRESH_FRACTION * config.request_timeout - 3 * config.poll_interval


def _dropped(member: Member, group: SealedGroup, board: Board) -> bool:
    """Whether ``member`` of ``group`` joined another group that then committed without it: such a
    member joins the next open group that lists its attempt, this one, once it reads the commit
    (:func:`_step_following`). A leader that reads the member's marker before the member has read
    that commit kept abandoning its group instead, and left out of its plans (for
    ``IGNORE_TIMEOUTS``) the very member that was about to join it, while that member waited on it
    as a planned leader and then left it out too: two honest peers ignoring each other for three
    request timeouts (1,000 simulated peers, 2% dying, seed 3: 67 polls to group everyone). The
    leader waits for it, never past ``commit_by``: a hostile member that writes such a marker costs
    what a silent one costs. It waited only where it would otherwise abandon its group, and a group
    that could commit without the member did, and left it alone on the prefix's board, the last live
    peer in no group (1,000 simulated peers, 0% dying, seed 1)."""
    joined = board.markers.get(member.key)
    commit = board.commits.get(joined) if joined is not None and joined != group.group_id else None
    if commit is None or member.key in commit.members:
        return False
    # a record of another attempt of this peer: it looked again under a new one instead (or it is an old
    # attempt, and this wait is not taken: the leader abandons, as it did before this rule)
    records = (*board.declarations, *board.markers)
    return not any(key[0] == member.peer_id and key != member.key for key in records)


def _seal(
    group: tuple[Declaration, ...], now: float, config: MatchmakingConfig, start_at: float, direct: bool
) -> SealedGroup:
    members = tuple(d.member for d in group)
    # Commit before the first member's deadline, leaving it one poll to read the commit.
    commit_by = min(now + config.request_timeout, min(d.deadline for d in group) - config.poll_interval)
    return SealedGroup(group_id_for(members), members, commit_by, start_at if start_at > now else -math.inf, direct)


def _retry(
    me: Declaration,
    now: float,
    config: MatchmakingConfig,
    writes: tuple[Write, ...],
    ignored: Ignored,
    carried: State,
    shunned: Ignored | None = None,
) -> Step:
    """Look again under a new attempt, keeping seniority, times, whom to leave out of plans, whose seals
    not to join (``shunned``, by default ``carried``'s) and the memory of ``carried`` (see :func:`_join`)."""
    fresh = replace(me, member=replace(me.member, attempt=next_attempt(me.member.attempt)), expiration=-math.inf)
    fresh, declare = _refresh(fresh, now, config)
    dead = _forget_dead(carried.dead, {}, now)
    shunned = carried.shunned if shunned is None else shunned
    looking = Looking(fresh, None, ignored, shunned=shunned, dead=dead, reopened=carried.reopened)
    return Step(looking, writes + declare)


def _forget_dead(dead: Dead, seen: dict[PeerKey, float], now: float) -> Dead:
    """``dead`` plus the attempts of ``seen`` (with the expiration their declarations had), less the
    declarations that have expired since (nothing left to leave out).

    A leader remembers the members it saw miss their refresh (:data:`STALE_LEFT`) and leaves those
    declarations out of its later plans, as long as they are not refreshed: a member that died after
    declaring stays on the board until its declaration expires, one ``request_timeout``, and a leader
    that abandoned its group and planned with it again waited on it once more (a dead planned leader
    holds its group until a deputy seals). A member that only looked dead (a lagging DHT showed its
    declaration before its refresh) refreshes it, and is planned with again at once: unlike
    ``ignored``, which leaves a peer out for ``IGNORE_TIMEOUTS`` whatever it writes."""
    merged = {**dict(dead), **seen}
    return tuple(sorted((key, expiration) for key, expiration in merged.items() if expiration > now))


def _refresh(me: Declaration, now: float, config: MatchmakingConfig) -> tuple[Declaration, tuple[Write, ...]]:
    """(Re)declare when the stored declaration has lost a third of its lifetime; never past the deadline."""
    if me.expiration >= me.deadline or me.expiration - now >= REFRESH_FRACTION * config.request_timeout:
        return me, ()
    me = replace(me, expiration=min(now + config.request_timeout, me.deadline))
    return me, (declaration_write(me),)


def _mark(
    me: Declaration, group: SealedGroup | None, now: float, config: MatchmakingConfig
) -> tuple[Declaration, Write]:
    """Overwrite my attempt's record with a marker (joined ``group``, or left); it expires with its
    purpose, and strictly after what it replaces (see :mod:`.lifetimes`)."""
    expiration, marker = marker_record(me, group, now, config)
    return replace(me, expiration=expiration), marker
