"""Counters of one peer's averaging rounds: how many finished or failed, how long the last one took,
how many bytes they moved. Every averager of a peer (gradients, state, an auxiliary peer's, an
algorithm's) adds to the same :class:`RoundStats`, the one of its :class:`~hivemind_ext.p2p.runtime.PeerRuntime`
(:func:`round_stats_of`), so whoever reports the peer's metrics reads one place.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from dataclasses import dataclass

from hivemind_ext.p2p.runtime import PeerRuntime


@dataclass(frozen=True)
class RoundCounts:
    """A consistent copy of the counters.

    :param rounds_ok: averaging steps that ended with a result
    :param rounds_failed: steps that ended with an error (no group, an all-reduce that failed, a
      deadline); steps cancelled by their owner are not counted
    :param last_round_seconds: how long the all-reduce of the last round that began one took (None: none yet)
    :param last_round_ok: whether the last step that ended succeeded (None: none yet)
    :param bytes_sent / bytes_received: all-reduce payload bytes, all rounds together
    :param board_reads / board_bytes_read: matchmaking reads of the DHT and the records' bytes they
      returned (signed subkeys and msgpack values), all rounds together: what a poll costs
    """

    rounds_ok: int = 0
    rounds_failed: int = 0
    last_round_seconds: float | None = None
    last_round_ok: bool | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    board_reads: int = 0
    board_bytes_read: int = 0


class RoundStats:
    """Thread-safe counters; averagers add to them from the runtime's loop, readers copy them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = RoundCounts()

    def record_allreduce(self, *, seconds: float, bytes_sent: int, bytes_received: int) -> None:
        with self._lock:
            counts = self._counts
            self._counts = dataclasses.replace(
                counts,
                last_round_seconds=float(seconds),
                bytes_sent=counts.bytes_sent + int(bytes_sent),
                bytes_received=counts.bytes_received + int(bytes_received),
            )

    def record_result(self, ok: bool) -> None:
        with self._lock:
            counts = self._counts
            self._counts = dataclasses.replace(
                counts,
                rounds_ok=counts.rounds_ok + int(ok),
                rounds_failed=counts.rounds_failed + int(not ok),
                last_round_ok=ok,
            )

    def record_board_read(self, num_bytes: int) -> None:
        """One matchmaking read of the DHT that returned ``num_bytes`` of records."""
        with self._lock:
            counts = self._counts
            self._counts = dataclasses.replace(
                counts, board_reads=counts.board_reads + 1, board_bytes_read=counts.board_bytes_read + int(num_bytes)
            )

    def snapshot(self) -> RoundCounts:
        return self._counts  # immutable: replaced whole under the lock


_STATS: weakref.WeakKeyDictionary[PeerRuntime, RoundStats] = weakref.WeakKeyDictionary()
_STATS_LOCK = threading.Lock()


def round_stats_of(runtime: PeerRuntime) -> RoundStats:
    """The counters shared by every averager running on ``runtime`` (made on first use)."""
    with _STATS_LOCK:
        stats = _STATS.get(runtime)
        if stats is None:
            stats = _STATS[runtime] = RoundStats()
        return stats


__all__ = ["RoundCounts", "RoundStats", "round_stats_of"]
