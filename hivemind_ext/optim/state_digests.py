"""Per-epoch digests of the training state: peers that should hold identical states compare them.

In synchronous training every peer of a group applies the same averaged gradients to the same
parameters, so their states (parameters, optimizer state, epoch, learning rates) are bitwise
identical after each epoch. Each peer publishes the SHA-256 of its state after each epoch under
``<prefix>.state_digest.<epoch>`` (one subkey per peer, a 32-byte value, expiring after
``expiration`` seconds). At its next epoch it reads the digests of the previous one: if a majority
of the peers that published (at least 2, more than half) agree on a digest other than its own, its
state silently diverged (a split round, a bad download, a bit flip) and it resyncs: it downloads
the state at its next step. The digest covers what a newcomer downloads (``TrainingState.snapshot``),
so a joiner can compare a downloaded state with the digest the group agreed on (:meth:`DigestBoard.agreed`).

Cost per epoch: one copy of the state to host memory under the state lock (what serving a newcomer
costs too), then hashing and one DHT store and get in a worker thread, off the training path.
Measured on a loaded 2-core CPU host (Adam, so the state is 3x the parameters): 1M parameters
(12 MB) copy 14 ms, SHA-256 42 ms; 10M parameters (120 MB) copy 226 ms, SHA-256 135 ms (best of 5).
Only synchronous training publishes (see :mod:`.state_trust`).
Records are not signed (like donor records): a hostile peer can publish digests, but a majority
needs at least 2 agreeing subkeys and more than half of those published, and the worst a fake
majority can do is make a peer download the state (which is itself checked) once per epoch.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgpack
import torch
from hivemind import DHT
from hivemind.utils import get_dht_time

from hivemind_ext.optim.training_state import SCALAR_MARK

logger = logging.getLogger(__name__)

DIGEST_BYTES = 32
MAX_RECORDS = 4096  # digests read for one epoch at most (more subkeys than that is a flood)
_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{1,128}")

StateTaker = Callable[[], tuple[Any, Sequence[torch.Tensor]]]


def digest_key(prefix: str, epoch: int) -> str:
    return f"{prefix}.state_digest.{int(epoch)}"


def state_digest(metadata: Any, tensors: Sequence[torch.Tensor]) -> bytes:
    """SHA-256 of a training state: its metadata (0-d tensors by value and dtype, not device, so that
    a CPU and a GPU peer agree) and every tensor's dtype, shape and bytes."""
    digest = hashlib.sha256(msgpack.packb(_without_devices(metadata), use_bin_type=True))
    for tensor in tensors:
        host = tensor.detach().to("cpu").contiguous()
        digest.update(f"{host.dtype}{list(host.shape)}".encode())
        if host.numel():
            digest.update(memoryview(host.reshape(-1).view(torch.uint8).numpy()))
    return digest.digest()


def majority_digest(digests: Mapping[str, bytes]) -> bytes | None:
    """The digest that at least 2 and more than half of ``digests`` (peer -> digest) share, if any."""
    counts: dict[bytes, int] = {}
    for digest in digests.values():
        counts[digest] = counts.get(digest, 0) + 1
    if not counts:
        return None
    best, count = max(counts.items(), key=lambda item: item[1])
    return best if count >= 2 and 2 * count > len(digests) else None


def parse_digests(entries: Any) -> dict[str, bytes]:
    """``peer -> digest`` from what ``dht.get(key, latest=True)`` returned, skipping malformed entries."""
    value = getattr(entries, "value", None)
    if not isinstance(value, dict):
        return {}
    found: dict[str, bytes] = {}
    for subkey, item in list(value.items())[:MAX_RECORDS]:
        digest = getattr(item, "value", None)
        if isinstance(subkey, str) and _PEER_ID.fullmatch(subkey) and isinstance(digest, bytes):
            if len(digest) == DIGEST_BYTES:
                found[subkey] = digest
    return found


def _without_devices(value: Any) -> Any:
    if isinstance(value, dict):
        if SCALAR_MARK in value:
            return {k: v for k, v in value.items() if k != "device"}
        return {k: _without_devices(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_without_devices(v) for v in value]
    return value


class DigestBoard:
    """Publishes this peer's state digest after each epoch and resyncs it when the group disagrees.

    :param dht: the peer's DHT
    :param prefix: the run's state prefix (digests of different runs never meet)
    :param peer_id: this peer's id in base58 (its subkey)
    :param take_state: returns a copy of the training state (``TrainingState.snapshot`` under the lock)
    :param on_diverged: called (in the board's thread) with the epoch whose majority this peer's
      digest differed from; the Optimizer requests a resync
    """

    def __init__(
        self,
        dht: DHT,
        prefix: str,
        peer_id: str,
        *,
        take_state: StateTaker,
        on_diverged: Callable[[int], Any],
        expiration: float = 600.0,
        timeout: float = 10.0,
    ) -> None:
        self.dht, self.prefix, self.peer_id = dht, prefix, peer_id
        self.take_state, self.on_diverged = take_state, on_diverged
        self.expiration, self.timeout = expiration, timeout
        self._own: dict[int, bytes] = {}  # epoch -> this peer's digest (the last few epochs)
        self._lock = threading.Lock()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="state-digest")
        self._closed = False
        self.published = 0
        self.divergences = 0  # epochs at which this peer found its state different from the majority
        self.copy_seconds = 0.0  # total time spent copying the state on the training thread
        self.hash_seconds = 0.0  # total time spent hashing in the board's thread

    def after_epoch(self, epoch: int) -> concurrent.futures.Future[None] | None:
        """Takes the state of ``epoch`` now (on the caller's thread), then hashes, publishes it and
        checks the previous epoch in the background. Returns the background work's future."""
        if self._closed:
            return None
        started = time.perf_counter()
        state = self.take_state()
        self.copy_seconds += time.perf_counter() - started
        try:
            return self._executor.submit(self._publish_and_check, int(epoch), state)
        except RuntimeError:  # shut down meanwhile
            return None

    def forget(self) -> None:
        """Drops this peer's own digests (after it loaded a state: they no longer describe it)."""
        with self._lock:
            self._own.clear()

    def agreed(self, epoch: int) -> bytes | None:
        """The digest that a majority of the peers published for ``epoch`` (blocking DHT read), or None."""
        return majority_digest(self._read(epoch))

    def shutdown(self) -> None:
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _publish_and_check(self, epoch: int, state: tuple[Any, Sequence[torch.Tensor]]) -> None:
        started = time.perf_counter()
        digest = state_digest(*state)
        self.hash_seconds += time.perf_counter() - started
        with self._lock:
            self._own[epoch] = digest
            for old in [e for e in self._own if e < epoch - 2]:
                del self._own[old]
            previous = self._own.get(epoch - 1)
        try:
            future = self.dht.store(
                digest_key(self.prefix, epoch),
                digest,
                get_dht_time() + self.expiration,
                subkey=self.peer_id,
                return_future=True,
            )
            if future.result(self.timeout):
                self.published += 1
            if previous is not None:
                self._check(epoch - 1, previous)
        except Exception as e:  # a DHT that timed out or stopped: skip this epoch's comparison
            logger.debug(f"state digest of epoch {epoch}: {type(e).__name__}: {e}")

    def _check(self, epoch: int, own: bytes) -> None:
        digests = self._read(epoch)
        digests[self.peer_id] = own
        majority = majority_digest(digests)
        if majority is not None and majority != own:
            self.divergences += 1
            agreeing = sum(digest == majority for digest in digests.values())
            logger.warning(
                f"this peer's state at epoch {epoch} differs from that of {agreeing} of {len(digests)} peers: resyncing"
            )
            self.on_diverged(epoch)

    def _read(self, epoch: int) -> dict[str, bytes]:
        future = self.dht.get(digest_key(self.prefix, epoch), latest=True, return_future=True)
        return parse_digests(future.result(self.timeout))
