"""The grouping rule, the configuration checks and the record format, without a network."""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st
from matchmaking_builders import board_of, config, declaration, member, peer

from hivemind_ext.averaging.matchmaking.board import (
    MAX_GROUP_MEMBERS,
    Marker,
    Write,
    commit_write,
    declaration_write,
    marker_write,
    parse_board,
    parse_record,
    sealed_write,
)
from hivemind_ext.averaging.matchmaking.group import (
    MAX_BANDWIDTH,
    POLLS_BEFORE_DEADLINE,
    Board,
    Commit,
    Declaration,
    GroupInfo,
    MatchmakingConfig,
    Member,
    SealedGroup,
    all_auxiliary,
    group_id_for,
    is_viable,
    looking_peers,
    plan_groups,
)
from hivemind_ext.averaging.matchmaking.matchmaker import COMMIT_ATTEMPTS, Matchmaker
from hivemind_ext.errors import ConfigurationError, ProtocolError
from hivemind_ext.p2p.signing import owner_marker, signed_subkey

NOT_DUE, DUE = 0.0, 200.0  # every declaration below is ready at 100.0


def sizes(groups) -> list[int]:
    return [len(group) for group in groups]


def indices(group) -> list[int]:
    return sorted(int(d.member.attempt[:8], 16) for d in group)


def peers(count: int, **kwargs) -> list[Declaration]:
    return [declaration(i, **kwargs) for i in range(count)]


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "overrides",
    [
        dict(prefix=""),
        dict(prefix=None),
        dict(target_group_size=0),
        dict(target_group_size=2.0),
        dict(target_group_size=True),
        dict(min_group_size=0),
        dict(min_group_size=5, target_group_size=4),
        dict(min_matchmaking_time=-1.0),
        dict(min_matchmaking_time=math.nan),
        dict(request_timeout=0.0),
        dict(request_timeout=math.inf),
        dict(poll_interval=0.0),
        dict(poll_interval=0.5, request_timeout=1.0),  # too slow to refresh a declaration in time
        dict(client_mode=True, auxiliary=True),
        dict(bandwidth=-1.0),
        dict(bandwidth=math.inf),
        dict(bandwidth=math.nan),
        dict(bandwidth=1e308),  # finite, and it failed every member's opt.step with a bare ValueError
        dict(bandwidth=MAX_BANDWIDTH * 1.01),
        dict(bandwidth=True),
        dict(bandwidth="fast"),
    ],
)
def test_config_rejects_invalid_values(overrides: dict) -> None:
    with pytest.raises(ConfigurationError):
        config(**overrides)


def test_config_is_frozen_keyword_only_and_keeps_hivemind_names() -> None:
    cfg = MatchmakingConfig(prefix="run", target_group_size=None, min_group_size=1, bandwidth=0.0)
    with pytest.raises(AttributeError):
        cfg.prefix = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        MatchmakingConfig("run")  # type: ignore[misc]
    assert {"target_group_size", "min_group_size", "min_matchmaking_time", "request_timeout"} <= set(vars(cfg))


# ---------------------------------------------------------------- the grouping rule: scenarios


def test_a_full_group_forms_at_once_with_the_leader_first() -> None:
    (group,) = plan_groups(NOT_DUE, peers(4), config())
    assert indices(group) == [0, 1, 2, 3]
    assert group[0].member == member(0)  # ordered by peer id; the first member leads


def test_too_few_peers_wait_for_the_scheduled_time() -> None:
    assert plan_groups(NOT_DUE, peers(3), config()) == []
    assert sizes(plan_groups(DUE, peers(3), config())) == [3]


def test_expected_peers_form_one_group_before_the_scheduled_time() -> None:
    hint = config(target_group_size=None, expected_group_size=3)
    assert plan_groups(NOT_DUE, peers(2), hint) == []  # not everyone expected is here yet
    assert sizes(plan_groups(NOT_DUE, peers(3), hint)) == [3]
    assert sizes(plan_groups(NOT_DUE, peers(5), hint)) == [5]  # more than expected: still one group
    assert plan_groups(NOT_DUE, peers(3), config(target_group_size=None)) == []  # without the hint: wait
    with pytest.raises(ConfigurationError):
        config(target_group_size=None, expected_group_size=0)


def test_expected_peers_count_only_contributors_and_take_the_auxiliary_peers_along() -> None:
    """Issue 11 item 4: an auxiliary peer never stands in for an expected trainer (the group would form
    without the trainer, who then misses the round), and one that is looking joins the group."""
    hint = config(target_group_size=None, expected_group_size=2)
    trainer_and_aux = [declaration(0), declaration(1, auxiliary=True)]
    assert plan_groups(NOT_DUE, trainer_and_aux, hint) == []  # the second trainer is not here yet
    (group,) = plan_groups(NOT_DUE, [*trainer_and_aux, declaration(2)], hint)
    assert indices(group) == [0, 1, 2]
    assert plan_groups(NOT_DUE, [declaration(0), declaration(1)], hint) != []  # two trainers, no aux


def test_one_due_peer_is_enough_to_end_the_wait() -> None:
    looking = [*peers(2), declaration(2, ready_at=DUE - 1)]
    assert sizes(plan_groups(150.0, looking, config())) == [3]


def test_eight_peers_make_two_full_groups_by_seniority() -> None:
    looking = [declaration(i, declared_at=float(7 - i)) for i in range(8)]  # peer 7 is the most senior
    groups = plan_groups(NOT_DUE, looking, config())
    assert [indices(g) for g in groups] == [[4, 5, 6, 7], [0, 1, 2, 3]]


def test_full_groups_go_first_when_the_rest_can_still_form_a_group() -> None:
    groups = plan_groups(NOT_DUE, peers(6), config(min_group_size=2))
    assert [indices(g) for g in groups] == [[0, 1, 2, 3]]  # the two juniors wait for more peers
    assert sizes(plan_groups(DUE, peers(2), config(min_group_size=2))) == [2]


@pytest.mark.parametrize(("count", "min_size", "expected"), [(5, 2, [3, 2]), (6, 3, [3, 3]), (9, 2, [3, 3, 3])])
def test_nobody_is_stranded_when_an_even_split_exists(count: int, min_size: int, expected: list[int]) -> None:
    # Forming the full groups now would leave fewer than min_size peers behind: wait, then split evenly.
    assert plan_groups(NOT_DUE, peers(count), config(min_group_size=min_size)) == []
    assert sizes(plan_groups(DUE, peers(count), config(min_group_size=min_size))) == expected


def test_leftover_peers_are_fewer_than_min_group_size() -> None:
    groups = plan_groups(DUE, peers(5), config(min_group_size=3))
    assert sizes(groups) == [4]  # 3 + 2 would break min_group_size; one peer cannot be placed


def test_a_lone_peer_never_forms_a_group_unless_allowed() -> None:
    assert plan_groups(DUE, peers(1), config(min_group_size=2)) == []
    assert sizes(plan_groups(DUE, peers(1), config(min_group_size=1))) == [1]


def test_unlimited_target_waits_for_the_scheduled_time_then_takes_everyone() -> None:
    cfg = config(target_group_size=None)
    assert plan_groups(NOT_DUE, peers(30), cfg) == []
    assert sizes(plan_groups(DUE, peers(30), cfg)) == [30]


def test_a_newcomer_does_not_change_the_senior_group() -> None:
    cfg = config(min_group_size=1)
    assert plan_groups(NOT_DUE, peers(4), cfg) == plan_groups(NOT_DUE, peers(5), cfg)


def test_client_mode_peers_are_spread_over_groups() -> None:
    servers = [declaration(i) for i in range(2)]  # the two most senior accept connections
    clients = [declaration(i, client_mode=True) for i in range(2, 8)]
    groups = plan_groups(NOT_DUE, servers + clients, config())
    assert sizes(groups) == [4, 4]
    assert all(sum(not d.member.client_mode for d in group) == 1 for group in groups)


def test_groups_that_cannot_run_are_not_formed() -> None:
    assert plan_groups(NOT_DUE, peers(4, client_mode=True), config()) == []
    assert plan_groups(NOT_DUE, peers(4, auxiliary=True), config()) == []
    mixed = [declaration(0, auxiliary=True), *(declaration(i, client_mode=True) for i in range(1, 4))]
    assert sizes(plan_groups(NOT_DUE, mixed, config())) == [4]  # the auxiliary peer reduces, clients bring data


def test_auxiliary_peers_alone_form_a_group_only_once_due() -> None:
    """hivemind's edge case of auxiliary peers and no trainer: their steps finish (nothing to average)
    instead of waiting out the deadline; before the scheduled time they wait for trainers to come."""
    alone = [declaration(i, auxiliary=True, ready_at=10.0) for i in range(4)]
    assert plan_groups(5.0, alone, config()) == []
    (group,) = plan_groups(10.0, alone, config())
    assert all_auxiliary(d.member for d in group) and len(group) == 4
    assert len(plan_groups(10.0, alone, config(target_group_size=2))) == 1  # one group, target-sized
    assert plan_groups(10.0, alone[:1], config()) == []  # min_group_size still holds
    with_trainer = [*alone, declaration(9, ready_at=10.0)]
    groups = plan_groups(10.0, with_trainer, config(target_group_size=None))
    assert [is_viable(d.member for d in g) for g in groups] == [True]  # the trainer's group takes them all


# ---------------------------------------------------------------- who counts as looking


def test_looking_peers_skips_expired_other_prefix_and_near_deadline() -> None:
    cfg = config()
    now = 50.0
    board = board_of(
        declaration(0),
        declaration(1, expiration=now),  # expired
        declaration(2, prefix="other"),
        declaration(3, deadline=now + (POLLS_BEFORE_DEADLINE - 1) * cfg.poll_interval),
    )
    assert [d.member for d in looking_peers(now, board, cfg)] == [member(0)]


def test_looking_peers_skips_attempts_claimed_by_open_groups_and_commits() -> None:
    d = [declaration(i) for i in range(6)]
    open_group = SealedGroup(group_id_for([d[0].member]), (d[0].member,), commit_by=51.0)
    closed_group = SealedGroup(group_id_for([d[1].member]), (d[1].member,), commit_by=40.0)  # past commit_by
    committed = Commit("ab" * 16, (d[2].member.key,))
    # not plausible (see group.plausible): a hostile seal that would take d[4] and d[5] out of everyone's
    # plans until its far commit time, or until their deadlines
    far = SealedGroup(group_id_for([d[4].member]), (d[4].member,), commit_by=60.0)
    late_start = SealedGroup(group_id_for([d[5].member]), (d[5].member,), commit_by=51.0, start_at=500.0)
    board = board_of(
        *d,
        sealed={g.group_id: g for g in (open_group, closed_group, far, late_start)},
        commits={committed.group_id: committed},
    )
    expected = [d[1].member, d[3].member, d[4].member, d[5].member]
    assert [x.member for x in looking_peers(50.0, board, config())] == expected


def test_a_peer_with_two_live_attempts_counts_once_with_the_fresher_one() -> None:
    stale, fresh = declaration(0, attempt=1, expiration=300.0), declaration(0, attempt=2, expiration=400.0)
    assert looking_peers(50.0, board_of(stale, fresh), config()) == [fresh]


# ---------------------------------------------------------------- the grouping rule: properties

roles = st.sampled_from([(False, False), (False, False), (True, False), (False, True)])


@st.composite
def scenarios(draw):
    count = draw(st.integers(0, 24))
    target = draw(st.one_of(st.none(), st.integers(1, 8)))
    min_size = draw(st.integers(1, target or 8))
    looking = []
    for i in range(count):
        client, aux = draw(roles)
        looking.append(
            declaration(
                i,
                declared_at=draw(st.floats(0, 10)),
                ready_at=draw(st.floats(0, 100)),
                client_mode=client,
                auxiliary=aux,
            )
        )
    now = draw(st.floats(0, 120))
    return now, looking, config(target_group_size=target, min_group_size=min_size)


@settings(max_examples=300, deadline=None)
@given(scenarios(), st.randoms(use_true_random=False))
def test_plan_is_a_valid_partition_and_ignores_input_order(scenario, rnd: random.Random) -> None:
    now, looking, cfg = scenario
    groups = plan_groups(now, looking, cfg)
    shuffled = list(looking)
    rnd.shuffle(shuffled)
    assert plan_groups(now, shuffled, cfg) == groups  # every peer that sees the same records agrees
    placed = [d.member.key for group in groups for d in group]
    assert len(placed) == len(set(placed)), "no peer in two groups"
    assert set(placed) <= {d.member.key for d in looking}
    due = any(d.ready_at <= now for d in looking)
    for group in groups:
        assert cfg.min_group_size <= len(group) <= (cfg.target_group_size or len(looking))
        if all_auxiliary(d.member for d in group):  # nothing to average: only when due and nobody else looks
            assert due and all(d.member.auxiliary for d in looking) and len(groups) == 1
        else:
            assert is_viable(d.member for d in group)
        assert [d.member.key for d in group] == sorted(d.member.key for d in group)
    if not due:
        assert all(len(group) == cfg.target_group_size for group in groups), "only full groups before the timer"
    if due and all(not d.member.client_mode and not d.member.auxiliary for d in looking):
        assert len(looking) - len(placed) < cfg.min_group_size, "the leftover could not form a group anyway"


@settings(max_examples=100, deadline=None)
@given(scenarios(), st.integers(0, 5))
def test_peers_of_another_prefix_are_never_grouped(scenario, strangers: int) -> None:
    now, looking, cfg = scenario
    others = [declaration(100 + i, prefix="elsewhere") for i in range(strangers)]
    board = board_of(*(d for d in looking), *others)
    groups = plan_groups(now, looking_peers(now, board, cfg), cfg)
    assert all(d.prefix == cfg.prefix for group in groups for d in group)


# ---------------------------------------------------------------- records on the wire


def _roundtrip(write):
    return parse_record(write.subkey, write.value, write.expiration_time)


def test_records_round_trip_through_the_wire_format() -> None:
    d = declaration(3, client_mode=True, expiration=77.0)
    assert _roundtrip(declaration_write(d)) == d
    assert _roundtrip(marker_write(d.member.key, "cd" * 16, 78.0)) == Marker(d.member.key, "cd" * 16)
    assert _roundtrip(marker_write(d.member.key, None, 79.0)) == Marker(d.member.key, None)
    members = (member(1), member(2, auxiliary=True))
    group = SealedGroup(group_id_for(members), members, commit_by=12.5)
    assert _roundtrip(sealed_write(group, 80.0)) == group
    commit = Commit(group.group_id, (member(2).key,))
    assert _roundtrip(commit_write(commit, 81.0)) == commit


def test_parse_board_sorts_records_and_drops_expired_and_foreign_ones() -> None:
    now = 50.0
    mine, foreign, old = declaration(0, expiration=60.0), declaration(1, prefix="x"), declaration(2, expiration=40.0)
    writes = [declaration_write(d) for d in (mine, foreign, old)] + [marker_write(member(5).key, None, 70.0)]
    board = parse_board("run", [(w.subkey, w.value, w.expiration_time) for w in writes], now)
    assert board == Board(declarations={mine.member.key: mine}, markers={member(5).key: None})


def _sealed_value(*members_):
    return sealed_write(SealedGroup(group_id_for(members_), tuple(members_), 1.0), 2.0).value


@pytest.mark.parametrize(
    ("subkey", "value"),
    [
        (b"d/x", {}),
        ("d/" + peer(1), {"state": "left"}),  # no attempt
        ("d/" + peer(1) + "/" + "0" * 16, {"state": "maybe"}),
        ("d/bad id!/" + "0" * 16, {"state": "left"}),
        ("d/" + peer(1) + "/" + "0" * 16, {"state": "joined", "group": "short"}),
        ("d/" + peer(1) + "/" + "0" * 16, {**declaration_write(declaration(1)).value, "deadline": math.nan}),
        ("d/" + peer(1) + "/" + "0" * 16, {**declaration_write(declaration(1)).value, "ready_at": True}),
        ("d/" + peer(1) + "/" + "0" * 16, {**declaration_write(declaration(1)).value, "client_mode": 1}),
        ("d/" + peer(1) + "/" + "0" * 16, {**declaration_write(declaration(1)).value, "bandwidth": -2.0}),
        ("g/" + "ab" * 16, _sealed_value(member(1), member(2))),  # id does not match the members
        ("g/" + group_id_for([member(2), member(1)]), {**_sealed_value(member(1)), "members": []}),
        ("c/" + "ab" * 16, {"members": [[peer(1), "0" * 16]] * 2}),
        ("c/" + "ab" * 16, {"members": [[peer(1), "0" * 16]] * (MAX_GROUP_MEMBERS + 1)}),
        ("x/" + "ab" * 16, {}),
        ("c/" + "ab" * 16, [1, 2]),
    ],
)
def test_malformed_records_raise_protocol_error(subkey, value) -> None:
    with pytest.raises(ProtocolError):
        parse_record(subkey, value, 10.0)


@pytest.mark.parametrize("bandwidth", [1e308, MAX_BANDWIDTH * 2, MAX_BANDWIDTH, 100.0, 0.0])
def test_a_declared_bandwidth_is_capped_in_declarations_and_seals(bandwidth: float) -> None:
    # 1e308 from one peer overflowed the part split and chunk size of every member of its group
    expected = min(bandwidth, MAX_BANDWIDTH)
    value = {**declaration_write(declaration(1)).value, "bandwidth": bandwidth}
    assert parse_record("d/" + peer(1) + "/" + member(1).attempt, value, 10.0).member.bandwidth == expected
    members = (member(1), replace(member(2), bandwidth=bandwidth))
    sealed = parse_record("g/" + group_id_for(members), _sealed_value(*members), 10.0)
    assert [m.bandwidth for m in sealed.members] == [1.0, expected]
    assert sealed.group_id == group_id_for(members)  # the id does not depend on bandwidths


@pytest.mark.parametrize("bandwidth", [math.inf, -math.inf, math.nan, -1.0, "fast", True, [1.0]])
def test_a_non_finite_or_negative_declared_bandwidth_makes_the_record_malformed(bandwidth: object) -> None:
    value = {**declaration_write(declaration(1)).value, "bandwidth": bandwidth}
    with pytest.raises(ProtocolError, match="bandwidth"):
        parse_record("d/" + peer(1) + "/" + member(1).attempt, value, 10.0)


def test_sealed_members_must_be_ordered() -> None:
    members = (member(2), member(1))
    value = sealed_write(SealedGroup(group_id_for(members), members, 1.0), 2.0).value
    with pytest.raises(ProtocolError):
        parse_record("g/" + group_id_for(members), value, 10.0)


wire_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
_valid = [
    declaration_write(declaration(1)),
    marker_write(member(1).key, "ab" * 16, 5.0),
    sealed_write(SealedGroup(group_id_for([member(1), member(2)]), (member(1), member(2)), 1.0), 5.0),
    commit_write(Commit("ab" * 16, (member(1).key,)), 5.0),
]


@st.composite
def damaged_records(draw):
    """A valid record with one field replaced by garbage: reaches the deep checks that random maps miss."""
    write = draw(st.sampled_from(_valid))
    value = dict(write.value)
    value[draw(st.sampled_from(sorted(value)))] = draw(wire_values)
    subkey = draw(st.sampled_from([write.subkey, write.subkey[:-1], write.subkey + "/x"]))
    return subkey, value, draw(st.floats(allow_nan=True))


@settings(max_examples=150, deadline=None)
@given(st.lists(damaged_records() | st.tuples(wire_values, wire_values, wire_values), max_size=6))
def test_parse_board_never_raises_on_garbage(entries) -> None:
    assert isinstance(parse_board("run", entries, 0.0), Board)


def test_group_info_finds_members_and_converts_peer_ids() -> None:
    real_id = "12D3KooWFfZtDLuEvRGb9t9u8HaCdFnPm5Nffvgstc6NyJUuASwF"
    info = GroupInfo(b"\x01" * 16, (member(1), member(2)))
    assert info.size == 2 and info.index_of(peer(2)) == 1
    with pytest.raises(ValueError):
        info.index_of(peer(3))
    converted = GroupInfo(b"\x02", (Member(real_id, "0" * 16),))
    assert converted.peer_ids[0].to_base58() == real_id
    assert converted.index_of(converted.peer_ids[0]) == 0


SIGNING_KEY = RSAPrivateKey()
LEADER = Member(PeerID(b"x").to_base58(), "0" * 16)  # the matchmaker under test
GROUP_ID = group_id_for((LEADER,))


def _signed_entry(write: Write) -> tuple[bytes, SimpleNamespace]:
    """A record as the leader stored it: under its signed subkey."""
    subkey = signed_subkey(write.subkey, LEADER.peer_id, owner_marker(SIGNING_KEY))
    return subkey, SimpleNamespace(value=write.value, expiration_time=write.expiration_time)


class _CommitBoard:
    """The matchmaker's DHT seam (``dht_calls=``), standing in for the DHT and its node: every store
    "fails" (as a timed-out or refused store does) and a read shows the commit if ``visible``."""

    num_replicas = 5

    def __init__(self, visible: bool) -> None:
        self.visible = visible
        self.exchanges: list[tuple[tuple, bool]] = []  # (the records stored, whether the board was read)
        self._stored: tuple = ()

    def is_alive(self) -> bool:
        return True

    async def run_coroutine(self, request, *, timeout: float | None = None, deadline: float | None = None):
        self._stored = ()
        stored, entries = await request(self, self)  # runs as it would inside the DHT process
        self.exchanges.append((self._stored, entries is not None))
        return stored, entries

    async def store_many(self, keys: list, values: list, expirations: list, subkeys: list, **options) -> dict:
        self._stored = tuple(subkeys)
        return {key: False for key in keys}  # the store "failed"

    async def get(self, key: str, latest: bool = True, **options) -> SimpleNamespace | None:
        if not self.visible:
            return None
        seal = sealed_write(SealedGroup(GROUP_ID, (LEADER,), get_dht_time() + 10), get_dht_time() + 30)
        commit = commit_write(Commit(GROUP_ID, (LEADER.key,)), get_dht_time() + 30)
        return SimpleNamespace(value=dict(map(_signed_entry, (seal, commit))))


def test_a_leader_whose_commit_store_reports_failure_returns_if_the_commit_is_on_the_board() -> None:
    """A store that timed out or was refused by a replica that already held the commit may still
    have landed; members run the group once they read it, so the leader must too."""
    group = GroupInfo(bytes.fromhex(GROUP_ID), ())
    writes = (commit_write(Commit(GROUP_ID, (LEADER.key,)), get_dht_time() + 30),)
    for visible, expected, calls in ((True, True, 2), (False, False, 2 * COMMIT_ATTEMPTS)):
        board = _CommitBoard(visible)
        config = MatchmakingConfig(prefix="run", target_group_size=2)
        matchmaker = Matchmaker(config, dht=None, peer_id=PeerID(b"x"), dht_calls=board, signing_key=SIGNING_KEY)  # type: ignore[arg-type]
        committed = asyncio.run(matchmaker.commit(writes, group, deadline=get_dht_time() + 30))
        exchanges = board.exchanges
        assert committed is expected and len(exchanges) == calls


class _SlowBoard(_CommitBoard):
    """A DHT whose reads take ``read_time`` seconds (an internet DHT, or a saturated machine)."""

    def __init__(self, read_time: float) -> None:
        super().__init__(visible=False)
        self.read_time = read_time

    async def get(self, key: str, latest: bool = True, **options) -> SimpleNamespace | None:
        await asyncio.sleep(self.read_time)
        return await super().get(key, latest, **options)


def test_the_matchmaker_paces_the_protocol_at_the_time_its_reads_take() -> None:
    """Every read of the board is timed (see .pace): slow reads stretch the pace, fast ones leave
    the configured poll_interval."""
    group = GroupInfo(bytes.fromhex(GROUP_ID), ())
    writes = (commit_write(Commit(GROUP_ID, (LEADER.key,)), get_dht_time() + 30),)
    config = MatchmakingConfig(prefix="run", target_group_size=2, request_timeout=3.0, poll_interval=0.05)
    for read_time, low, high in ((0.0, 0.05, 0.05), (0.25, 0.25, 0.5)):
        board = _SlowBoard(read_time)
        matchmaker = Matchmaker(config, dht=None, peer_id=PeerID(b"x"), dht_calls=board, signing_key=SIGNING_KEY)  # type: ignore[arg-type]
        asyncio.run(matchmaker.commit(writes, group, deadline=get_dht_time() + 30))  # reads after each failed store
        assert sum(read for _, read in board.exchanges) == COMMIT_ATTEMPTS
        assert low <= matchmaker.read_pace.pace(config) <= high
