"""Local updates (``Optimizer(use_local_updates=True)``): step the wrapped optimizer on every
batch's own gradients, and average the parameters with the swarm when an epoch ends.

Each ``step()`` applies the batch's gradients at once and reports the samples to the progress
tracker; when the swarm reached ``target_batch_size`` the peer enters the next epoch and, every
``average_state_every`` epochs, averages its parameters and optimizer statistics
(:class:`~.state_rounds.StateRounds`). No gradients are communicated.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from hivemind_ext.optim.algorithms.base import AlgorithmContext, AlgorithmImpl
from hivemind_ext.optim.algorithms.state_rounds import StateRounds

if TYPE_CHECKING:
    from hivemind_ext.optim.grad_scaler import BoundGradScaler

logger = logging.getLogger(__name__)


class LocalUpdatesImpl(AlgorithmImpl):
    """What ``GradientAllReduce()`` reifies into with ``use_local_updates=True``: a StepEngine itself."""

    runs_own_steps = True

    def __init__(self, context: AlgorithmContext) -> None:
        super().__init__(context)
        self.state_rounds = StateRounds(context)
        self.blocked_seconds = 0.0

    def train_step(self, batch_size: int, grad_scaler: BoundGradScaler | None) -> None:
        context = self.context
        if grad_scaler is not None and grad_scaler.unscale_and_check():
            logger.log(context.status_loglevel, "gradients overflowed: skipping this batch (the scale is lowered)")
            return
        grads = [p.grad for p in context.params]
        with context.state_lock:
            context.state.apply_gradients(grads)
            context.state.copy_to_model()
        tracker = context.tracker
        tracker.report_local_progress(context.local_epoch, tracker.local_progress.samples_accumulated + batch_size)
        if tracker.ready_to_update_epoch:
            self._end_epoch()

    def _end_epoch(self) -> None:
        started = time.perf_counter()
        entering = self.state_rounds.next_epoch()
        average_state = self.state_rounds.due(entering)
        if average_state:
            self.state_rounds.begin(entering)
        apply_now = average_state and not self.context.config.delay_state_averaging
        self.context.advance_epoch(before_announcing=self.state_rounds.apply_now if apply_now else None)
        self.blocked_seconds += time.perf_counter() - started

    def collect_background_work(self, wait: bool) -> None:
        self.state_rounds.collect(wait)

    def prepare_for_download(self) -> None:
        """Nothing runs in the background (the Optimizer cancels the state round: it owns the state averager)."""

    def discard_local_progress(self) -> None:
        """Nothing accumulates: every batch was applied at once."""
