"""Publishing one peer's metrics record (see :mod:`.records`) every few seconds, for monitors.

:class:`MetricsPublisher` is a background thread that, every ``period`` seconds, reads the peer's
numbers (a ``snapshot`` callable for epoch, role and speed; the peer's
:func:`~hivemind_ext.averaging.round_stats.round_stats_of` for its rounds and traffic; a
:class:`LossMeter` for the losses the user reported) and stores the record under the run's metrics
key in the peer's signed owner subkey. Each store has a deadline; a record outlives a few missed
publications, then expires. :meth:`MetricsPublisher.shutdown` stops the thread and withdraws the
record without waiting for the DHT.

``Optimizer(..., metrics_period=S)`` builds one with :meth:`MetricsPublisher.for_optimizer`;
``Optimizer.report_loss(loss)`` feeds its loss meter.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hivemind.utils import get_dht_time

from hivemind_ext.averaging.round_stats import round_stats_of
from hivemind_ext.errors import ClosedError, ConfigurationError, HivemindExtError
from hivemind_ext.monitoring.records import ROLES, PeerMetrics, metrics_key, metrics_value
from hivemind_ext.p2p.runtime import PeerRuntime

logger = logging.getLogger(__name__)

MIN_PERIOD = 0.1
EXPIRATION_PERIODS = 3  # a record outlives this many missed publications (plus EXPIRATION_SLACK)
EXPIRATION_SLACK = 5.0
MAX_STORE_SECONDS = 10.0
_POLL_SECONDS = 0.1  # how often a store in flight checks for shutdown


@dataclass(frozen=True)
class LocalSnapshot:
    """The peer's own numbers at one moment, as the publisher's ``snapshot`` callable returns them."""

    epoch: int
    samples_per_second: float
    role: str


class LossMeter:
    """The mean of the losses reported since it was last read; when none were, the previous mean
    (so a peer that pauses keeps showing its last loss). Thread-safe; non-finite losses are ignored."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sum, self._count = 0.0, 0
        self._last: float | None = None

    def add(self, loss: Any) -> None:
        value = float(loss)  # a Python number, or a one-element tensor (read at once)
        if not math.isfinite(value):
            return
        with self._lock:
            self._sum += value
            self._count += 1

    def take(self) -> float | None:
        with self._lock:
            if self._count:
                self._last = self._sum / self._count
                self._sum, self._count = 0.0, 0
            return self._last


class MetricsPublisher:
    """Publishes the metrics record of the peer of ``runtime`` every ``period`` seconds.

    :param runtime: the peer's runtime (acquired here, released by :meth:`shutdown`)
    :param run_id: the run whose metrics key the record goes under
    :param owner_subkey: the peer's ``[owner:<public key>]`` subkey, which its DHT signs records under
      (:attr:`hivemind_ext.optim.progress.ProgressTracker.owner_subkey`)
    :param snapshot: returns the peer's :class:`LocalSnapshot`; called from the publisher's thread
    """

    def __init__(
        self,
        *,
        runtime: PeerRuntime,
        run_id: str,
        owner_subkey: bytes,
        period: float,
        snapshot: Callable[[], LocalSnapshot],
        start: bool = True,
    ) -> None:
        if isinstance(period, bool) or not isinstance(period, int | float) or not MIN_PERIOD <= period < math.inf:
            raise ConfigurationError(f"metrics_period must be a number of seconds >= {MIN_PERIOD}, got {period!r}")
        self.key, self.period, self.owner_subkey = metrics_key(run_id), float(period), owner_subkey
        self.loss = LossMeter()
        self.published = 0  # records the DHT accepted
        self.last_record: PeerMetrics | None = None  # the last record handed to the DHT
        self._snapshot = snapshot
        self._peer_id = runtime.dht.peer_id.to_base58()
        self._runtime = PeerRuntime.acquire(runtime.dht)
        self._stats = round_stats_of(self._runtime)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"MetricsPublisher({run_id})", daemon=True)
        if start:
            self._thread.start()

    @classmethod
    def for_optimizer(cls, optimizer: Any, period: float) -> MetricsPublisher:
        """The publisher of a ``hivemind_ext.Optimizer``: its tracker's runtime and subkey, its epoch,
        measured speed and role."""
        tracker = optimizer.tracker

        def snapshot() -> LocalSnapshot:
            role = "aux" if optimizer.auxiliary else "client" if optimizer.client_mode else "trainer"
            speed = tracker.performance_ema.samples_per_second
            return LocalSnapshot(epoch=optimizer.local_epoch, samples_per_second=speed, role=role)

        return cls(
            runtime=tracker.runtime,
            run_id=optimizer.run_id,
            owner_subkey=tracker.owner_subkey,
            period=period,
            snapshot=snapshot,
        )

    def report_loss(self, loss: Any) -> None:
        """Adds one training loss (a number or a one-element tensor) to the next record's mean."""
        self.loss.add(loss)

    def current_record(self) -> PeerMetrics:
        """The record this peer would publish now (reads the loss meter)."""
        local, rounds = self._snapshot(), self._stats.snapshot()
        if local.role not in ROLES:
            raise ConfigurationError(f"role must be one of {ROLES}, got {local.role!r}")
        return PeerMetrics(
            peer_id=self._peer_id,
            role=local.role,
            epoch=int(local.epoch),
            samples_per_second=float(local.samples_per_second),
            loss=self.loss.take(),
            rounds_ok=rounds.rounds_ok,
            rounds_failed=rounds.rounds_failed,
            last_round_seconds=rounds.last_round_seconds,
            last_round_ok=rounds.last_round_ok,
            bytes_sent=rounds.bytes_sent,
            bytes_received=rounds.bytes_received,
            time=get_dht_time(),
        )

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self) -> None:
        """Stops publishing and withdraws the record (handed to the DHT, not waited for). Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            if self._thread.ident is not None:
                self._thread.join(MAX_STORE_SECONDS + 1)
                # a withdrawal needs a later expiration than the last record to replace it
                expiration = get_dht_time() + self._expiration_seconds() + 1
                self._runtime.dht_calls.store_nowait(self.key, None, expiration, subkey=self.owner_subkey)
        except HivemindExtError as e:  # the DHT is gone already: the record simply expires
            logger.debug("could not withdraw the metrics record: %r", e)
        finally:
            self._runtime.release()

    def _expiration_seconds(self) -> float:
        return EXPIRATION_PERIODS * self.period + EXPIRATION_SLACK

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._publish()
                self._stop.wait(self.period)
        except Exception:  # a bug: say so, and let is_alive() tell
            logger.exception("the metrics publisher failed")

    def _publish(self) -> None:
        record = self.current_record()
        timeout = min(max(self.period, 2.0), MAX_STORE_SECONDS)
        try:
            store = self._runtime.dht_calls.store(
                self.key,
                metrics_value(record),
                record.time + self._expiration_seconds(),
                subkey=self.owner_subkey,
                timeout=timeout,
            )
            stored = self._wait(self._runtime.submit(store), give_up=time.monotonic() + timeout + 1)
        except (HivemindExtError, concurrent.futures.CancelledError) as e:
            logger.debug("publishing the metrics record failed: %r", e)
            return
        self.last_record = record
        if stored:
            self.published += 1
        else:
            logger.debug("the DHT refused the metrics record")

    def _wait(self, future: concurrent.futures.Future[bool], give_up: float) -> bool:
        """The store's answer; gives up (cancelling it) at ``give_up`` (monotonic) or on shutdown."""
        while True:
            try:
                return future.result(timeout=_POLL_SECONDS)
            except HivemindExtError:  # before TimeoutError: DeadlineExceededError may be one
                raise
            except concurrent.futures.TimeoutError:
                if self._stop.is_set() or time.monotonic() >= give_up:
                    future.cancel()
                    raise ClosedError("the metrics store was abandoned") from None


__all__ = ["LocalSnapshot", "LossMeter", "MetricsPublisher"]
