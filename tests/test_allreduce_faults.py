"""Faults during a butterfly all-reduce round: every honest peer finishes in time with the exact
weighted mean over the contributors it reports, and the faulty peer is excluded.

Faults are injected through RoundHooks (the round's seam): a hook delays, corrupts or fails a
message, or crashes its peer by cancelling that peer's run_round task (which, like a dead process,
drops every stream of the peer at once).
"""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Callable

import pytest
import torch
from allreduce_swarm import Outcome, Swarm, check_round, config, group_of, make_tensors, run_round, swarm_fixtures
from hivemind.p2p import PeerID

from hivemind_ext.averaging.allreduce.service import RoundHooks
from hivemind_ext.compression import Float16Compression, MinMaxUInt8, NoCompression
from hivemind_ext.p2p import Message, pack_tensor

pytestmark = pytest.mark.timeout(90)
swarm, no_leftover_tasks = swarm_fixtures(4)

SHAPES = [(40, 25), (333,), (0,), (2, 2, 50)]  # 1533 values
NEXT_CHUNK_TIMEOUT, ALLREDUCE_TIMEOUT, MARGIN = 1.0, 4.0, 1.5
FAULTY = 3  # the peer that misbehaves, unless a test says otherwise


def fault_config(**overrides):
    values = dict(part_size_bytes=1024, next_chunk_timeout=NEXT_CHUNK_TIMEOUT, allreduce_timeout=ALLREDUCE_TIMEOUT)
    values.update(overrides)
    return config(**values)


def run_faulty(swarm: Swarm, hooks: Callable[[dict], dict[int, RoundHooks]], *, skip=(), cfg=None, seed=0):
    """One round on the whole swarm with the hooks that ``hooks(tasks)`` builds (``tasks`` maps each
    peer to its run_round task, so that a hook can crash its peer); returns (inputs, weights, outcomes)."""
    peers = swarm.peers
    inputs = [make_tensors(SHAPES, seed * 10 + i) for i in range(len(peers))]
    weights = [1.0 + (i * 7 + seed) % 4 for i in range(len(peers))]
    outcomes = run_with_hooks(swarm, inputs, weights, hooks, cfg=cfg or fault_config(), skip=skip)
    return inputs, weights, outcomes


def run_with_hooks(
    swarm: Swarm, inputs, weights, hooks: Callable[[dict], dict[int, RoundHooks]], *, cfg, skip, timeout=60
):
    """One round on the whole swarm with the given inputs and the hooks that ``hooks(tasks)`` builds
    (as in :func:`run_faulty`); returns the outcomes."""
    peers = swarm.peers
    tasks: dict = {}
    group = group_of([p.member() for p in peers])
    return swarm.run(
        run_round(peers, group, inputs, weights=weights, config=cfg, hooks=hooks(tasks), skip=skip, tasks_out=tasks),
        timeout=timeout,
    )


def assert_excluded_everywhere(
    swarm: Swarm, outcomes: list[Outcome | None], faulty: int, honest, *, unless_delivered: bool = False
) -> None:
    """The faulty peer is excluded by every honest peer and contributes to no part of another owner
    (``unless_delivered``: except parts whose whole slice it had delivered before it failed)."""
    faulty_id = swarm.peers[faulty].peer_id
    for i in honest:
        result = outcomes[i].result
        assert faulty_id in result.excluded, f"peer {i} did not exclude the faulty peer: {result.excluded}"
        if not unless_delivered:
            assert all(faulty_id not in part.contributors for part in result.parts if part.owner != faulty_id)
        assert outcomes[i].seconds < ALLREDUCE_TIMEOUT + MARGIN


def honest_parts_averaged(outcomes, honest, owners) -> None:
    for i in honest:
        for part in outcomes[i].result.parts:
            if part.owner in owners:
                assert part.averaged, f"peer {i}: part of {part.owner} not averaged: {part.reason}"


def crash(tasks: dict, index: int) -> None:
    tasks[index].cancel()


# ----- hooks


class CrashAfter(RoundHooks):
    """Crashes peer ``index`` (cancels its round) at the ``after``-th call of :meth:`count_down`."""

    def __init__(self, tasks: dict, index: int, after: int) -> None:
        self.tasks, self.index, self.left = tasks, index, after

    async def count_down(self) -> None:
        self.left -= 1
        if self.left < 0:
            crash(self.tasks, self.index)
            await asyncio.sleep(3600)


class CrashWhileSending(CrashAfter):
    """Crashes its peer (cancels its round) when it is about to send its ``after``-th chunk."""

    async def before_send_chunk(self, owner: PeerID, part: int, index: int, message: Message) -> Message:
        await self.count_down()
        return message


class FailStreamTo(RoundHooks):
    """The stream to one owner breaks after ``after`` chunks (the other streams are fine)."""

    def __init__(self, owner: PeerID, after: int) -> None:
        self.owner, self.left = owner, after

    async def before_send_chunk(self, owner: PeerID, part: int, index: int, message: Message) -> Message:
        if owner == self.owner:
            self.left -= 1
            if self.left < 0:
                raise ConnectionResetError("injected: connection reset")
        return message


class CrashWhileReducing(CrashAfter):
    """An owner that crashes after receiving ``after`` chunks."""

    async def after_receive_chunk(self, sender: PeerID, part: int, index: int, message: Message) -> None:
        await self.count_down()


class HangWhileReducing(RoundHooks):
    """An owner that stops reading each stream at its chunk ``at``, but stays connected."""

    def __init__(self, at: int) -> None:
        self.at = at

    async def after_receive_chunk(self, sender: PeerID, part: int, index: int, message: Message) -> None:
        if index >= self.at:
            await asyncio.sleep(3600)


class StallAt(RoundHooks):
    """A sender that pauses ``seconds`` before chunk ``at`` of every stream (too slow, not dead)."""

    def __init__(self, at: int, seconds: float) -> None:
        self.at, self.seconds = at, seconds

    async def before_send_chunk(self, owner: PeerID, part: int, index: int, message: Message) -> Message:
        if index == self.at:
            await asyncio.sleep(self.seconds)
        return message


class Corrupt(RoundHooks):
    """Replaces chunk ``at`` sent to ``owner`` (any owner if None) by ``corrupt(message)``."""

    def __init__(self, corrupt: Callable[[Message], Message], owner: PeerID | None = None, at: int = 1) -> None:
        self.corrupt, self.owner, self.at = corrupt, owner, at

    async def before_send_chunk(self, owner: PeerID, part: int, index: int, message: Message) -> Message:
        if index == self.at and self.owner in (None, owner):
            return self.corrupt(message)
        return message


class CorruptJoin(RoundHooks):
    def __init__(self, header_update: dict) -> None:
        self.update = header_update

    async def before_join(self, owner: PeerID, part: int, message: Message) -> Message:
        return Message({**message.header, **self.update}, message.payload)


class CorruptResult(RoundHooks):
    """An owner that sends ``corrupt(message)`` instead of averaged chunk ``at`` to one sender."""

    def __init__(self, corrupt: Callable[[Message], Message], sender: PeerID, at: int = 0) -> None:
        self.corrupt, self.sender, self.at = corrupt, sender, at

    async def before_send_result(self, sender: PeerID, part: int, index: int | None, message: Message) -> Message:
        if sender == self.sender and index == self.at:
            return self.corrupt(message)
        return message


def _numel(message: Message) -> int:
    return message.header["tensor"]["shape"][0]


def _replace_values(make: Callable[[int], torch.Tensor]) -> Callable[[Message], Message]:
    def replace(message: Message) -> Message:
        fields = {key: value for key, value in message.header.items() if key != "tensor"}  # "i", and "from"
        return pack_tensor(NoCompression().compress(make(_numel(message))), **fields)

    return replace


def _with_index(new_index: int) -> Callable[[Message], Message]:
    return lambda m: Message({**m.header, "i": new_index}, m.payload)


def _with_contributors(positions: Callable[[list[int]], object]) -> Callable[[Message], Message]:
    """An averaged chunk whose per-chunk contributor list ("from") is replaced by ``positions(old)``."""
    return lambda m: Message({**m.header, "from": positions(m.header["from"])}, m.payload)


def _without_contributors(message: Message) -> Message:
    return Message({key: value for key, value in message.header.items() if key != "from"}, message.payload)


def _oversized_payload(message: Message) -> Message:
    return Message(message.header, bytes(message.payload_view()) + b"\0" * 64)


def _garbage_header(message: Message) -> Message:
    return Message({"tensor": {"codec": "no such codec", "shape": [1]}, "i": message.header["i"]}, message.payload)


MALFORMED = {
    "nan": _replace_values(lambda n: torch.full((n,), float("nan"))),
    "inf": _replace_values(lambda n: torch.cat([torch.zeros(n - 1), torch.tensor([float("inf")])])),
    "longer": _replace_values(lambda n: torch.zeros(n + 1)),
    "shorter": _replace_values(lambda n: torch.zeros(n - 1)),
    "integers": _replace_values(lambda n: torch.zeros(n, dtype=torch.int64)),
    "oversized_payload": _oversized_payload,
    "garbage_header": _garbage_header,
    "duplicate_index": _with_index(0),
    "index_out_of_range": _with_index(10**6),
    "not_a_chunk": lambda m: Message({"hello": 1}, b"?"),
}


# ----- the tests


def test_peer_that_never_shows_up(swarm: Swarm) -> None:
    inputs, weights, outcomes = run_faulty(swarm, lambda tasks: {}, skip=[FAULTY])
    honest = [0, 1, 2]
    check_round(swarm.peers, inputs, weights, outcomes, honest=honest)
    assert_excluded_everywhere(swarm, outcomes, FAULTY, honest)
    owners = {swarm.peers[i].peer_id for i in honest}
    honest_parts_averaged(outcomes, honest, owners)
    for i in honest:  # its own part could not be averaged: everyone kept their values
        assert not outcomes[i].result.parts[FAULTY].averaged
        assert outcomes[i].seconds < NEXT_CHUNK_TIMEOUT + MARGIN  # no one waited for the whole timeout


def test_peer_whose_daemon_is_dead(swarm: Swarm) -> None:
    dead = swarm.run(swarm.new_peer())

    async def kill() -> None:
        await dead.service.shutdown()
        await dead.server.shutdown()
        await dead.p2p.shutdown()

    swarm.run(kill())
    peers = [*swarm.peers[:3], dead]
    inputs = [make_tensors(SHAPES, i) for i in range(4)]
    group = group_of([p.member() for p in peers])
    outcomes = swarm.run(run_round(peers, group, inputs, config=fault_config(), skip=[3]))
    check_round(peers, inputs, [1.0] * 4, outcomes, honest=[0, 1, 2])
    for i in range(3):
        result = outcomes[i].result
        assert dead.peer_id in result.excluded and not result.parts[3].averaged
        assert outcomes[i].seconds < NEXT_CHUNK_TIMEOUT + MARGIN


@pytest.mark.parametrize("after", [0, 3, 5])
def test_sender_that_crashes_mid_send(swarm: Swarm, after: int) -> None:
    inputs, weights, outcomes = run_faulty(
        swarm, lambda tasks: {FAULTY: CrashWhileSending(tasks, FAULTY, after)}, seed=after
    )
    assert isinstance(outcomes[FAULTY].error, asyncio.CancelledError)
    honest = [0, 1, 2]
    check_round(swarm.peers, inputs, weights, outcomes, honest=honest)
    assert_excluded_everywhere(swarm, outcomes, FAULTY, honest, unless_delivered=after > 0)
    honest_parts_averaged(outcomes, honest, {swarm.peers[i].peer_id for i in honest})


def test_stream_to_one_owner_breaks(swarm: Swarm) -> None:
    owner = swarm.peers[0].peer_id
    inputs, weights, outcomes = run_faulty(swarm, lambda tasks: {FAULTY: FailStreamTo(owner, 1)})
    check_round(swarm.peers, inputs, weights, outcomes, honest=range(4))
    for i in range(4):
        parts = outcomes[i].result.parts
        if i != FAULTY:
            assert swarm.peers[FAULTY].peer_id not in parts[0].contributors and parts[0].averaged
        assert all(swarm.peers[FAULTY].peer_id in part.contributors for part in parts[1:])
    assert not outcomes[FAULTY].result.parts[0].averaged  # it kept its own values for that part


@pytest.mark.parametrize("after", [0, 4])
def test_owner_that_crashes_mid_reduce(swarm: Swarm, after: int) -> None:
    inputs, weights, outcomes = run_faulty(
        swarm, lambda tasks: {FAULTY: CrashWhileReducing(tasks, FAULTY, after)}, seed=after
    )
    assert isinstance(outcomes[FAULTY].error, asyncio.CancelledError)
    honest = [0, 1, 2]
    check_round(swarm.peers, inputs, weights, outcomes, honest=honest)
    assert_excluded_everywhere(swarm, outcomes, FAULTY, honest, unless_delivered=True)  # it sends at once
    for i in honest:
        assert not outcomes[i].result.parts[FAULTY].averaged
        assert all(part.averaged for part in outcomes[i].result.parts[:FAULTY])
        assert outcomes[i].seconds < NEXT_CHUNK_TIMEOUT + MARGIN


def test_owner_that_hangs_mid_reduce(swarm: Swarm) -> None:
    inputs, weights, outcomes = run_faulty(swarm, lambda tasks: {FAULTY: HangWhileReducing(1)})
    check_round(swarm.peers, inputs, weights, outcomes, honest=range(4))  # the hanging owner returns too
    for i in range(FAULTY):
        assert not outcomes[i].result.parts[FAULTY].averaged
        assert swarm.peers[FAULTY].peer_id in outcomes[i].result.excluded
    assert all(o.seconds < ALLREDUCE_TIMEOUT + MARGIN for o in outcomes)


def test_sender_too_slow_is_excluded_without_waiting_for_the_round_timeout(swarm: Swarm) -> None:
    stall = 2.5 * NEXT_CHUNK_TIMEOUT
    inputs, weights, outcomes = run_faulty(swarm, lambda tasks: {FAULTY: StallAt(at=1, seconds=stall)})
    honest = [0, 1, 2]
    check_round(swarm.peers, inputs, weights, outcomes, honest=range(4))
    assert_excluded_everywhere(swarm, outcomes, FAULTY, honest)
    honest_parts_averaged(outcomes, honest, {swarm.peers[i].peer_id for i in range(4)})
    for i in honest:
        assert "next chunk" in outcomes[i].result.excluded[swarm.peers[FAULTY].peer_id]
        assert outcomes[i].seconds < stall + MARGIN  # excluded after next_chunk_timeout, not at the deadline


class Trickle(RoundHooks):
    """A sender that waits a little less than next_chunk_timeout before every chunk: never stalled,
    but far too slow to finish before the owners' collect deadline."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def before_send_chunk(self, owner: PeerID, part: int, index: int, message: Message) -> Message:
        await asyncio.sleep(self.seconds)
        return message


def test_trickling_sender_is_cut_off_at_the_collect_deadline(swarm: Swarm) -> None:
    cfg = fault_config(part_size_bytes=256, allreduce_timeout=3.0)  # collect deadline: 2.25 s
    inputs, weights, outcomes = run_faulty(swarm, lambda tasks: {FAULTY: Trickle(0.7 * NEXT_CHUNK_TIMEOUT)}, cfg=cfg)
    honest = [0, 1, 2]
    check_round(swarm.peers, inputs, weights, outcomes, honest=range(4))
    assert_excluded_everywhere(swarm, outcomes, FAULTY, honest)
    honest_parts_averaged(outcomes, honest, {swarm.peers[i].peer_id for i in range(4)})
    for i in honest:
        assert "collect deadline" in outcomes[i].result.excluded[swarm.peers[FAULTY].peer_id]
        assert cfg.collect_timeout - 0.1 < outcomes[i].seconds < cfg.allreduce_timeout + MARGIN


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_malformed_chunks_exclude_the_sender(swarm: Swarm, kind: str) -> None:
    owner = swarm.peers[0].peer_id
    inputs, weights, outcomes = run_faulty(swarm, lambda tasks: {FAULTY: Corrupt(MALFORMED[kind], owner)})
    check_round(swarm.peers, inputs, weights, outcomes, honest=range(4))
    faulty_id = swarm.peers[FAULTY].peer_id
    for i in range(4):
        parts = outcomes[i].result.parts
        if i == FAULTY:  # refused: it keeps its own values for that part
            assert not parts[0].averaged and parts[0].contributors == (faulty_id,)
        else:
            assert parts[0].averaged and faulty_id not in parts[0].contributors
        assert all(part.averaged and faulty_id in part.contributors for part in parts[1:])
        assert outcomes[i].seconds < NEXT_CHUNK_TIMEOUT + MARGIN
    assert faulty_id in outcomes[0].result.excluded


@pytest.mark.parametrize("update", [{"weight": -1.0}, {"layout": b"0" * 16}, {"v": 99}, {"weight": "heavy"}])
def test_malformed_join_is_refused(swarm: Swarm, update: dict) -> None:
    inputs, weights, outcomes = run_faulty(swarm, lambda tasks: {FAULTY: CorruptJoin(update)})
    honest = [0, 1, 2]
    check_round(swarm.peers, inputs, weights, outcomes, honest=range(4))
    faulty_id = swarm.peers[FAULTY].peer_id
    for i in honest:
        parts = outcomes[i].result.parts
        assert all(faulty_id not in part.contributors for part in parts if part.owner != faulty_id)
        assert outcomes[i].seconds < NEXT_CHUNK_TIMEOUT / 2  # refused at once, not at the join deadline


BAD_FROM = "averaged chunk 0 needs 'from'"
BAD_POSITIONS = "averaged chunk 0 lists contributor positions"


@pytest.mark.parametrize(
    "corrupt, reason",
    [
        pytest.param(_replace_values(lambda n: torch.full((n,), float("nan"))), "NaN", id="nan"),
        pytest.param(_replace_values(lambda n: torch.zeros(n + 3)), "shape", id="wrong_shape"),
        pytest.param(_with_index(5), "expected averaged chunk 0, got 5", id="wrong_index"),
        pytest.param(_with_index(1), "expected averaged chunk 0, got 1", id="out_of_order"),
        pytest.param(_oversized_payload, "", id="oversized_payload"),
        pytest.param(_garbage_header, "", id="garbage"),
        # the per-chunk contributor list (positions in RESULT's list; the victim is at position 1)
        pytest.param(_without_contributors, BAD_FROM, id="no_contributors"),
        pytest.param(_with_contributors(lambda old: "everyone"), BAD_FROM, id="contributors_not_a_list"),
        pytest.param(_with_contributors(lambda old: [float(p) for p in old]), BAD_FROM, id="contributor_not_an_int"),
        pytest.param(_with_contributors(lambda old: old[::-1]), BAD_POSITIONS, id="contributors_unsorted"),
        pytest.param(_with_contributors(lambda old: [0, 0, *old]), BAD_POSITIONS, id="contributor_twice"),
        pytest.param(_with_contributors(lambda old: [*old, 99]), BAD_POSITIONS, id="contributor_out_of_range"),
        pytest.param(_with_contributors(lambda old: [-1, *old]), BAD_POSITIONS, id="contributor_negative"),
        pytest.param(  # a lie: the victim delivered chunk 0, and an owner that leaves a sender out refuses it
            _with_contributors(lambda old: [p for p in old if p != 1]),
            "averaged chunk 0 leaves out this member",
            id="contributors_leave_out_the_victim",
        ),
    ],
)
def test_owner_that_sends_an_invalid_average(swarm: Swarm, corrupt, reason: str) -> None:
    victim = swarm.peers[1].peer_id
    inputs, weights, outcomes = run_faulty(swarm, lambda tasks: {FAULTY: CorruptResult(corrupt, victim)})
    check_round(swarm.peers, inputs, weights, outcomes, honest=range(4))
    assert not outcomes[1].result.parts[FAULTY].averaged
    assert reason in outcomes[1].result.excluded[swarm.peers[FAULTY].peer_id]
    assert all(outcomes[i].result.all_averaged for i in (0, 2, 3))


class FailStreamLater(RoundHooks):
    """The stream to ``owner`` breaks at chunk ``at``, ``delay`` seconds after the chunks before it
    went out (by then every other sender has delivered the whole part)."""

    def __init__(self, owner: PeerID, at: int, delay: float) -> None:
        self.owner, self.at, self.delay = owner, at, delay

    async def before_send_chunk(self, owner: PeerID, part: int, index: int, message: Message) -> Message:
        if owner == self.owner and index == self.at:
            await asyncio.sleep(self.delay)
            raise ConnectionResetError("injected: connection reset")
        return message


def test_a_sender_that_drops_out_mid_part_is_reported_chunk_by_chunk(swarm: Swarm) -> None:
    # the owner streamed chunks 0-1 back with the sender's values in them before the sender dropped out
    owner, faulty_id = swarm.peers[0].peer_id, swarm.peers[FAULTY].peer_id
    cfg = fault_config(part_size_bytes=256)  # part 0 is 384 values: 6 chunks
    hooks = {FAULTY: FailStreamLater(owner, at=2, delay=0.7 * NEXT_CHUNK_TIMEOUT)}
    inputs, weights, outcomes = run_faulty(swarm, lambda tasks: hooks, cfg=cfg)
    check_round(swarm.peers, inputs, weights, outcomes, honest=range(4))  # checks every run's values
    for i in range(FAULTY):
        result = outcomes[i].result
        part = result.parts[0]
        assert part.averaged and faulty_id not in part.contributors
        first, rest = part.runs
        assert (first.start, first.end, rest.end) == (part.start, part.start + 128, part.end)
        assert faulty_id in first.contributors and faulty_id not in rest.contributors
        assert not result.complete and faulty_id in result.missing
    assert not outcomes[FAULTY].result.parts[0].averaged  # it kept its own values for that part


def test_own_nan_values_are_not_averaged_and_do_not_poison_others(swarm: Swarm) -> None:
    peers = swarm.peers
    inputs = [make_tensors(SHAPES, i) for i in range(4)]
    inputs[FAULTY][0][3, 3] = float("nan")  # in part 0
    group = group_of([p.member() for p in peers])
    outcomes = swarm.run(run_round(peers, group, inputs, config=fault_config()))
    for i in range(FAULTY):
        assert torch.isfinite(outcomes[i].result.tensors[0]).all()
    check_round(peers, inputs, [1.0] * 4, outcomes, honest=range(3), atol=1e-5)
    assert peers[FAULTY].peer_id not in outcomes[0].result.parts[0].contributors


# ----- many rounds with random faults

FAULTS = ["none", "absent", "crash_send", "stall", "corrupt", "crash_reduce", "corrupt_result", "break_stream"]


def random_hooks(rng: random.Random, fault: str, faulty: int, swarm: Swarm, tasks: dict) -> dict[int, RoundHooks]:
    peers = swarm.peers
    if fault == "crash_send":
        return {faulty: CrashWhileSending(tasks, faulty, rng.randrange(0, 6))}
    if fault == "stall":
        return {faulty: StallAt(at=rng.randrange(0, 3), seconds=0.9)}
    if fault == "corrupt":
        owner = rng.choice([p.peer_id for p in peers if p is not peers[faulty]] + [None])
        return {faulty: Corrupt(MALFORMED[rng.choice(sorted(MALFORMED))], owner, at=rng.randrange(0, 2))}
    if fault == "crash_reduce":
        return {faulty: CrashWhileReducing(tasks, faulty, rng.randrange(0, 6))}
    if fault == "corrupt_result":
        victim = rng.choice([p.peer_id for p in peers if p is not peers[faulty]])
        return {faulty: CorruptResult(MALFORMED["nan"], victim, at=0)}
    if fault == "break_stream":
        owner = rng.choice([p.peer_id for p in peers if p is not peers[faulty]])
        return {faulty: FailStreamTo(owner, rng.randrange(0, 3))}
    return {}


@pytest.mark.timeout(120)
def test_many_rounds_with_random_faults(swarm: Swarm) -> None:
    rng = random.Random(2024)
    cfg_timeouts = dict(part_size_bytes=512, next_chunk_timeout=0.4, allreduce_timeout=2.0)
    codecs = [NoCompression(), Float16Compression(), MinMaxUInt8()]
    averaged = 0
    for round_index in range(24):
        fault, faulty = rng.choice(FAULTS), rng.randrange(4)
        codec = rng.choice(codecs)
        shapes = [(rng.randrange(0, 300),) for _ in range(rng.randrange(1, 4))]
        peers = swarm.peers
        inputs = [make_tensors(shapes, round_index * 10 + i) for i in range(4)]
        weights = [rng.choice([0.5, 1.0, 2.0, 3.0]) for _ in range(4)]
        outcomes = run_with_hooks(
            swarm,
            inputs,
            weights,
            functools.partial(random_hooks, rng, fault, faulty, swarm),
            cfg=fault_config(compression=codec, **cfg_timeouts),
            skip=[faulty] if fault == "absent" else [],
            timeout=10,
        )
        honest = [i for i in range(4) if i != faulty or fault in ("none", "break_stream", "corrupt_result")]
        atol = 0.1 if isinstance(codec, MinMaxUInt8) else 1e-2 if isinstance(codec, Float16Compression) else 1e-5
        context = f"round {round_index}: {fault} by peer {faulty} with {type(codec).__name__}"
        try:
            check_round(peers, inputs, weights, outcomes, honest=honest, atol=atol, rtol=1e-2)
        except AssertionError as e:
            raise AssertionError(f"{context}: {e}") from e
        for i in range(4):
            outcome = outcomes[i]
            if outcome is not None and outcome.error is None:
                assert outcome.seconds < cfg_timeouts["allreduce_timeout"] + MARGIN, context
        if fault == "none":
            assert all(outcomes[i].result.all_averaged for i in range(4)), context
        averaged += sum(part.averaged for i in honest for part in outcomes[i].result.parts)
        assert not swarm.leftover_tasks(), context
    assert averaged > 24 * 4  # most parts of most rounds are averaged despite the faults
