"""The peers this peer has recently seen on its matchmaking board (declared, sealed into or
committed to a group): the swarm members that the all-reduce's admission gives reserved slots to
(see :mod:`hivemind_ext.averaging.allreduce.admission`).

What the board says is not authenticated (a peer may declare itself; issue 12, item 5 signs the
records): being listed only buys a requester the member pool's per-peer share, never more.
"""

from __future__ import annotations

import collections

from hivemind.p2p import PeerID

from hivemind_ext.averaging.matchmaking.group import Board

DEFAULT_TTL = 600.0  # a peer stays listed this long after it was last seen on the board
MAX_LISTED = 4096  # the least recently seen are forgotten beyond this many


class ListedPeers:
    """Base58 peer ids seen on the board, with when they were last seen (on any monotonic clock)."""

    def __init__(self, ttl: float = DEFAULT_TTL, max_peers: int = MAX_LISTED) -> None:
        self.ttl, self.max_peers = ttl, max_peers
        self._seen: collections.OrderedDict[str, float] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def update(self, board: Board, now: float) -> None:
        names = {peer for peer, _ in board.declarations}
        names.update(peer for commit in board.commits.values() for peer, _ in commit.members)
        names.update(member.peer_id for group in board.sealed.values() for member in group.members)
        for name in names:
            self._seen.pop(name, None)
            self._seen[name] = now
        while len(self._seen) > self.max_peers:
            self._seen.popitem(last=False)

    def lists(self, peer: PeerID | str, now: float) -> bool:
        name = peer if isinstance(peer, str) else peer.to_base58()
        seen = self._seen.get(name)
        return seen is not None and now - seen <= self.ttl
