"""The gradient round's further hops (``Optimizer(grad_averaging_hops=...)``; the rules, in words,
are in :mod:`hivemind_ext.optim.hops`).

:class:`GradientHops` belongs to the synchronous path (:class:`.sync_gradients.SyncGradientsImpl`),
which calls :meth:`GradientHops.run` once its gradient round of an epoch averaged, before the
optimizer step reads the averaged gradients: every gradient round is then made in that one place.
Hop ``h`` runs on its own averager (started the first time it is needed, on the prefix
:func:`~hivemind_ext.optim.hops.hop_prefix`), which shares the peer's rotation coordinates with
the gradient averager (``averager_opts["rotation"]``), so that each hop ranks peers by the digits the
hop before dealt: its groups take one member from each of the hop before's groups where shards fill.

Each hop copies the gradient averager's buffers (the mean so far) into its own, averages them with
its group, each member weighted by the samples its mean covers (sent in the gather data, so every
member learns the group's total), and copies the result back. A hop that finds no group within its
search window, fails, or whose group mixes epochs is skipped (its result is not copied back), and the
peer steps on what it has: no resync, since its mean is still an average of the swarm's gradients.

A hop's peers arrive as their previous hop's groups finish, not together: a hop's averager waits up
to one matchmaking time in its shard before it falls back to a coarser board (its poll interval is
``matchmaking_time / SHARD_WAIT_POLLS``, within the matchmaker's bounds), where a peer that came early
would otherwise meet its own previous group again; there, full groups form at once until the hop's
scheduled time, a matchmaking time later (:func:`~hivemind_ext.optim.hops.hop_plan`). In the 16-peer
digits benchmark on a loaded machine (load 25) with a single matchmaking time, peers that fell back
were already past their scheduled time and paired up at once: 122 of 176 second hops had groups of 2
(with two matchmaking times, 72 of 175 were full groups of 4).

Each hop averager holds one float32 copy of the gradients.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging

import torch
from hivemind.utils import get_dht_time

from hivemind_ext.averaging.averager import DecentralizedAverager
from hivemind_ext.averaging.matchmaking.protocol import SHARD_WAIT_POLLS
from hivemind_ext.errors import (
    AllreduceError,
    ConfigurationError,
    DeadlineExceededError,
    HivemindExtError,
    MatchmakingError,
)
from hivemind_ext.optim.algorithms.base import AlgorithmContext
from hivemind_ext.optim.hops import AUTO, hop_count, hop_plan, hop_prefix
from hivemind_ext.optim.keys import grad_prefix
from hivemind_ext.optim.rounds import gathered_epochs, gathered_samples

logger = logging.getLogger(__name__)

HOP_FAILURES = (
    MatchmakingError,
    AllreduceError,
    DeadlineExceededError,
    TimeoutError,
    concurrent.futures.TimeoutError,
    concurrent.futures.CancelledError,
    HivemindExtError,
)


class GradientHops:
    """The hops after one peer's gradient rounds (see the module docstring).

    :param context: the algorithm's context (its config's ``grad_averaging_hops``, its averager options);
      a setting that cannot work raises ConfigurationError here, before any averager starts
    """

    def __init__(self, context: AlgorithmContext) -> None:
        self.context = context
        self.setting = context.config.grad_averaging_hops
        self.group_size = context.averager_options.get("target_group_size")
        if self.setting not in (1, AUTO) and not (isinstance(self.group_size, int) and self.group_size >= 2):
            raise ConfigurationError(
                "grad_averaging_hops > 1 averages in rotating groups: pass averager_opts=dict(target_group_size=...) "
                "(in one group of the whole swarm, one round already gives every peer the global mean)"
            )
        #: the gradient averager, whose buffers hold the mean that each hop refines (set by its owner)
        self.grad_averager: DecentralizedAverager | None = None
        self.averagers: dict[int, DecentralizedAverager] = {}  # hop -> its averager (hop 0: the gradient round's)
        #: per hop after the first, in the last epoch: the members of its group (0: skipped or failed)
        self.last_hops: list[int] = []

    @property
    def enabled(self) -> bool:
        return self.setting != 1

    def count(self) -> int:
        """The gradient rounds of this epoch (the first included)."""
        return hop_count(self.setting, swarm_size=self.context.rounds.peers_seen, group_size=self.group_size)

    def run(self, *, epoch: int, covered: int) -> int:
        """After this peer's gradient round of ``epoch`` averaged ``covered`` samples: the further hops.
        Returns the samples that the mean in the gradient averager's buffers covers now. Stops at the
        first hop that is skipped (the peer steps on what it has, see the module docstring)."""
        self.last_hops = []
        for hop in range(1, self.count()):
            if covered <= 0:  # every member's gradients overflowed: nothing to weigh
                break
            outcome = self._hop(hop, epoch=epoch, covered=covered)
            self.last_hops.append(outcome[1] if outcome is not None else 0)
            if outcome is None:
                break
            covered = outcome[0]
        return covered

    def _hop(self, hop: int, *, epoch: int, covered: int) -> tuple[int, int] | None:
        """One hop: (samples covered, group members), or None if it was skipped."""
        config = self.context.config
        assert self.grad_averager is not None, "GradientHops.grad_averager is not set"
        averager = self._averager(hop)
        with self.grad_averager.get_tensors() as current, averager.get_tensors() as buffers:
            for buffer, tensor in zip(buffers, current, strict=True):
                buffer.copy_(tensor)
        now = get_dht_time()
        scheduled, deadline = hop_plan(
            now, matchmaking_time=config.matchmaking_time, averaging_timeout=config.averaging_timeout
        )
        swarm = self.context.rounds.peers_seen
        control = averager.step(
            gather={"samples": int(covered), "epoch": epoch},
            weight=float(covered),
            scheduled_time=scheduled,
            timeout=deadline - now,
            allow_retries=False,  # the search cut-off: no second search after a failed one
            expected_group_size=swarm if swarm >= 2 else None,
            wait=False,
        )
        loglevel = self.context.status_loglevel
        try:
            gathered = self.context.rounds.wait(control, watch_swarm=False)
        except HOP_FAILURES as e:
            logger.log(loglevel, f"gradient hop {hop} skipped ({e!r}): stepping on the mean of {covered} samples")
            return None
        if gathered_epochs(gathered) - {epoch}:
            logger.log(loglevel, f"gradient hop {hop} mixed epochs: stepping on the mean of {covered} samples")
            return None
        total = sum(gathered_samples(gathered).values())
        with self.grad_averager.get_tensors() as current, averager.get_tensors() as buffers:
            for tensor, buffer in zip(current, buffers, strict=True):
                tensor.copy_(buffer)
        return total, len(gathered or {})

    def _averager(self, hop: int) -> DecentralizedAverager:
        averager = self.averagers.get(hop)
        if averager is not None:
            return averager
        config = self.context.config
        assert self.grad_averager is not None
        with self.grad_averager.get_tensors() as current:
            buffers = [torch.zeros_like(t) for t in current]
        options = {"allow_state_sharing": False, **self.context.averager_options}
        averager = DecentralizedAverager(
            buffers,
            self.context.dht,
            prefix=hop_prefix(grad_prefix(config.run_id), hop),
            compression=self.context.grad_compression,
            start=False,
            **options,
        )
        matchmaking = averager.matchmaking_config
        wait = config.matchmaking_time / SHARD_WAIT_POLLS
        poll = min(matchmaking.request_timeout / 4, max(matchmaking.poll_interval, wait))
        averager.matchmaking_config = dataclasses.replace(matchmaking, poll_interval=poll)
        averager.keep_concurrent_updates = False  # the buffers are only written between rounds
        averager.run_in_background()
        self.averagers[hop] = averager
        return averager

    def shutdown(self) -> None:
        for averager in self.averagers.values():
            try:
                averager.shutdown()
            except Exception as e:  # the DHT's daemon may be gone already: the Optimizer must still close
                logger.debug(f"error while shutting down a gradient hop's averager: {e!r}")
        self.averagers.clear()
