"""The round driver's decisions as tables of (situation -> decision), without a network; and its one
wait loop, driven with a stand-in control."""

from __future__ import annotations

import concurrent.futures
import threading
from types import SimpleNamespace

import pytest
from hivemind.utils import get_dht_time

from hivemind_ext.averaging.control import AveragingStage
from hivemind_ext.errors import AllreduceError, DeadlineExceededError, MatchmakingError
from hivemind_ext.optim.progress import GlobalTrainingProgress
from hivemind_ext.optim.rounds import (
    FailedRound,
    RoundDriver,
    RoundHooks,
    RoundPlan,
    after_failed_round,
    contributing_members,
    expected_group_size,
    give_up_time,
    missed_round,
    next_epoch,
    plan_round,
    should_abandon_search,
    should_prepare_round,
    straggler_patience,
)


@pytest.mark.parametrize(
    "last_group_size, peers_seen, expected",
    [
        (None, 1, None),  # alone, no round yet: no one to wait for
        (None, 0, None),
        (None, 3, 3),  # the tracker's count, at once (before the first round too)
        (1, 1, None),
        (4, 2, 4),  # peers the tracker has not seen yet this refresh: the last group counts
        (2, 5, 5),  # more peers now than in the last group
    ],
)
def test_expected_group_size(last_group_size, peers_seen, expected) -> None:
    assert expected_group_size(last_group_size, peers_seen) == expected


@pytest.mark.parametrize(
    "eta, expected, scheduled, deadline",
    [
        (None, None, 100.5, 110.5),  # now + one matchmaking time; the round gets averaging_timeout after it
        (None, 3, 101.0, 111.0),  # a group is expected: two matchmaking times of fallback
        (103.0, None, 103.5, 113.5),  # at the swarm's estimated epoch end
        (103.0, 2, 104.0, 114.0),
        (90.0, None, 100.5, 110.5),  # an estimate in the past counts as now
    ],
)
def test_plan_round(eta, expected, scheduled, deadline) -> None:
    plan = plan_round(100.0, matchmaking_time=0.5, averaging_timeout=10.0, eta=eta, expected=expected)
    assert plan == RoundPlan(scheduled_time=scheduled, deadline=deadline, expected_group_size=expected)
    assert plan.timeout(100.0) == deadline - 100.0


def test_patience_extends_only_a_round_that_expects_peers() -> None:
    waits = plan_round(100.0, matchmaking_time=0.5, averaging_timeout=10.0, expected=3, patience=2.0)
    assert (waits.scheduled_time, waits.deadline) == (103.0, 113.0)  # the all-reduce keeps its whole timeout
    alone = plan_round(100.0, matchmaking_time=0.5, averaging_timeout=10.0, expected=None, patience=2.0)
    assert alone.scheduled_time == 100.5


@pytest.mark.parametrize(
    "samples, slowest_speed, patience",
    [
        (80, 40.0, 2.0),  # the straggler needs 2 s for this peer's samples of the round
        (80, 400.0, 0.2),
        (80, 1.0, 5.0),  # never past the limit (a stalled or lying record)
        (80, 0.0, 5.0),  # its speed unknown yet (a peer that just joined): the limit
        (80, float("nan"), 5.0),
        (80, float("inf"), 5.0),
        (0, 40.0, 0.0),  # nothing since the last round
        (float("nan"), 40.0, 0.0),
    ],
)
def test_straggler_patience(samples, slowest_speed, patience) -> None:
    assert straggler_patience(samples, slowest_speed, limit=5.0) == pytest.approx(patience)


def test_the_driver_waits_for_the_slowest_trainer_except_in_groups() -> None:
    rounds = driver(slowest=40.0)
    assert rounds.straggler_patience(80) == pytest.approx(2.0)
    assert driver(slowest=1.0).straggler_patience(80) == pytest.approx(2.5)  # half the averaging timeout
    rounds.in_groups = True  # rotating groups form when full: they never wait for the whole swarm
    assert rounds.straggler_patience(80) == 0.0


@pytest.mark.parametrize(
    "now, eta, prepare",
    [(100.0, 105.0, False), (100.0, 100.5, True), (100.0, 101.0, True), (100.0, 99.0, True)],
)
def test_should_prepare_round(now, eta, prepare) -> None:
    assert should_prepare_round(now, eta, matchmaking_time=1.0) is prepare


def test_give_up_time_is_the_deadline_plus_a_short_grace() -> None:
    assert 50.0 < give_up_time(50.0) <= 52.0


@pytest.mark.parametrize(
    "searching, swarm_epoch, local_epoch, watch_swarm, abandon",
    [
        (True, 5, 4, True, True),  # still looking while the swarm finished this epoch: it happened without us
        (False, 5, 4, True, False),  # in the all-reduce already: see it through
        (True, 4, 4, True, False),  # the swarm is at our epoch: keep looking
        (True, 5, 4, False, False),  # a round on the algorithm's own schedule: wait it out
    ],
)
def test_should_abandon_search(searching, swarm_epoch, local_epoch, watch_swarm, abandon) -> None:
    decision = should_abandon_search(
        searching=searching, swarm_epoch=swarm_epoch, local_epoch=local_epoch, watch_swarm=watch_swarm
    )
    assert decision is abandon


@pytest.mark.parametrize(
    "searching, swarm_epoch, local_epoch, overlap, missed",
    [
        (None, 5, 4, False, True),  # no round scheduled and the swarm moved on
        (True, 5, 4, False, True),  # the scheduled round never found its group
        (False, 5, 4, False, False),  # the scheduled round has its group: it may still finish
        (None, 4, 4, False, False),  # the swarm is at our epoch
        (None, 5, 4, True, False),  # delayed averaging: peers enter the next epoch before rounds end
    ],
)
def test_missed_round(searching, swarm_epoch, local_epoch, overlap, missed) -> None:
    decision = missed_round(
        searching=searching, swarm_epoch=swarm_epoch, local_epoch=local_epoch, rounds_overlap_epochs=overlap
    )
    assert decision is missed


@pytest.mark.parametrize(
    "peers_seen, missed, outcome",
    [
        (3, False, FailedRound(step_locally=True, resync=True)),  # failed: local step, then resync
        (1, False, FailedRound(step_locally=True, resync=False)),  # failed and alone: no one to resync with
        (2, True, FailedRound(step_locally=False, resync=True)),  # missed: the download replaces the step
        (1, True, FailedRound(step_locally=False, resync=True)),  # missed proves others train
    ],
)
def test_after_failed_round(peers_seen, missed, outcome) -> None:
    assert after_failed_round(peers_seen=peers_seen, missed=missed) == outcome


@pytest.mark.parametrize("local, swarm, after", [(3, 3, 4), (3, 2, 4), (3, 7, 7), (0, 1, 1)])
def test_next_epoch(local, swarm, after) -> None:
    assert next_epoch(local, swarm) == after


# ----- the one wait loop


class _Control(concurrent.futures.Future):
    def __init__(self, deadline: float, stage: AveragingStage = AveragingStage.LOOKING_FOR_GROUP) -> None:
        super().__init__()
        self.deadline, self.stage = deadline, stage


class _Recorder(RoundHooks):
    def __init__(self, fail: BaseException | None = None) -> None:
        self.fail, self.events = fail, []

    def before_round(self, control, *, watch_swarm: bool) -> None:
        self.events.append(("before", watch_swarm))
        if self.fail is not None:
            raise self.fail

    def after_round(self, control, error) -> None:
        self.events.append(("after", type(error).__name__ if error is not None else None))


def driver(
    hooks: RoundHooks | None = None, *, swarm_epoch: int = 0, peers: int = 2, aux: int = 0, slowest: float = 0.0
) -> RoundDriver:
    progress = GlobalTrainingProgress(
        epoch=swarm_epoch,
        samples_accumulated=0,
        target_batch_size=1,
        num_peers=peers + aux,
        num_clients=0,
        eta_next_epoch=0.0,
        next_fetch_time=0.0,
        num_auxiliary=aux,
        slowest_trainer_speed=slowest,
    )
    tracker = SimpleNamespace(global_progress=progress)
    return RoundDriver(tracker=tracker, matchmaking_time=0.5, averaging_timeout=5.0, local_epoch=lambda: 0, hooks=hooks)


def test_the_wait_returns_the_result_and_calls_the_hooks() -> None:
    hooks = _Recorder()
    control = _Control(get_dht_time() + 5)
    control.set_result({"peer": {"samples": 4}})
    assert driver(hooks).wait(control, watch_swarm=False) == {"peer": {"samples": 4}}
    assert hooks.events == [("before", False), ("after", None)]


@pytest.mark.timeout(10)
def test_a_hook_fails_a_round_and_the_round_is_cancelled() -> None:
    hooks = _Recorder(fail=AllreduceError("injected"))
    control = _Control(get_dht_time() + 5)
    with pytest.raises(AllreduceError):
        driver(hooks).wait(control)
    assert control.cancelled() and hooks.events == [("before", True), ("after", "AllreduceError")]


@pytest.mark.timeout(10)
def test_the_wait_gives_up_once_the_swarm_finished_the_epoch_without_this_peer() -> None:
    control = _Control(get_dht_time() + 30)
    with pytest.raises(MatchmakingError):
        driver(swarm_epoch=1).wait(control, watch_swarm=True)
    assert control.cancelled()


@pytest.mark.timeout(10)
def test_the_wait_never_outlasts_the_deadline() -> None:
    control = _Control(get_dht_time() + 0.2)
    started = get_dht_time()
    with pytest.raises(DeadlineExceededError):
        driver().wait(control, watch_swarm=False)
    assert get_dht_time() - started <= give_up_time(0.2) + 0.5
    assert control.cancelled()


@pytest.mark.timeout(10)
def test_a_stop_flag_abandons_the_round() -> None:
    stop = threading.Event()
    stop.set()
    control = _Control(get_dht_time() + 30)
    with pytest.raises(concurrent.futures.CancelledError):
        driver().wait(control, watch_swarm=False, stop=stop)
    assert control.cancelled()


@pytest.mark.parametrize("peers, aux, resync", [(1, 0, False), (3, 0, True), (1, 2, False)])
def test_a_resync_request_follows_the_failed_round_rule(peers, aux, resync) -> None:
    """A trainer with only auxiliary peers around has no one to download the state from."""
    rounds = driver(peers=peers, aux=aux)
    assert rounds.request_resync() is resync and rounds.resync_pending is resync
    assert rounds.request_resync(missed=True) and rounds.resync_pending
    rounds.clear_resync()
    assert not rounds.resync_pending


def test_auxiliary_peers_are_never_expected_in_a_group() -> None:
    assert driver(peers=1, aux=2).plan().expected_group_size is None  # a lone trainer expects no one
    assert driver(peers=2, aux=1).plan().expected_group_size == 2


def _report(*parts: tuple[str, ...]) -> SimpleNamespace:
    return SimpleNamespace(contributors=parts)


def test_a_group_size_is_expected_once_a_round_had_a_group() -> None:
    """plan_after: the one rule of gradient and state rounds (the tracker may not see a late peer yet
    before any round had a group; from then on the group forms as soon as every expected peer looks)."""
    assert contributing_members(None) == 0 and contributing_members(_report(("a",), ())) == 1
    assert contributing_members(_report(("a", "b"), ("b", "c"))) == 3
    rounds = driver(peers=3)
    assert rounds.plan_after(None).expected_group_size is None
    assert rounds.plan_after(_report(("a",))).expected_group_size is None  # a round alone had no group
    assert rounds.plan_after(_report(("a", "b"))).expected_group_size == 3  # the tracker sees more
    assert driver(peers=2).plan_after(_report(("a", "b", "c"))).expected_group_size == 3  # the last group
    # expecting a group size, the fallback is two matchmaking times away (late peers still join)
    now = get_dht_time()
    plan = rounds.plan_after(_report(("a", "b")), eta=now + 10)
    assert plan.scheduled_time == pytest.approx(now + 10 + 2 * 0.5, abs=0.2)
