"""State rounds: averaging the parameters (and optimizer statistics) every ``average_state_every``
epochs, at the epoch's end, with the peer's TrainingStateAverager (from the algorithm's context).

What the built-in synchronous gradient averaging and local updates share. A round begins right
after this epoch's optimizer step on every peer (so that all peers average parameters taken after
the same step) and is applied by the training thread: at once with ``delay_state_averaging=False``,
else at a later ``step()`` (:meth:`StateRounds.collect`).
"""

from __future__ import annotations

from hivemind.utils import get_dht_time

from hivemind_ext.errors import ConfigurationError
from hivemind_ext.optim.algorithms.base import AlgorithmContext
from hivemind_ext.optim.rounds import next_epoch
from hivemind_ext.optim.state_averager import TrainingStateAverager


class StateRounds:
    def __init__(self, context: AlgorithmContext) -> None:
        if context.state_averager is None:
            raise ConfigurationError("state rounds need the context's state_averager")
        self.context = context
        self.averager: TrainingStateAverager = context.state_averager

    def next_epoch(self) -> int:
        """The epoch this peer enters when its current one ends (the swarm's, if that is further)."""
        return next_epoch(self.context.local_epoch, self.context.tracker.global_progress.epoch)

    def due(self, epoch: int) -> bool:
        """Whether to average the state on entering ``epoch`` (other peers train, and none is pending)."""
        if self.context.tracker.global_progress.num_trainers < 2 or epoch % self.context.config.average_state_every:
            return False
        return not self.averager.has_round

    def begin(self, epoch: int | None = None) -> None:
        """Starts the round of ``epoch`` (the one the peer enters; rounds of peers that disagree on it
        are discarded, see :meth:`TrainingStateAverager.begin_round`); its result is applied by the
        training thread, in ``step()``."""
        config = self.context.config
        if self.averager.has_round:
            return  # one still runs, or it finished and step() has not applied it yet (starting would lose it)
        self.averager.begin_round(
            timeout=config.averaging_timeout + config.matchmaking_time,
            scheduled_time=get_dht_time() + config.matchmaking_time,
            epoch=epoch,
        )

    def apply_now(self) -> None:
        """Waits for the round (as long as it may take) and applies it (``delay_state_averaging=False``)."""
        config = self.context.config
        self.averager.apply_round(wait=config.averaging_timeout + config.matchmaking_time + 1.0)

    def collect(self, wait: bool) -> None:
        """Applies a finished round (``wait``: for up to about ``averaging_timeout`` while it runs)."""
        self.averager.apply_round(wait=self.context.config.averaging_timeout + 1.0 if wait else 0.0)
