"""Per-epoch digests of the training state: peers that should hold identical states compare them.

In synchronous training every peer of a group applies the same averaged gradients to the same
parameters, so their states (parameters, optimizer state, epoch, learning rates) are bitwise
identical after each epoch. Each peer publishes the SHA-256 of its state after each epoch under
``<prefix>.state_digest.<epoch>`` (one signed subkey per peer, a 32-byte value, expiring after
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

Records are signed (:mod:`hivemind_ext.p2p.signing`): the subkey is ``digest@<peer id>[owner:<public
key>]``, so nobody can write or overwrite another peer's digest, DHT nodes refuse unsigned entries
under the key, and readers bind each peer id to one key (:class:`~hivemind_ext.p2p.signing.OwnerBook`)
and count one vote per key, however many peer ids it claims. What a hostile peer can still do: vote
with keys of its own. A fake majority needs at least 2 agreeing keys and more than half of the
votes, so Sybil keys that outnumber the honest peers can make them resync; the worst that does is
one state download per epoch, and the download is itself checked (donor agreement and the range
checks of :mod:`.state_checks`), so no state is adopted on the word of the digests alone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgpack
import torch
from hivemind import DHT
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from hivemind_ext.optim.training_state import SCALAR_MARK
from hivemind_ext.p2p.dht_calls import DHTCalls
from hivemind_ext.p2p.signing import (
    OwnerBook,
    believed_records,
    default_signing_key,
    install_signing,
    owner_marker,
    signed_subkey,
)

logger = logging.getLogger(__name__)

DIGEST_BYTES = 32
MAX_RECORDS = 4096  # digests read for one epoch at most (more subkeys than that is a flood)
DIGEST_TAG = "digest"

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


def digest_subkey(peer_id: str, owner: bytes) -> bytes:
    """The signed subkey of a peer's digest record (``owner``: its key's ``[owner:...]`` marker)."""
    return signed_subkey(DIGEST_TAG, peer_id, owner)


def parse_digests(entries: Any, book: OwnerBook, now: float) -> dict[str, bytes]:
    """``peer -> digest`` from what ``dht.get(key, latest=True)`` returned: one vote per owner key
    (:func:`~hivemind_ext.p2p.signing.believed_records`); unsigned, expired, malformed or untrusted
    entries are skipped and counted in ``book.rejected``."""
    value = getattr(entries, "value", None)
    if not isinstance(value, dict):
        return {}
    items = list(value.items())[:MAX_RECORDS]
    entries = [(subkey, getattr(item, "value", None), getattr(item, "expiration_time", None)) for subkey, item in items]
    found = {}
    for peer_id, digest in believed_records(entries, DIGEST_TAG, book, now).items():
        if isinstance(digest, bytes) and len(digest) == DIGEST_BYTES:
            found[peer_id] = digest
        else:
            book.rejected += 1
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
    :param signing_key: the RSA key the DHT signs this peer's records with (default: this DHT's, see
      :func:`~hivemind_ext.p2p.signing.default_signing_key`)
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
        signing_key: RSAPrivateKey | None = None,
    ) -> None:
        self.dht, self.prefix, self.peer_id = dht, prefix, peer_id
        self._signing_key = signing_key if signing_key is not None else default_signing_key(dht)
        self._owner = owner_marker(self._signing_key)
        self._protected: set[int] = set()  # epochs whose key this DHT was told to refuse unsigned entries under
        self.book = OwnerBook(own=(peer_id, self._owner))  # counts the records it rejected
        self.take_state, self.on_diverged = take_state, on_diverged
        self.expiration, self.timeout = expiration, timeout
        self._own: dict[int, bytes] = {}  # epoch -> this peer's digest (the last few epochs)
        # bumped by forget(): work on a state taken before a load no longer describes this peer
        self._generation = 0
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
            return self._executor.submit(self._publish_and_check, int(epoch), state, self._generation)
        except RuntimeError:  # shut down meanwhile
            return None

    def forget(self) -> None:
        """Drops this peer's own digests (after it loaded a state: they no longer describe it), and the
        publications and checks of states taken before: a check still running on a digest of the old
        state would find it diverged and resync the peer again (a second download, a missed round)."""
        with self._lock:
            self._own.clear()
            self._generation += 1

    def agreed(self, epoch: int) -> bytes | None:
        """The digest that a majority of the peers published for ``epoch`` (blocking DHT read), or None."""
        return majority_digest(self._read(epoch))

    def shutdown(self) -> None:
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _publish_and_check(self, epoch: int, state: tuple[Any, Sequence[torch.Tensor]], generation: int) -> None:
        started = time.perf_counter()
        digest = state_digest(*state)
        self.hash_seconds += time.perf_counter() - started
        with self._lock:
            if generation != self._generation:  # taken before a load: describes nothing this peer holds
                return
            self._own[epoch] = digest
            for old in [e for e in self._own if e < epoch - 2]:
                del self._own[old]
            previous = self._own.get(epoch - 1)
        try:
            self._protect(epoch)
            future = self.dht.store(
                digest_key(self.prefix, epoch),
                digest,
                get_dht_time() + self.expiration,
                subkey=digest_subkey(self.peer_id, self._owner),
                return_future=True,
            )
            if future.result(self.timeout):
                self.published += 1
            if previous is not None:
                self._check(epoch - 1, previous, generation)
        except Exception as e:  # a DHT that timed out or stopped: skip this epoch's comparison
            logger.debug(f"state digest of epoch {epoch}: {type(e).__name__}: {e}")

    def _check(self, epoch: int, own: bytes, generation: int) -> None:
        digests = self._read(epoch)
        digests[self.peer_id] = own
        majority = majority_digest(digests)
        with self._lock:
            stale = generation != self._generation  # the peer loaded a state while this read ran
        if majority is not None and majority != own and not stale:
            self.divergences += 1
            agreeing = sum(digest == majority for digest in digests.values())
            logger.warning(
                f"this peer's state at epoch {epoch} differs from that of {agreeing} of {len(digests)} peers: resyncing"
            )
            self.on_diverged(epoch)

    def _read(self, epoch: int) -> dict[str, bytes]:
        self._protect(epoch)  # a reader's DHT node needs the signature validator to strip signatures
        future = self.dht.get(digest_key(self.prefix, epoch), latest=True, return_future=True)
        with self._lock:
            return parse_digests(future.result(self.timeout), self.book, get_dht_time())

    def _protect(self, epoch: int) -> None:
        """Makes this DHT sign with this peer's key and refuse unsigned entries under the key of
        ``epoch`` (once per epoch: the key changes every epoch; one call into the DHT process)."""
        if epoch in self._protected:
            return
        install = install_signing(
            DHTCalls(self.dht),
            self._signing_key,
            protected_keys=(digest_key(self.prefix, epoch),),
            timeout=self.timeout,
        )
        asyncio.run(install)
        self._protected.add(epoch)
        for old in [e for e in self._protected if e < epoch - 2]:
            self._protected.discard(old)
