"""What a monitor knows about a run: the peers' latest metrics records, a short history of swarm-wide
summaries, and how many malformed records it has read.

:func:`summarize` is a pure function of the records; :class:`SwarmState` is the thread-safe store
that the poller writes into and the web server and the Prometheus collector read.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hivemind_ext.monitoring.records import ROLES, PeerMetrics


@dataclass(frozen=True)
class SwarmSummary:
    """The swarm at one poll, from the records of the peers that report metrics.

    :param epoch: the highest epoch reported (None: no peer reports)
    :param samples_per_second: the peers' speeds added up
    :param loss: the mean of the losses the peers reported (None: none did)
    :param peers: how many peers of each role (``trainer``, ``client``, ``aux``) report
    :param rounds_ok / rounds_failed: the peers' averaging steps since they started, added up
    :param last_round_seconds: the mean of the peers' last all-reduce durations (None: none yet)
    :param bytes_sent / bytes_received: the peers' all-reduce traffic since they started, added up
    """

    time: float
    epoch: int | None
    samples_per_second: float
    loss: float | None
    peers: dict[str, int]
    rounds_ok: int
    rounds_failed: int
    last_round_seconds: float | None
    bytes_sent: int
    bytes_received: int


def summarize(records: Sequence[PeerMetrics], now: float) -> SwarmSummary:
    losses = [record.loss for record in records if record.loss is not None]
    durations = [record.last_round_seconds for record in records if record.last_round_seconds is not None]
    return SwarmSummary(
        time=now,
        epoch=max((record.epoch for record in records), default=None),
        samples_per_second=sum(record.samples_per_second for record in records),
        loss=sum(losses) / len(losses) if losses else None,
        peers={role: sum(1 for record in records if record.role == role) for role in ROLES},
        rounds_ok=sum(record.rounds_ok for record in records),
        rounds_failed=sum(record.rounds_failed for record in records),
        last_round_seconds=sum(durations) / len(durations) if durations else None,
        bytes_sent=sum(record.bytes_sent for record in records),
        bytes_received=sum(record.bytes_received for record in records),
    )


class SwarmState:
    """The monitor's view of a run; every method is thread-safe.

    :param history: how many summaries to keep (one per poll)
    """

    def __init__(self, run_id: str, *, history: int = 600) -> None:
        self.run_id = run_id
        self._lock = threading.Lock()
        self._records: list[PeerMetrics] = []
        self._history: deque[SwarmSummary] = deque(maxlen=history)
        self._polls = self._failed_polls = 0
        self._invalid_last = self._invalid_total = 0

    def update(self, records: Sequence[PeerMetrics], invalid: int, now: float) -> SwarmSummary:
        """One successful poll: the valid records it read and how many entries were malformed."""
        summary = summarize(records, now)
        with self._lock:
            self._records = list(records)
            self._history.append(summary)
            self._polls += 1
            self._invalid_last = invalid
            self._invalid_total += invalid
        return summary

    def poll_failed(self) -> None:
        with self._lock:
            self._failed_polls += 1

    @property
    def records(self) -> list[PeerMetrics]:
        with self._lock:
            return list(self._records)

    @property
    def latest(self) -> SwarmSummary | None:
        with self._lock:
            return self._history[-1] if self._history else None

    def counters(self) -> dict[str, int]:
        """Polls done and failed, malformed records in the last poll and in all of them."""
        with self._lock:
            return {
                "polls": self._polls,
                "failed_polls": self._failed_polls,
                "invalid_records": self._invalid_last,
                "invalid_records_total": self._invalid_total,
            }

    def to_json(self) -> dict[str, Any]:
        """Everything the dashboard shows, as plain JSON-able data."""
        with self._lock:
            history = [dataclasses.asdict(summary) for summary in self._history]
            records = [dataclasses.asdict(record) for record in self._records]
        return {
            "run_id": self.run_id,
            **self.counters(),
            "latest": history[-1] if history else None,
            "history": history,
            "peers": records,
        }


__all__ = ["SwarmState", "SwarmSummary", "summarize"]
