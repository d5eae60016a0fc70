"""An auxiliary peer: helps the swarm average gradients without training (no data, CPU only).

It follows the swarm's progress through the :class:`.ProgressTracker`, joins each gradient
averaging round when the swarm is about to reach ``target_batch_size``, owns a part of the
all-reduce (it reduces what the trainers send and sends the averages back) and contributes no
gradients. It needs no model: the round's layout arrives with the trainers' streams.

It never makes training slower than without it: it joins only rounds where it can help, those of
two trainers or more (:func:`should_help`). Its progress record says it is auxiliary, so trainers
count only each other: a trainer alone steps alone at once, and a trainer never waits for an
auxiliary peer to form its group (matchmaking compares the expected group size with the
contributing peers that are looking; an auxiliary peer that looks too joins the group).

Used by ``Optimizer(auxiliary=True)`` and by the command ``hivemind-ext aux``. It is a role, not an
algorithm: an algorithm decides how a model is updated from its gradients (``AlgorithmImpl`` and its
hooks all act on a model), while this peer has no model, takes no batches and never steps; it
only follows the trainers' gradient rounds. So ``Optimizer(auxiliary=True)`` binds no algorithm and
its ``step()`` runs this peer's loop instead.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from hivemind import DHT
from hivemind.utils import get_dht_time

from hivemind_ext.averaging.averager import DecentralizedAverager
from hivemind_ext.averaging.control import StepControl
from hivemind_ext.errors import HivemindExtError
from hivemind_ext.optim.config import averager_options
from hivemind_ext.optim.fingerprint import auxiliary_fingerprint
from hivemind_ext.optim.keys import check_run_id, grad_prefix, progress_prefix
from hivemind_ext.optim.progress import ProgressTracker
from hivemind_ext.optim.rounds import (
    SEARCHING,
    next_epoch,
    plan_round,
    should_abandon_search,
    should_prepare_round,
)
from hivemind_ext.optim.run_guard import RunGuard

logger = logging.getLogger(__name__)


def should_help(num_trainers: int) -> bool:
    """Whether an auxiliary peer joins the coming round: only a round of two trainers or more
    averages anything. With one, the round would cost the trainer a matchmaking wait for nothing."""
    return num_trainers >= 2


class AuxiliaryPeer:
    """:param averager: a DecentralizedAverager with ``auxiliary=True`` on the run's gradient prefix
    :param tracker: the run's progress tracker
    """

    def __init__(
        self,
        *,
        averager: DecentralizedAverager,
        tracker: ProgressTracker,
        matchmaking_time: float,
        averaging_timeout: float,
        status_loglevel: int = logging.INFO,
    ) -> None:
        self.averager, self.tracker = averager, tracker
        self.matchmaking_time, self.averaging_timeout = matchmaking_time, averaging_timeout
        self.status_loglevel = status_loglevel
        self.local_epoch = tracker.global_progress.epoch
        self.rounds_joined = 0
        self._control: StepControl | None = None

    def step(self, max_wait: float = 1.0) -> None:
        """One turn of the loop: (pre)schedule the next round, trigger it when the swarm is ready,
        collect a finished one. Returns within about ``max_wait`` seconds, or once a round finished
        (so that callers that count rounds, as ``max_rounds`` does, see each one)."""
        give_up, rounds = time.monotonic() + max_wait, self.rounds_joined
        while True:
            self._turn()
            if time.monotonic() >= give_up or self.rounds_joined != rounds:
                return
            time.sleep(min(0.05, max(give_up - time.monotonic(), 0)))

    def _turn(self) -> None:
        progress = self.tracker.global_progress
        if progress.epoch > self.local_epoch and self._control is None:
            self.local_epoch = progress.epoch  # the swarm moved on without us
        self.tracker.report_local_progress(self.local_epoch, 0)
        now = get_dht_time()
        eta = self.tracker.estimated_next_update_time
        if (
            self._control is None
            and should_help(progress.num_trainers)
            and should_prepare_round(now, eta, self.matchmaking_time)
        ):
            # the trainers' rule for the round's time (they expect no one before their first round either)
            plan = plan_round(
                now, matchmaking_time=self.matchmaking_time, averaging_timeout=self.averaging_timeout, eta=eta
            )
            # the base class's step: a GradientAverager (Optimizer(auxiliary=True)) overrides step() with
            # gradient-accumulation semantics that take no require_trigger
            control = DecentralizedAverager.step(
                self.averager,
                scheduled_time=plan.scheduled_time,
                timeout=plan.timeout(now),
                wait=False,
                require_trigger=True,
            )
            if not isinstance(control, StepControl):
                raise HivemindExtError("a step with wait=False must return its StepControl")
            self._control = control
        control = self._control
        if control is None:
            return
        searching = control.stage in SEARCHING
        if should_abandon_search(
            searching=searching, swarm_epoch=progress.epoch, local_epoch=self.local_epoch, watch_swarm=True
        ):
            # the trainers averaged this epoch without us: waiting on could only last until the deadline
            control.cancel()
            self._control, self.local_epoch = None, progress.epoch
            return
        if not control.triggered and (self.tracker.ready_to_update_epoch or control.groupmate_started):
            control.allow_allreduce()
        if control.done():
            self._control = None
            try:
                control.result(0)
                self.rounds_joined += 1
                logger.log(self.status_loglevel, f"helped average the gradients of epoch {self.local_epoch}")
            except HivemindExtError as e:
                logger.log(self.status_loglevel, f"an averaging round failed without us: {e}")
            self.local_epoch = next_epoch(self.local_epoch, self.tracker.global_progress.epoch)
            self.tracker.update_epoch(self.local_epoch)

    def shutdown(self) -> None:
        if self._control is not None and not self._control.done():
            self._control.cancel()
        self._control = None


def run_auxiliary_peer(
    dht: DHT,
    *,
    run_id: str,
    target_batch_size: int,
    matchmaking_time: float = 5.0,
    averaging_timeout: float = 60.0,
    averager_opts: dict[str, Any] | None = None,
    tracker_opts: dict[str, Any] | None = None,
    max_rounds: int | None = None,
    stop: threading.Event | None = None,
    status_interval: float = 60.0,
    on_status: Callable[[str], None] | None = None,
    alone_hint: str = "check the run_id and the DHT's initial_peers",
) -> int:
    """Runs an auxiliary peer until ``stop`` is set (or ``max_rounds`` rounds joined); returns the rounds joined.

    A status line (epoch, samples toward the target, trainers, rounds helped) goes to ``on_status`` (default:
    this module's logger at INFO) when the swarm's epoch changes, and at least every ``status_interval`` s.

    :raises RunMismatchError: the trainers' run has another ``target_batch_size`` (checked on join and
      before each round; the peer leaves the swarm first). ``alone_hint`` is logged once if no other
      peer shows up for a while.
    """
    check_run_id(run_id)
    stop = stop if stop is not None else threading.Event()
    report = on_status if on_status is not None else logger.info
    tracker_opts = {"fingerprint": auxiliary_fingerprint(target_batch_size), **(tracker_opts or {})}
    tracker = ProgressTracker(
        dht, progress_prefix(run_id), target_batch_size, auxiliary=True, start=True, **tracker_opts
    )
    averager: DecentralizedAverager | None = None
    peer: AuxiliaryPeer | None = None
    try:
        guard = RunGuard(tracker, run_id, alone_hint=alone_hint)
        guard.check()
        averager = DecentralizedAverager(
            [],
            dht,
            start=True,
            prefix=grad_prefix(run_id),
            auxiliary=True,
            **averager_options(
                matchmaking_time=matchmaking_time, allreduce_timeout=averaging_timeout, overrides=averager_opts
            ),
        )
        peer = AuxiliaryPeer(
            averager=averager, tracker=tracker, matchmaking_time=matchmaking_time, averaging_timeout=averaging_timeout
        )
        reported: tuple[int, int] | None = None  # (epoch, rounds helped) of the last status line
        last_report = -math.inf
        while not stop.is_set() and (max_rounds is None or peer.rounds_joined < max_rounds):
            guard.check()
            peer.step()
            progress = tracker.global_progress
            now = time.monotonic()
            if reported != (progress.epoch, peer.rounds_joined) or now - last_report >= status_interval:
                report(
                    f"epoch {progress.epoch}: {progress.samples_accumulated}/{target_batch_size} samples, "
                    f"{progress.num_trainers} trainers, {peer.rounds_joined} rounds helped"
                    + ("" if should_help(progress.num_trainers) else " (waiting for a second trainer)")
                )
                reported, last_report = (progress.epoch, peer.rounds_joined), now
        return peer.rounds_joined
    finally:
        if peer is not None:
            peer.shutdown()
        if averager is not None:
            averager.shutdown()
        tracker.shutdown()
