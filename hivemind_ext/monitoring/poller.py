"""Reading a run's metrics records from the DHT every few seconds into a
:class:`~hivemind_ext.monitoring.swarm_state.SwarmState`.

:class:`MetricsPoller` is a background thread; each read goes through the peer runtime's DHT helper
with a deadline. :func:`install_validators` makes the monitor's DHT check the owners' signatures of
what it reads (hivemind's RSASignatureValidator), so no one can write a record in another peer's name.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time

from hivemind_ext.errors import HivemindExtError
from hivemind_ext.monitoring.records import metrics_key, parse_metrics_entries
from hivemind_ext.monitoring.swarm_state import SwarmState
from hivemind_ext.p2p.dht_calls import add_validators
from hivemind_ext.p2p.runtime import PeerRuntime

logger = logging.getLogger(__name__)

_POLL_SECONDS = 0.1  # how often a read in flight checks for shutdown


def install_validators(dht: Any) -> None:
    """Makes ``dht`` refuse records under an owner subkey that its owner did not sign."""
    add_validators(dht, [RSASignatureValidator()])


class MetricsPoller:
    """Reads the metrics records of ``state.run_id`` every ``period`` seconds (each read bounded by
    ``timeout``) and updates ``state``. Acquires the DHT's peer runtime; :meth:`shutdown` releases it."""

    def __init__(self, dht: Any, state: SwarmState, *, period: float = 2.0, timeout: float = 10.0) -> None:
        self.state, self.period, self.timeout = state, float(period), float(timeout)
        self.key = metrics_key(state.run_id)
        self._runtime = PeerRuntime.acquire(dht)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"MetricsPoller({state.run_id})", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def poll_once(self) -> None:
        """One read of the records, now (what the thread does every period)."""
        try:
            found = self._read()
        except (HivemindExtError, concurrent.futures.CancelledError) as e:
            logger.info("reading the metrics of %s failed: %r", self.state.run_id, e)
            self.state.poll_failed()
            return
        entries = []
        if found is not None and isinstance(found.value, dict):
            entries = [(subkey, item.value, item.expiration_time) for subkey, item in found.value.items()]
        now = get_dht_time()
        records, invalid = parse_metrics_entries(entries, now=now)
        if invalid:
            logger.debug("ignored %d malformed metrics records", invalid)
        self.state.update(records, invalid, now)

    def shutdown(self) -> None:
        """Stops the thread (a read in flight is abandoned) and releases the runtime. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(self.timeout + 1)
        self._runtime.release()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.poll_once()
                self._stop.wait(self.period)
        except Exception:  # a bug: say so, and let is_alive() tell
            logger.exception("the metrics poller failed")

    def _read(self) -> Any:
        give_up = time.monotonic() + self.timeout + 1
        read = self._runtime.dht_calls.get(self.key, latest=True, timeout=self.timeout)
        future = self._runtime.submit(read)
        while True:
            try:
                return future.result(timeout=_POLL_SECONDS)
            except HivemindExtError:  # before TimeoutError: DeadlineExceededError is one
                raise
            except concurrent.futures.TimeoutError:
                if self._stop.is_set() or time.monotonic() >= give_up:
                    future.cancel()
                    raise concurrent.futures.CancelledError("the read was abandoned") from None


__all__ = ["MetricsPoller", "install_validators"]
