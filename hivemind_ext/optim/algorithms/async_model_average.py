"""Asynchronous model averaging (Bagua's AsyncModelAverage): local steps in the training loop, model
averaging with peers in a background thread, neither waiting for the other.

The computation side: every ``step()`` applies the wrapped torch optimizer to the local gradients.
The communication side: a thread owned by the implementation averages the parameters with whichever
peers are averaging too, every ``sync_interval_seconds``. Both hold the Optimizer's ``state_lock``
while they touch the parameters; the communication thread holds it only to take a snapshot, never
during the network round, so training goes on meanwhile. The result is applied by the training
thread at its next ``step()`` (a write from the communication thread could land between the user's
forward and backward passes). The progress made during a round is kept::

    snapshot = x                              # communication thread, under the lock
    avg      = weighted mean over peers of their snapshots (network, no lock)
    x       += avg - snapshot                 # training thread, next step(), under the lock

``abort()`` stops the communication thread (e.g. before evaluation), ``resume()`` starts it again;
``shutdown()`` stops it with bounded waits. Every peer weighs 1 (a plain model average, as in Bagua).
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import threading
from typing import Any

import torch
from hivemind.utils import get_dht_time

from hivemind_ext.averaging.averager import DecentralizedAverager
from hivemind_ext.averaging.control import StepControl
from hivemind_ext.averaging.delta import apply_delta, average_delta, take_snapshot
from hivemind_ext.errors import ConfigurationError, HivemindExtError
from hivemind_ext.optim.algorithms.base import Algorithm, AlgorithmContext, AlgorithmImpl, NamedTensor

logger = logging.getLogger(__name__)


class AsyncModelAverage(Algorithm):
    """Local optimizer steps plus background model averaging.

    :param sync_interval_seconds: pause between the end of one averaging round and the start of the
      next. Default 1.0 s: a round already costs the Optimizer's ``matchmaking_time`` (peers that
      start looking within that window average together), and a pause of the same order keeps the
      thread from averaging back to back on slow links. 0 averages continuously.
    :param codec: the codec of the parameter all-reduce. Default ``None`` (no compression):
      parameters, unlike gradients or differences, are large values averaged again and again, and
      the rounding error of a lossy codec lands in the weights at every round.
    :param warmup_steps: local steps before the communication thread starts (Bagua's ``warmup_steps``)
    """

    def __init__(self, sync_interval_seconds: float = 1.0, *, codec: Any = None, warmup_steps: int = 0) -> None:
        if not (
            isinstance(sync_interval_seconds, int | float)
            and math.isfinite(sync_interval_seconds)
            and sync_interval_seconds >= 0
        ):
            raise ConfigurationError(f"sync_interval_seconds must be >= 0, got {sync_interval_seconds!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ConfigurationError(f"warmup_steps must be a non-negative integer, got {warmup_steps!r}")
        self.sync_interval_seconds = float(sync_interval_seconds)
        self.codec = codec
        self.warmup_steps = warmup_steps

    def reify(self, context: AlgorithmContext) -> AsyncModelAverageImpl:
        return AsyncModelAverageImpl(context, self)


class AsyncModelAverageImpl(AlgorithmImpl):
    """AsyncModelAverage bound to one optimizer. Counters: ``local_steps``, ``rounds`` (averaging
    rounds applied), ``failed_rounds``. ``running`` tells whether the communication thread runs."""

    def __init__(self, context: AlgorithmContext, algorithm: AsyncModelAverage) -> None:
        super().__init__(context)
        self.algorithm = algorithm
        self._lock = context.state_lock
        self._state = context.state
        self._params: list[torch.Tensor] = list(self._state.opt_params)
        self._join_timeout = float(context.config.shutdown_timeout)
        with self._lock:
            self._buffers = [p.detach().float().clone() for p in self._params]
        self.averager = DecentralizedAverager(
            self._buffers,
            context.dht,
            start=True,
            prefix=context.prefix("async_model_average"),
            compression=algorithm.codec,
            allow_state_sharing=False,
            **context.averager_options,
        )
        self.local_steps = 0
        self.rounds = 0
        self.failed_rounds = 0
        self._thread_lock = threading.Lock()  # guards the thread handles below
        self._thread: threading.Thread | None = None
        self._stop: threading.Event | None = None  # the running thread's own stop flag
        self._control: StepControl | None = None
        self._pending: list[torch.Tensor] | None = None  # a finished round's update, not applied yet
        self._aborted = False  # abort() was called: on_backward does not (re)start the thread
        self._closed = False

    # ----- the computation side

    def init_tensors(self) -> list[NamedTensor]:
        return []  # nothing for the runner to average: the communication thread does it

    def on_backward(self, batch_size: int) -> None:
        grads = [p.grad for p in self.context.params]
        with self._lock:
            self._apply_pending_average()
            self._state.apply_gradients(grads)
            self._state.copy_to_model()
        self.local_steps += 1
        if self.local_steps >= self.algorithm.warmup_steps and not self._aborted and not self.running:
            self._start()

    def should_communicate(self) -> bool:
        return False

    # ----- the communication thread

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    @property
    def round_in_progress(self) -> bool:
        """Whether the communication thread is in an averaging round (matchmaking or all-reduce)."""
        control = self._control
        return control is not None and not control.done()

    def abort(self, timeout: float | None = None) -> bool:
        """Stops the communication thread (a round in progress is cancelled and not applied) and
        waits at most ``timeout`` seconds (default: the Optimizer's ``shutdown_timeout``) for it.
        Returns whether it has stopped."""
        with self._thread_lock:
            self._aborted = True
            thread, stop, control = self._thread, self._stop, self._control
            if stop is not None:
                stop.set()
        if control is not None and not control.done():
            control.cancel()
        if thread is None:
            return True
        thread.join(self._join_timeout if timeout is None else timeout)
        if thread.is_alive():
            logger.warning("the async model averaging thread did not stop in time; it will exit on its own")
            return False
        return True

    def resume(self) -> None:
        """(Re)starts the communication thread after ``abort()``."""
        if self._closed:
            raise HivemindExtError("the algorithm is shut down")
        self._aborted = False
        self._start()

    def _start(self) -> None:
        with self._thread_lock:
            if self._closed or (self._thread is not None and self._thread.is_alive() and not self._stop.is_set()):
                return
            stop = threading.Event()  # a thread that has not yet seen an old stop flag keeps its own
            thread = threading.Thread(
                target=self._run, args=(stop,), name=f"{self.context.prefix('async')}-averaging", daemon=True
            )
            self._thread, self._stop = thread, stop
            thread.start()

    def _run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self._average_once(stop)
            except Exception as e:  # the thread must survive one bad round; the next may succeed
                self.failed_rounds += 1
                logger.warning(f"async model averaging round failed: {e!r}")
            if stop.wait(self.algorithm.sync_interval_seconds):
                return

    def _average_once(self, stop: threading.Event) -> None:
        with self._lock:  # the model as it will be once the pending update is applied
            snapshot = take_snapshot(self._params)
            if self._pending is not None:
                torch._foreach_add_(snapshot, self._pending)
        with self.averager.get_tensors() as buffers:
            torch._foreach_copy_(list(buffers), snapshot)
        rounds = self.context.rounds
        with self._thread_lock:
            if stop.is_set():
                return
            # no expected group: whichever peers are averaging at the time make the group
            plan = rounds.plan(expect_peers=False)
            control = self.averager.step(
                weight=1.0, scheduled_time=plan.scheduled_time, timeout=plan.timeout(get_dht_time()), wait=False
            )
            if not isinstance(control, StepControl):
                raise HivemindExtError("a step with wait=False must return its StepControl")
            self._control = control
        try:
            rounds.wait(control, watch_swarm=False, stop=stop)
        except concurrent.futures.CancelledError:
            return
        except HivemindExtError as e:
            if not stop.is_set():
                self.failed_rounds += 1
                logger.info(f"async model averaging round failed ({e}); keeping the local parameters")
            return
        finally:
            with self._thread_lock:
                self._control = None
        if stop.is_set():
            return  # aborted while the round finished: do not touch the model any more
        with self.averager.get_tensors() as buffers:
            deltas = average_delta(buffers, snapshot)
        with self._lock:
            # applied by the training thread at its next step(): writing the parameters from here could
            # change them between the user's forward and backward passes (autograd would refuse them)
            self._pending = (
                deltas if self._pending is None else [a + b for a, b in zip(self._pending, deltas, strict=True)]
            )
        self.rounds += 1

    def _apply_pending_average(self) -> None:
        """``x += mean(snapshot) - snapshot`` for the last finished round (under the lock)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        with torch.no_grad():
            apply_delta(self._params, pending)
            self._state.copy_to_model()

    # ----- shutting down

    def shutdown(self) -> None:
        """Stops the thread (bounded wait) and the averager; never blocks longer than about twice the
        Optimizer's ``shutdown_timeout``."""
        if self._closed:
            return
        self.abort()
        with self._thread_lock:
            self._closed = True
        try:
            self.averager.shutdown()
        except Exception as e:  # e.g. the DHT's daemon is already gone
            logger.debug(f"error while shutting down the async averager: {e!r}")
