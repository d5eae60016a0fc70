"""State rounds of two peers: rounds begun at the same epoch average the parameters; rounds begun at
different epochs (a peer whose previous round was still pending skipped one) are discarded by both,
because their average would mix parameters from before and after a step and pull the peers apart."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import hivemind
import pytest
import torch
from hivemind.utils import get_dht_time
from swarm import local_swarm

from hivemind_ext.optim.algorithms.state_rounds import StateRounds
from hivemind_ext.optim.algorithms.sync_gradients import SyncGradientsImpl
from hivemind_ext.optim.rounds import MAX_EPOCH_SPREAD_IN_GROUPS, epochs_mix_well, gathered_epochs
from hivemind_ext.optim.state_averager import TrainingStateAverager
from hivemind_ext.optim.training_state import TrainingState

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]
_prefixes = itertools.count()


def test_round_epochs_reads_only_plain_int_epochs() -> None:
    gathered = {"a": {"epoch": 3}, "b": None, "c": {"epoch": True}, "d": "x", "e": {"epoch": -1}, "f": {"epoch": 3}}
    assert gathered_epochs(gathered) == {3}
    assert gathered_epochs({"a": {"epoch": 3}, "b": {"epoch": 4}}) == {3, 4}
    assert gathered_epochs(None) == set() and gathered_epochs(["not", "a", "dict"]) == set()


def test_which_epochs_a_state_round_may_mix() -> None:
    assert epochs_mix_well(set(), in_groups=False) and epochs_mix_well({3}, in_groups=False)
    assert not epochs_mix_well({3, 4}, in_groups=False)
    assert epochs_mix_well({3, 4}, in_groups=True)
    assert epochs_mix_well({3, 3 + MAX_EPOCH_SPREAD_IN_GROUPS}, in_groups=True)
    assert not epochs_mix_well({3, 4 + MAX_EPOCH_SPREAD_IN_GROUPS}, in_groups=True)


class _FakeStateAverager:
    """A state averager's round bookkeeping (no network): a round is begun, then ends, then is applied.
    ``ends_in``: how long a running round still runs (None: past any wait)."""

    def __init__(self, events: list[str] | None = None) -> None:
        self.events = events if events is not None else []
        self.running = self.pending = False
        self.ends_in: float | None = None
        self.applied = 0
        self.waits: list[float] = []
        self.last_round = None

    @property
    def has_round(self) -> bool:
        return self.pending

    @property
    def round_in_progress(self) -> bool:
        return self.pending and self.running

    def apply_round(self, wait: float | None = 0.0) -> bool | None:
        self.waits.append(wait or 0.0)
        if self.running and self.ends_in is not None and self.ends_in <= (wait or 0.0):
            self.running = False
        if not self.pending or self.running:
            return None
        self.pending = False
        self.applied += 1
        self.events.append("state round applied")
        return True


def _state_rounds(averager: _FakeStateAverager, *, trainers: int = 8, every: int = 1) -> StateRounds:
    progress = SimpleNamespace(num_trainers=trainers, epoch=0)
    context = SimpleNamespace(
        state_averager=averager,
        tracker=SimpleNamespace(global_progress=progress),
        config=SimpleNamespace(average_state_every=every),
        local_epoch=4,
    )
    rounds = StateRounds(context)
    rounds.deadline = get_dht_time() + 10.0  # the pending round's (see StateRounds.begin)
    return rounds


def test_a_finished_state_round_is_applied_before_deciding_whether_the_next_is_due() -> None:
    """A round that ended while the epoch's last step ran is applied, and the next epoch's round is due.
    Before: it counted as pending (step() applies it at its next call), and the next round was skipped."""
    averager = _FakeStateAverager()
    rounds = _state_rounds(averager)
    averager.pending = True
    assert rounds.due(5) and averager.applied == 1 and not averager.has_round


def test_a_state_round_still_running_is_waited_for_and_the_next_is_due() -> None:
    """As hivemind waits for its delayed updates. Before, the next round was skipped: the peers that
    began it waited for this one until their scheduled time, and skipped the round after it, so that
    only every other epoch had a state round (test_optimizer_large_swarm, eight_peers)."""
    averager = _FakeStateAverager()
    rounds = _state_rounds(averager)
    averager.pending = averager.running = True
    averager.ends_in = 2.0
    assert rounds.due(5) and averager.applied == 1 and not averager.has_round
    assert 9.0 < max(averager.waits) < 12.0  # up to the round's deadline and its grace


def test_a_state_round_that_outlives_its_deadline_makes_the_next_one_skip() -> None:
    averager = _FakeStateAverager()
    rounds = _state_rounds(averager)
    averager.pending = averager.running = True
    assert not rounds.due(5) and averager.applied == 0 and averager.has_round


@pytest.mark.parametrize("trainers, every, epoch", [(1, 1, 5), (8, 2, 5)])
def test_no_state_round_alone_or_between_every_nth_epoch(trainers, every, epoch) -> None:
    averager = _FakeStateAverager()
    averager.pending = True  # finished: left for step() to apply, as no round is due anyway
    assert not _state_rounds(averager, trainers=trainers, every=every).due(epoch)
    assert averager.applied == 0


class _EpochEnd(SyncGradientsImpl):
    """SyncGradientsImpl's epoch end with its rounds faked: records what happens in which order."""

    def __init__(self, events: list[str], state_rounds: StateRounds) -> None:  # no averager, no network
        self.events = events
        self.state_rounds = state_rounds
        self.scheduled_round = None
        self.blocked_seconds = 0.0
        self.grad_averager = SimpleNamespace(last_round=None, local_samples_accumulated=32)
        self.background = SimpleNamespace(pending=False)
        config = SimpleNamespace(delay_grad_averaging=False, delay_optimizer_step=False, delay_state_averaging=True)
        self.context = SimpleNamespace(
            config=config,
            local_epoch=4,
            tracker=SimpleNamespace(report_local_progress=lambda epoch, samples: None),
            advance_epoch=lambda before_announcing=None: events.append("epoch advanced"),
        )

    def _accumulate(self, batch_size: int, grad_scaler) -> bool:
        return True  # this batch completes the epoch's share

    def _epoch_is_over(self) -> bool:
        return True

    def _wait_background(self) -> None:
        pass

    def _swarm_averaged_without_us(self, control) -> bool:
        return False

    def _alone(self, control) -> bool:
        return False

    def _begin_gradient_round(self, control, *, zero_weight: bool):
        self.events.append("gradient round")
        self.state_rounds.averager.running = False  # the previous state round ends meanwhile
        return control

    def _wait_gradient_round(self, control, *, epoch: int) -> bool:
        return True

    def _apply_averaged_gradients(self, *, publish: bool) -> None:
        self.events.append("optimizer step")


def test_the_epoch_end_asks_for_a_state_round_after_the_gradient_round() -> None:
    """The previous epoch's state round, still running when the epoch ends, ends during this epoch's
    gradient round: this epoch's state round begins all the same, after the optimizer step. Before, the
    epoch end asked before the gradient round and skipped it (the round was still running)."""
    events: list[str] = []
    averager = _FakeStateAverager(events)
    averager.pending = averager.running = True
    rounds = _state_rounds(averager)
    rounds.begin = lambda epoch, after=None: events.append(f"state round {epoch} begun")
    impl = _EpochEnd(events, rounds)
    impl.train_step(32, None)  # the batch that ends the epoch
    assert events == [
        "gradient round",
        "state round applied",
        "optimizer step",
        "state round 5 begun",
        "epoch advanced",
    ]


@pytest.fixture(scope="module")
def pair() -> Iterator[list[hivemind.DHT]]:
    with local_swarm(2) as dhts:
        yield dhts


def _averagers(
    dhts: list[hivemind.DHT], values: tuple[float, float], in_groups: bool = False
) -> list[TrainingStateAverager]:
    prefix = f"state-rounds-{next(_prefixes)}"
    averagers = []
    for dht, value in zip(dhts, values, strict=True):
        model = torch.nn.Linear(3, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(value)
        state = TrainingState(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), params=model.parameters())
        averagers.append(
            TrainingStateAverager(
                state,
                dht=dht,
                prefix=prefix,
                state_lock=threading.RLock(),
                start=True,
                target_group_size=2,
                in_groups=in_groups,
            )
        )
    return averagers


def _round(averagers: list[TrainingStateAverager], epochs: tuple[int, int]) -> list[bool | None]:
    for averager, epoch in zip(averagers, epochs, strict=True):
        averager.begin_round(timeout=30, epoch=epoch)
    return [averager.apply_round(wait=40) for averager in averagers]


def _weights(averagers: list[TrainingStateAverager]) -> list[float]:
    return [float(a.training_state.main_params[0].detach()[0, 0]) for a in averagers]


@pytest.mark.parametrize(
    "in_groups, epochs, applied, expected",
    [
        (False, (4, 4), True, [2.0, 2.0]),
        (False, (4, 5), False, [1.0, 3.0]),
        # in groups smaller than the swarm, groups keep their own pace: discarding every round that mixed
        # neighbouring epochs left groups unmixed (before: (4, 5) was discarded as in one group)
        (True, (4, 5), True, [2.0, 2.0]),
        (True, (4, 7), False, [1.0, 3.0]),
    ],
)
def test_rounds_of_distant_epochs_are_discarded(pair, in_groups, epochs, applied, expected) -> None:
    """One group of everyone discards any round that mixed epochs; rotating groups accept neighbours."""
    averagers = _averagers(pair, (1.0, 3.0), in_groups=in_groups)
    try:
        assert _round(averagers, epochs) == [applied, applied]
        assert _weights(averagers) == pytest.approx(expected)
    finally:
        for averager in averagers:
            averager.shutdown()
