"""The throughput estimate a peer declares as its bandwidth (hivemind_ext/averaging/allreduce/throughput.py)."""

import math

import pytest

from hivemind_ext.averaging.allreduce.throughput import ThroughputEstimator, receive_rate
from hivemind_ext.averaging.matchmaking.group import MAX_BANDWIDTH, MatchmakingConfig
from hivemind_ext.errors import ConfigurationError

MB = 1_000_000


def test_the_rate_is_the_best_cumulative_rate_since_the_start() -> None:
    # a fast peer: two 1 MB slices from fast groupmates at 0.1 s, then it waits 2 s for a slow one
    fast = [(10.1, MB), (10.1, MB), (12.1, MB), (12.2, MB)]
    assert receive_rate(fast, started=10.0) == pytest.approx(20 * MB)  # 2 MB in 0.1 s, not 4 MB in 2.2 s
    # a late starter finds a small message waiting: a fifth of the round's bytes must be in
    late = [(10.001, MB // 10), *fast]
    assert receive_rate(late, started=10.0) == pytest.approx(21 * MB)
    # a slow link: busy all round at 1 MB/s
    slow = [(11.0, MB), (12.0, MB), (13.0, MB)]
    assert receive_rate(slow, started=10.0) == pytest.approx(MB)


def test_tiny_rounds_are_not_measured() -> None:
    assert receive_rate([(10.5, 100_000)], started=10.0) is None  # too little to tell
    assert receive_rate([(10.0, MB)], started=10.0) is None  # no time to divide by
    assert receive_rate([], started=0.0) is None


def test_the_estimate_is_a_moving_average_in_mbit_per_s() -> None:
    estimator = ThroughputEstimator(smoothing=0.5)
    assert estimator.mbit_per_s is None and estimator.update(None) is None  # nothing measured: the group's mean
    assert estimator.update(1.25 * MB) == pytest.approx(10.0)  # 1.25 MB/s = 10 Mbit/s
    assert estimator.update(2.5 * MB) == pytest.approx(15.0)
    assert estimator.update(2.5 * MB) == pytest.approx(17.5)
    for bad in (None, math.nan, math.inf, -1.0, 0.0):
        assert estimator.update(bad) == pytest.approx(17.5)
    assert estimator.rounds == 3
    for smoothing in (0, 1.5, math.nan, "x"):
        with pytest.raises(ConfigurationError):
            ThroughputEstimator(smoothing=smoothing)


def test_a_measured_rate_is_declared_no_higher_than_the_largest_bandwidth() -> None:
    # the estimate is declared as this peer's bandwidth, which MatchmakingConfig refuses above MAX_BANDWIDTH
    estimator = ThroughputEstimator()
    assert estimator.update(1e300) == MAX_BANDWIDTH
    assert MatchmakingConfig(prefix="run", bandwidth=estimator.mbit_per_s).bandwidth == MAX_BANDWIDTH
