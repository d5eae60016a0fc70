"""Group keys (hivemind's group bits) and sealing ahead of the scheduled time, without a network."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from matchmaking_builders import board_of, config, declaration, member

from hivemind_ext.averaging.matchmaking.board import parse_record, sealed_write
from hivemind_ext.averaging.matchmaking.group import SealedGroup, group_id_for, looking_peers, plan_groups
from hivemind_ext.averaging.matchmaking.group_key import (
    MAX_GROUP_BITS,
    bucket_count,
    check_group_bits,
    deal_buckets,
    group_key,
    next_group_bits,
)
from hivemind_ext.averaging.matchmaking.protocol import Following, Leading, Looking, step
from hivemind_ext.averaging.matchmaking.timing import (
    SEAL_AHEAD_POLLS,
    SEAL_AHEAD_SHARE,
    group_start,
    plan_ahead,
    seal_time,
)
from hivemind_ext.errors import ConfigurationError, ProtocolError

# ---------------------------------------------------------------- group keys


def test_group_key_is_the_prefix_plus_the_bits_as_hivemind_names_it() -> None:
    assert group_key("run", "") == "run"  # no bits: the board of peers without group bits
    assert group_key("run", "0110") == "run.0b0110"
    assert config(group_bits="01").group_key == "run.0b01"
    assert config().group_key == "run"


@pytest.mark.parametrize("bits", ["012", "0b01", " 1", None, 101, "1" * (MAX_GROUP_BITS + 1)])
def test_invalid_group_bits_are_refused(bits: object) -> None:
    with pytest.raises(ConfigurationError):
        check_group_bits(bits)
    with pytest.raises(ConfigurationError):
        config(group_bits=bits)


def test_peers_only_see_declarations_of_their_own_group_key() -> None:
    zeros = [declaration(i, prefix="run.0b0") for i in range(4)]
    ones = [declaration(i, prefix="run.0b1") for i in range(4, 8)]
    bare = [declaration(i, prefix="run") for i in range(8, 10)]
    board = board_of(*zeros, *ones, *bare)
    for bits, expected in (("0", zeros), ("1", ones), ("", bare)):
        cfg = config(group_bits=bits)
        looking = looking_peers(0.0, board, cfg)
        assert looking == expected
        # within one key, the grouping rule is the rule without keys
        assert plan_groups(0.0, looking, cfg) == plan_groups(0.0, expected, config())


# ---------------------------------------------------------------- moving the bits after a round


@pytest.mark.parametrize(("size", "target"), [(2, 2), (4, 4), (3, 4), (3, None), (5, None), (1, None), (8, 8)])
def test_members_of_one_group_are_dealt_distinct_buckets_the_same_way(size: int, target: int | None) -> None:
    buckets = bucket_count(size, target)
    assert buckets >= size and (target is not None or buckets & (buckets - 1) == 0)
    for seed in range(20):
        group_id = bytes([seed]) * 16
        deal = deal_buckets(group_id, size, buckets)
        assert deal == deal_buckets(group_id, size, buckets)  # every member computes the same deal
        assert len(set(deal)) == size and all(0 <= b < buckets for b in deal)
        bits = [next_group_bits("0101", group_id, i, size, target) for i in range(size)]
        assert all(len(b) == 4 for b in bits)
        assert len(set(bits)) == size or buckets == 1, "groupmates must move to different keys"


def test_the_new_bits_append_the_bucket_and_drop_from_the_front() -> None:
    group_id = b"\x07" * 16
    first, second = (next_group_bits("110", group_id, i, 2, 2) for i in range(2))
    assert {first, second} == {"100", "101"}
    assert next_group_bits("", group_id, 0, 2, 2) == ""  # without bits, peers keep the prefix's key
    assert next_group_bits("1", group_id, 0, 1, None) == "1"  # one bucket: nothing to append
    with pytest.raises(ConfigurationError):
        next_group_bits("1", group_id, 2, 2, 2)


def _rounds_of_moshpit(count: int, target: int, width: int, rounds: int) -> list[list[float]]:
    """Peers that average only with peers of the same key, moving keys as the averager does."""
    values = [float(i * i) for i in range(count)]
    bits = [format(i // target, f"0{width}b") for i in range(count)]
    history = [list(values)]
    for round_index in range(rounds):
        by_key: dict[str, list[int]] = {}
        for peer, key in enumerate(bits):
            by_key.setdefault(key, []).append(peer)
        for key, members in by_key.items():
            assert len(members) == target, f"round {round_index}: key {key} holds {members}"
            mean = sum(values[p] for p in members) / len(members)
            group_id = f"{round_index}/{key}".encode()
            for index, peer in enumerate(members):
                values[peer] = mean
                bits[peer] = next_group_bits(bits[peer], group_id, index, len(members), target)
        history.append(list(values))
    return history


@pytest.mark.parametrize(("count", "target", "width", "rounds"), [(8, 2, 2, 3), (16, 4, 2, 2), (64, 8, 3, 2)])
def test_a_grid_of_group_bits_reaches_the_exact_mean_after_log_rounds(count, target, width, rounds) -> None:
    history = _rounds_of_moshpit(count, target, width, rounds)
    mean = sum(history[0]) / count
    assert all(math.isclose(v, mean) for v in history[-1])
    assert not all(math.isclose(v, mean) for v in history[-2]), "not one round too early"


# ---------------------------------------------------------------- sealing ahead of the scheduled time


def test_a_declaration_is_planned_as_due_a_little_before_its_scheduled_time() -> None:
    cfg = config(poll_interval=0.05)
    assert seal_time(declaration(0, declared_at=0.0, ready_at=10.0), cfg) == pytest.approx(
        10.0 - SEAL_AHEAD_POLLS * 0.05
    )
    # never more than a share of the declaration's own wait: short waits keep room for latecomers
    assert seal_time(declaration(0, declared_at=9.9, ready_at=10.0), cfg) == pytest.approx(
        10.0 - SEAL_AHEAD_SHARE * 0.1
    )


def test_unlimited_target_seals_everyone_ahead_and_starts_at_the_scheduled_time() -> None:
    cfg = config(target_group_size=None, poll_interval=0.05)
    looking = [declaration(i, declared_at=0.0, ready_at=10.0 + 0.01 * i) for i in range(4)]
    assert plan_ahead(9.0, looking, cfg) == []  # long before: wait for more peers, as before
    ((group, start),) = plan_ahead(9.8, looking, cfg)
    assert sorted(group, key=lambda d: d.member.key) == looking and start == 10.0  # the first scheduled time
    ((late_group, late_start),) = plan_ahead(10.5, looking, cfg)
    assert late_group == group and late_start == 10.5  # past it: at once, as plan_groups
    assert group_start(10.5, looking) == 10.5


def test_full_groups_still_start_at_once_and_the_rest_is_sealed_ahead() -> None:
    cfg = config(target_group_size=4, min_group_size=2, poll_interval=0.05)
    looking = [declaration(i, declared_at=float(i) / 100, ready_at=10.0) for i in range(6)]
    (full,) = plan_ahead(1.0, looking, cfg)
    assert full == (tuple(looking[:4]), 1.0)
    rest = looking[4:]
    assert plan_ahead(1.0, rest, cfg) == []
    assert plan_ahead(9.8, rest, cfg) == [(tuple(rest), 10.0)]


@settings(max_examples=200, deadline=None)
@given(
    count=st.integers(0, 12),
    target=st.one_of(st.none(), st.integers(1, 6)),
    now=st.floats(0, 20),
    readies=st.lists(st.floats(0, 20), min_size=12, max_size=12),
)
def test_planning_ahead_only_adds_groups_where_the_rule_formed_none(count, target, now, readies) -> None:
    cfg = config(target_group_size=target, min_group_size=min(2, target or 2), poll_interval=0.05)
    looking = [declaration(i, declared_at=0.0, ready_at=readies[i]) for i in range(count)]
    now_groups = plan_groups(now, looking, cfg)
    ahead = plan_ahead(now, looking, cfg)
    if now_groups:
        assert ahead == [(g, now) for g in now_groups]
    else:
        assert not ahead or any(seal_time(d, cfg) <= now for d in looking), "nothing planned ahead of its time"
        placed = [d.member.key for group, _ in ahead for d in group]
        assert len(placed) == len(set(placed)) and set(placed) <= {d.member.key for d in looking}
        for group, start in ahead:
            assert start == group_start(now, looking) >= now
            assert cfg.min_group_size <= len(group) <= (target or count)


def test_a_group_sealed_ahead_carries_its_start_to_every_member() -> None:
    cfg = config(target_group_size=None, poll_interval=0.05)
    me = declaration(0, declared_at=0.0, ready_at=10.0, expiration=10.5)
    others = [declaration(i, declared_at=0.0, ready_at=10.0, expiration=10.5) for i in (1, 2)]
    leading = step(Looking(me), 9.8, board_of(*others), cfg)
    assert isinstance(leading.state, Leading) and leading.state.group.start_at == 10.0
    sealed = leading.state.group
    record = next(w for w in leading.writes if w.subkey.startswith("g/"))
    assert parse_record(record.subkey, record.value, 20.0) == sealed  # start_at travels on the wire
    confirmed = {m.key: sealed.group_id for m in sealed.members}
    final = step(leading.state, 9.85, board_of(markers=confirmed), cfg)
    assert final.group is not None and final.start_at == 10.0  # committed early, starts on schedule
    follower = Following(others[0], sealed)
    commit = next(w for w in final.writes if w.subkey.startswith("c/"))
    board = board_of(commits={sealed.group_id: parse_record(commit.subkey, commit.value, 20.0)})
    assert step(follower, 9.9, board, cfg).start_at == 10.0


def test_a_full_group_is_sealed_without_a_start_and_old_records_parse() -> None:
    cfg = config()
    leading = step(Looking(declaration(0)), 0.0, board_of(*(declaration(i) for i in (1, 2, 3))), cfg)
    assert leading.state.group.start_at == -math.inf
    record = next(w for w in leading.writes if w.subkey.startswith("g/"))
    assert "start_at" not in record.value
    members = (member(1), member(2))
    value = {**sealed_write(SealedGroup(group_id_for(members), members, 1.0), 2.0).value, "start_at": math.nan}
    with pytest.raises(ProtocolError):
        parse_record("g/" + group_id_for(members), value, 10.0)
