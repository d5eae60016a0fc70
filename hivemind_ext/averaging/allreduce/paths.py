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

Except for small slices: a stream that carries at most :data:`SMALL_SLICE_BYTES` of values takes the
direct path whatever the links. The argument above is about transfers long enough to be bound by
the link; a slice that a 150 Mbit/s link moves in a few tens of ms is bound by latency and CPU on
either path, and there the direct path saves the daemons' work and (since direct connections are
reused across rounds) the libp2p stream set-up. It also keeps small rounds off libp2p for a reason
that is no link at all: a declared bandwidth is, without ``bandwidth=``, the rate measured in the
peer's own rounds (:mod:`.throughput`), a lower bound that a short round holds far below the link.
Measured with benchmarks/scale.py's one group of 8 peers with 256 KiB each (session 17): every peer
measured ~20 Mbit/s on loopback after its first round, so every later round ran all 56 streams
over libp2p (13-34 ms median, up to 90 ms, to open a stream through the daemons) instead of
reusing the direct connections the first round had opened.
"""

from __future__ import annotations

from hivemind_ext.averaging.matchmaking.group import Member

# Below this declared bandwidth the link, not the CPU, bounds a round. Measured bandwidths are of the
# bytes on the wire: a 100 Mbit/s link measures 75-95; four peers on loopback measure 1-2 Gbit/s
# without compression and 300-450 Mbit/s with 8-bit (CPU-bound, at load 6), which stays above it.
DIRECT_PATH_MIN_MBIT = 150.0
# A stream that carries at most this many bytes of values takes the direct path whatever the links
# (56 ms at DIRECT_PATH_MIN_MBIT; not measured on thin links: a bound on what the argument above covers)
SMALL_SLICE_BYTES = 1 << 20


def direct_path_pays(sender: Member, owner: Member, slice_bytes: int | None = None) -> bool:
    """Whether the stream from ``sender`` to ``owner`` should use the direct path (where it is on);
    ``slice_bytes``: the bytes of values it carries (the sender's slice of the owner's part)."""
    if slice_bytes is not None and slice_bytes <= SMALL_SLICE_BYTES:
        return True
    return all(member.bandwidth is None or member.bandwidth >= DIRECT_PATH_MIN_MBIT for member in (sender, owner))
