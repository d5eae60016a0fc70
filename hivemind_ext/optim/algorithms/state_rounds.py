"""State rounds: averaging the parameters (and optimizer statistics) every ``average_state_every``
epochs, at the epoch's end, with the peer's TrainingStateAverager (from the algorithm's context).

What the built-in synchronous gradient averaging and local updates share. A round begins right
after this epoch's optimizer step on every peer (so that all peers average parameters taken after
the same step) and is applied by the training thread: at once with ``delay_state_averaging=False``,
else at a later ``step()`` (:meth:`StateRounds.collect`).
"""

from __future__ import annotations

from hivemind.utils import get_dht_time

from hivemind_ext.averaging.averager import RoundReport
from hivemind_ext.errors import ConfigurationError
from hivemind_ext.optim.algorithms.base import AlgorithmContext
from hivemind_ext.optim.rounds import give_up_time, next_epoch
from hivemind_ext.optim.state_averager import TrainingStateAverager


class StateRounds:
    def __init__(self, context: AlgorithmContext) -> None:
        if context.state_averager is None:
            raise ConfigurationError("state rounds need the context's state_averager")
        self.context = context
        self.averager: TrainingStateAverager = context.state_averager
        self.deadline = 0.0  # the DHT time at which the last round begun gives up (see apply_now)

    def next_epoch(self) -> int:
        """The epoch this peer enters when its current one ends (the swarm's, if that is further)."""
        return next_epoch(self.context.local_epoch, self.context.tracker.global_progress.epoch)

    def due(self, epoch: int) -> bool:
        """Whether to average the state on entering ``epoch``: other peers train, and it is such an epoch.
        Ask from the training thread only: a previous round still pending is applied first, waited for
        (as hivemind's TrainingStateAverager waits for its delayed updates) if it still runs.

        Skipping the round instead (a previous one was still pending) cascaded: the peers that began it
        expect every peer of the swarm in its group, so without the peers that skipped it, it formed
        only at its scheduled time, and by then they had skipped the next one. Only every other epoch
        had a state round, and 8 peers in groups of 4 ended up to 0.41 of the distance moved apart
        (``test_optimizer_large_swarm``, bound 0.25; with every round, 0.00-0.02 in 7 of 9 runs and 0.22 in
        2). A round that finished but was not applied yet (``step()`` applies it at its next call)
        counted as pending too."""
        if self.context.tracker.global_progress.num_trainers < 2 or epoch % self.context.config.average_state_every:
            return False
        if self.averager.has_round:
            self.averager.apply_round(wait=max(0.0, give_up_time(self.deadline) - get_dht_time()))
        return not self.averager.has_round

    def begin(self, epoch: int | None = None, *, after: RoundReport | None = None) -> None:
        """Starts the round of ``epoch`` (the one the peer enters; rounds of peers that disagree on it
        are discarded, see :meth:`TrainingStateAverager.begin_round`); its result is applied by the
        training thread, in ``step()``.

        It is planned as gradient rounds are (:meth:`~hivemind_ext.optim.rounds.RoundDriver.plan_after`):
        once a round had a group, the group forms as soon as every expected peer is looking, instead of
        a whole matchmaking time later. That round is this averager's last one, else ``after``: a round
        this peer just had with the same swarm (this epoch's gradient round)."""
        if self.averager.has_round:
            return  # one still runs, or it finished and step() has not applied it yet (starting would lose it)
        last = self.averager.last_round if self.averager.last_round is not None else after
        plan = self.context.rounds.plan_after(last)
        self.averager.begin_round(
            timeout=plan.timeout(get_dht_time()),
            scheduled_time=plan.scheduled_time,
            expected_group_size=plan.expected_group_size,
            epoch=epoch,
        )
        self.deadline = plan.deadline

    def apply_now(self) -> None:
        """Waits for the round (as long as it may take) and applies it (``delay_state_averaging=False``)."""
        self.averager.apply_round(wait=max(0.0, give_up_time(self.deadline) - get_dht_time()))

    def collect(self, wait: bool) -> None:
        """Applies a finished round (``wait``: for up to about ``averaging_timeout`` while it runs)."""
        self.averager.apply_round(wait=self.context.config.averaging_timeout + 1.0 if wait else 0.0)
