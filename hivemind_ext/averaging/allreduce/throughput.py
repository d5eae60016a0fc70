"""How fast this peer's link is, learned from its own all-reduce rounds: the bandwidth it declares
in matchmaking (in Mbit/s) when the user did not pass ``bandwidth=``, so that part sizes follow the
links the group actually has (:mod:`.partition`).

A round's rate is read off the bytes this member *received*, as each message completed
(:class:`ReceiveLog`): a message is counted once it is off the network, whereas a sent message is
counted when it is handed to a socket buffer that may hold megabytes. The whole round's average
would not do: a fast peer that waits for a slow one would measure the slow one's rate (in an even
split every member moves the same bytes in the same round time). :func:`receive_rate` is the best
cumulative rate since the round started, max over arrivals t of (bytes received by t) / (t - start),
taken over the arrivals by which at least :data:`MIN_FRACTION` of the round's bytes were in. Every
byte counted by t crossed the link between the start and t, so each figure is a lower bound of the
link's download capacity, except for bytes that crossed before this member started (a member that
starts late finds what its groupmates sent meanwhile waiting in its buffers, up to the start
skew's worth of its link's rate): requiring a fifth of the round's bytes keeps those few. A fast
peer gets its slices from the other fast peers early, at its link's rate (they are at least a fifth
of what it receives in a group of four with one slow peer, whichever the split); a slow link is
busy all round and measures about its bandwidth. Latency and pipeline stalls make every figure a
little low, which matters little: part sizes depend on the ratios. It measures the download side;
the model of :mod:`.partition` takes one bandwidth per link, both ways (asymmetric links are seen
by their download).

:class:`ThroughputEstimator` keeps an exponential moving average of these rates over recent rounds,
so that one round's noise (a late start, a busy CPU) moves the declared bandwidth only part of the
way. Before its first measured round a peer declares no bandwidth, which the
group reads as its mean (an even split when nobody knows yet). Rounds that received too little to
tell (small tensors) are not counted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hivemind_ext.averaging.matchmaking.group import MAX_BANDWIDTH
from hivemind_ext.errors import ConfigurationError
from hivemind_ext.p2p import now

MIN_MEASURED_BYTES = 1 << 18  # rounds that received less say more about latency than about the link
MIN_MEASURED_SECONDS = 0.001  # arrivals closer to the start than this are not divided by
MIN_FRACTION = 0.2  # the rate is taken over arrivals by which this share of the round's bytes was in
DEFAULT_SMOOTHING = 0.5  # weight of the newest round in the moving average
BITS_PER_MEGABIT = 1e6


class ReceiveLog:
    """When one round's received payload bytes came off the network: (loop time, bytes) per message.

    Behind the round's ``traffic.received`` counter (``traffic.received += n`` logs an arrival, see
    :class:`~hivemind_ext.averaging.allreduce.round_state.Traffic`).
    """

    def __init__(self) -> None:
        self.total = 0
        self.arrivals: list[tuple[float, int]] = []

    def add(self, nbytes: int) -> None:
        self.total += nbytes
        if nbytes > 0:
            self.arrivals.append((now(), nbytes))


def receive_rate(
    arrivals: Sequence[tuple[float, int]],
    started: float,
    *,
    min_bytes: int = MIN_MEASURED_BYTES,
    min_seconds: float = MIN_MEASURED_SECONDS,
) -> float | None:
    """This member's download rate in one round, in bytes/s: the best ``bytes received by t / (t - started)``
    over the arrival times t at least ``min_seconds`` after the start by which :data:`MIN_FRACTION` of
    the round's bytes were in (see the module docstring); None if the round received fewer than
    ``min_bytes``."""
    total = sum(nbytes for _, nbytes in arrivals)
    if total < min_bytes:
        return None
    best, received = None, 0
    for time, nbytes in sorted(arrivals):
        received += nbytes
        elapsed = time - started
        if elapsed >= min_seconds and received >= MIN_FRACTION * total:
            rate = received / elapsed
            best = rate if best is None else max(best, rate)
    return best


class ThroughputEstimator:
    """This peer's throughput in Mbit/s (the unit ``bandwidth`` is declared in): a moving average of
    its measured rates.

    :param smoothing: weight of the newest round, in (0, 1]; 1 keeps only the last round
    """

    def __init__(self, smoothing: float = DEFAULT_SMOOTHING) -> None:
        if not (isinstance(smoothing, int | float) and 0 < smoothing <= 1):
            raise ConfigurationError(f"smoothing must be in (0, 1], got {smoothing!r}")
        self.smoothing = float(smoothing)
        self.mbit_per_s: float | None = None  # None until a round was measured
        self.rounds = 0

    def update(self, bytes_per_s: float | None) -> float | None:
        """Folds one round's rate (None: the round could not tell) into the estimate; returns it."""
        if bytes_per_s is None or not math.isfinite(bytes_per_s) or bytes_per_s <= 0:
            return self.mbit_per_s
        # capped: it is declared as this peer's bandwidth, which may not exceed MAX_BANDWIDTH
        sample = min(bytes_per_s * 8 / BITS_PER_MEGABIT, MAX_BANDWIDTH)
        if self.mbit_per_s is None:
            self.mbit_per_s = sample
        else:
            self.mbit_per_s += self.smoothing * (sample - self.mbit_per_s)
        self.rounds += 1
        return self.mbit_per_s
