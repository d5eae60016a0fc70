"""How donors advertise their state in hivemind's DHT, and how newcomers read and rank the records.

All donors of a prefix write under one DHT key (:func:`donors_key`), one subkey per donor (its
peer id in base58), so one ``get(key, latest=True)`` lists them all. A record is
``{"version": int, "accepts": bool}`` with an expiration ``declare_state_period`` ahead, refreshed
while the donor runs; a donor that stops sharing overwrites it with ``accepts: False``.

The DHT is open to anyone, so every record is validated and a malformed one is skipped. A record
only says where to ask: the version a newcomer ends up with is the one in the donor's manifest,
and the peer it talks to is authenticated by libp2p.
"""

from __future__ import annotations

import logging
import math
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hivemind_ext.errors import ProtocolError

logger = logging.getLogger(__name__)

MAX_VERSION = 2**63 - 1
_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{1,128}")  # base58


@dataclass(frozen=True)
class DonorRecord:
    peer_id: str  # base58
    version: int
    accepts: bool
    expiration: float


def donors_key(prefix: str) -> str:
    """The DHT key under which the donors of a prefix advertise (versioned with the record format)."""
    return f"{prefix}.state_donors.v1"


def donor_value(version: int, accepts: bool) -> dict[str, Any]:
    return {"version": version, "accepts": accepts}


def parse_donor_records(entries: Iterable[tuple[Any, Any, Any]], now: float) -> list[DonorRecord]:
    """Records from ``(subkey, value, expiration)`` triples, skipping expired and malformed ones."""
    records = []
    for subkey, value, expiration in entries:
        try:
            records.append(parse_donor_record(subkey, value, expiration, now))
        except ProtocolError as e:
            logger.debug("skipping a state donor record %.80r: %s", subkey, e)
    return records


def parse_donor_record(subkey: Any, value: Any, expiration: Any, now: float) -> DonorRecord:
    """One record; raises :class:`ProtocolError` if anything in it is malformed or it has expired."""
    if not _is_finite(expiration) or expiration <= now:
        raise ProtocolError("expired or malformed expiration")
    if not isinstance(subkey, str) or not _PEER_ID.fullmatch(subkey):
        raise ProtocolError("the subkey must be a base58 peer id")
    if not isinstance(value, dict) or set(value) != {"version", "accepts"}:
        raise ProtocolError("the value must be a map with keys version and accepts")
    version, accepts = value["version"], value["accepts"]
    if type(version) is not int or not 0 <= version <= MAX_VERSION:
        raise ProtocolError(f"version must be an integer in [0, 2**63), got {version!r:.40}")
    if not isinstance(accepts, bool):
        raise ProtocolError("accepts must be a bool")
    return DonorRecord(subkey, version, accepts, float(expiration))


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
