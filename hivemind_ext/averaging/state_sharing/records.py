"""How donors advertise their state in hivemind's DHT, and how newcomers read and rank the records.

All donors of a prefix write under one DHT key (:func:`donors_key`), one subkey per donor, so one
``get(key, latest=True)`` lists them all. A record is ``{"version": int, "accepts": bool}`` with an
expiration ``declare_state_period`` ahead, refreshed while the donor runs; a donor that stops
sharing overwrites it with ``accepts: False``.

The subkey is signed (:mod:`hivemind_ext.p2p.signing`): ``donor@<peer id>[owner:<public key>]``,
so only the donor's own key can write or overwrite its record, and DHT nodes refuse entries under
any other subkey. Another key can still publish a record that claims the same peer id; readers
cannot tell which key is the donor's, so a claim under one key never hides a claim under another:
a peer is a candidate if any valid record for it says it accepts (:func:`merge_donor_claims`).
That is safe because a record only says where to ask: the peer a newcomer then talks to is
authenticated by libp2p, it refuses if it does not share, and the version a newcomer ends up with
is the one in the donor's manifest. Malformed, expired and unsigned records are skipped and counted.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hivemind_ext.errors import ProtocolError
from hivemind_ext.p2p.signing import signed_subkey, split_signed_subkey

logger = logging.getLogger(__name__)

MAX_VERSION = 2**63 - 1
DONOR_TAG = "donor"


@dataclass(frozen=True)
class DonorRecord:
    peer_id: str  # base58
    version: int
    accepts: bool
    expiration: float
    owner: bytes = b""  # the [owner:<public key>] marker that signed the record


def donors_key(prefix: str) -> str:
    """The DHT key under which the donors of a prefix advertise (versioned with the record format)."""
    return f"{prefix}.state_donors.v2"


def donor_subkey(peer_id: str, owner: bytes) -> bytes:
    """The signed subkey of a donor's record (``owner``: its key's ``[owner:...]`` marker)."""
    return signed_subkey(DONOR_TAG, peer_id, owner)


def donor_value(version: int, accepts: bool) -> dict[str, Any]:
    return {"version": version, "accepts": accepts}


def parse_donor_records(entries: Iterable[tuple[Any, Any, Any]], now: float) -> list[DonorRecord]:
    """One record per donor from ``(subkey, value, expiration)`` triples, skipping expired, unsigned
    and malformed ones (see :func:`read_donor_records`)."""
    return read_donor_records(entries, now)[0]


def read_donor_records(entries: Iterable[tuple[Any, Any, Any]], now: float) -> tuple[list[DonorRecord], int]:
    """One record per donor (claims for one peer id merged by :func:`merge_donor_claims`), and how
    many entries were skipped as expired-but-kept, unsigned or malformed."""
    claims: dict[str, list[DonorRecord]] = {}
    skipped = 0
    for subkey, value, expiration in entries:
        try:
            record = parse_donor_record(subkey, value, expiration, now)
        except ProtocolError as e:
            skipped += 1
            logger.debug("skipping a state donor record %.80r: %s", subkey, e)
            continue
        claims.setdefault(record.peer_id, []).append(record)
    return [merge_donor_claims(records) for records in claims.values()], skipped


def merge_donor_claims(records: list[DonorRecord]) -> DonorRecord:
    """The records that claim one peer id, under different keys, as one: an accepting claim wins
    (the newest version it names), so that a claim under another key can never hide the donor."""
    accepting = [record for record in records if record.accepts]
    if len(records) > 1:
        logger.debug("%d keys claim state donor %s", len(records), records[0].peer_id)
    return max(accepting or records, key=lambda record: (record.version, record.expiration))


def parse_donor_record(subkey: Any, value: Any, expiration: Any, now: float) -> DonorRecord:
    """One record; raises :class:`ProtocolError` if anything in it is malformed or it has expired."""
    if not _is_finite(expiration) or expiration <= now:
        raise ProtocolError("expired or malformed expiration")
    signed = split_signed_subkey(subkey)
    if signed.tag != DONOR_TAG:
        raise ProtocolError(f"not a donor record: {signed.tag!r}")
    if not isinstance(value, dict) or set(value) != {"version", "accepts"}:
        raise ProtocolError("the value must be a map with keys version and accepts")
    version, accepts = value["version"], value["accepts"]
    if type(version) is not int or not 0 <= version <= MAX_VERSION:
        raise ProtocolError(f"version must be an integer in [0, 2**63), got {version!r:.40}")
    if not isinstance(accepts, bool):
        raise ProtocolError("accepts must be a bool")
    return DonorRecord(signed.peer_id, version, accepts, float(expiration), signed.owner)


def donor_tiers(
    records: Iterable[DonorRecord], *, exclude: str | None = None, rng: random.Random | None = None
) -> list[tuple[int, list[str]]]:
    """Donors that accept downloads, grouped by version, newest first; each group shuffled so that
    newcomers spread over donors instead of all starting with the same one."""
    by_version: dict[int, list[str]] = {}
    for record in records:
        if record.accepts and record.peer_id != exclude:
            by_version.setdefault(record.version, []).append(record.peer_id)
    rng = rng if rng is not None else random.Random()
    tiers = []
    for version in sorted(by_version, reverse=True):
        peers = sorted(set(by_version[version]))
        rng.shuffle(peers)
        tiers.append((version, peers))
    return tiers


def _is_finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
