"""Synchronous gradient averaging: the default algorithm (``GradientAllReduce()``, what
``Optimizer(algorithm=None)`` runs), hivemind's behaviour.

Per ``step()``: add the batch's gradients to the :class:`~hivemind_ext.optim.GradientAverager`'s
accumulator and report the samples to the progress tracker; when the swarm's epoch end is near,
start matchmaking for the gradient round ahead of time (pre-scheduled, held by a trigger); when the
swarm reached ``target_batch_size`` (or a groupmate already started the round), average the
gradients weighted by samples, step the optimizer, enter the next epoch (``context.advance_epoch()``:
the LR scheduler steps with it) and every ``average_state_every`` epochs average the parameters
(:class:`~.state_rounds.StateRounds`).

Variants: ``delay_optimizer_step`` (the step runs in a background thread on host copies of the
parameters, and is published at a later ``step()``), ``delay_grad_averaging`` (the round itself
runs in the background too), ``reuse_grad_buffers`` with a GradScaler (the scale stays fixed for an
epoch; an overflowed epoch contributes weight 0). A peer alone steps on its own gradients at once;
a peer that missed the swarm's round drops its gradients and resyncs; a round that fails leaves the
peer with its local gradients and a resync (:mod:`hivemind_ext.optim.rounds`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from hivemind.utils import get_dht_time

from hivemind_ext.averaging.control import AveragingStage, StepControl
from hivemind_ext.errors import (
    AllreduceError,
    ConfigurationError,
    DeadlineExceededError,
    HivemindExtError,
    MatchmakingError,
)
from hivemind_ext.optim.algorithms.base import Algorithm, AlgorithmContext, AlgorithmImpl
from hivemind_ext.optim.algorithms.grad_hops import GradientHops
from hivemind_ext.optim.algorithms.local_updates import LocalUpdatesImpl
from hivemind_ext.optim.algorithms.state_rounds import StateRounds
from hivemind_ext.optim.background import BackgroundWorker
from hivemind_ext.optim.grad_averager import GradientAverager
from hivemind_ext.optim.keys import grad_prefix
from hivemind_ext.optim.rounds import gathered_epochs, gathered_samples, missed_round, should_prepare_round

if TYPE_CHECKING:
    from hivemind_ext.optim.grad_scaler import BoundGradScaler

logger = logging.getLogger(__name__)

ROUND_FAILURES = (MatchmakingError, AllreduceError, DeadlineExceededError)
WAIT_FAILURES = (TimeoutError, concurrent.futures.TimeoutError, concurrent.futures.CancelledError, HivemindExtError)


class GradientAllReduce(Algorithm):
    """The default: synchronous gradient averaging to ``target_batch_size``
    (:class:`SyncGradientsImpl`), or local updates with parameter averaging if the Optimizer was
    given ``use_local_updates=True`` (:class:`~.local_updates.LocalUpdatesImpl`)."""

    def reify(self, context: AlgorithmContext) -> AlgorithmImpl:
        if context.config.use_local_updates:
            return LocalUpdatesImpl(context)
        return SyncGradientsImpl(context)


def _chain(first: Callable[[], None], then: Callable[[], None] | None) -> Callable[[], None]:
    def job() -> None:
        first()
        if then is not None:
            then()

    return job


class SyncGradientsImpl(AlgorithmImpl):
    """The standard synchronous path (see the module docstring): a StepEngine itself, which owns its
    gradient averager, its pre-scheduled rounds and its background worker."""

    runs_own_steps = True

    def __init__(self, context: AlgorithmContext) -> None:
        super().__init__(context)
        config = context.config
        self.state_rounds = StateRounds(context)
        self.hops = GradientHops(context)  # grad_averaging_hops: the rounds after the first (checked first)
        factory = context.grad_averager_factory or GradientAverager
        # newcomers download the state averager's state, never accumulated gradients: a gradient
        # averager that served them would only advertise itself in the DHT at every change
        options = {"allow_state_sharing": False, **context.averager_options}
        try:
            averager = factory(
                context.params,
                dht=context.dht,
                prefix=grad_prefix(config.run_id),
                reuse_grad_buffers=config.reuse_grad_buffers,
                compression=context.grad_compression,
                start=True,
                **options,
            )
        except TypeError as e:
            raise ConfigurationError(f"averager_opts: {e}") from e
        if not isinstance(averager, GradientAverager):
            raise ConfigurationError("grad_averager_factory must return a hivemind_ext GradientAverager")
        self.grad_averager = averager
        self.hops.grad_averager = averager
        self.background = BackgroundWorker(f"{config.run_id}-optimizer")
        self.scheduled_round: StepControl | None = None  # pre-scheduled for this epoch's end
        self.blocked_seconds = 0.0
        # samples averaged in this peer's last epoch (its group's total; with hops, what the last hop covers)
        self.last_epoch_samples = 0
        self.last_round_samples: dict[str, int] = {}  # its first round's, per group member (base58 peer id)

    # ----- the StepEngine

    def train_step(self, batch_size: int, grad_scaler: BoundGradScaler | None) -> None:
        if not self._accumulate(batch_size, grad_scaler):
            return
        context = self.context
        context.tracker.report_local_progress(context.local_epoch, self.grad_averager.local_samples_accumulated)
        if self._epoch_is_over():
            self._end_epoch(grad_scaler)
        else:
            self._maybe_schedule_round()

    def collect_background_work(self, wait: bool) -> None:
        """Publishes a finished delayed step and applies a finished state round."""
        if self.background.pending and (wait or not self.background.busy):
            self._wait_background()
        self.state_rounds.collect(wait)

    def prepare_for_download(self) -> None:
        """Publishes a delayed step first (the download replaces the state it writes to), and cancels
        the pre-scheduled round (the Optimizer cancels the state round: it owns the state averager)."""
        self._wait_background()
        self._cancel_scheduled_round()

    def discard_local_progress(self) -> None:
        self.grad_averager.reset_accumulated_grads_()

    def shutdown(self) -> None:
        """Stops the background worker and cancels the rounds in flight; the averager goes last."""
        try:
            self.background.shutdown(self.context.config.shutdown_timeout)
            self._cancel_scheduled_round()
            self.hops.shutdown()
        finally:
            try:
                self.grad_averager.shutdown()
            except Exception as e:  # e.g. the DHT's daemon is already gone: the Optimizer must still close
                logger.debug(f"error while shutting down the gradient averager: {e!r}")

    def _cancel_scheduled_round(self) -> None:
        control, self.scheduled_round = self.scheduled_round, None
        if control is not None and not control.done():
            control.cancel()

    # ----- accumulating

    def _accumulate(self, batch_size: int, grad_scaler: BoundGradScaler | None) -> bool:
        averager = self.grad_averager
        if grad_scaler is not None:
            if self.context.config.reuse_grad_buffers:
                grad_scaler.defer()  # .grad holds a sum of scaled gradients until the epoch ends
                averager.accumulator.accumulate(batch_size, check_finite=False)
                return True
            if grad_scaler.unscale_and_check():
                logger.log(
                    self.context.status_loglevel, "gradients overflowed: skipping this batch (the scale is lowered)"
                )
                return False
        averager.accumulate_grads_(batch_size)
        return True

    def _epoch_is_over(self) -> bool:
        if self.context.tracker.ready_to_update_epoch:
            return True
        control = self.scheduled_round
        return control is not None and control.groupmate_started

    def _maybe_schedule_round(self) -> None:
        """Starts matchmaking for the coming gradient round when the swarm's epoch end is near."""
        control = self.scheduled_round
        if control is not None and not control.done():
            return
        if self.background.busy:
            return  # the previous round still runs in the background: its group tells whom to expect next
        now = get_dht_time()
        eta = self.context.tracker.estimated_next_update_time
        if not should_prepare_round(now, eta, self.context.config.matchmaking_time):
            return
        plan = self.context.rounds.plan_after(self.grad_averager.last_round, eta=eta)
        logger.log(
            self.context.status_loglevel, f"pre-scheduling the gradient round in {plan.scheduled_time - now:.2f} s"
        )
        self.scheduled_round = self.grad_averager.schedule_step(
            scheduled_time=plan.scheduled_time,
            timeout=plan.timeout(now),
            expected_group_size=plan.expected_group_size,
        )

    # ----- the end of an epoch

    def _end_epoch(self, grad_scaler: BoundGradScaler | None) -> None:
        started = time.perf_counter()
        config = self.context.config
        # no pause_updates() here: the tracker keeps publishing, so peers see this epoch's final count
        entering = self.state_rounds.next_epoch()
        self._wait_background()  # the buffers and the optimizer must be free
        control, self.scheduled_round = self.scheduled_round, None
        if control is not None and control.done() and not control.triggered:
            control = None  # matchmaking failed or expired before the epoch ended
        average_state = False
        if self._swarm_averaged_without_us(control):
            self._skip_round(control)
        else:
            average_state = self._average_and_step(control, grad_scaler, state_round=entering)
        apply_now = average_state and not config.delay_state_averaging and not self.background.pending
        self.context.advance_epoch(before_announcing=self.state_rounds.apply_now if apply_now else None)
        self.blocked_seconds += time.perf_counter() - started

    def _average_and_step(
        self, control: StepControl | None, grad_scaler: BoundGradScaler | None, *, state_round: int
    ) -> bool:
        """This epoch's gradient round (or a solo step), then the optimizer step, now or in the background;
        then the state round of epoch ``state_round``, if one is due, right after the optimizer step (in
        the background job for delayed steps). Returns whether that state round was begun (or will be)."""
        config = self.context.config
        found_inf = grad_scaler is not None and config.reuse_grad_buffers and grad_scaler.unscale_and_check()
        if found_inf:
            logger.log(self.context.status_loglevel, "this epoch's gradients overflowed: contributing nothing")
            self.grad_averager.reset_accumulated_grads_()
        if self._alone(control):
            self._step_alone(control, found_inf=found_inf)
            return False  # alone: no state round either
        epoch = self.context.local_epoch  # the round's epoch (a delayed round ends after the peer entered the next)
        if config.delay_grad_averaging:
            then = self._state_round_after_step(state_round)  # the round runs in the background: ask now
            control = self._begin_gradient_round(control, zero_weight=found_inf)
            finish = self._finish_gradient_round
            self.background.submit(_chain(lambda: finish(control, epoch=epoch, apply=not found_inf), then))
            return then is not None
        control = self._begin_gradient_round(control, zero_weight=found_inf)
        averaged = self._wait_gradient_round(control, epoch=epoch)
        # asked after the gradient round (the training thread's longest wait), when the previous state
        # round has most likely ended: asked before it, rounds still running skipped every other epoch
        then = self._state_round_after_step(state_round)
        if config.delay_optimizer_step:
            self.background.submit(_chain(lambda: self._apply_averaged_gradients(publish=False), then))
            return then is not None
        if averaged or not found_inf:
            self._apply_averaged_gradients(publish=True)
        if then is not None:
            then()
        return then is not None

    def _state_round_after_step(self, entering: int) -> Callable[[], None] | None:
        """What begins the state round of epoch ``entering`` if one is due (asked in the training thread).

        The state round snapshots the parameters after this epoch's optimizer step on every peer (a
        delayed step runs it in the background job, right after the step), or peers would average
        parameters taken before the step on some and after it on others, and drift apart (this epoch's
        gradient round, just before it, tells the state round whom to expect)."""
        if not self.state_rounds.due(entering):
            return None
        return lambda: self.state_rounds.begin(entering, after=self.grad_averager.last_round)

    def _swarm_averaged_without_us(self, control: StepControl | None) -> bool:
        """Another peer already finished this epoch's round and this one never found its group: a new
        search could only wait out ``averaging_timeout``."""
        return missed_round(
            searching=None
            if control is None
            else control.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP),
            swarm_epoch=self.context.tracker.global_progress.epoch,
            local_epoch=self.context.local_epoch,
            # in groups, another group finishing first says nothing about this peer's round
            rounds_overlap_epochs=self.context.config.delay_grad_averaging or self.context.rounds.in_groups,
        )

    def _skip_round(self, control: StepControl | None) -> None:
        logger.warning(
            f"the swarm averaged epoch {self.context.local_epoch} without this peer (it was late): "
            "dropping its gradients and downloading the state from peers"
        )
        if control is not None and not control.done():
            control.cancel()
        self.grad_averager.reset_accumulated_grads_()  # after_failed_round(missed=True): no step, resync
        self.context.rounds.request_resync(missed=True)

    def _alone(self, control: StepControl | None) -> bool:
        """No other trainer reports progress and none started this round: a round could only time out,
        or average this peer's gradients with nothing (auxiliary peers bring none)."""
        tracker = self.context.tracker
        if (control is not None and control.groupmate_started) or tracker.global_progress.num_trainers > 1:
            return False
        try:  # the tracker's view may be a refresh period old (peers that just joined): confirm it
            return tracker.fetch_now().num_trainers <= 1
        except HivemindExtError as e:
            logger.debug(f"could not refresh the swarm's progress ({e!r}): taking this peer as alone")
            return True

    def _step_alone(self, control: StepControl | None, *, found_inf: bool) -> None:
        """A solo peer steps on its own mean gradient at once, as hivemind does, instead of waiting
        ``averaging_timeout`` for a group that cannot form."""
        averager = self.grad_averager
        if control is not None and not control.done():
            control.cancel()
        samples = 0 if found_inf else averager.local_samples_accumulated
        logger.log(self.context.status_loglevel, "no other peers: stepping with local gradients")
        averager.load_accumulators_into_averager_()
        averager.reset_accumulated_grads_()
        self.last_round_samples = {str(self.context.dht.peer_id): samples}
        self.last_epoch_samples = samples
        if found_inf:
            return
        if self.context.config.delay_optimizer_step:
            self.background.submit(lambda: self._apply_averaged_gradients(publish=False))
        else:
            self._apply_averaged_gradients(publish=True)

    # ----- the gradient round

    def _begin_gradient_round(self, control: StepControl | None, *, zero_weight: bool) -> StepControl:
        averager = self.grad_averager
        samples = averager.local_samples_accumulated
        if control is None:  # none was pre-scheduled: whoever is looking within a matchmaking time
            now = get_dht_time()
            plan = self.context.rounds.plan(expect_peers=False)
            control = averager.schedule_step(scheduled_time=plan.scheduled_time, timeout=plan.timeout(now))
        with contextlib.suppress(RuntimeError):  # too late to change the weight: the round has begun
            control.weight = 0.0 if zero_weight else float(samples)
        # groupmates learn how many samples each member averaged (read back in _wait_gradient_round);
        # the round packs control.gather only when it starts, after the trigger below
        control.gather = {"samples": 0 if zero_weight else int(samples), "epoch": self.context.local_epoch}
        averager.step(control=control, weight=0.0 if zero_weight else float(samples), wait=False)
        return control

    def _wait_gradient_round(self, control: StepControl, *, epoch: int, in_background: bool = False) -> bool:
        """Waits for the round that this peer began in ``epoch``; whether it averaged."""
        rounds = self.context.rounds
        try:
            gathered = rounds.wait(control, watch_swarm=not in_background)
        except ROUND_FAILURES as e:
            logger.warning(f"averaging gradients failed ({e}): proceeding with local gradients")
            rounds.request_resync()
            return False
        except WAIT_FAILURES as e:
            logger.warning(f"averaging gradients did not finish ({e!r}): proceeding with local gradients")
            rounds.request_resync()
            return False
        report = self.grad_averager.last_round
        peers = report.group_size if report is not None else len(gathered or {})
        self.last_round_samples = gathered_samples(gathered)
        self.last_epoch_samples = sum(self.last_round_samples.values())
        logger.debug(f"averaged gradients with {peers} peers")  # the round driver logs the round's outcome
        epochs = gathered_epochs(gathered)
        # compared with the round's epoch, never the current one: with delay_grad_averaging this runs in
        # the background after the peer entered the next epoch, and every round would look like a miss
        if epochs - {epoch}:
            # groupmates averaged another epoch's gradients (this peer was behind, e.g. right after a
            # download that raced their step): the update still helps, but download the state next
            logger.info(f"groupmates were at epochs {sorted(epochs)}: resynchronizing")
            rounds.request_resync(missed=True)  # the swarm is at another epoch: this peer missed its round
        elif self.hops.enabled:  # grad_averaging_hops: the further rounds refine the mean in the buffers
            self.last_epoch_samples = self.hops.run(epoch=epoch, covered=self.last_epoch_samples)
        return True

    def _finish_gradient_round(self, control: StepControl, *, epoch: int, apply: bool) -> None:
        """Background job (delay_grad_averaging): wait for the round of ``epoch``, then step on its result."""
        self._wait_gradient_round(control, epoch=epoch, in_background=True)
        if apply:
            self._apply_averaged_gradients(publish=False)

    def _apply_averaged_gradients(self, *, publish: bool) -> None:
        state = self.context.state
        with self.context.state_lock, self.grad_averager.use_averaged_gradients() as grads:
            state.apply_gradients(list(grads))
            if publish:
                state.copy_to_model()

    def _wait_background(self) -> None:
        if not self.background.pending:
            return
        started = time.perf_counter()
        try:
            self.background.wait(self.context.config.averaging_timeout + self.context.config.shutdown_timeout)
        except DeadlineExceededError as e:
            logger.warning(f"{e}: the step will be applied when it finishes")
            return
        except HivemindExtError as e:
            logger.warning(f"a background step failed: {e}")
        finally:
            self.blocked_seconds += time.perf_counter() - started
        with self.context.state_lock:
            self.context.state.copy_to_model()
