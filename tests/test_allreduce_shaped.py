"""All-reduce over shaped links: four peers with default settings, each a process in its own network
namespace with a thin ``tc tbf`` link (tests/netns.py, tests/netns_averager.py). Skipped only where
this machine cannot create namespaces (CI runs as root and can).

On a thin link one chunk takes longer than ``next_chunk_timeout`` (5 s by default) to cross while
its bytes keep flowing at the link's rate. A fixed per-chunk deadline then cut healthy peers, and the
round reported success with a mean that was not the mean; deadlines now follow progress (an idle
window), so the round must return the exact mean with default settings.
"""

from __future__ import annotations

import pytest
from netns import Link, Topology, unavailable_reason
from netns_averager import AveragerSwarm, round_seconds

from hivemind_ext.averaging.allreduce.api import DEFAULT_NEXT_CHUNK_TIMEOUT

MISSING = unavailable_reason()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"no network namespaces: {MISSING}")

# 4 Mbit/s = 0.5 MB/s per peer and direction. Each peer sends its 1 MiB slice of every other owner's
# part (one chunk each: a part is smaller than the default 2 MiB chunk) over its shared uplink, so each
# chunk takes ~6 s to arrive, longer than the default next_chunk_timeout; the results as long.
RATE_MBIT = 4
NUMEL = 2**20  # float32 per peer: 4 MiB
T_MIN = 2 * 3 / 4 * NUMEL * 4 * 8 / (RATE_MBIT * 1e6)  # the butterfly's limit on this link: 12.6 s


@pytest.mark.timeout(180)
def test_four_peers_on_thin_links_get_the_exact_mean_with_default_settings() -> None:
    config = dict(impl="ours", codec="NoCompression", numel=NUMEL, group_size=4, contributors=[0, 1, 2, 3])
    with Topology([Link(rate_mbit=RATE_MBIT)] * 4, prefix="hxs") as topology:
        with AveragerSwarm(topology, [config] * 4) as swarm:
            results = swarm.run_round()
    for result in results:
        assert result["error"] is None, result["error"]
        assert result["max_error"] < 1e-5, f"peer {result['index']}: not the mean; excluded {result['excluded']}"
        assert result["excluded"] == {}
    seconds = round_seconds(results)
    # the link really was the bottleneck (a chunk took longer than the idle window), and the round ran
    # close to the link's limit rather than waiting for a deadline
    assert DEFAULT_NEXT_CHUNK_TIMEOUT < 0.9 * T_MIN < seconds < 2.0 * T_MIN, seconds
