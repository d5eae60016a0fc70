"""Idle things (connections) kept per key (a peer) and in all, with both bounds: :class:`BoundedIdle`.

Both ends of a reused direct connection keep its idle connections this way (the caller in
:class:`~hivemind_ext.p2p.direct_client.DirectConnector`, the server in
:class:`~hivemind_ext.p2p.direct_server.DirectListener`): adding one beyond either bound drops the
oldest idle one (of that key, or of anyone), so no key holds more than its share however many it
made, and all keys together hold at most ``max_total``.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V", bound=Hashable)


class BoundedIdle(Generic[K, V]):
    """Values (each held once) under keys, oldest first, at most ``max_per_key`` per key and
    ``max_total`` in all. ``on_drop(key, value)`` is called for each value dropped (by a bound,
    :meth:`drop` or :meth:`drop_all`), never for one taken (:meth:`take`) or :meth:`discard`-ed:
    those are the caller's again."""

    def __init__(self, max_per_key: int, max_total: int, on_drop: Callable[[K, V], Any]) -> None:
        self.max_per_key, self.max_total, self._on_drop = max_per_key, max_total, on_drop
        self._keys: collections.OrderedDict[V, K] = collections.OrderedDict()  # value -> its key, oldest first
        self._per_key: dict[K, collections.OrderedDict[V, None]] = {}  # key -> its values, oldest first

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, value: object) -> bool:
        return value in self._keys

    def count(self, key: K) -> int:
        values = self._per_key.get(key)
        return len(values) if values is not None else 0

    def add(self, key: K, value: V) -> bool:
        """Keeps ``value`` under ``key`` (the newest), dropping the oldest of ``key``, then the oldest
        of all, where a bound is reached. Returns False (having dropped ``value`` itself) if a bound
        is 0."""
        if self.max_per_key < 1 or self.max_total < 1:
            self._on_drop(key, value)
            return False
        if self.count(key) >= self.max_per_key:
            self.drop(next(iter(self._per_key[key])))
        if len(self._keys) >= self.max_total:
            self.drop(next(iter(self._keys)))
        self._keys[value] = key
        self._per_key.setdefault(key, collections.OrderedDict())[value] = None
        return True

    def take(self, key: K) -> V | None:
        """The newest value of ``key``, no longer kept (not dropped: the caller owns it); None if none."""
        values = self._per_key.get(key)
        if not values:
            return None
        value = next(reversed(values))
        self.discard(value)
        return value

    def discard(self, value: V) -> bool:
        """Stops keeping ``value`` (without dropping it); whether it was kept."""
        if value not in self._keys:
            return False
        key = self._keys.pop(value)
        values = self._per_key[key]
        del values[value]
        if not values:
            del self._per_key[key]
        return True

    def drop(self, value: V) -> None:
        """Stops keeping ``value`` and drops it (``on_drop``), if it was kept."""
        if value in self._keys:
            key = self._keys[value]
            self.discard(value)
            self._on_drop(key, value)

    def drop_all(self) -> None:
        for value in list(self._keys):
            self.drop(value)
