"""Which matchmaking records to believe: every record is signed, and speaks for the peer that wrote it.

Each peer stores its records (see :mod:`.board`) under the signed subkey
``<record subkey>@<its peer id>[owner:<its public key>]`` (:mod:`hivemind_ext.p2p.signing`), so the
DHT refuses any change to them that its key did not sign, and nobody can overwrite or hide another
peer's declaration, marker, seal or commit. A record is believed only if the peer it speaks for is
the peer that signed it, through the reader's :class:`~hivemind_ext.p2p.signing.OwnerBook`:

- a declaration or marker ``d/<peer>/<attempt>`` must be signed for ``<peer>``;
- a sealed group ``g/<group id>`` must be signed for its leader (its first member);
- a commit ``c/<group id>`` must be signed for the leader of that sealed group, which must be
  believed in the same read.

Anything else (unsigned, another peer's name, malformed, a commit without its seal) is skipped
and counted in the book; :func:`authenticate_board` hands the rest to :func:`.board.parse_board`
under their plain subkeys, so the protocol above never sees a key.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from hivemind_ext.averaging.matchmaking.board import parse_record
from hivemind_ext.averaging.matchmaking.group import SealedGroup
from hivemind_ext.errors import ProtocolError
from hivemind_ext.p2p.signing import OwnerBook, SignedSubkey, split_signed_subkey

logger = logging.getLogger(__name__)


def authenticate_board(
    entries: Iterable[tuple[Any, Any, Any]], book: OwnerBook, now: float
) -> list[tuple[str, Any, float]]:
    """The ``(subkey, value, expiration)`` entries of one read that ``book`` lets this reader
    believe, with plain subkeys; expired entries are dropped, rejected ones counted in ``book``."""
    claimed: list[tuple[SignedSubkey, Any, float]] = []
    for subkey, value, expiration in entries:
        if not _is_live(expiration, now):
            continue
        try:
            signed = split_signed_subkey(subkey)
            _check_claim(signed, value, float(expiration))
        except ProtocolError as e:
            book.rejected += 1
            logger.debug("skipping a matchmaking record %.80r: %s", subkey, e)
            continue
        claimed.append((signed, value, float(expiration)))
    trusted = book.resolve(((signed.peer_id, signed.owner) for signed, _, _ in claimed), now)
    believed = [entry for entry in claimed if trusted.get(entry[0].peer_id) == entry[0].owner]
    leaders = {signed.tag[2:]: signed.peer_id for signed, _, _ in believed if signed.tag.startswith("g/")}
    kept = [
        (signed.tag, value, expiration)
        for signed, value, expiration in believed
        if not signed.tag.startswith("c/") or leaders.get(signed.tag[2:]) == signed.peer_id
    ]
    book.rejected += len(claimed) - len(kept)
    return kept


def _check_claim(signed: SignedSubkey, value: Any, expiration: float) -> None:
    """Raises :class:`ProtocolError` unless the record speaks for the peer that signed it (commits
    are checked against their seal later). A seal is parsed whole: its group id is derived from its
    members, so a group id has one leader, and a commit can be matched to it."""
    kind, _, rest = signed.tag.partition("/")
    if kind == "d":
        if rest.partition("/")[0] != signed.peer_id:
            raise ProtocolError("a declaration signed for another peer")
    elif kind == "g":
        sealed = parse_record(signed.tag, value, expiration)
        if not isinstance(sealed, SealedGroup) or sealed.leader.peer_id != signed.peer_id:
            raise ProtocolError("a sealed group signed by someone other than its leader")
    elif kind != "c":
        raise ProtocolError(f"unknown record kind {kind!r}")


def _is_live(expiration: Any, now: float) -> bool:
    return isinstance(expiration, int | float) and not isinstance(expiration, bool) and expiration > now


__all__ = ["authenticate_board"]
