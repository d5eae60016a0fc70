"""Neighbours for decentralized algorithms: who they are (a pure choice) and how they are found (DHT).

Peers of one run and model register under one DHT key, each under its signed subkey
``neighbour@<peer id>[owner:<public key>]`` (:mod:`hivemind_ext.p2p.signing`), refreshed with an
expiration: nobody can overwrite or hide another peer's registration, DHT nodes refuse unsigned
entries under the key, and readers take one registration per key, for the peer id that key is
trusted to speak for. A registration only says whom to ask: the neighbour a peer then subscribes to
is authenticated by libp2p, and one that does not answer is replaced.

Each peer chooses its neighbours on a ring of the sorted peer ids: the ``count`` peers that follow
it (wrapping around), skipping itself, current neighbours and excluded (dead) peers. The choice is
made once and kept for the run; a neighbour is replaced only when it fails.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from hivemind_ext.errors import HivemindExtError
from hivemind_ext.p2p.runtime import PeerRuntime
from hivemind_ext.p2p.signing import OwnerBook, believed_records, install_signing, owner_marker, signed_subkey

logger = logging.getLogger(__name__)

MAX_REGISTERED = 4096  # a registry read may list at most this many peers (the rest are ignored)
NEIGHBOUR_TAG = "neighbour"


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
    read lists nobody. Registrations are signed with ``signing_key`` (the key this peer's DHT signs
    its other records with); ``rejected`` counts the entries a read skipped (unsigned, malformed,
    expired, or under a key that does not speak for their peer id)."""

    def __init__(
        self,
        runtime: PeerRuntime,
        key: str,
        peer_id: str,
        *,
        signing_key: RSAPrivateKey,
        expiration: float = 30.0,
        timeout: float = 5.0,
    ) -> None:
        self.runtime, self.key, self.peer_id = runtime, key, peer_id
        self.expiration, self.timeout = expiration, timeout
        self._signing_key, self._owner = signing_key, owner_marker(signing_key)
        self._book = OwnerBook(own=(peer_id, self._owner))
        self._signing = False  # whether the DHT signs with the key and protects ``key`` yet
        self._registered_until = 0.0

    @property
    def rejected(self) -> int:
        return self._book.rejected

    def register(self, force: bool = False) -> None:
        now = get_dht_time()
        if not force and now < self._registered_until - self.expiration / 2:
            return
        try:
            self._install_signing()
            subkey = signed_subkey(NEIGHBOUR_TAG, self.peer_id, self._owner)
            store = self.runtime.dht_calls.store(
                self.key, now, now + self.expiration, subkey=subkey, timeout=self.timeout
            )
            if self.runtime.run(store, timeout=self.timeout + 1):
                self._registered_until = now + self.expiration
        except HivemindExtError as e:  # a DHT hiccup: try again at the next call
            logger.debug(f"could not register as a neighbour under {self.key}: {e!r}")

    def live_peers(self) -> list[str]:
        try:
            self._install_signing()  # a reader's DHT needs the signature validator to strip signatures
            found = self.runtime.run(
                self.runtime.dht_calls.get(self.key, timeout=self.timeout), timeout=self.timeout + 1
            )
        except HivemindExtError as e:
            logger.debug(f"could not read the neighbour registry {self.key}: {e!r}")
            return []
        if found is None or not isinstance(found.value, dict):
            return []
        entries = [
            (subkey, getattr(item, "value", None), getattr(item, "expiration_time", None))
            for subkey, item in list(found.value.items())[:MAX_REGISTERED]
        ]
        peers = believed_records(entries, NEIGHBOUR_TAG, self._book, get_dht_time())
        return [p for p in peers if p != self.peer_id]

    def _install_signing(self) -> None:
        """Once: makes the DHT sign with this peer's key and refuse unsigned entries under ``key``.
        :raises ConfigurationError: the DHT signs with another key (see :func:`install_signing`)."""
        if self._signing:
            return
        install = install_signing(
            self.runtime.dht_calls, self._signing_key, protected_keys=(self.key,), timeout=self.timeout
        )
        self.runtime.run(install, timeout=self.timeout + 1)
        self._signing = True
