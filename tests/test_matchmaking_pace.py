"""The protocol's pace (hivemind_ext.averaging.matchmaking.pace): the poll interval stretched to
the time DHT reads take, and what it does to a swarm whose reads are slow (simulated)."""

from __future__ import annotations

import math

import pytest
from matchmaking_builders import config

from hivemind_ext.averaging.matchmaking.pace import PACE_WINDOW, ReadPace, pace_for, paced
from hivemind_ext.averaging.matchmaking.rotation import initial_digits
from hivemind_ext.averaging.matchmaking.simulation import simulate_round, simulated_peer_id

CFG = config(request_timeout=3.0, poll_interval=0.05)


def test_fast_reads_keep_the_configured_poll_interval_and_configuration() -> None:
    reads = ReadPace()
    assert reads.pace(CFG) == CFG.poll_interval and reads.paced(CFG) is CFG  # nothing read yet
    for _ in range(3 * PACE_WINDOW):
        reads.record(0.01)
    assert reads.pace(CFG) == CFG.poll_interval
    assert reads.paced(CFG) is CFG  # the very same configuration: the protocol runs as before


def test_slow_reads_set_the_pace_and_only_the_poll_interval_changes() -> None:
    reads = ReadPace()
    for _ in range(PACE_WINDOW):
        reads.record(0.4)
    assert reads.pace(CFG) == pytest.approx(0.4)
    slow = reads.paced(CFG)
    assert slow.poll_interval == pytest.approx(0.4)
    assert slow.group_key == CFG.group_key and slow.request_timeout == CFG.request_timeout
    assert {**vars(slow), "poll_interval": CFG.poll_interval} == vars(CFG)


def test_the_pace_follows_reads_that_slow_down_and_speed_up_again() -> None:
    reads = ReadPace()
    for _ in range(PACE_WINDOW):
        reads.record(0.01)
    for _ in range(PACE_WINDOW // 4 + 1):  # a quarter of the window and one: the slow reads count
        reads.record(0.6)
    assert reads.pace(CFG) == pytest.approx(0.6)
    for _ in range(PACE_WINDOW):
        reads.record(0.02)
    assert reads.pace(CFG) == CFG.poll_interval


def test_one_outlier_does_not_move_the_pace_and_it_stays_bounded() -> None:
    reads = ReadPace()
    for _ in range(PACE_WINDOW - 1):
        reads.record(0.01)
    reads.record(30.0)  # one read that stalled (a replica timed out)
    assert reads.pace(CFG) == CFG.poll_interval
    reads = ReadPace()
    for _ in range(PACE_WINDOW - 1):
        reads.record(0.3)
    reads.record(30.0)
    assert reads.pace(CFG) == pytest.approx(0.3)
    for _ in range(PACE_WINDOW):
        reads.record(30.0)  # a DHT that hardly answers: never past request_timeout / 4
    assert reads.pace(CFG) == CFG.request_timeout / 4
    reads.paced(CFG)  # a valid configuration (poll_interval at most request_timeout / 4)
    reads.record(math.nan)
    reads.record(math.inf)
    assert reads.pace(CFG) == CFG.request_timeout / 4


def test_pace_for_is_max_of_poll_interval_and_read_time_capped() -> None:
    assert pace_for(CFG, 0.0) == CFG.poll_interval
    assert pace_for(CFG, 0.2) == pytest.approx(0.2)
    assert pace_for(CFG, 5.0) == CFG.request_timeout / 4
    assert paced(CFG, 0.01) is CFG


def _slow_round(seed: int):
    # the brief's 64 peers in groups of 8 on a DHT whose reads take up to 2 s and lag up to 2 s
    cfg = config(target_group_size=8, min_matchmaking_time=15.0, request_timeout=15.0)
    coordinates = {p: initial_digits(p, 8) for p in map(simulated_peer_id, range(64))}
    return simulate_round(
        coordinates, cfg, swarm_size=64, seed=seed, max_lag=2.0, spread=0.5, scheduled_time=15.0, read_time=2.0
    )


@pytest.mark.parametrize("seed", range(6))
def test_a_swarm_whose_reads_take_seconds_groups_without_pairs_and_in_time(seed: int) -> None:
    """Counted in 50 ms poll intervals, the protocol's windows were over before a read came back:
    64 simulated peers in groups of 8 with 2 s reads and lag (min_matchmaking_time 15 s) left groups
    of 2 behind and found the last group 24-32 s in (seeds 0-11). At the pace of their reads they
    form the shards' groups as fast reads do, the last by 16-23 s."""
    result = _slow_round(seed)
    sizes = sorted({g.group_id: g.size for g in result.groups.values()}.values())
    assert min(sizes) >= 3, sizes
    assert len(result.ungrouped) <= 1  # known gap: a stray that reaches the prefix's board after its groups committed
    assert max(result.found_at.values()) <= 25.0
