"""Parts follow measured bandwidth: three peers in network namespaces, one of them throttled with
``tc tbf``. Nobody passes ``bandwidth=``: the first round splits evenly (nothing measured yet); each
peer then declares the throughput it measured, and the throttled peer's part shrinks - to nothing
here, which is optimal at this ratio (see ``partition.optimal_fractions``) - while the mean stays
exact and the round does not wait on the member that owns nothing."""

from __future__ import annotations

import pytest
from netns import Link, Topology, unavailable_reason
from netns_averager import AveragerSwarm, round_seconds

MISSING = unavailable_reason()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"no network namespaces: {MISSING}")

# 384 KiB of float32 per peer: a round receives enough to measure (256 KiB), in ~2 s at 2 Mbit/s, a rate
# far below what the unshaped peers reach even on a loaded 2-core machine
NUMEL = 3 * 2**15


@pytest.mark.timeout(120)
def test_a_throttled_peer_gets_a_smaller_part_after_a_measured_round():
    links = [Link(rate_mbit=2), Link(rate_mbit=None), Link(rate_mbit=None)]
    config = dict(impl="ours", codec="NoCompression", numel=NUMEL, group_size=3, contributors=[0, 1, 2])
    with Topology(links, prefix="hxbw") as topology, AveragerSwarm(topology, [config] * 3) as swarm:
        first = swarm.run_round()
        second = swarm.run_round()
    for results in (first, second):
        for result in results:
            assert result["error"] is None and result["excluded"] == {}
            assert result["max_error"] < 1e-5  # the exact mean, with every member's contribution
    slow = first[0]["peer_id"]
    assert all(r["declared_bandwidth"] is None for r in first)  # nothing measured yet: the group's mean
    assert first[0]["part_sizes"][slow] in (NUMEL // 3, NUMEL // 3 + 1)  # an even split
    fast_rates = [r["receive_rate"] for r in first[1:]]
    assert first[0]["receive_rate"] < 0.6 * min(fast_rates)  # 250 kB/s against a bridge's speed
    assert 0.5 < second[0]["declared_bandwidth"] < min(r["declared_bandwidth"] for r in second[1:])  # Mbit/s
    # 1 x S / B_slow exceeds (1 + f) x S / B_fast for any f once B_fast > 1.5 B_slow: no part at all
    assert second[0]["part_sizes"][slow] == 0
    assert {tuple(sorted(r["part_sizes"].items())) for r in second} == {tuple(sorted(second[0]["part_sizes"].items()))}
    # the member that owns nothing holds nobody up: no 5 s wait for a JOIN, no timeout
    assert round_seconds(second) < 4.0
