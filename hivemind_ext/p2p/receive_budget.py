"""How many bytes the framing layer holds for payloads that are still arriving, per peer and in all.

A frame announces its payload's size before sending it, so a peer that announces a large payload
and then sends nothing must cost nothing: :mod:`~hivemind_ext.p2p.framing` allocates a payload's
buffer as its bytes arrive (see ``EAGER_PAYLOAD_BYTES`` there) and charges every byte it allocates
to the stream's :class:`ReceiveAccount` until the frame is complete (then the buffer belongs to the
receiver) or fails (then it is dropped). A server keeps one :class:`ReceiveBudget` shared by every
incoming stream: a peer may hold at most ``max_bytes_per_peer`` in incomplete payloads, except that
its first payload in flight is always admitted (up to the handler's own size limit), so one honest
large transfer is never refused while a flood of parallel ones is.

:func:`receiving_bytes` is the process-wide total, for tests and monitoring.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Hashable

from hivemind_ext.errors import ConfigurationError, MessageTooLargeError

DEFAULT_MAX_BYTES_PER_PEER = 256 * 1024 * 1024

_total_lock = threading.Lock()
_total = 0  # bytes held by incomplete payloads in this process (several event loops may share it)


def receiving_bytes() -> int:
    """Bytes this process holds, right now, in buffers of payloads that have not fully arrived."""
    return _total


def _add_total(nbytes: int) -> None:
    global _total
    with _total_lock:
        _total += nbytes


class ReceiveBudget:
    """Bytes of incomplete payloads held per peer, capped at ``max_bytes_per_peer`` (see the module)."""

    def __init__(self, max_bytes_per_peer: int = DEFAULT_MAX_BYTES_PER_PEER) -> None:
        if type(max_bytes_per_peer) is not int or max_bytes_per_peer < 1:
            raise ConfigurationError(f"max_bytes_per_peer must be a positive int, got {max_bytes_per_peer!r}")
        self.max_bytes_per_peer = max_bytes_per_peer
        self._held: collections.Counter[Hashable] = collections.Counter()
        self._lock = threading.Lock()

    def held_bytes(self, peer: Hashable) -> int:
        return self._held.get(peer, 0)

    def account(self, peer: Hashable) -> ReceiveAccount:
        """The account of one stream from ``peer``."""
        return ReceiveAccount(self, peer)

    def _charge(self, peer: Hashable, nbytes: int, already: int) -> None:
        with self._lock:
            held = self._held[peer]
            # ``already``: this stream's own bytes. A peer's only payload in flight is always admitted.
            if held + nbytes > self.max_bytes_per_peer and held > already:
                raise MessageTooLargeError(
                    f"the peer already has {held} bytes of payloads in flight here (limit {self.max_bytes_per_peer})"
                )
            self._held[peer] = held + nbytes

    def _release(self, peer: Hashable, nbytes: int) -> None:
        with self._lock:
            left = self._held[peer] - nbytes
            if left > 0:
                self._held[peer] = left
            else:
                del self._held[peer]


class ReceiveAccount:
    """What one stream holds in its current incomplete payload; :meth:`release` when it is done."""

    def __init__(self, budget: ReceiveBudget | None = None, peer: Hashable = None) -> None:
        self._budget, self._peer = budget, peer
        self.held = 0

    def charge(self, nbytes: int) -> None:
        """Records ``nbytes`` more; raises MessageTooLargeError (recording nothing) if over the peer's cap."""
        if self._budget is not None:
            self._budget._charge(self._peer, nbytes, self.held)
        self.held += nbytes
        _add_total(nbytes)

    def release(self, nbytes: int | None = None) -> None:
        """Forgets ``nbytes`` of what this account holds (default: all of it: the payload is complete,
        or dropped)."""
        nbytes = self.held if nbytes is None else min(nbytes, self.held)
        self.held -= nbytes
        if nbytes:
            if self._budget is not None:
                self._budget._release(self._peer, nbytes)
            _add_total(-nbytes)
