"""The round driver: every decision about an averaging round, and the one loop that waits on it.

The Optimizer's gradient rounds, the algorithms' rounds (:class:`.AlgorithmRunner`), the auxiliary
peer and asynchronous model averaging all ask this module the same questions:

- when is the round scheduled, and when is its deadline (:func:`plan_round`); how long a round on a
  peer's own clock waits for the swarm's slowest trainer (:func:`straggler_patience`);
- how many peers to expect (:func:`expected_group_size`, :func:`contributing_members`);
- when to start matchmaking ahead of the epoch's end (:func:`should_prepare_round`);
- when to stop waiting (:func:`give_up_time`, :func:`should_abandon_search`);
- what a round missed or failed means (:func:`missed_round`, :func:`after_failed_round`);
- which epoch comes next (:func:`next_epoch`).

They are pure functions of numbers, so ``tests/test_rounds.py`` drives them as a table of cases.
:class:`RoundDriver` holds the one implementation that waits on a round; it calls an optional
:class:`RoundHooks` before and after each round: the documented seam where a test fails a round
(raise from ``before_round``) or watches the outcome, without patching private attributes.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from hivemind.utils import get_dht_time

from hivemind_ext.averaging.control import AveragingStage, StepControl
from hivemind_ext.errors import DeadlineExceededError, MatchmakingError

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.1  # while waiting for a round: how often to look at the swarm's epoch and the stop flag
GRACE_SECONDS = 1.0  # a round's result may arrive this long after its deadline (the averager's own cleanup)
SEARCHING = (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP)


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    """When a round starts even if its group is not full, when it gives up, and whom it expects."""

    scheduled_time: float
    deadline: float
    expected_group_size: int | None

    def timeout(self, now: float) -> float:
        """What ``DecentralizedAverager.step(timeout=...)`` takes: the deadline, relative to ``now``."""
        return self.deadline - now

    def begin(self, averager: Any, *, weight: float) -> StepControl:
        """Starts this round on ``averager`` (a ``DecentralizedAverager``) in the background: its control."""
        return averager.step(
            weight=weight,
            scheduled_time=self.scheduled_time,
            timeout=self.timeout(get_dht_time()),
            expected_group_size=self.expected_group_size,
            wait=False,
        )


@dataclasses.dataclass(frozen=True)
class FailedRound:
    """What a peer does after a round it missed or that failed.

    :param step_locally: update the model from this peer's local values (its own gradients)
    :param resync: download the swarm's state at the next step (its update drifted from the swarm's)
    """

    step_locally: bool
    resync: bool


@dataclasses.dataclass(frozen=True)
class RoundOutcome:
    """What one round that this peer waited on came to (for its logs and its progress bar).

    :param group_size: members of the round's group (0 when it failed before the averager reported one)
    :param seconds: the all-reduce's duration when it averaged, else how long this peer waited
    :param excluded: members left out of the average (base58 peer id -> why)
    :param error: why the round failed; None when it averaged
    :param auxiliary: members that contributed no tensors and were not excluded (auxiliary peers)
    """

    group_size: int
    seconds: float
    excluded: dict[str, str] = dataclasses.field(default_factory=dict)
    error: str | None = None
    auxiliary: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None

    def describe(self, *, short: bool = False) -> str:
        """One line: ``averaged with 4 peers in 0.31 s (1 excluded: ...)`` or ``round failed: ...``
        (``short``: ``avg 4 peers 0.31s``, for a progress bar)."""
        if self.error is not None:
            return f"round failed: {self.error}" if not short else f"round failed: {self.error[:60]}"
        if short:
            excluded = f" -{len(self.excluded)}" if self.excluded else ""
            return f"avg {self.group_size} peers{excluded} {self.seconds:.2f}s"
        text = f"averaged with {self.group_size} peers in {self.seconds:.2f} s"
        if self.excluded:
            reasons = "; ".join(f"{peer[-8:]}: {reason}" for peer, reason in sorted(self.excluded.items()))
            text += f" ({len(self.excluded)} excluded: {reasons})"
        return text


def round_outcome(control: StepControl, error: BaseException | None, waited: float) -> RoundOutcome:
    """The outcome of a round from its control (whose ``report`` the averager set) and the wait's end."""
    report = getattr(control, "report", None)
    if error is not None:
        return RoundOutcome(group_size=0, seconds=waited, error=str(error) or type(error).__name__)
    if report is None:  # a control that no averager reported on (e.g. a test's)
        result = control.result(0) if control.done() else None
        return RoundOutcome(group_size=len(result) if isinstance(result, dict) else 0, seconds=waited)
    contributed = contributors(report) | set(report.excluded)
    return RoundOutcome(
        group_size=report.group_size,
        seconds=report.seconds,
        excluded=dict(report.excluded),
        auxiliary=max(0, report.group_size - len(contributed)),
    )


# ----- the decisions (pure)


def expected_group_size(last_group_size: int | None, peers_seen: int) -> int | None:
    """The larger of the last round's contributing members and the trainers the tracker sees; None
    below 2 (no one to wait for: the round forms at its scheduled time with whoever is looking).
    Auxiliary peers never count: they join a round only when they find it (matchmaking compares this
    number with the contributing peers that are looking), so a trainer never waits for one."""
    expected = max(last_group_size or 0, peers_seen)
    return expected if expected >= 2 else None


def contributing_members(report: Any) -> int:
    """How many members contributed tensors to the round that ``report`` (an averager's ``last_round``,
    None before its first) describes; auxiliary members and members that contributed to no part do
    not count. A planned round expects a group size only once this is at least 2
    (:meth:`RoundDriver.plan_after`)."""
    return len(contributors(report)) if report is not None else 0


def contributors(report: Any) -> set[str]:
    """The members that contributed tensors to at least one part of the round ``report`` describes."""
    return {peer for part in report.contributors for peer in part}


def plan_round(
    now: float,
    *,
    matchmaking_time: float,
    averaging_timeout: float,
    eta: float | None = None,
    expected: int | None = None,
    patience: float = 0.0,
) -> RoundPlan:
    """Schedules a round: at the swarm's estimated epoch end ``eta`` (now, if unknown or past) plus
    one matchmaking time, two when a group size is expected (the group then forms as soon as every
    expected peer is looking; the later fallback lets peers that entered the epoch late still join),
    plus ``patience`` when a group size is expected (see :func:`straggler_patience`).
    ``averaging_timeout`` counts from the scheduled time: the round itself gets that long."""
    start = now if eta is None else max(eta, now)
    scheduled = start + (matchmaking_time * 2 + max(0.0, patience) if expected else matchmaking_time)
    return RoundPlan(scheduled_time=scheduled, deadline=scheduled + averaging_timeout, expected_group_size=expected)


def straggler_patience(samples: float, slowest_speed: float, *, limit: float) -> float:
    """How much longer than its matchmaking window a round on each peer's own clock (DiLoCo's: every H
    inner steps, wherever the swarm's epoch is) waits for the peers the swarm reports: the seconds the
    slowest live trainer needs for this peer's ``samples`` since its last round, at most ``limit``
    (``limit`` while that speed is unknown, e.g. a peer that just joined).

    Peers that ended the last round in one group start the next together; the slowest reaches its end
    that much later, and the group forms as soon as it is looking. Without this wait, peers of one
    round index that drifted more than a matchmaking window apart (a slower pair, a loaded machine)
    sealed separate groups at their own scheduled times, and went on doing so every round: nothing on
    a peer's own clock pulls them back (the Optimizer's rounds share the swarm's epoch end instead).
    A dead peer is still counted until its progress record expires; at its last speed it costs each
    round about one of its rounds, and never more than ``limit``."""
    if not (math.isfinite(samples) and samples > 0):
        return 0.0
    if not (math.isfinite(slowest_speed) and slowest_speed > 0):
        return limit
    return min(samples / slowest_speed, limit)


def should_prepare_round(now: float, eta: float, matchmaking_time: float) -> bool:
    """Start matchmaking ahead of time: the swarm's epoch end is at most one matchmaking time away."""
    return eta - now <= matchmaking_time


def give_up_time(deadline: float) -> float:
    """No one waits for a round past its deadline plus a short grace."""
    return deadline + GRACE_SECONDS


def should_abandon_search(*, searching: bool, swarm_epoch: int, local_epoch: int, watch_swarm: bool) -> bool:
    """A peer still looking for a group once the swarm has finished this epoch could only wait out
    its deadline: the round happened without it."""
    return watch_swarm and searching and swarm_epoch > local_epoch


def missed_round(*, searching: bool | None, swarm_epoch: int, local_epoch: int, rounds_overlap_epochs: bool) -> bool:
    """Whether the swarm already averaged this epoch without this peer, known before its round began.

    :param searching: whether this peer's pre-scheduled round is still looking for a group (None: none)
    :param rounds_overlap_epochs: peers enter the next epoch before their round ends (delayed
      averaging): a further swarm epoch then says nothing about this peer's round
    """
    if rounds_overlap_epochs or swarm_epoch <= local_epoch:
        return False
    return searching is None or searching


def after_failed_round(*, peers_seen: int, missed: bool = False) -> FailedRound:
    """The one rule for a round missed or failed, whatever the algorithm.

    A round that failed (or was given up): the peer steps on its local values (its own mean gradient,
    pseudo-gradient, ...), as ``hivemind.Optimizer`` does when averaging fails, and, if other peers
    train, downloads the swarm's state at its next step, which brings it back in line. A peer alone
    has no one to resync with.

    A round *missed* (the swarm finished this epoch's round before this peer's began): other peers
    train by definition, so it resyncs; it does not step, since the download replaces the parameters
    its step would change (its gradients belong to an epoch the swarm has left).
    """
    if missed:
        return FailedRound(step_locally=False, resync=True)
    return FailedRound(step_locally=True, resync=peers_seen > 1)


def next_epoch(local_epoch: int, swarm_epoch: int) -> int:
    """The epoch a peer enters when its current one ends (the swarm's, if that is further)."""
    return max(local_epoch + 1, swarm_epoch)


# ----- the seam


class RoundHooks:
    """Called by :class:`RoundDriver` around each round it waits on. Subclass and pass it as
    ``Optimizer(..., round_hooks=...)`` (or to a driver) to watch rounds, or to fail one: an
    exception raised by ``before_round`` fails the round as if the averager had raised it (the
    driver cancels the round's control first)."""

    def before_round(self, control: StepControl, *, watch_swarm: bool) -> None:
        """Before waiting on ``control``."""

    def after_round(self, control: StepControl, error: BaseException | None) -> None:
        """After the wait: ``error`` is None when the round succeeded, else what the wait raised."""


class _Tracker(Protocol):
    @property
    def global_progress(self) -> Any: ...


class RoundDriver:
    """One peer's rounds: plans them from its settings and the swarm's progress, and waits on them.

    :param tracker: the run's progress tracker (its ``global_progress``: the swarm's epoch, peers)
    :param local_epoch: returns this peer's epoch
    :param hooks: see :class:`RoundHooks`
    :param status_loglevel: the level of the line that says how each round ended (INFO with ``verbose``)
    :param in_groups: the swarm averages in groups smaller than itself (``target_group_size``, with
      rotating groups, see ``hivemind_ext.averaging.matchmaking.rotation``): the swarm's epoch moving
      on then only says that some group finished its round, not that this peer's round happened
      without it, so the round is neither abandoned nor counted as missed for it
    """

    def __init__(
        self,
        *,
        tracker: _Tracker,
        matchmaking_time: float,
        averaging_timeout: float,
        local_epoch: Callable[[], int],
        hooks: RoundHooks | None = None,
        status_loglevel: int = logging.DEBUG,
        in_groups: bool = False,
    ) -> None:
        self.tracker = tracker
        self.in_groups = in_groups
        self.matchmaking_time, self.averaging_timeout = float(matchmaking_time), float(averaging_timeout)
        self.local_epoch = local_epoch
        self.hooks = hooks if hooks is not None else RoundHooks()
        self.status_loglevel = status_loglevel
        #: how the last round waited on ended (None before the first)
        self.last_outcome: RoundOutcome | None = None
        self._resync = False

    # ----- after a missed or failed round

    @property
    def resync_pending(self) -> bool:
        """A round failed while other peers train: the Optimizer downloads the swarm's state at the next step."""
        return self._resync

    def request_resync(self, *, missed: bool = False) -> bool:
        """Applies :func:`after_failed_round`'s resync rule; returns whether a download is now pending."""
        self._resync = self._resync or self.after_failure(missed=missed).resync
        return self._resync

    def clear_resync(self) -> None:
        """Called when the download starts."""
        self._resync = False

    @property
    def peers_seen(self) -> int:
        """The trainers the tracker sees (this one included); auxiliary peers bring nothing to average."""
        return int(self.tracker.global_progress.num_trainers)

    def plan(
        self,
        *,
        eta: float | None = None,
        last_group_size: int | None = None,
        expect_peers: bool = True,
        patience: float = 0.0,
    ) -> RoundPlan:
        """A round for now (or the epoch end ``eta``); ``expect_peers=False``: no expected group size;
        ``patience``: see :func:`plan_round` (:meth:`straggler_patience`)."""
        expected = expected_group_size(last_group_size, self.peers_seen) if expect_peers else None
        return plan_round(
            get_dht_time(),
            matchmaking_time=self.matchmaking_time,
            averaging_timeout=self.averaging_timeout,
            eta=eta,
            expected=expected,
            patience=patience,
        )

    def straggler_patience(self, samples: float) -> float:
        """:func:`straggler_patience` for a round on this peer's own clock after ``samples`` samples, with
        the slowest trainer the tracker sees, at most half the averaging timeout. 0 in groups smaller
        than the swarm (rotating groups form when full; they never wait for the whole swarm)."""
        if self.in_groups:
            return 0.0
        slowest = float(self.tracker.global_progress.slowest_trainer_speed)
        return straggler_patience(samples, slowest, limit=self.averaging_timeout / 2)

    def plan_after(self, report: Any, *, eta: float | None = None) -> RoundPlan:
        """The plan of a round that follows the round ``report`` describes (an averager's ``last_round``;
        None before its first): every round of the Optimizer's built-in modes, gradient and state rounds.

        A group size is expected only once a round had a group of two or more contributors: before it
        the tracker's count can be short (a peer whose progress record has not arrived yet), and peers
        that expected that count formed the first round without the late one, which then missed it.
        From then on the group forms as soon as every expected peer is looking, instead of at the end
        of a matchmaking time (with rotating groups, see :class:`RoundDriver`'s ``in_groups``, the
        swarm's size chooses the matchmaking shard)."""
        contributed = contributing_members(report)
        return self.plan(eta=eta, last_group_size=contributed or None, expect_peers=contributed >= 2)

    def missed_this_epoch(self) -> bool:
        """:func:`missed_round` for a round about to begin at this peer's epoch end (none pre-scheduled):
        most other peers already entered a further epoch, so they averaged this one without this peer
        (not in groups smaller than the swarm, where that only says that some group finished)."""
        return missed_round(
            searching=None,
            swarm_epoch=self.tracker.global_progress.epoch,
            local_epoch=self.local_epoch(),
            rounds_overlap_epochs=self.in_groups,
        )

    def after_failure(self, *, missed: bool = False) -> FailedRound:
        """:func:`after_failed_round` with the peers the tracker sees now."""
        return after_failed_round(peers_seen=self.peers_seen, missed=missed)

    def wait(self, control: StepControl, *, watch_swarm: bool = True, stop: threading.Event | None = None) -> Any:
        """The round's gathered data. Gives up (cancelling the round) at ``give_up_time`` of its
        deadline (DeadlineExceededError); with ``watch_swarm``, as soon as the swarm has finished this
        epoch while this peer still looks for a group (MatchmakingError); when ``stop`` is set
        (concurrent.futures.CancelledError). Re-raises what the round raised."""
        started = time.monotonic()
        try:
            self.hooks.before_round(control, watch_swarm=watch_swarm)
            result = self._wait(control, watch_swarm=watch_swarm, stop=stop)
        except BaseException as e:
            if not control.done():
                control.cancel()
            self._record(control, e, started)
            self.hooks.after_round(control, e)
            raise
        self._record(control, None, started)
        self.hooks.after_round(control, None)
        return result

    def _record(self, control: StepControl, error: BaseException | None, started: float) -> None:
        outcome = round_outcome(control, error, time.monotonic() - started)
        self.last_outcome = outcome
        # a failure is also a warning of the caller, which says what the peer does next: details only here
        logger.log(
            self.status_loglevel if outcome.ok else logging.DEBUG,
            "round of epoch %d: %s",
            self.local_epoch(),
            outcome.describe(),
        )

    def _wait(self, control: StepControl, *, watch_swarm: bool, stop: threading.Event | None) -> Any:
        def abandon() -> bool:
            return should_abandon_search(
                searching=control.stage in SEARCHING,
                swarm_epoch=self.tracker.global_progress.epoch,
                local_epoch=self.local_epoch(),
                watch_swarm=watch_swarm and not self.in_groups,
            )

        return wait_on_round(control, stop=stop, abandon=abandon)


def wait_on_round(
    control: StepControl, *, stop: threading.Event | None = None, abandon: Callable[[], bool] | None = None
) -> Any:
    """The one loop that waits on a round: its gathered data. Gives up (cancelling the round) at
    ``give_up_time`` of its deadline (DeadlineExceededError), when ``abandon()`` says the swarm went on
    without this peer (MatchmakingError), when ``stop`` is set (concurrent.futures.CancelledError).
    Re-raises what the round raised (a deadline that ran out leaves the cancelling to the caller).
    :meth:`RoundDriver.wait` (with its hooks) calls it; so does
    :meth:`hivemind_ext.optim.GradientAverager.step` with ``wait=True``."""
    give_up = give_up_time(control.deadline)
    while True:
        try:
            return control.result(min(POLL_SECONDS, max(give_up - get_dht_time(), 0.0)))
        except (TimeoutError, concurrent.futures.TimeoutError):
            if control.done():
                raise  # the round itself failed with a timeout: not a wait that ran out
            if get_dht_time() >= give_up:
                raise DeadlineExceededError("the averaging round did not finish before its deadline") from None
        if stop is not None and stop.is_set():
            control.cancel()
            raise concurrent.futures.CancelledError("the round was stopped")
        if abandon is not None and abandon():
            control.cancel()
            raise MatchmakingError("the swarm finished this epoch's round without this peer")


def gathered_epochs(gathered: Any) -> set[int]:
    """The epochs that a round's members reported in their gather data (``{"epoch": e}``). Untrusted wire
    data: only plain ints in range count; auxiliary members and members that sent no epoch are left out."""
    epochs = set()
    for data in gathered.values() if isinstance(gathered, dict) else ():
        epoch = data.get("epoch") if isinstance(data, dict) else None
        if isinstance(epoch, int) and not isinstance(epoch, bool) and 0 <= epoch < 2**62:
            epochs.add(epoch)
    return epochs


def gathered_samples(gathered: Any) -> dict[str, int]:
    """Samples per member from a gradient round's gathered data ({"samples": n} from each member);
    gather data is untrusted wire input: anything else (e.g. an auxiliary peer's None) counts as 0."""
    samples = {}
    for peer, data in (gathered or {}).items():
        value = data.get("samples") if isinstance(data, dict) else None
        ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**62
        samples[str(peer)] = value if ok else 0
    return samples


#: in groups smaller than the swarm, a state round may mix epochs this far apart (see :func:`epochs_mix_well`)
MAX_EPOCH_SPREAD_IN_GROUPS = 2


def epochs_mix_well(epochs: set[int], *, in_groups: bool) -> bool:
    """Whether a state-averaging round whose members began it at these epochs may be applied.

    In one group of the whole swarm, no: every peer averages at every epoch's end, and an average of
    parameters from before and after a step would pull peers that are otherwise in step apart. In
    rotating groups (``target_group_size``) groups keep their own pace, and with background rounds
    (``delay_state_averaging``) a group that is still averaging one epoch meets peers of the next:
    discarding those rounds left the groups unmixed for good (8 peers in groups of 4 with local
    updates: every last round discarded, parameters 0.22 apart after moving 0.71). There any average
    is a step toward the swarm's mean, and the peers' own progress since the round began is kept
    (:func:`~hivemind_ext.averaging.delta.apply_average`), so rounds that mix epochs up to
    ``MAX_EPOCH_SPREAD_IN_GROUPS`` apart (a peer skips an epoch's round while its last one is still
    pending) are applied; a peer further behind downloads the state instead."""
    if len(epochs) <= 1:
        return True
    return in_groups and max(epochs) - min(epochs) <= MAX_EPOCH_SPREAD_IN_GROUPS
