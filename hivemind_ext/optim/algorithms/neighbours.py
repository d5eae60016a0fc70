"""Neighbours for decentralized algorithms: who they are (a pure choice) and how they are found (DHT).

Peers of one run and model register under one DHT key (subkey: their peer id, refreshed with an
expiration). Each peer chooses its neighbours on a ring of the sorted peer ids: the ``count``
peers that follow it (wrapping around), skipping itself, current neighbours and excluded (dead)
peers. The choice is made once and kept for the run; a neighbour is replaced only when it fails.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from hivemind.utils import get_dht_time

from hivemind_ext.errors import HivemindExtError
from hivemind_ext.p2p.runtime import PeerRuntime

logger = logging.getLogger(__name__)

MAX_REGISTERED = 4096  # a registry read may list at most this many peers (the rest are ignored)


def choose_neighbours(
    me: str, live: Iterable[str], count: int, *, current: Sequence[str] = (), exclude: Iterable[str] = ()
) -> list[str]:
    """``current`` plus new neighbours, up to ``count`` in total: the live peers that follow ``me`` on the
    ring of sorted peer ids, skipping ``me``, ``current`` and ``exclude``. Pure (tested directly)."""
    excluded = set(exclude) | {me} | set(current)
    ring = sorted(set(live) | {me})
    start = ring.index(me)
    chosen = list(current)
    for offset in range(1, len(ring)):
        if len(chosen) >= count:
            break
        candidate = ring[(start + offset) % len(ring)]
        if candidate not in excluded:
            chosen.append(candidate)
    return chosen


class NeighbourRegistry:
    """Registers this peer under ``key`` and lists the other registered peers (blocking DHT calls
    through the peer runtime's DHT helper, each within ``timeout``; call from a worker thread, not
    the event loop). A failed call is skipped: registering is retried at the next call, and a failed
    read lists nobody."""

    def __init__(
        self, runtime: PeerRuntime, key: str, peer_id: str, *, expiration: float = 30.0, timeout: float = 5.0
    ) -> None:
        self.runtime, self.key, self.peer_id = runtime, key, peer_id
        self.expiration, self.timeout = expiration, timeout
        self._registered_until = 0.0

    def register(self, force: bool = False) -> None:
        now = get_dht_time()
        if not force and now < self._registered_until - self.expiration / 2:
            return
        try:
            store = self.runtime.dht_calls.store(
                self.key, now, now + self.expiration, subkey=self.peer_id, timeout=self.timeout
            )
            if self.runtime.run(store, timeout=self.timeout + 1):
                self._registered_until = now + self.expiration
        except HivemindExtError as e:  # a DHT hiccup: try again at the next call
            logger.debug(f"could not register as a neighbour under {self.key}: {e!r}")

    def live_peers(self) -> list[str]:
        try:
            found = self.runtime.run(
                self.runtime.dht_calls.get(self.key, timeout=self.timeout), timeout=self.timeout + 1
            )
        except HivemindExtError as e:
            logger.debug(f"could not read the neighbour registry {self.key}: {e!r}")
            return []
        if found is None or not isinstance(found.value, dict):
            return []
        peers = [str(subkey) for subkey in list(found.value)[:MAX_REGISTERED] if _is_peer_id(subkey)]
        return [p for p in peers if p != self.peer_id]


def _is_peer_id(subkey: Any) -> bool:
    return isinstance(subkey, str) and 20 <= len(subkey) <= 128 and subkey.isalnum()
