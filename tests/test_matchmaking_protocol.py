"""One peer's protocol state machine, step by step, and many peers over a simulated lagging DHT."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from matchmaking_builders import board_of, config, declaration, member, peer

from hivemind_ext.averaging.matchmaking.board import (
    Write,
    board_key,
    commit_write,
    declaration_write,
    marker_write,
    parse_board,
    sealed_write,
)
from hivemind_ext.averaging.matchmaking.confirmation import Confirmations, answer_limits
from hivemind_ext.averaging.matchmaking.group import (
    SEAL_HORIZON,
    Board,
    Commit,
    Declaration,
    GroupInfo,
    MatchmakingConfig,
    SealedGroup,
    all_auxiliary,
    group_id_for,
    plausible,
)
from hivemind_ext.averaging.matchmaking.lifetimes import LAG_MARGIN, seal_expiration
from hivemind_ext.averaging.matchmaking.protocol import (
    DEPUTY_FRACTION,
    EAGER_POLLS,
    STALE_LEFT,
    Following,
    Leading,
    Looking,
    leader_failed,
    next_attempt,
    step,
    withdrawal,
)
from hivemind_ext.averaging.matchmaking.simulation import LaggingDHT, SimulatedRound, simulate_round, simulated_peer_id
from hivemind_ext.errors import ProtocolError
from hivemind_ext.p2p.framing import pack_header
from hivemind_ext.p2p.messages import Message

NOW = 50.0


def fresh(index: int, **kwargs) -> Declaration:
    """A peer's declaration as it is before its first write."""
    return replace(declaration(index, **kwargs), expiration=-math.inf)


def declared(index: int, **kwargs) -> Looking:
    """A peer looking for a group whose declaration has been stored (one request timeout of ``config()``)."""
    return Looking(replace(declaration(index, **kwargs), expiration=NOW + 1.0))


def board_after(*writes: Write, board: Board | None = None, now: float = NOW) -> Board:
    """What a reader sees once ``writes`` landed on top of ``board`` (the later expiration wins)."""
    dht = LaggingDHT(seed=0, max_lag=0.0)
    for write in (*_as_writes(board or Board()), *writes):
        dht.store("run", write, now)
    return parse_board("run", dht.read("run", "reader", now), now)


def _as_writes(board: Board) -> list[Write]:
    later = 10_000.0
    writes = [declaration_write(d) for d in board.declarations.values()]
    writes += [marker_write(key, gid, later) for key, gid in board.markers.items()]
    writes += [sealed_write(g, later) for g in board.sealed.values()]
    return writes + [commit_write(c, later) for c in board.commits.values()]


# ---------------------------------------------------------------- single steps


def test_the_first_step_declares_until_one_request_timeout_or_the_deadline() -> None:
    cfg = config(request_timeout=1.0)
    result = step(Looking(fresh(0)), NOW, Board(), cfg)
    (write,) = result.writes
    assert isinstance(result.state, Looking) and result.state.declaration.expiration == NOW + 1.0
    assert write.expiration_time == NOW + 1.0 and write.value["state"] == "looking"
    near = step(Looking(fresh(0, deadline=NOW + 0.5)), NOW, Board(), cfg)
    assert near.writes[0].expiration_time == NOW + 0.5


def test_a_new_attempt_declares_before_it_plans_even_when_it_would_lead_a_full_group() -> None:
    # Sealing on its first read (before anyone had seen it) let a peer that died right after hold its
    # group two request timeouts (1,000 simulated peers, 2% dying, seed 1: 31.9 polls).
    cfg = config()
    others = board_of(*(declaration(i) for i in (1, 2, 3)))
    first = step(Looking(fresh(0)), NOW, others, cfg)
    assert isinstance(first.state, Looking) and first.urgent
    assert [w.value["state"] for w in first.writes] == ["looking"]
    second = step(first.state, NOW + 0.01, board_after(*first.writes, board=others), cfg)
    assert isinstance(second.state, Leading) and len(second.state.group.members) == 4


def test_declarations_are_refreshed_after_a_third_of_their_lifetime() -> None:
    cfg = config(request_timeout=0.9)
    state = step(Looking(fresh(0)), NOW, Board(), cfg).state
    assert step(state, NOW + 0.29, Board(), cfg).writes == ()
    (refresh,) = step(state, NOW + 0.31, Board(), cfg).writes
    assert refresh.expiration_time == pytest.approx(NOW + 1.21)


def test_the_leader_seals_a_full_group_and_confirms_itself() -> None:
    cfg = config()
    others = [declaration(i) for i in (1, 2, 3)]
    result = step(declared(0), NOW, board_of(*others), cfg)
    assert isinstance(result.state, Leading)
    sealed = result.state.group
    assert sealed.members == tuple(member(i) for i in range(4))
    assert sealed.group_id == group_id_for(sealed.members)
    assert sealed.commit_by == NOW + cfg.request_timeout
    kinds = sorted(w.subkey[0] for w in result.writes)
    assert kinds == ["d", "g"]
    marker = next(w for w in result.writes if w.subkey.startswith("d/"))
    assert marker.value == {"state": "joined", "group": sealed.group_id}
    assert marker.expiration_time == seal_expiration(sealed, cfg) == sealed.commit_by + LAG_MARGIN * cfg.request_timeout


def test_a_member_that_is_not_the_leader_waits_and_polls_sooner() -> None:
    result = step(declared(3), NOW, board_of(*(declaration(i) for i in range(3))), config())
    assert isinstance(result.state, Looking) and result.urgent  # its leader is about to seal
    alone = step(declared(3), NOW, board_of(declaration(0)), config())
    assert isinstance(alone.state, Looking) and not alone.urgent


def test_a_peer_polls_at_the_urgent_pace_just_after_it_starts_looking() -> None:
    cfg = config(poll_interval=0.05)
    alone = declared(0, declared_at=NOW)
    assert step(alone, NOW, Board(), cfg).urgent
    assert step(alone, NOW + (EAGER_POLLS - 0.5) * cfg.poll_interval, Board(), cfg).urgent
    assert not step(alone, NOW + (EAGER_POLLS + 0.5) * cfg.poll_interval, Board(), cfg).urgent


def test_a_peer_polls_sooner_while_its_group_is_being_formed() -> None:
    cfg = config()
    leading, board = _sealed_by_leader(cfg)
    assert leading == step(declared(0), NOW, board_of(*(declaration(i) for i in (1, 2, 3))), cfg).state
    assert step(leading, NOW + 0.01, board, cfg).urgent
    assert step(Looking(declaration(1)), NOW + 0.01, board, cfg).urgent  # joins the sealed group
    assert step(Following(declaration(1), leading.group), NOW + 0.01, board, cfg).urgent


def test_commit_time_leaves_the_nearest_deadline_one_poll() -> None:
    cfg = config()
    others = [declaration(1, deadline=NOW + 0.5), declaration(2), declaration(3)]
    sealed = step(declared(0), NOW, board_of(*others), cfg).state.group
    assert sealed.commit_by == NOW + 0.5 - cfg.poll_interval


def _sealed_by_leader(cfg: MatchmakingConfig, count: int = 4, ready_at: float = 100.0):
    """Peer 0 seals a group of ``count``: a full one before their scheduled time by default."""
    board = board_of(*(declaration(i, ready_at=ready_at) for i in range(1, count)))
    result = step(declared(0, ready_at=ready_at), NOW, board, cfg)
    return result.state, board_after(*result.writes, board=board)


def test_members_join_a_sealed_group_and_the_marker_outlives_their_declaration() -> None:
    cfg = config()
    leading, board = _sealed_by_leader(cfg)
    me = declaration(2, expiration=NOW + 100)
    result = step(Looking(me), NOW, board, cfg)
    assert isinstance(result.state, Following) and result.state.group == leading.group
    (marker,) = result.writes
    assert marker.value == {"state": "joined", "group": leading.group.group_id}
    assert marker.expiration_time > me.expiration


def test_a_peer_offered_two_groups_joins_the_lowest_leaders() -> None:
    # then the lowest id. By id alone it joined the higher leader's seal, and the lower leader, which no
    # open group takes in, was left in no group (1,000 simulated peers, 0% dying, seed 12)
    cfg = config(target_group_size=3, min_group_size=2)  # room for the three-member seal below
    me = declaration(3)
    lower, higher = _sealed((member(0), me.member)), _sealed((me.member, member(4)))
    assert higher.group_id < lower.group_id
    sealed = {g.group_id: g for g in (lower, higher)}
    result = step(Looking(me), NOW, board_of(me, sealed=sealed), cfg)
    assert result.state.group == lower
    same_leader = _sealed((member(0), me.member, member(4)))
    sealed[same_leader.group_id] = same_leader
    expected = min(lower, same_leader, key=lambda g: g.group_id)
    assert step(Looking(me), NOW, board_of(me, sealed=sealed), cfg).state.group == expected


def _sealed(members, commit_by: float = NOW + 1) -> SealedGroup:
    members = tuple(sorted(members, key=lambda m: m.key))
    return SealedGroup(group_id_for(members), members, commit_by)


def _confirm(board: Board, group: SealedGroup, indices) -> Board:
    return board_after(*(marker_write(member(i).key, group.group_id, 1_000.0) for i in indices), board=board)


def test_the_leader_commits_once_everyone_confirmed_and_members_read_the_same_group() -> None:
    cfg = config()
    leading, board = _sealed_by_leader(cfg)
    assert step(leading, NOW + 0.1, board, cfg).group is None  # nobody confirmed yet
    board = _confirm(board, leading.group, (1, 2, 3))
    result = step(leading, NOW + 0.1, board, cfg)
    assert result.group == GroupInfo(bytes.fromhex(leading.group.group_id), leading.group.members)
    board = board_after(*result.writes, board=board)
    following = Following(declaration(2), leading.group)
    assert step(following, NOW + 0.2, board, cfg).group == result.group


def test_the_leader_commits_early_without_members_that_went_elsewhere() -> None:
    cfg = config()
    leading, board = _sealed_by_leader(cfg, ready_at=NOW)  # sealed at the scheduled time: any size goes
    board = _confirm(board, leading.group, (1, 2))
    board = board_after(marker_write(member(3).key, "ef" * 16, 1_000.0), board=board)
    result = step(leading, NOW + 0.1, board, cfg)
    assert [m.peer_id for m in result.group.members] == [member(i).peer_id for i in range(3)]


def test_a_full_group_sealed_before_the_scheduled_time_commits_only_whole() -> None:
    # a member went elsewhere (two leaders with different views): committing the other three would
    # leave the peers this group was to be paired with short of a full group until their scheduled time
    cfg = config()
    leading, board = _sealed_by_leader(cfg)
    assert leading.full_until == 100.0
    board = _confirm(board, leading.group, (1, 2))
    board = board_after(marker_write(member(3).key, "ef" * 16, 1_000.0), board=board)
    result = step(leading, NOW + 0.1, board, cfg)
    assert result.group is None and isinstance(result.state, Looking)
    assert next(w for w in result.writes if w.subkey.startswith("c/")).value == {"members": []}
    # once the scheduled time has come, the same leader commits whoever confirmed
    late = step(replace(leading, full_until=NOW), NOW + 0.1, board, cfg)
    assert late.group is not None and late.group.size == 3


def test_a_leader_listed_by_a_lower_leader_gives_way_and_joins_that_group() -> None:
    cfg = config()
    leading, board = _sealed_by_leader(cfg, count=4)  # peer 0 leads peers 0-3
    # peer 2 also sealed (it saw other peers): it is listed in peer 0's group, so it gives way
    mine = _sealed([member(2), member(5), member(6), member(7)])
    me = Leading(declaration(2), mine)
    result = step(me, NOW + 0.1, board_after(sealed_write(mine, 1_000.0), board=board), cfg)
    assert isinstance(result.state, Following) and result.state.group == leading.group
    abandon, confirm = result.writes
    assert abandon.subkey == f"c/{mine.group_id}" and abandon.value == {"members": []}
    assert confirm.value == {"state": "joined", "group": leading.group.group_id}
    # the lower leader waits for it meanwhile, though its marker still names its own group
    board = _confirm(board_after(sealed_write(mine, 1_000.0), board=board), leading.group, (1, 3))
    board = board_after(marker_write(member(2).key, mine.group_id, 1_000.0), board=board)
    assert step(leading, NOW + 0.1, board, cfg).group is None
    # a member of the abandoned group joins another open group that lists it instead of looking again
    follower = Following(declaration(5), mine)
    other = _sealed([member(4), member(5)])
    board = board_after(commit_write(Commit(mine.group_id, ()), 1_000.0), sealed_write(other, 1_000.0), board=board)
    moved = step(follower, NOW + 0.2, board, cfg)
    assert isinstance(moved.state, Following) and moved.state.group == other


def test_the_leader_commits_whoever_confirmed_at_the_commit_time() -> None:
    cfg = config()
    leading, board = _sealed_by_leader(cfg, ready_at=NOW)
    board = _confirm(board, leading.group, (2,))
    assert step(leading, leading.group.commit_by - 0.01, board, cfg).group is None
    result = step(leading, leading.group.commit_by, board, cfg)
    assert [m.peer_id for m in result.group.members] == [member(0).peer_id, member(2).peer_id]


def test_a_group_too_small_at_commit_time_is_abandoned_and_everyone_retries() -> None:
    cfg = config(min_group_size=3)
    leading, board = _sealed_by_leader(cfg)
    board = _confirm(board, leading.group, (1,))
    result = step(leading, leading.group.commit_by, board, cfg)
    assert result.group is None and isinstance(result.state, Looking)
    retry = result.state.declaration
    assert retry.member.attempt == next_attempt(leading.declaration.member.attempt)
    assert retry.declared_at == leading.declaration.declared_at  # seniority is kept
    commit = next(w for w in result.writes if w.subkey.startswith("c/"))
    assert commit.value == {"members": []}
    assert any(w.value.get("state") == "looking" for w in result.writes)
    board = board_after(*result.writes, board=board)
    follower = step(Following(declaration(1), leading.group), leading.group.commit_by + 0.1, board, cfg)
    assert isinstance(follower.state, Looking) and follower.group is None


def test_an_all_auxiliary_group_commits_but_a_mixed_one_left_with_auxiliary_peers_is_abandoned() -> None:
    cfg = config()
    aux = [declaration(i, auxiliary=True, ready_at=NOW) for i in range(1, 4)]
    result = step(declared(0, auxiliary=True, ready_at=NOW), NOW, board_of(*aux), cfg)
    leading = result.state
    assert isinstance(leading, Leading)
    board = _confirm(board_after(*result.writes, board=board_of(*aux)), leading.group, ())
    board = board_after(*(marker_write(d.member.key, leading.group.group_id, 1_000.0) for d in aux), board=board)
    committed = step(leading, NOW + 0.1, board, cfg)
    assert committed.group is not None and len(committed.group.members) == 4  # nothing to average: they finish

    # an auxiliary leader seals a group with a trainer; the trainer never confirms: what is left has
    # nothing to average, so the group is abandoned and the auxiliary peers look for one with work
    mixed = [declaration(1), *(declaration(i, auxiliary=True) for i in (2, 3))]
    sealed = step(declared(0, auxiliary=True), NOW, board_of(*mixed), cfg)
    mixed_leader = sealed.state
    assert isinstance(mixed_leader, Leading) and not all_auxiliary(mixed_leader.group.members)
    mixed_board = _confirm(board_after(*sealed.writes, board=board_of(*mixed)), mixed_leader.group, (2, 3))
    abandoned = step(mixed_leader, mixed_leader.group.commit_by, mixed_board, cfg)
    assert abandoned.group is None and isinstance(abandoned.state, Looking)


def test_a_member_left_out_of_the_commit_looks_again() -> None:
    cfg = config()
    leading, board = _sealed_by_leader(cfg)
    board = board_after(commit_write(Commit(leading.group.group_id, (member(0).key,)), 1_000.0), board=board)
    result = step(Following(declaration(3), leading.group), NOW + 0.5, board, cfg)
    assert isinstance(result.state, Looking) and result.state.declaration.member.attempt != member(3).attempt


def test_a_member_whose_leader_vanished_leaves_then_looks_again() -> None:
    cfg = config()
    leading, board = _sealed_by_leader(cfg)
    following = Following(declaration(1), leading.group)
    assert step(following, leading.group.commit_by + cfg.request_timeout, board, cfg).state == following
    result = step(following, leading.group.commit_by + cfg.request_timeout + 0.01, board, cfg)
    assert isinstance(result.state, Looking)
    assert [w.value["state"] for w in result.writes] == ["left", "looking"]


def test_a_member_seals_its_planned_group_without_a_leader_that_stays_silent() -> None:
    # A planned leader that died after declaring held its group until its declaration expired (one
    # request timeout; 1,000 simulated peers, 2% dying: 12-13 polls to group everyone, goal 10).
    cfg = config()
    board = board_of(*(declaration(i) for i in range(4)))  # one full group, led by peer 0
    overdue = DEPUTY_FRACTION * cfg.request_timeout
    for position, waited, seals in [(1, 0.9, False), (1, 1.1, True), (2, 1.9, False), (2, 2.1, True)]:
        looking = replace(declared(position), waiting_on=(peer(0), NOW - waited * overdue))
        result = step(looking, NOW, board, cfg)
        if not seals:
            assert isinstance(result.state, Looking) and result.urgent
            continue
        assert isinstance(result.state, Leading), (position, waited)
        assert result.state.group.members == tuple(member(i) for i in range(position, 4))  # the rest, as planned
    # a rest too small to run is no group: the member keeps waiting (its shard's fall-back takes over there)
    pair = board_of(declaration(0, ready_at=NOW))
    alone = replace(declared(1, ready_at=NOW), waiting_on=(peer(0), NOW - 10 * overdue))
    assert isinstance(step(alone, NOW, pair, cfg).state, Looking)


def _stale_board(group: SealedGroup, stale: int, marked: tuple[int, ...], now: float, cfg: MatchmakingConfig) -> Board:
    """The leader's read: ``marked`` members confirmed, ``stale`` shows a declaration it stopped refreshing."""
    left = 0.9 * STALE_LEFT * cfg.request_timeout  # it missed its refresh
    return Board(
        declarations={member(stale).key: declaration(stale, expiration=now + left)},
        markers={member(i).key: group.group_id for i in marked},
        sealed={group.group_id: group},
    )


def test_a_leader_stops_waiting_for_a_member_whose_declaration_missed_its_refresh() -> None:
    # It waited until the commit time (one request timeout after the seal): a group sealed ahead with a
    # member that had died was final 11-13 polls after the scheduled time (1,000 simulated peers, 2% dying).
    cfg = config()
    leading, _ = _sealed_by_leader(cfg, count=4, ready_at=NOW)  # sealed at the scheduled time: not full
    group, now = leading.group, NOW + 0.05
    fresh_board = replace(_stale_board(group, 3, (1, 2), now, cfg), declarations={member(3).key: declaration(3)})
    assert step(leading, now, fresh_board, cfg).group is None  # a member that refreshes is waited for
    result = step(leading, now, _stale_board(group, 3, (1, 2), now, cfg), cfg)
    assert result.group is not None and result.group.members == tuple(member(i) for i in range(3))
    # once seen stale it stays gone, though its declaration then expires (no record is waited for: a
    # member of a direct group that marked itself but has not called yet shows none)
    waiting = step(leading, now, _stale_board(group, 3, (1,), now, cfg), cfg)
    assert waiting.group is None and member(3).key in waiting.state.gone
    later = Board(markers={member(i).key: group.group_id for i in (1, 2)}, sealed={group.group_id: group})
    assert step(waiting.state, now + 0.5, later, cfg).group.members == tuple(member(i) for i in range(3))
    assert step(leading, now + 0.5, later, cfg).group is None  # never seen stale: waited for


def test_a_leader_that_abandons_does_not_ignore_a_member_it_saw_not_refreshing() -> None:
    # A DHT lagging 0.4 s shows a live member's declaration before its refresh: the leader of a pair saw it
    # stale, abandoned, and left it out of its plans for IGNORE_TIMEOUTS while that member planned this
    # leader, then left it out too: two honest peers ungrouped until their deadline (8 peers in pairs,
    # found by hypothesis in CI). A dead one's declaration expires before the ignore would have ended.
    cfg = config()
    leading, _ = _sealed_by_leader(cfg, count=2, ready_at=NOW)
    now = NOW + 0.05
    result = step(leading, now, _stale_board(leading.group, 1, (), now, cfg), cfg)
    assert result.group is None and isinstance(result.state, Looking)  # 1 < min_group_size: abandoned
    assert member(1).peer_id not in {peer for peer, _ in result.state.ignored}
    again = step(result.state, now + 0.05, board_of(declaration(1, ready_at=NOW)), cfg)
    assert isinstance(again.state, Leading) and member(1) in again.state.group.members  # planned again


def test_a_leader_leaves_a_member_it_saw_dead_out_of_its_next_plans_until_it_refreshes() -> None:
    # A member that died after declaring stays on the board until its declaration expires: the leader that
    # abandoned its group (or lost it) planned with it again and waited on it once more (1,000 simulated
    # peers, 2% dying, seed 15: 11.9 polls to group everyone, against a goal of 10).
    cfg = config()
    leading, _ = _sealed_by_leader(cfg, count=2, ready_at=NOW)
    now = NOW + 0.05
    stale = _stale_board(leading.group, 1, (), now, cfg)
    abandoned = step(leading, now, stale, cfg)
    assert abandoned.group is None and isinstance(abandoned.state, Looking)
    retry = step(abandoned.state, now + 0.01, Board(), cfg).state  # its new attempt declares first
    dead, live = stale.declarations[member(1).key], declaration(2, ready_at=NOW)
    again = step(retry, now + 0.05, board_of(dead, live), cfg)
    assert isinstance(again.state, Leading) and again.state.group.members == (retry.declaration.member, member(2))
    refreshed = replace(dead, expiration=now + cfg.request_timeout)  # it only looked dead: planned with again
    assert member(1) in step(retry, now + 0.05, board_of(refreshed, live), cfg).state.group.members


def test_alone_on_the_prefix_board_a_peer_plans_with_the_peers_it_ignores() -> None:
    # Two honest peers can end up ignoring each other (a leader that abandoned its group ignores the
    # members that did not confirm, a member ignores a leader that did not seal in time) while the rest
    # of the swarm has grouped: waiting alone they stayed ungrouped for IGNORE_TIMEOUTS (1,000 simulated
    # peers, 2% dying, seed 9: 65.8 polls to group everyone). A shard's peer falls back instead.
    cfg = config()
    me = replace(declared(0, ready_at=NOW), ignored=((peer(1), NOW + 3.0),))
    other = declaration(1, ready_at=NOW)
    result = step(me, NOW, board_of(other), cfg)
    assert isinstance(result.state, Leading) and result.state.group.members == (member(0), member(1))
    # not alone: the ignored peer stays out of its plans
    with_another = step(me, NOW, board_of(other, declaration(2, ready_at=NOW)), cfg)
    assert with_another.state.group.members == (member(0), member(2))
    # nor where others wait with it for a full group before their scheduled time: a hostile leader it had
    # left made the full group, and held three honest peers until their deadline (LyingDesk)
    early = replace(declared(0), ignored=((peer(1), NOW + 3.0),))
    waiting = step(early, NOW, board_of(*(declaration(i) for i in (1, 2, 3))), cfg)
    assert isinstance(waiting.state, Looking)


def test_a_leader_on_the_prefix_board_takes_in_a_peer_left_alone_there() -> None:
    # Peers come to the prefix's board one by one as they fall back; a leader that sealed what it saw a
    # moment before a late one came left that one alone, the last live peer in no group (1,000 simulated
    # peers, 0% or 2% dying: 10 of 24 seeds each).
    cfg = config()
    leading, _ = _sealed_by_leader(cfg, count=2, ready_at=NOW)
    group, now = leading.group, NOW + 0.05
    late = declaration(2, ready_at=NOW)
    board = board_of(late, markers={member(1).key: group.group_id}, sealed={group.group_id: group})
    result = step(leading, now, board, cfg)
    assert result.group is None and isinstance(result.state, Leading)
    taken = result.state.group
    assert taken.members == (member(0), member(1), member(2)) and taken.commit_by <= group.commit_by
    assert [w.subkey for w in result.writes][:2] == [f"g/{taken.group_id}", f"c/{group.group_id}"]  # seal first
    # its member reads the old group's commit without it, and joins the new seal (not another open one)
    other = SealedGroup(group_id_for((member(1), member(16))), (member(1), member(16)), now + 1.0)
    assert other.group_id < taken.group_id  # the lowest group id, the choice among other offers
    after = board_after(*result.writes, board=replace(board, sealed={other.group_id: other}), now=now)
    follower = step(Following(declaration(1), group), now + 0.01, after, cfg)
    assert isinstance(follower.state, Following) and follower.state.group == taken
    # once per stray, and only with room: a full group commits
    again = step(result.state, now + 0.01, replace(board, sealed={taken.group_id: taken}), cfg)
    assert not (isinstance(again.state, Leading) and again.state.group != taken)
    assert step(leading, now, replace(board, declarations={}), cfg).group.size == 2  # nobody alone: commits
    full, _ = _sealed_by_leader(cfg, count=4, ready_at=NOW)
    confirmed = {member(i).key: full.group.group_id for i in (1, 2, 3)}
    assert step(full, now, board_of(late, markers=confirmed, sealed={full.group.group_id: full.group}), cfg).group


def test_a_leader_on_the_prefix_board_waits_for_a_higher_seal_of_its_member_and_takes_that_leader_in() -> None:
    # The last peers of the prefix's board: leaders 0 and 1 sealed peer 2 with each; peer 2 joined the
    # lower one. Leader 0 committed as soon as peer 2 confirmed, a read before leader 1 abandoned its
    # seal and looked again: leader 1 was the last live peer in no group (1,000 simulated peers, 0%
    # dying, seed 8).
    cfg = config()
    leading = step(declared(0, ready_at=NOW), NOW, board_of(declaration(2, ready_at=NOW)), cfg).state
    group, now = leading.group, NOW + 0.05
    assert group.members == (member(0), member(2))
    rival = _sealed((member(1), member(2)), commit_by=NOW + 1.0)
    markers = {member(2).key: group.group_id, member(1).key: rival.group_id}
    board = board_of(markers=markers, sealed={group.group_id: group, rival.group_id: rival})
    waits = step(leading, now, board, cfg)
    assert waits.group is None and waits.writes == () and waits.urgent and waits.state.group == group
    # the rival seal abandoned, its leader looks again: taken in
    again = declaration(1, attempt=1, ready_at=NOW)
    abandoned = replace(board, commits={rival.group_id: Commit(rival.group_id, ())})
    taken = step(waits.state, now + 0.01, replace(abandoned, declarations={again.member.key: again}), cfg)
    assert isinstance(taken.state, Leading) and taken.state.group.members == (member(0), again.member, member(2))
    # not for a rival it ignores, nor for one below it, nor where the group is full, nor past commit_by
    ignoring = replace(leading, ignored=((peer(1), now + 3.0),))
    assert step(ignoring, now, board, cfg).group.size == 2
    below = step(declared(1, ready_at=NOW), NOW, board_of(declaration(2, ready_at=NOW)), cfg).state
    lower = _sealed((member(0), member(2)), commit_by=NOW + 1.0)
    mine = below.group
    lower_board = board_of(markers={member(2).key: mine.group_id}, sealed={mine.group_id: mine, lower.group_id: lower})
    assert step(below, now, lower_board, cfg).group.size == 2
    assert step(leading, group.commit_by + 0.01, board, cfg).group is not None
    pair = config(target_group_size=2)
    full = step(declared(0, ready_at=NOW), NOW, board_of(declaration(2, ready_at=NOW)), pair).state
    assert full.group == group and step(full, now, board, pair).group.size == 2


def test_a_leader_takes_in_a_member_that_looks_again_under_a_new_attempt() -> None:
    # Its group was sealed with the member's old attempt, which the member had left (it abandoned a
    # group it led): the leader committed without it and left its new attempt out as a member, alone on
    # the prefix's board (1,000 simulated peers, 0% dying, seed 12)
    cfg = config()
    leading = step(declared(0, ready_at=NOW), NOW, board_of(*(declaration(i, ready_at=NOW) for i in (1, 2))), cfg).state
    group, now = leading.group, NOW + 0.05
    again = declaration(2, attempt=1, ready_at=NOW)
    markers = {member(1).key: group.group_id, member(2).key: None}
    board = board_of(again, markers=markers, sealed={group.group_id: group})
    result = step(leading, now, board, cfg)
    assert result.group is None and isinstance(result.state, Leading)
    assert result.state.group.members == (member(0), member(1), again.member)
    # once: then it commits without it
    assert step(result.state, now + 0.01, replace(board, sealed={}), cfg).state.group == result.state.group


def test_a_peer_alone_below_an_open_groups_leader_does_not_take_the_group_over() -> None:
    # It sealed the group with itself (its leader gives way to a lower seal): a leader that lies to its
    # members then took every honest group over (test_matchmaking_dht, LyingDesk, 2 of 3 runs)
    cfg = config()
    group = SealedGroup(group_id_for((member(1), member(2))), (member(1), member(2)), NOW + 1.0)
    result = step(declared(0, ready_at=NOW), NOW, board_of(sealed={group.group_id: group}), cfg)
    assert isinstance(result.state, Looking) and result.writes == ()


def test_a_leader_on_the_prefix_board_abandons_its_group_for_a_peer_left_alone_below_it() -> None:
    # The stray would lead any group that takes it in, which the leader's seal cannot make it: left alone,
    # it was the last live peer in no group (1,000 simulated peers, 0% dying, seeds 15 and 17)
    cfg = config()
    leading = step(declared(1, ready_at=NOW), NOW, board_of(declaration(2, ready_at=NOW)), cfg).state
    group, now = leading.group, NOW + 0.05
    stray = declaration(0, ready_at=NOW, expiration=NOW + 0.9)  # declared a poll before, at least
    board = board_of(stray, markers={member(2).key: group.group_id}, sealed={group.group_id: group})
    result = step(leading, now, board, cfg)
    assert result.group is None and isinstance(result.state, Looking)
    assert result.state.declaration.member.attempt != member(1).attempt and peer(0) in result.state.reopened
    # its member looks again, ignoring nobody; the three plan one group, led by the stray
    after = board_after(*result.writes, board=board, now=now)
    assert after.commits[group.group_id].members == (), "the group is abandoned"
    member_step = step(Following(declaration(2), group), now + 0.01, after, cfg)
    assert isinstance(member_step.state, Looking) and member_step.state.ignored == ()
    # once per stray: then it commits; a stray it ignores is none
    assert step(replace(leading, reopened=frozenset({peer(0)})), now, board, cfg).group.size == 2
    assert step(replace(leading, ignored=((peer(0), now + 3.0),)), now, board, cfg).group.size == 2
    # nor one that has just declared (it may be about to plan a group: a cascade of abandoned groups)
    just = board_of(replace(stray, expiration=now + 1.0), markers=board.markers, sealed=board.sealed)
    assert step(leading, now, just, cfg).group.size == 2


def test_a_full_group_that_lost_only_a_dead_member_commits_before_its_scheduled_time() -> None:
    cfg = config()
    leading, _ = _sealed_by_leader(cfg)  # a full group of 4, sealed long before its scheduled time
    now = NOW + 0.05
    result = step(leading, now, _stale_board(leading.group, 3, (1, 2), now, cfg), cfg)
    assert result.group is not None and result.group.size == 3
    went_elsewhere = Board(markers={member(i).key: leading.group.group_id for i in (1, 2)} | {member(3).key: None})
    abandoned = step(leading, now, replace(went_elsewhere, sealed={leading.group.group_id: leading.group}), cfg)
    assert abandoned.group is None and isinstance(abandoned.state, Looking)  # a live member left: abandoned


def test_an_abandoning_leader_waits_for_a_member_that_another_group_dropped() -> None:
    # The leader read the member's marker of the other group before the member read that group's commit
    # without it; it abandoned, left the member out of its plans, and the member, which then joined this
    # group, waited on it and left it out too: 67 polls (1,000 simulated peers, 2% dying, seed 3).
    cfg = config()
    leading, _ = _sealed_by_leader(cfg, count=2, ready_at=NOW)
    group, now = leading.group, NOW + 0.05
    other = group_id_for((member(1), member(7)))
    board = Board(
        markers={member(1).key: other},
        sealed={group.group_id: group},
        commits={other: Commit(other, (member(7).key,))},
    )
    result = step(leading, now, board, cfg)
    assert result.state == leading and result.urgent and result.writes == ()
    joined = replace(board, markers={member(1).key: group.group_id})
    assert step(result.state, now + 0.05, joined, cfg).group.size == 2
    retried = replace(board, declarations={member(1, attempt=1).key: declaration(1, attempt=1)})
    assert isinstance(step(leading, now, retried, cfg).state, Looking)  # it looked again instead: abandon
    assert isinstance(step(leading, group.commit_by + 0.01, board, cfg).state, Looking)  # never past commit_by
    kept = replace(board, commits={other: Commit(other, (member(1).key, member(7).key))})
    assert isinstance(step(leading, now, kept, cfg).state, Looking)  # in the other group: not coming


def test_a_leader_that_could_commit_waits_for_a_member_that_another_group_dropped() -> None:
    # It waited only where it would otherwise abandon: a group of 3 committed 2, and the member on its way
    # back was left alone on the prefix's board, the last live peer in no group (0% dying, seed 1).
    cfg = config()
    leading, _ = _sealed_by_leader(cfg, count=3, ready_at=NOW)
    group, now = leading.group, NOW + 0.05
    other = group_id_for((member(1), member(7)))
    board = Board(
        markers={member(1).key: other, member(2).key: group.group_id},
        sealed={group.group_id: group},
        commits={other: Commit(other, (member(7).key,))},
    )
    result = step(leading, now, board, cfg)
    assert result.group is None and result.state == leading and result.urgent
    joined = replace(board, markers={member(i).key: group.group_id for i in (1, 2)})
    assert step(result.state, now + 0.05, joined, cfg).group.size == 3
    assert step(leading, group.commit_by + 0.01, board, cfg).group.size == 2  # never past commit_by


def test_a_sealed_group_past_its_commit_time_is_not_joined() -> None:
    cfg = config()
    leading, board = _sealed_by_leader(cfg)
    result = step(Looking(declaration(1)), leading.group.commit_by + 0.01, board, cfg)
    assert not isinstance(result.state, Following)


def test_withdrawal_leaves_and_a_leader_also_abandons_its_group() -> None:
    cfg = config()
    leading, _ = _sealed_by_leader(cfg)
    (left,) = withdrawal(Looking(declaration(1)), NOW, cfg)
    assert left.value == {"state": "left"} and left.expiration_time > declaration(1).expiration
    left, abandon = withdrawal(leading, NOW, cfg)
    assert left.value == {"state": "left"} and abandon.value == {"members": []}
    assert left.expiration_time > leading.declaration.expiration


def test_a_group_records_expire_with_the_group_and_a_late_commit_keeps_its_seal() -> None:
    # records used to live 3 request timeouts from their last write whatever they were for
    cfg = config()
    leading, board = _sealed_by_leader(cfg, ready_at=NOW)
    group = leading.group
    until = group.commit_by + LAG_MARGIN * cfg.request_timeout
    others = board_of(*(declaration(i, ready_at=NOW) for i in (1, 2, 3)))
    sealed, confirm = step(declared(0, ready_at=NOW), NOW, others, cfg).writes
    assert sealed.expiration_time == confirm.expiration_time == until
    board = _confirm(board, group, (1, 2, 3))
    (commit,) = step(leading, NOW + 0.1, board, cfg).writes
    assert commit.expiration_time == until
    # a member's marker expires with the group it joined; one that leaves, LAG_MARGIN after it left
    (joined,) = step(Looking(declaration(2, expiration=NOW + 1.0)), NOW, board, cfg).writes
    assert joined.expiration_time == until
    (left,) = withdrawal(Looking(declaration(1, expiration=NOW + 0.1)), NOW, cfg)
    assert left.expiration_time == NOW + LAG_MARGIN * cfg.request_timeout
    # a leader whose reads lagged past the commit time: members that are still waiting must believe
    # the commit, which needs its seal, so the seal is stored again to expire with the commit
    late = group.commit_by + cfg.request_timeout
    resealed, commit = step(leading, late, board, cfg).writes
    assert resealed.subkey == sealed.subkey and resealed.value == sealed.value
    assert resealed.expiration_time == commit.expiration_time == late + LAG_MARGIN * cfg.request_timeout


def test_a_round_reads_no_records_of_the_rounds_before() -> None:
    # 4 peers, a round every 2 request timeouts on one DHT: each read of a round used to return the
    # seals, commits and markers of the two rounds before too (the board grew round after round)
    cfg = config(min_matchmaking_time=0.2)
    dht = LaggingDHT(seed=0, max_lag=0.05, per_record=True)
    peers = {simulated_peer_id(i): () for i in range(4)}
    for index in range(4):
        begin = 2 * cfg.request_timeout * index
        assert dht.read("run.matchmaking.v1", "probe", begin) == []
        result = simulate_round(
            peers, cfg, swarm_size=None, seed=index, spread=0.1, until=begin + 1.9, dht=dht, begin=begin, attempt=index
        )
        check_agreement(result, cfg, 4)
        assert len(result.groups) == 4


def test_next_attempt_is_deterministic_and_new() -> None:
    token = member(1).attempt
    assert next_attempt(token) == next_attempt(token) != token
    assert len(next_attempt(token)) == 16


# ---------------------------------------------------------------- hostile leaders


def _hostile_seal(me: Declaration, **fields) -> SealedGroup:
    """A seal by peer 0 (who leads it) listing ``me``, with ``fields`` (commit_by, start_at) as it chose them."""
    return replace(_sealed((member(0), me.member)), **fields)


@pytest.mark.parametrize(
    ("commit_by", "joined"),
    [(NOW + 1.0, True), (NOW + SEAL_HORIZON * 1.0, True), (NOW + SEAL_HORIZON * 1.0 + 0.01, False), (900.0, False)],
)
def test_a_seal_whose_commit_time_lies_far_ahead_is_not_joined(commit_by: float, joined: bool) -> None:
    # joined, such a seal held its member until the member's deadline (it waits one request_timeout
    # past the commit time), however near the honest leaders around it were to forming a group
    cfg = config()
    me = declaration(2)
    group = _hostile_seal(me, commit_by=commit_by)
    result = step(Looking(me), NOW, board_of(me, sealed={group.group_id: group}), cfg)
    assert isinstance(result.state, Following) == joined


def test_a_seal_that_commits_after_my_deadline_is_not_joined() -> None:
    cfg = config()
    me = declaration(2, deadline=NOW + 2.0)
    late = _hostile_seal(me, commit_by=NOW + 2.5)  # within the horizon, past my deadline: no honest leader does it
    assert not isinstance(step(Looking(me), NOW, board_of(me, sealed={late.group_id: late}), cfg).state, Following)
    honest = _hostile_seal(me, commit_by=NOW + 2.0 - cfg.poll_interval)
    assert isinstance(step(Looking(me), NOW, board_of(me, sealed={honest.group_id: honest}), cfg).state, Following)


@pytest.mark.parametrize(("start_at", "joined"), [(100.0, True), (100.01, False), (1e9, False), (-1e9, True)])
def test_a_seal_that_starts_after_my_scheduled_time_is_not_joined(start_at: float, joined: bool) -> None:
    # an honest leader that seals ahead starts the group when its first member is due (timing.group_start),
    # never after any member's scheduled time; a start far ahead held every member until its deadline
    # (the matchmaker sleeps until the start, capped at the deadline). One in the past costs nothing.
    cfg = config()
    me = declaration(2)  # scheduled at 100
    group = _hostile_seal(me, start_at=start_at)
    result = step(Looking(me), NOW, board_of(me, sealed={group.group_id: group}), cfg)
    assert isinstance(result.state, Following) == joined


@pytest.mark.parametrize(("listed", "joined"), [(4, True), (5, False), (4096, False)])
def test_a_seal_that_lists_more_members_than_the_target_is_not_joined(listed: int, joined: bool) -> None:
    # no honest leader seals more than target_group_size members; a hostile one that listed a member among
    # thousands of made-up ones made its round open a stream to each of them
    cfg = config()  # groups of 4
    me = declaration(2)
    members = (member(0), me.member, *(member(index) for index in range(3, listed + 1)))
    group = _sealed(members)
    assert len(group.members) == listed
    board = board_of(me, sealed={group.group_id: group})
    assert isinstance(step(Looking(me), NOW, board, cfg).state, Following) == joined
    assert plausible(group, me, NOW, cfg) == joined
    # without a target (one group of everyone), the size alone says nothing
    assert plausible(group, me, NOW, config(target_group_size=None, min_group_size=2))


def test_a_peer_does_not_join_seals_of_a_leader_that_failed_it_but_joins_one_it_only_ignores() -> None:
    cfg = config()
    me = declaration(2)
    group = _hostile_seal(me)
    board = board_of(me, sealed={group.group_id: group})
    shunning = Looking(me, ignored=((peer(0), NOW + 0.5),), shunned=((peer(0), NOW + 0.5),))
    assert not isinstance(step(shunning, NOW, board, cfg).state, Following)
    assert isinstance(step(shunning, NOW + 0.6, board, cfg).state, Following)  # it ran out
    # left out of plans only (it was slow to seal, or did not confirm: maybe an honest peer that lagged):
    # its seal is joined, which is what reconciles honest peers that ignore each other
    ignoring = Looking(me, ignored=((peer(0), NOW + 0.5),))
    assert isinstance(step(ignoring, NOW, board, cfg).state, Following)


def test_a_member_that_left_a_lying_leader_does_not_join_its_next_seal() -> None:
    # leader_failed ignores the leader; it used to seal the member's next attempt at once, and the member
    # joined and waited on it again, attempt after attempt, until its deadline
    cfg = config()
    me = declaration(2)
    first = _hostile_seal(me)
    failed = leader_failed(Following(me, first), NOW, cfg)
    again = failed.state.declaration
    assert isinstance(failed.state, Looking) and again.member.key != me.member.key
    second = _hostile_seal(again)
    board = board_of(again, sealed={second.group_id: second})
    assert not isinstance(step(failed.state, NOW + 0.1, board, cfg).state, Following)
    # nor after joining another group and being left out of its commit (the shunning is carried along)
    other = _sealed((member(1), again.member))
    joined = step(failed.state, NOW + 0.1, board_of(again, sealed={other.group_id: other}), cfg).state
    assert isinstance(joined, Following) and joined.shunned == failed.state.shunned


def test_a_leader_does_not_give_way_to_a_senior_seal_that_is_not_plausible() -> None:
    cfg = config()
    leading, board = _sealed_by_leader(cfg)  # led by peer 0, with peers 1-3
    me = leading.declaration
    hostile_leader = replace(member(0), peer_id=peer(0)[:-1])  # sorts before peer 0
    assert hostile_leader.key < me.member.key
    far = _sealed((hostile_leader, me.member), commit_by=NOW + 100.0)
    result = step(leading, NOW + 0.1, board_after(sealed_write(far, 1_000.0), board=board), cfg)
    assert isinstance(result.state, Leading) and result.state.group == leading.group


def test_a_member_accepts_no_commit_answer_longer_than_its_group_allows() -> None:
    # the answer used to be allowed MAX_GROUP_MEMBERS rows (half a megabyte), whatever the group
    me = declaration(2)
    group = _hostile_seal(me, direct=True)
    limits = answer_limits(group)
    longest_peer = replace(member(1), peer_id="1" * 128)
    biggest_honest = _sealed((member(0), longest_peer, *(member(i) for i in range(3, 16))))
    honest = {"group": biggest_honest.group_id, "members": [list(m.key) for m in biggest_honest.members]}
    assert len(pack_header(honest, answer_limits(biggest_honest))) <= answer_limits(biggest_honest).max_header_bytes
    assert answer_limits(biggest_honest).max_header_bytes < 4096  # 3.5 kB for 16 members, not 512 kB
    refusal = {"error": "\u20ac" * 200}  # a refusal of 200 three-byte characters fits any group
    pack_header(refusal, limits)

    class HostileLeader:
        """Answers every confirmation with the group, its two members, and a thousand rows of padding."""

        async def call(self, peer_id, name, request, *, timeout, limits):
            padding = [["1" * 128, "0" * 16]] * 1000
            answer = {"group": group.group_id, "members": [list(m.key) for m in group.members], "pad": padding}
            pack_header(answer, limits)  # what the caller's framing checks before it reads the header
            return Message(answer)

    confirmations = Confirmations(HostileLeader())
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        asyncio.run(confirmations.confirm(group, me.member.key, timeout=1.0))


# ---------------------------------------------------------------- many peers over a simulated DHT


def simulate(
    count: int,
    cfg: MatchmakingConfig,
    *,
    seed: int,
    max_lag: float,
    spread: float,
    until: float,
    per_record: bool = False,
) -> SimulatedRound:
    """``count`` peers on one board (no rotation) that start within ``spread`` seconds, over the
    library's simulated lagging DHT, until they all finish or ``until`` passes."""
    peers = {simulated_peer_id(i): () for i in range(count)}
    return simulate_round(
        peers, cfg, swarm_size=None, seed=seed, max_lag=max_lag, spread=spread, until=until, per_record=per_record
    )


def check_agreement(result: SimulatedRound, cfg: MatchmakingConfig, count: int, *, complete: bool = True) -> None:
    by_id: dict[bytes, GroupInfo] = {}
    for peer_id, group in result.groups.items():
        assert by_id.setdefault(group.group_id, group) == group, "members disagree on a group"
        assert peer_id in {m.peer_id for m in group.members}
        assert cfg.min_group_size <= group.size <= (cfg.target_group_size or count)
    if not complete:
        return
    for group in by_id.values():
        for m in group.members:  # with bounded lag, everyone committed reads the commit in time
            assert result.groups.get(m.peer_id) == group, "a committed member did not join its group"


@settings(max_examples=100, deadline=None)
@given(
    count=st.integers(1, 10),
    target=st.integers(1, 5),
    min_size=st.integers(1, 5),
    seed=st.integers(0, 2**32),
    max_lag=st.sampled_from([0.0, 0.05, 0.2, 0.4]),
    spread=st.sampled_from([0.0, 0.1, 1.0]),
    per_record=st.booleans(),
)
# found by random draws, each failed before its fix: a live member's declaration seen before its refresh
# got it ignored by an abandoning leader (CI); members that had joined, their markers lagging 0.4 s, were
# taken for dead and left out of a commit (STALE_LEFT was 1/3: it tolerated lags below a third of a timeout)
@example(count=8, target=2, min_size=2, seed=2, max_lag=0.4, spread=1.0, per_record=True)
@example(count=6, target=4, min_size=2, seed=1477593643, max_lag=0.4, spread=0.1, per_record=True)
def test_simulated_peers_agree_on_every_group(count, target, min_size, seed, max_lag, spread, per_record) -> None:
    cfg = config(target_group_size=target, min_group_size=min(min_size, target), min_matchmaking_time=1.0)
    result = simulate(count, cfg, seed=seed, max_lag=max_lag, spread=spread, until=8.0, per_record=per_record)
    check_agreement(result, cfg, count)
    ungrouped = count - len(result.groups)
    assert ungrouped < cfg.min_group_size, "peers that could have formed a group were left waiting"


@settings(max_examples=20, deadline=None)
@given(count=st.integers(2, 10), seed=st.integers(0, 2**32), max_lag=st.sampled_from([1.5, 3.0]))
def test_members_agree_even_when_the_dht_lags_beyond_request_timeout(count, seed, max_lag) -> None:
    # Some member may then miss its commit (the documented gap), but no two members disagree.
    cfg = config(target_group_size=4, min_group_size=2, min_matchmaking_time=1.0)
    result = simulate(count, cfg, seed=seed, max_lag=max_lag, spread=1.0, until=8.0, per_record=True)
    check_agreement(result, cfg, count, complete=False)


@pytest.mark.parametrize(("count", "expected"), [(4, [4]), (8, [4, 4]), (6, [4, 2]), (3, [3]), (5, [3, 2])])
def test_simulated_round_without_lag_forms_the_planned_groups(count: int, expected: list[int]) -> None:
    cfg = config(min_matchmaking_time=1.0)
    result = simulate(count, cfg, seed=count, max_lag=0.0, spread=0.0, until=5.0)
    check_agreement(result, cfg, count)
    groups = {group.group_id: group for group in result.groups.values()}
    assert sorted((g.size for g in groups.values()), reverse=True) == expected


def test_simulated_full_group_forms_within_a_few_polls() -> None:
    cfg = config(min_matchmaking_time=100.0)
    result = simulate(4, cfg, seed=1, max_lag=0.02, spread=0.0, until=100.0)
    check_agreement(result, cfg, 4)
    assert len(result.groups) == 4
    assert max(result.found_at.values()) < 10 * cfg.poll_interval


def test_a_simulated_round_lists_its_live_peers_in_no_group() -> None:
    # polls_to_group counts grouped peers only: a live peer left alone must show somewhere
    cfg = config(min_matchmaking_time=0.5)
    peers = {simulated_peer_id(i): () for i in range(3)}
    result = simulate_round(peers, cfg, swarm_size=None, seed=0, spread=0.0, until=3.0, dying=[simulated_peer_id(2)])
    assert result.ungrouped == () and len(result.groups) == 2
    alone = simulate_round(peers, cfg, swarm_size=None, seed=0, spread=0.0, until=3.0, dying=list(peers)[1:])
    assert alone.ungrouped == (simulated_peer_id(0),) and not alone.groups


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_honest_peers_group_around_a_leader_that_seals_them_all_with_a_far_commit_time(seed: int) -> None:
    # A hostile peer (the lowest peer id) seals every honest peer's first attempt into a pair with itself,
    # with a commit time far ahead, and never commits: each honest peer joined its seal and waited on it
    # until its deadline (here: `until`), and no group formed at all.
    cfg = config(min_matchmaking_time=1.0)
    count, until = 8, 20.0
    hostile = replace(member(0), peer_id=peer(0)[:-1])  # sorts before every honest peer
    planted = []
    for i in range(count):
        members = (hostile, member(i))
        group = SealedGroup(group_id_for(members), members, commit_by=1_000.0)
        planted.append((board_key("run"), sealed_write(group, 10_000.0)))
    result = simulate_round(
        {peer(i): () for i in range(count)}, cfg, swarm_size=None, seed=seed, max_lag=0.05, until=until, planted=planted
    )
    check_agreement(result, cfg, count)
    assert result.ungrouped == () and len(result.groups) == count
    assert max(result.found_at.values()) < 3.0  # their scheduled time (1 s after they started), and a few polls


def test_a_leader_does_not_give_way_to_a_lower_seal_of_a_leader_it_shuns() -> None:
    # A leader that lies to its members and takes a peer alone into its group took honest groups over
    # again and again (test_matchmaking_dht, LyingDesk, 2 of 3 runs)
    cfg = config()
    group = SealedGroup(group_id_for((member(1), member(2))), (member(1), member(2)), NOW + 1.0)
    hostile = SealedGroup(group_id_for((member(0), member(1), member(2))), (member(0), member(1), member(2)), NOW + 1)
    board = board_of(sealed={group.group_id: group, hostile.group_id: hostile})
    leading = Leading(declaration(1), group, shunned=((peer(0), NOW + 3.0),))
    assert step(leading, NOW, board, cfg).state.group == group
    assert isinstance(step(replace(leading, shunned=()), NOW, board, cfg).state, Following)  # gives way otherwise
