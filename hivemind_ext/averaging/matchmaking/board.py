"""The matchmaking records of one group key as they lie in the DHT, and their strict parsing.

All records of a group key (the prefix, plus the group bits if the peer has any: see
:mod:`.group_key`) live under one DHT key (:func:`board_key`), one subkey per record, so one
``get(key, latest=True)`` returns a whole snapshot, merged by hivemind across the nodes that hold
the key. Subkeys:

- ``d/<peer>/<attempt>``: the state of one attempt: a declaration while the peer is looking, then
  a marker (``joined`` a group, or ``left``) stored with a later expiration, which hides the
  declaration because the DHT keeps the value that expires last;
- ``g/<group id>``: a group sealed by its leader (with the time its all-reduce starts, if it was
  sealed ahead of its scheduled time);
- ``c/<group id>``: the leader's commit of that group.

How long each record lives (with the group it belongs to) is decided in :mod:`.lifetimes`.

Anyone can write into the DHT, so every record is validated; a malformed one is skipped (and
logged), never trusted and never fatal to the reader.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hivemind_ext.averaging.matchmaking.group import (
    MAX_FINGERPRINT_CHARS,
    Board,
    Commit,
    Declaration,
    Member,
    PeerKey,
    SealedGroup,
    capped_bandwidth,
    group_id_for,
)
from hivemind_ext.averaging.matchmaking.rotation import check_digits
from hivemind_ext.errors import ConfigurationError, ProtocolError

logger = logging.getLogger(__name__)

MAX_GROUP_MEMBERS = 4096  # far above any useful group; bounds the work a hostile record can cause
_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{1,128}")  # base58
_ATTEMPT = re.compile(r"[0-9a-f]{16}")
_GROUP_ID = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class Write:
    """One record to store: what the protocol asks the I/O layer to put into the DHT."""

    subkey: str | bytes  # plain; the I/O layer stores it under its signed form (bytes), see .authenticity
    value: dict[str, Any]
    expiration_time: float


@dataclass(frozen=True)
class Marker:
    """What became of an attempt that stopped looking: the group it joined, or None if it left."""

    key: PeerKey
    group_id: str | None


def board_key(prefix: str) -> str:
    """The DHT key that holds all matchmaking records of a group key (versioned with the wire format)."""
    return f"{prefix}.matchmaking.v1"


def declaration_write(declaration: Declaration) -> Write:
    member = declaration.member
    value = {
        "state": "looking",
        "prefix": declaration.prefix,
        "declared_at": declaration.declared_at,
        "ready_at": declaration.ready_at,
        "deadline": declaration.deadline,
        "bandwidth": member.bandwidth,
        "client_mode": member.client_mode,
        "auxiliary": member.auxiliary,
    }
    if declaration.fingerprint:
        value["fingerprint"] = declaration.fingerprint
    if declaration.digits:
        value["digits"] = list(declaration.digits)
    return Write(_attempt_subkey(member.key), value, declaration.expiration)


def marker_write(key: PeerKey, group_id: str | None, expiration_time: float) -> Write:
    value: dict[str, Any] = {"state": "left"} if group_id is None else {"state": "joined", "group": group_id}
    return Write(_attempt_subkey(key), value, expiration_time)


def sealed_write(group: SealedGroup, expiration_time: float) -> Write:
    members = [[m.peer_id, m.attempt, m.bandwidth, m.client_mode, m.auxiliary] for m in group.members]
    value: dict[str, Any] = {"members": members, "commit_by": group.commit_by}
    if _is_finite(group.start_at):  # absent: the group starts as soon as it is committed
        value["start_at"] = group.start_at
    if group.direct:  # absent: members confirm on the board
        value["direct"] = True
    return Write(f"g/{group.group_id}", value, expiration_time)


def commit_write(commit: Commit, expiration_time: float) -> Write:
    return Write(f"c/{commit.group_id}", {"members": [list(key) for key in commit.members]}, expiration_time)


def parse_board(prefix: str, entries: Iterable[tuple[Any, Any, Any]], now: float, fingerprint: str = "") -> Board:
    """Build a :class:`Board` from ``(subkey, value, expiration)`` triples, skipping expired,
    malformed and other-prefix records, and declarations of another run ``fingerprint`` (see
    :func:`same_run`)."""
    declarations: dict[PeerKey, Declaration] = {}
    markers: dict[PeerKey, str | None] = {}
    sealed: dict[str, SealedGroup] = {}
    commits: dict[str, Commit] = {}
    for subkey, value, expiration in entries:
        if not _is_finite(expiration) or expiration <= now:
            continue
        try:
            record = parse_record(subkey, value, expiration)
        except ProtocolError as e:
            logger.debug("skipping a malformed matchmaking record %.80r: %s", subkey, e)
            continue
        if isinstance(record, Declaration):
            if record.prefix == prefix and same_run(record.fingerprint, fingerprint):
                declarations[record.member.key] = record
        elif isinstance(record, Marker):
            markers[record.key] = record.group_id
        elif isinstance(record, SealedGroup):
            sealed[record.group_id] = record
        else:
            commits[record.group_id] = record
    return Board(declarations, markers, sealed, commits)


def same_run(theirs: str, mine: str) -> bool:
    """Whether a declaration with fingerprint ``theirs`` may be grouped with this peer's ``mine``: equal,
    or either is empty (a peer that does not check, such as an auxiliary peer, which has no model)."""
    return theirs == mine or not theirs or not mine


def parse_record(subkey: Any, value: Any, expiration: float) -> Declaration | Marker | SealedGroup | Commit:
    """Parse one record; raises :class:`ProtocolError` if anything in it is malformed."""
    if not isinstance(subkey, str) or not isinstance(value, dict):
        raise ProtocolError("a record needs a string subkey and a map value")
    kind, _, rest = subkey.partition("/")
    if kind == "d":
        return _parse_attempt_record(rest, value, expiration)
    if kind == "g":
        return _parse_sealed(_matching(_GROUP_ID, rest, "group id"), value)
    if kind == "c":
        return _parse_commit(_matching(_GROUP_ID, rest, "group id"), value)
    raise ProtocolError(f"unknown record kind {kind!r}")


def _parse_attempt_record(rest: str, value: dict, expiration: float) -> Declaration | Marker:
    peer_id, _, attempt = rest.partition("/")
    key = (_matching(_PEER_ID, peer_id, "peer id"), _matching(_ATTEMPT, attempt, "attempt"))
    state = value.get("state")
    if state == "left":
        return Marker(key, None)
    if state == "joined":
        return Marker(key, _matching(_GROUP_ID, value.get("group"), "group id"))
    if state != "looking":
        raise ProtocolError(f"unknown attempt state {state!r}")
    prefix = value.get("prefix")
    if not isinstance(prefix, str):
        raise ProtocolError("a declaration needs a string prefix")
    member = _member(peer_id, attempt, value.get("bandwidth"), value.get("client_mode"), value.get("auxiliary"))
    times = [_finite(value.get(name), name) for name in ("declared_at", "ready_at", "deadline")]
    fingerprint = value.get("fingerprint", "")
    if not isinstance(fingerprint, str) or len(fingerprint) > MAX_FINGERPRINT_CHARS:
        raise ProtocolError(f"a declaration's fingerprint must be a string of at most {MAX_FINGERPRINT_CHARS} chars")
    try:  # rotation coordinates (see .rotation): absent for peers that do not rotate
        digits = check_digits(value.get("digits", []))
    except ConfigurationError as e:
        raise ProtocolError(str(e)) from e
    return Declaration(member, prefix, *times, expiration=expiration, fingerprint=fingerprint, digits=digits)


def _parse_sealed(group_id: str, value: dict) -> SealedGroup:
    rows = _bounded_list(value.get("members"), "members")
    if not rows:
        raise ProtocolError("a sealed group needs members")
    members = tuple(_member(*_row(row, 5)) for row in rows)
    if [m.key for m in members] != sorted({m.key for m in members}):
        raise ProtocolError("sealed members must be unique and ordered by peer id")
    if group_id_for(members) != group_id:
        raise ProtocolError("the group id does not match the sealed members")
    start_at = _finite(value["start_at"], "start_at") if "start_at" in value else -math.inf
    direct = value.get("direct", False)
    if not isinstance(direct, bool):
        raise ProtocolError(f"a sealed group's direct flag must be a boolean, got {direct!r:.80}")
    return SealedGroup(group_id, members, _finite(value.get("commit_by"), "commit_by"), start_at, direct)


def _parse_commit(group_id: str, value: dict) -> Commit:
    keys = tuple(member_key(*_row(row, 2)) for row in _bounded_list(value.get("members"), "members"))
    if len(set(keys)) != len(keys):
        raise ProtocolError("committed members must be unique")
    return Commit(group_id, keys)


def member_key(peer_id: Any, attempt: Any) -> PeerKey:
    """A peer's attempt key as it comes off the wire; :class:`ProtocolError` if malformed."""
    return (_matching(_PEER_ID, peer_id, "peer id"), _matching(_ATTEMPT, attempt, "attempt"))


def group_id_of(text: Any) -> str:
    """A group id as it comes off the wire; :class:`ProtocolError` if malformed."""
    return _matching(_GROUP_ID, text, "group id")


def _member(peer_id: Any, attempt: Any, bandwidth: Any, client_mode: Any, auxiliary: Any) -> Member:
    if bandwidth is not None and not (_is_finite(bandwidth) and bandwidth >= 0):
        raise ProtocolError(f"bandwidth must be None or finite and non-negative, got {bandwidth!r:.80}")
    if not isinstance(client_mode, bool) or not isinstance(auxiliary, bool):
        raise ProtocolError("client_mode and auxiliary must be booleans")
    return Member(
        _matching(_PEER_ID, peer_id, "peer id"),
        _matching(_ATTEMPT, attempt, "attempt"),
        None if bandwidth is None else capped_bandwidth(bandwidth),  # every member parses the seal alike
        client_mode,
        auxiliary,
    )


def _attempt_subkey(key: PeerKey) -> str:
    return f"d/{key[0]}/{key[1]}"


def _matching(pattern: re.Pattern[str], text: Any, what: str) -> str:
    if not isinstance(text, str) or not pattern.fullmatch(text):
        raise ProtocolError(f"malformed {what}: {text!r:.80}")
    return text


def _bounded_list(items: Any, what: str) -> list:
    if not isinstance(items, list) or len(items) > MAX_GROUP_MEMBERS:
        raise ProtocolError(f"{what} must be a list of at most {MAX_GROUP_MEMBERS} items")
    return items


def _row(row: Any, length: int) -> list:
    if not isinstance(row, list) or len(row) != length:
        raise ProtocolError(f"expected a list of {length} fields, got {row!r:.80}")
    return row


def _finite(value: Any, what: str) -> float:
    if not _is_finite(value):
        raise ProtocolError(f"{what} must be a finite number, got {value!r:.80}")
    return float(value)


def _is_finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
