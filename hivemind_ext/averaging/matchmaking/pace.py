"""The protocol's pace: its poll interval, stretched to how long this peer's DHT reads take.

The protocol counts its windows in poll intervals (:data:`.protocol.HOLD_POLLS`,
:data:`.protocol.HOP_WAIT_POLLS`, :data:`.protocol.SHARD_WAIT_POLLS`, :data:`.protocol.EAGER_POLLS`,
:data:`.timing.SEAL_AHEAD_POLLS`, the margins of a commit time, ...): each is meant as "a few reads
of the board". With the default ``poll_interval`` of 50 ms that holds on a loopback, where a read
takes 5-50 ms; on an internet DHT (0.1-1 s per read) or a saturated machine (64 real peers on two
cores: seconds per read) a window of 10 poll intervals is half a read, so peers move on before
they could see each other: 64 simulated peers in groups of 8, reads and DHT lag of 1 s, fragmented
into groups of 2 and 3, and with 2 s, most found no group within 60 s.

The rule: a peer's *pace* is ``max(poll_interval, R)``, where ``R`` is an upper quantile
(:data:`PACE_QUANTILE`) of its last :data:`PACE_WINDOW` read durations, and never more than
``request_timeout / 4`` (the least number of polls a declaration's lifetime must hold, as
:class:`.group.MatchmakingConfig` requires of ``poll_interval``). The protocol steps on the
configuration :func:`paced` returns, whose ``poll_interval`` is the pace, and the matchmaker
pauses that long between reads: everything counted in poll intervals is counted in reads. When
reads are fast, the pace is ``poll_interval`` and the configuration is the peer's own, so the
protocol behaves exactly as before. A quantile of a window, not a mean: one read that stalled
(a garbage collection, a replica that timed out) among fast ones does not move it, while a DHT
that became slow moves it within a quarter of the window.

Only the pace changes: records, their lifetimes (counted in ``request_timeout``) and the wire
format do not, and peers of one board may run at different paces (each counts its own windows).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace

from hivemind_ext.averaging.matchmaking.group import MatchmakingConfig

PACE_WINDOW = 16  # read durations the estimate looks at (the most recent ones)
PACE_QUANTILE = 0.75  # which quantile of them: one outlier among fast reads does not count


class ReadPace:
    """The recent durations of one peer's DHT reads, and the pace they call for (see the module docstring)."""

    def __init__(self, window: int = PACE_WINDOW, quantile: float = PACE_QUANTILE) -> None:
        if window < 1 or not 0 <= quantile <= 1:
            raise ValueError(f"window must be positive and quantile in [0, 1], got {window}, {quantile}")
        self._durations: deque[float] = deque(maxlen=window)
        self._quantile = quantile

    def record(self, seconds: float) -> None:
        """One read took this long (a read that failed or timed out: as long as it was waited for)."""
        if math.isfinite(seconds):
            self._durations.append(max(0.0, seconds))

    def estimate(self) -> float:
        """How long a read takes: the window's :data:`PACE_QUANTILE` (0 before the first read)."""
        if not self._durations:
            return 0.0
        ordered = sorted(self._durations)
        return ordered[max(0, math.ceil(self._quantile * len(ordered)) - 1)]

    def pace(self, config: MatchmakingConfig) -> float:
        """The poll interval to count in: ``max(poll_interval, estimate)``, at most ``request_timeout / 4``."""
        return pace_for(config, self.estimate())

    def paced(self, config: MatchmakingConfig) -> MatchmakingConfig:
        """``config`` as the protocol steps on it at this pace (see :func:`paced`)."""
        return paced(config, self.estimate())


def pace_for(config: MatchmakingConfig, read_time: float) -> float:
    """The pace of a peer whose reads take ``read_time``: ``max(poll_interval, read_time)``, at most
    ``request_timeout / 4`` (never less than ``poll_interval``)."""
    return max(config.poll_interval, min(read_time, config.request_timeout / 4))


def paced(config: MatchmakingConfig, read_time: float) -> MatchmakingConfig:
    """``config`` with its ``poll_interval`` replaced by the pace for ``read_time`` (:func:`pace_for`);
    ``config`` itself when reads are fast. The one place the pace enters the protocol."""
    pace = pace_for(config, read_time)
    return config if pace <= config.poll_interval else replace(config, poll_interval=pace)
