"""Which path each stream of a round takes: the direct data path, or libp2p streams.

Why: the direct path (:mod:`hivemind_ext.p2p.direct_wire`) exists for CPU: on fast links the libp2p
daemons' copies and encryption cost more than the peers themselves (on loopback the direct path is
2-4x faster). On thin links CPU is idle and the link is the bottleneck, and there the direct path
loses: it opens a fresh TCP connection per stream and round, two per pair of members (one each
way), so a member's uplink carries 2 (N - 1) new flows every round, whose congestion windows start
from nothing and settle on very unequal shares (measured on 100 Mbit/s ``tc tbf`` links, 4 peers:
BBR estimates of 9 to 320 Mbit/s among one peer's six flows a second into a round), and the
butterfly waits for its slowest stream. libp2p keeps one long-lived connection per pair and
multiplexes every stream over it. Measured (benchmarks/RESULTS.md, session 8): 16 MiB per peer over
100 Mbit/s links, 512 KiB chunks, 1.16x t_min over libp2p against 1.32-1.55x over the direct path
(neither larger socket buffers nor another congestion control closed the gap).

So a stream goes over the direct path unless its sender or its owner declared a link thinner than
:data:`DIRECT_PATH_MIN_MBIT`; a member that declared nothing (every peer's first round) counts as
fast. The choice is the sender's (it opens the stream), from the member list every member shares.
"""

from __future__ import annotations

from hivemind_ext.averaging.matchmaking.group import Member

# Below this declared bandwidth the link, not the CPU, bounds a round. Measured bandwidths are of the
# bytes on the wire: a 100 Mbit/s link measures 75-95; four peers on loopback measure 1-2 Gbit/s
# without compression and 300-450 Mbit/s with 8-bit (CPU-bound, at load 6), which stays above it.
DIRECT_PATH_MIN_MBIT = 150.0


def direct_path_pays(sender: Member, owner: Member) -> bool:
    """Whether the stream from ``sender`` to ``owner`` should use the direct path (where it is on)."""
    return all(member.bandwidth is None or member.bandwidth >= DIRECT_PATH_MIN_MBIT for member in (sender, owner))
