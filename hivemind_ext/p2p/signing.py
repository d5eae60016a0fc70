"""Signed DHT records: one RSA key per peer signs every record it publishes.

hivemind's :class:`RSASignatureValidator` signs a record whose subkey holds the writer's public key
as ``[owner:<public key>]``, and makes every DHT node that runs it reject a record under such a
subkey (on store, and on reading one from another node) unless it carries a valid signature by
that key. So nobody can write, overwrite or replay-with-a-later-expiration a record under another
peer's owner subkey. Progress records (:mod:`hivemind_ext.optim.progress`), matchmaking records
and state-donor records all go under such subkeys, signed by one key per peer
(:func:`default_signing_key`).

A signed subkey here is ``<tag>@<peer id>[owner:<public key>]``: the tag says which record it is,
the peer id which peer the record speaks for. Both are covered by the signature, but the DHT cannot
tell whether the key belongs to that peer: libp2p peer ids come from the daemon's own identity key,
which cannot sign DHT records. Readers therefore bind a peer id to one owner key themselves
(:class:`OwnerBook`): the first key seen speaking for a peer id, alone, is pinned, and records for
that peer id under any other key are skipped and counted. A peer id claimed by two keys at once,
before any pin, is disputed: no record for it is trusted until one key is left. What an attacker
with a key of its own can still do: publish its own records (under its own peer id or under a peer
id it makes up, as any Sybil can), and claim an honest peer's id to readers that have never seen
that peer, which makes the reader ignore that peer's records while the dispute lasts (a delay,
never a forged or overwritten record). :class:`OwnedRecordsValidator` makes DHT nodes refuse any
entry under the protected keys that is not under a signed subkey.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import re
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer
from hivemind.utils.crypto import RSAPrivateKey

from hivemind_ext.errors import ConfigurationError, ProtocolError
from hivemind_ext.p2p.dht_calls import DHTCalls

PIN_SECONDS = 600.0  # a pinned key is forgotten once no record under it was seen for this long
_SIGNED_SUBKEY = re.compile(rb"([!-?A-~]{1,200})@([1-9A-HJ-NP-Za-km-z]{1,128})(\[owner:[^\]]{1,2048}\])", re.DOTALL)


@dataclass(frozen=True)
class SignedSubkey:
    """A subkey ``<tag>@<peer id>[owner:<public key>]``, split."""

    tag: str
    peer_id: str  # base58: the peer the record speaks for
    owner: bytes  # the whole ``[owner:...]`` marker: the key that signed the record


def owner_marker(private_key: RSAPrivateKey) -> bytes:
    """The ``[owner:<public key>]`` marker of ``private_key`` (what the DHT signs with it)."""
    return RSASignatureValidator(private_key).local_public_key


def signed_subkey(tag: str, peer_id: str, owner: bytes) -> bytes:
    return f"{tag}@{peer_id}".encode() + owner


def split_signed_subkey(subkey: Any) -> SignedSubkey:
    """Raises :class:`ProtocolError` unless ``subkey`` is a well-formed signed subkey."""
    match = _SIGNED_SUBKEY.fullmatch(subkey) if isinstance(subkey, bytes) else None
    if match is None:
        raise ProtocolError(f"not a signed subkey <tag>@<peer>[owner:<key>]: {subkey!r:.80}")
    return SignedSubkey(match[1].decode(), match[2].decode(), match[3])


class OwnerBook:
    """Which owner key speaks for which peer id, as one reader has learned it (see the module)."""

    def __init__(self, *, own: tuple[str, bytes] | None = None, pin_seconds: float = PIN_SECONDS) -> None:
        self._pins: dict[str, tuple[bytes, float]] = {}  # peer id -> (owner, last seen)
        self._own = own
        self.pin_seconds = pin_seconds
        self.rejected = 0  # records skipped: under a key that does not speak for their peer id, or malformed
        self.disputed = 0  # reads in which a peer id was claimed by several keys before it was pinned

    def resolve(self, claims: Iterable[tuple[str, bytes]], now: float) -> dict[str, bytes | None]:
        """The owner trusted for each peer id in ``claims`` (pairs seen in one read); None: disputed."""
        seen: dict[str, set[bytes]] = {}
        for peer_id, owner in claims:
            seen.setdefault(peer_id, set()).add(owner)
        trusted: dict[str, bytes | None] = {}
        for peer_id, owners in seen.items():
            if self._own is not None and peer_id == self._own[0]:
                trusted[peer_id] = self._own[1]
                continue
            pin = self._pins.get(peer_id)
            if pin is not None and now - pin[1] > self.pin_seconds:
                pin = None
            if pin is None and len(owners) > 1:
                self.disputed += 1
                trusted[peer_id] = None
                continue
            owner = pin[0] if pin is not None else next(iter(owners))
            if owner in owners:
                self._pins[peer_id] = (owner, now)
            trusted[peer_id] = owner
        return trusted


def believed_records(entries: Iterable[tuple[Any, Any, Any]], tag: str, book: OwnerBook, now: float) -> dict[str, Any]:
    """``peer id -> value`` of the ``(subkey, value, expiration)`` entries of one read that are live,
    under a signed subkey tagged ``tag``, and under the key ``book`` trusts for their peer id; one
    record per key (a key that speaks for several peer ids keeps the first), so that a vote or a
    registration costs a key. Everything else is skipped and counted in ``book.rejected``.

    For records where each peer has one voice (state digests, neighbour registrations); the
    signatures themselves were checked by the reader's DHT node, which drops records whose
    signature does not match their owner subkey."""
    claims: list[tuple[SignedSubkey, Any]] = []
    for subkey, value, expiration in entries:
        try:
            signed = split_signed_subkey(subkey)
        except ProtocolError:
            book.rejected += 1
            continue
        live = isinstance(expiration, int | float) and not isinstance(expiration, bool) and expiration > now
        if signed.tag != tag or not live:
            book.rejected += 1
            continue
        claims.append((signed, value))
    trusted = book.resolve(((signed.peer_id, signed.owner) for signed, _ in claims), now)
    believed: dict[str, Any] = {}
    voted: set[bytes] = set()
    for signed, value in claims:
        if trusted.get(signed.peer_id) != signed.owner or signed.owner in voted or signed.peer_id in believed:
            book.rejected += 1
            continue
        voted.add(signed.owner)
        believed[signed.peer_id] = value
    return believed


class OwnedRecordsValidator(RecordValidatorBase):
    """Makes a DHT node refuse, under the keys it protects, any entry whose subkey is not a signed
    subkey (so not signed by anyone: :class:`RSASignatureValidator` passes such entries). Runs after
    the signature validator, which has checked the signature by then. Instances merge."""

    def __init__(self, keys: Iterable[str]) -> None:
        self.key_ids = {DHTID.generate(source=key).to_bytes() for key in keys}

    def validate(self, record: DHTRecord) -> bool:
        if record.key not in self.key_ids:
            return True
        try:
            split_signed_subkey(MSGPackSerializer.loads(record.subkey))
            return True
        except Exception:  # anything a hostile byte string makes msgpack or the parser raise
            return False

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, OwnedRecordsValidator):
            return False
        self.key_ids |= other.key_ids
        return True


class CachingSignatureValidator(RSASignatureValidator):
    """hivemind's :class:`RSASignatureValidator` that remembers what it has verified.

    A DHT node verifies every entry of a dictionary value on every read (a matchmaking board of a few
    dozen records, read by every peer every few tens of milliseconds while a group forms), and the
    records are the same bytes from one read to the next. The result of ``validate`` depends only on
    the record's bytes, so it is kept for the last ``CACHE_SIZE`` records, by a digest of all of them;
    a changed byte is a new record, verified afresh. Signing is unchanged."""

    CACHE_SIZE = 4096

    def __init__(self, private_key: RSAPrivateKey | None = None) -> None:
        super().__init__(private_key)
        self._verified: collections.OrderedDict[bytes, bool] = collections.OrderedDict()

    def validate(self, record: DHTRecord) -> bool:
        # the record's fields as dataclasses.astuple lists them, without its deep copy of each field
        # (half the cost of a cache hit, and a node validates every record of a board on every read)
        fields = (record.key, record.subkey, record.value, record.expiration_time)
        digest = hashlib.blake2b(MSGPackSerializer.dumps(fields), digest_size=20).digest()
        known = self._verified.get(digest)
        if known is not None:
            self._verified.move_to_end(digest)
            return known
        valid = super().validate(record)
        self._verified[digest] = valid
        if len(self._verified) > self.CACHE_SIZE:
            self._verified.popitem(last=False)
        return valid


_SIGNING_KEYS: weakref.WeakKeyDictionary[Any, RSAPrivateKey] = weakref.WeakKeyDictionary()
_SIGNING_KEYS_LOCK = threading.Lock()


def default_signing_key(dht: Any, preferred: RSAPrivateKey | None = None) -> RSAPrivateKey:
    """The key that signs this DHT's records: ``preferred`` if this DHT has none yet (a tracker's
    ``private_key``), else the one it got first. Without one, the first DHT of a process uses the
    process-wide key (what hivemind's own components on that DHT use); every other DHT of the process
    gets a key of its own, so that several peers in one process (tests, local swarms in threads) do
    not share one owner subkey."""
    with _SIGNING_KEYS_LOCK:
        if dht not in _SIGNING_KEYS:
            fresh = RSAPrivateKey.process_wide() if not _SIGNING_KEYS else RSAPrivateKey()
            _SIGNING_KEYS[dht] = preferred if preferred is not None else fresh
        return _SIGNING_KEYS[dht]


async def install_signing(
    dht_calls: DHTCalls,
    private_key: RSAPrivateKey,
    *,
    protected_keys: Iterable[str] = (),
    timeout: float,
    verify: bool = True,
) -> bytes:
    """Makes the DHT sign this peer's records with ``private_key`` and refuse unsigned entries under
    ``protected_keys`` (one call into the DHT process); returns the owner marker. A reader needs it
    too: a DHT without a signature validator cannot strip signatures, and hivemind's ``get`` then
    never answers. ``verify=False`` (a reader that signs nothing) accepts a DHT that signs with another key.

    :raises ConfigurationError: the DHT already signs with another key (hivemind keeps the first
        :class:`RSASignatureValidator` it is given): records under this key would be refused
    :raises DeadlineExceededError, PeerUnreachableError, ClosedError: as :class:`DHTCalls`
    """
    validator = CachingSignatureValidator(private_key)
    install = partial(_install, signer=validator, protected_keys=tuple(protected_keys))
    if not await dht_calls.run_coroutine(install, timeout=timeout) and verify:
        raise ConfigurationError(
            "this DHT already signs records with another RSA key (a previous RSASignatureValidator); "
            "pass that key as private_key, or leave every component at the process-wide default"
        )
    return validator.local_public_key


async def _install(_dht: Any, node: Any, *, signer: RSASignatureValidator, protected_keys: tuple[str, ...]) -> bool:
    """Runs inside the DHT process: adds the validators, and says whether the node now signs with ``signer``'s key."""
    validators: list[RecordValidatorBase] = [signer]
    if protected_keys:
        validators.append(OwnedRecordsValidator(protected_keys))
    node.protocol.record_validator.extend(validators)
    return signs_with_key(node.protocol.record_validator, signer.local_public_key, checker=signer)


def signs_with_key(
    record_validator: RecordValidatorBase, owner: bytes, *, checker: RSASignatureValidator | None = None
) -> bool:
    """Whether ``record_validator`` signs a record under the owner subkey ``owner`` with the matching
    private key. ``checker`` verifies the signature (any instance: ``validate()`` checks against the key in
    the subkey, whatever the validator's own key); without one, a default instance is made, which
    generates the process-wide key in the calling process if it has none yet (hundreds of ms)."""
    record = DHTRecord(b"signing-key-check", MSGPackSerializer.dumps(owner), MSGPackSerializer.dumps(0), 0.0)
    signed = dataclasses.replace(record, value=record_validator.sign_value(record))
    checker = checker if checker is not None else RSASignatureValidator()
    return signed.value != record.value and checker.validate(signed)


__all__ = [
    "PIN_SECONDS",
    "CachingSignatureValidator",
    "OwnedRecordsValidator",
    "OwnerBook",
    "SignedSubkey",
    "believed_records",
    "default_signing_key",
    "install_signing",
    "owner_marker",
    "signed_subkey",
    "signs_with_key",
    "split_signed_subkey",
]
