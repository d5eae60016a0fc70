"""The metrics record a peer publishes for monitors, and its strict parser.

A peer that reports metrics (``Optimizer(..., metrics_period=...)``) stores one record under the DHT
key :func:`metrics_key` of its run, in its ``[owner:<RSA public key>]`` subkey: hivemind's
:class:`~hivemind.dht.crypto.RSASignatureValidator` (installed by the peer's progress tracker) signs
it, and every node that runs the validator (the monitor does) refuses a record under such a subkey
that its owner did not sign. The value is a small dict (:func:`metrics_value`), or ``None`` once the
peer has left.

The DHT is open to anyone: a reader gets whatever a hostile peer wrote under its own key. Every
record is parsed strictly (:func:`parse_metrics_value`: known fields, exact types, finite numbers in
range, bounded strings and sizes) and a malformed one is skipped and counted, never trusted.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hivemind_ext.errors import ProtocolError

ROLES = ("trainer", "client", "aux")
MAX_COUNT = 2**62  # epochs, rounds and byte counts above this are absurd
MAX_FIELDS = 32  # a record with more entries than this is refused unread (newer versions may add a few)
MAX_KEY_LENGTH = 32
_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{1,128}")  # base58
_OWNER_SUBKEY = re.compile(rb"\[owner:(.{1,2048})\]", re.DOTALL)  # RSASignatureValidator's subkey format


@dataclass(frozen=True)
class PeerMetrics:
    """What one peer reports about itself.

    :param role: ``trainer``, ``client`` (a trainer in client mode) or ``aux`` (an auxiliary peer)
    :param samples_per_second: this peer's measured training speed
    :param loss: the mean of the losses the user reported since the previous record (None: none reported)
    :param rounds_ok / rounds_failed: averaging steps that succeeded / failed since the peer started
    :param last_round_seconds: how long the last all-reduce took (None: none yet)
    :param last_round_ok: whether the last averaging step succeeded (None: none yet)
    :param bytes_sent / bytes_received: all-reduce payload bytes since the peer started
    :param time: DHT time of the report
    """

    peer_id: str
    role: str
    epoch: int
    samples_per_second: float
    loss: float | None
    rounds_ok: int
    rounds_failed: int
    last_round_seconds: float | None
    last_round_ok: bool | None
    bytes_sent: int
    bytes_received: int
    time: float


def metrics_key(run_id: str) -> str:
    """The DHT key under which the peers of ``run_id`` publish their metrics."""
    return f"{run_id}_metrics"


def metrics_value(metrics: PeerMetrics) -> dict[str, Any]:
    """The DHT value that publishes ``metrics``."""
    return {
        "peer_id": metrics.peer_id,
        "role": metrics.role,
        "epoch": metrics.epoch,
        "samples_per_second": float(metrics.samples_per_second),
        "loss": None if metrics.loss is None else float(metrics.loss),
        "rounds_ok": metrics.rounds_ok,
        "rounds_failed": metrics.rounds_failed,
        "last_round_seconds": None if metrics.last_round_seconds is None else float(metrics.last_round_seconds),
        "last_round_ok": metrics.last_round_ok,
        "bytes_sent": metrics.bytes_sent,
        "bytes_received": metrics.bytes_received,
        "time": float(metrics.time),
    }


def parse_metrics_value(value: Any) -> PeerMetrics:
    """One record's value; raises :class:`ProtocolError` if anything in it is malformed."""
    if not isinstance(value, dict):
        raise ProtocolError("a metrics record must be a dict")
    if len(value) > MAX_FIELDS:
        raise ProtocolError(f"a metrics record has at most {MAX_FIELDS} fields")
    for key in value:
        if not isinstance(key, str) or len(key) > MAX_KEY_LENGTH:
            raise ProtocolError("field names must be short strings")
    peer_id, role = value.get("peer_id"), value.get("role")
    if not isinstance(peer_id, str) or not _PEER_ID.fullmatch(peer_id):
        raise ProtocolError("peer_id must be a base58 string")
    if role not in ROLES or not isinstance(role, str):
        raise ProtocolError(f"role must be one of {ROLES}")
    last_round_ok = value.get("last_round_ok")
    if last_round_ok is not None and not isinstance(last_round_ok, bool):
        raise ProtocolError("last_round_ok must be a bool or None")
    return PeerMetrics(
        peer_id=peer_id,
        role=role,
        epoch=_count(value, "epoch"),
        samples_per_second=_number(value, "samples_per_second", low=0.0),
        loss=_optional_number(value, "loss", low=-math.inf),
        rounds_ok=_count(value, "rounds_ok"),
        rounds_failed=_count(value, "rounds_failed"),
        last_round_seconds=_optional_number(value, "last_round_seconds", low=0.0),
        last_round_ok=last_round_ok,
        bytes_sent=_count(value, "bytes_sent"),
        bytes_received=_count(value, "bytes_received"),
        time=_number(value, "time", low=-math.inf),
    )


def is_owner_subkey(subkey: Any) -> bool:
    """Whether ``subkey`` names an RSA owner: the only subkeys whose records the DHT makes their writer sign."""
    return isinstance(subkey, bytes) and _OWNER_SUBKEY.fullmatch(subkey) is not None


def parse_metrics_entries(entries: Iterable[tuple[Any, Any, Any]], *, now: float) -> tuple[list[PeerMetrics], int]:
    """The valid records among ``(subkey, value, expiration)`` triples, one per peer id (the newest),
    and how many entries were malformed. Withdrawn (``None``) and expired records are skipped
    without counting: they are not malformed."""
    newest: dict[str, PeerMetrics] = {}
    invalid = 0
    for subkey, value, expiration in entries:
        if value is None or not _is_real(expiration) or not expiration > now:
            continue
        try:
            if not is_owner_subkey(subkey):
                raise ProtocolError("the subkey is not an [owner:<public key>] marker: nothing signed the record")
            record = parse_metrics_value(value)
        except ProtocolError:
            invalid += 1
            continue
        previous = newest.get(record.peer_id)
        if previous is None or record.time > previous.time:
            newest[record.peer_id] = record
    return sorted(newest.values(), key=lambda record: record.peer_id), invalid


def _count(value: dict[str, Any], name: str) -> int:
    number = value.get(name)
    if type(number) is not int or not 0 <= number <= MAX_COUNT:
        raise ProtocolError(f"{name} must be an integer in [0, 2**62]")
    return number


def _number(value: dict[str, Any], name: str, *, low: float) -> float:
    number = value.get(name)
    if not _is_real(number) or abs(number) > MAX_COUNT or not math.isfinite(number) or number < low:
        raise ProtocolError(f"{name} must be a finite number in [{low}, 2**62]")
    return float(number)


def _optional_number(value: dict[str, Any], name: str, *, low: float) -> float | None:
    return None if value.get(name) is None else _number(value, name, low=low)


def _is_real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


__all__ = [
    "ROLES",
    "PeerMetrics",
    "is_owner_subkey",
    "metrics_key",
    "metrics_value",
    "parse_metrics_entries",
    "parse_metrics_value",
]
