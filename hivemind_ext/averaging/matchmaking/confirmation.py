"""Confirming a sealed group with its leader by one direct call over libp2p, instead of through the DHT.

Over the DHT alone, a group takes seven DHT calls in a row once its last member declared (the
leader reads the declaration, stores the seal; members read it and store their confirmations; the
leader reads those and stores the commit; members read the commit), each 30-70 ms on a loaded
loopback. Here the board is kept for discovery (declarations and seals), and the rest is one call:

- a leader that serves this call seals its group as *direct* (:attr:`.group.SealedGroup.direct`);
- a member that joins a direct group calls the leader's ``matchmaking_confirm`` handler with the
  group id and its attempt, and waits in that call;
- the leader counts the callers as its confirmations (and only them: a member that confirmed on
  the board but never called might not be waiting), commits as the board protocol would (every
  member confirmed or visibly went elsewhere, or the commit time came), and answers every waiting
  call with the commit at once; it then stores the commit on the board without waiting, for the
  other peers' plans and for a member whose answer got lost, which reads it there.

Who may say what: the caller is the PeerID that libp2p authenticated, so a member can only confirm
its own attempt (a request naming another peer is refused), and the answer comes from the leader
named in the seal that the leader signed. A member checks that the commit is of the group it joined
and lists only members of the seal, in the seal's order; anything else is a :class:`ProtocolError`,
and the member leaves that leader as it leaves a dead one (:func:`.protocol.leader_failed`). Every
wait is bounded: the leader answers at its commit time at the latest, and the member gives up one
``request_timeout`` after it (a leader that never answers), then falls back to reading the board.
Requests are small (:data:`HANDLER_CONFIG`; the answer may list up to ``MAX_GROUP_MEMBERS``), few
per peer at a time, and a member accepts back no more than a commit of its own group can take
(:func:`answer_limits`: 3.5 kB for a group of 16, where a hostile leader could otherwise make it
read and parse half a megabyte), and a refusal is an answer, not a handler failure, so a hostile caller cannot
flood the leader's logs.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from hivemind.p2p import PeerID

from hivemind_ext.averaging.matchmaking.board import MAX_GROUP_MEMBERS, group_id_of, member_key
from hivemind_ext.averaging.matchmaking.group import Board, Commit, PeerKey, SealedGroup
from hivemind_ext.errors import ProtocolError, RemoteError
from hivemind_ext.p2p.client import RPCClient
from hivemind_ext.p2p.deadlines import wait_until
from hivemind_ext.p2p.messages import Limits, Message
from hivemind_ext.p2p.server import RPCServer
from hivemind_ext.p2p.serving import HandlerConfig, RPCContext

logger = logging.getLogger(__name__)

HANDLER = "matchmaking_confirm"
# the commit lists every member (~75 bytes each: a group of 16 is 1.2 kB), the request only one
ANSWER_LIMITS = Limits(max_header_bytes=MAX_GROUP_MEMBERS * 128, max_payload_bytes=0, idle_timeout=5.0)
HANDLER_CONFIG = HandlerConfig(
    limits=Limits(max_header_bytes=1024, max_payload_bytes=0, idle_timeout=5.0),
    answer_limits=ANSWER_LIMITS,
    max_timeout=120.0,
    open_timeout=5.0,
    max_concurrent_calls=256,
    max_calls_per_peer=4,
)
ANSWER_ROW_BYTES = 160
"""At most what one ``[peer id, attempt]`` row of a commit answer takes (msgpack: a peer id of up to
128 characters, a 16-character attempt, their framing)."""
ANSWER_BASE_BYTES = 1024
"""The rest of an answer: the group id and the map's framing, or a refusal (200 characters, which
may be multi-byte)."""
RECENT_COMMITS = 64  # settled groups whose commit a late caller still gets (it then looks again)
# Event-loop turns a leader yields after its commit so that its answers go out first (see
# Confirmations.let_answers_out): until the waiting answer handlers have returned (a few turns: the
# commit is already there), at most this many, then WRITE_TURNS more for their frames to be written.
MAX_ANSWER_TURNS = 50
WRITE_TURNS = 10
REFUSAL = "error"


def confirmation_request(group_id: str, key: PeerKey) -> dict[str, str]:
    """What a member sends its leader: the group it joins and its own attempt."""
    return {"group": group_id, "peer": key[0], "attempt": key[1]}


def parse_confirmation(header: Mapping[str, Any], caller: str) -> tuple[str, PeerKey]:
    """(group id, member key) of a confirmation sent by ``caller`` (base58); :class:`ProtocolError`
    if it is malformed or confirms for another peer than the one libp2p authenticated."""
    group_id, key = group_id_of(header.get("group")), member_key(header.get("peer"), header.get("attempt"))
    if key[0] != caller:
        raise ProtocolError(f"{caller} confirms for another peer ({key[0]})")
    return group_id, key


def commit_answer(commit: Commit) -> dict[str, Any]:
    return {"group": commit.group_id, "members": [list(key) for key in commit.members]}


def parse_commit_answer(header: Mapping[str, Any], group: SealedGroup) -> Commit:
    """The leader's commit of ``group`` from its answer; :class:`RemoteError` if it refused, and
    :class:`ProtocolError` if the answer is malformed, of another group, or lists anyone that is not
    a member of the seal, or in another order."""
    if REFUSAL in header:
        raise RemoteError(f"the leader refused the confirmation: {str(header[REFUSAL])[:200]}")
    if header.get("group") != group.group_id:
        raise ProtocolError(f"the leader answered for another group: {header.get('group')!r:.80}")
    rows = header.get("members")
    if not isinstance(rows, list) or len(rows) > len(group.members):
        raise ProtocolError("the commit's members must be a list no longer than the sealed group")
    keys = []
    for row in rows:
        if not isinstance(row, list) or len(row) != 2 or not all(isinstance(part, str) for part in row):
            raise ProtocolError(f"a committed member must be [peer id, attempt], got {row!r:.80}")
        keys.append((row[0], row[1]))
    sealed_order = [m.key for m in group.members]
    if any(key not in group.keys for key in keys) or keys != [k for k in sealed_order if k in set(keys)]:
        raise ProtocolError("the commit lists peers that are not sealed members, twice, or out of the sealed order")
    return Commit(group.group_id, tuple(keys))


def with_confirmations(board: Board, group: SealedGroup, confirmed: frozenset[PeerKey]) -> Board:
    """The board as the leader of the direct ``group`` steps on it: its members' markers of this group
    are the calls it received (a member that marked itself on the board but never called may not be
    waiting for the answer); their markers of other groups stay (they went elsewhere)."""
    markers = dict(board.markers)
    for member in group.members:
        if member.key in confirmed:
            markers[member.key] = group.group_id
        elif member.key in markers and markers[member.key] == group.group_id:
            del markers[member.key]
    return dataclasses.replace(board, markers=markers)


def with_commit(board: Board, commit: Commit) -> Board:
    """The board with a commit its leader answered directly, as if it had been read there."""
    return dataclasses.replace(board, commits={**board.commits, commit.group_id: commit})


def answer_limits(group: SealedGroup) -> Limits:
    """What a member of ``group`` accepts back from its leader: a commit can list only the seal's
    members, so anything longer than a commit of all of them is refused (:class:`MessageTooLargeError`,
    a :class:`ProtocolError`) before it is read, let alone parsed."""
    header = ANSWER_BASE_BYTES + ANSWER_ROW_BYTES * len(group.members)
    return dataclasses.replace(ANSWER_LIMITS, max_header_bytes=min(header, ANSWER_LIMITS.max_header_bytes))


class Confirmations:
    """Both sides of the direct confirmation: the leader's desk (``answer``, served on ``server``)
    and the member's call (``confirm``, through ``client``).

    :param client: calls leaders (a plain libp2p client: messages are tiny, one round trip)
    :param server: where this peer serves its desk as a leader; None: it never seals direct groups
        (a client-mode peer, which accepts no connections, passes None)
    """

    def __init__(self, client: RPCClient, server: RPCServer | None = None) -> None:
        self.client, self.server = client, server
        self.serving = False
        self.refused = 0  # confirmations refused (malformed, for another peer, of an unknown group)
        self._open: dict[str, tuple[SealedGroup, set[PeerKey], asyncio.Future[Commit]]] = {}
        self._settled: collections.OrderedDict[str, Commit] = collections.OrderedDict()
        self._answering: collections.Counter[str] = collections.Counter()  # answer handlers waiting, per group
        self.changed = asyncio.Event()  # set whenever a confirmation arrives

    async def start(self) -> None:
        """Registers the desk on the server (once)."""
        if self.server is not None and not self.serving:
            await self.server.add_unary(HANDLER, self.answer, config=HANDLER_CONFIG)
            self.serving = True

    # ----- the leader's side

    def open(self, group: SealedGroup) -> None:
        """Takes confirmations of ``group`` (sealed by this peer) from now until :meth:`settle`."""
        self._open[group.group_id] = (group, set(), asyncio.get_running_loop().create_future())

    def confirmed(self, group_id: str) -> frozenset[PeerKey]:
        """The members that called to confirm ``group_id`` so far."""
        entry = self._open.get(group_id)
        return frozenset(entry[1]) if entry is not None else frozenset()

    def settle(self, commit: Commit) -> None:
        """Answers every member waiting on the group with ``commit`` (no members: abandoned), and
        every later caller too."""
        entry = self._open.pop(commit.group_id, None)
        if entry is not None and not entry[2].done():
            entry[2].set_result(commit)
        self._settled[commit.group_id] = commit
        while len(self._settled) > RECENT_COMMITS:
            self._settled.popitem(last=False)

    async def answer(self, request: Message, context: RPCContext) -> Message:
        """The ``matchmaking_confirm`` handler: counts the caller as confirmed and answers with the
        commit once the group is settled (at the leader's commit time at the latest)."""
        try:
            group_id, key = parse_confirmation(request.header, context.peer_id.to_base58())
        except ProtocolError as e:
            return self._refuse(e, context)
        settled = self._settled.get(group_id)
        if settled is not None:
            return Message(commit_answer(settled))
        entry = self._open.get(group_id)
        if entry is None:
            return self._refuse(ProtocolError(f"no group {group_id} is open here"), context)
        group, confirmed, commit = entry
        if key not in group.keys:
            return self._refuse(ProtocolError(f"{key} is not a member of group {group_id}"), context)
        confirmed.add(key)
        self.changed.set()
        self._answering[group_id] += 1
        try:
            return Message(commit_answer(await wait_until(asyncio.shield(commit), context.deadline, "the commit")))
        finally:
            self._answering[group_id] -= 1
            if self._answering[group_id] <= 0:
                del self._answering[group_id]

    async def let_answers_out(self, group_id: str) -> None:
        """Yields the event loop, after :meth:`settle`, until the answers to ``group_id``'s waiting
        callers are written (a bounded number of turns; it never waits for the network).

        Why: a leader that returns its group goes on at once to the round's snapshot copy and the
        all-reduce's start, synchronous work on this loop (8-10 ms for 64 MB, more under load) during
        which the settled answers, each a few loop turns from being written, waited: measured on
        ``benchmarks/averaging.py`` (4 peers, loopback), the last member got its answer a median 27 ms
        after the leader's commit, against 8 ms when the leader let them out first; the members, not
        the leader, are then the round's last to start."""
        for _ in range(MAX_ANSWER_TURNS):
            if group_id not in self._answering:
                break
            await asyncio.sleep(0)
        for _ in range(WRITE_TURNS):
            await asyncio.sleep(0)

    def _refuse(self, error: ProtocolError, context: RPCContext) -> Message:
        self.refused += 1
        logger.debug("refused a matchmaking confirmation from %s: %s", context.peer_id, error)
        return Message({REFUSAL: str(error)[:200]})

    # ----- a member's side

    async def confirm(self, group: SealedGroup, me: PeerKey, timeout: float) -> Commit:
        """Confirms ``me`` in ``group`` with its leader and returns the leader's commit.

        :raises RemoteError: the leader refused; :raises ProtocolError: its answer is not a valid
            commit of this group, or is longer than one (:func:`answer_limits`);
        :raises DeadlineExceededError, PeerUnreachableError: no answer.
        """
        request = Message(confirmation_request(group.group_id, me))
        leader = PeerID.from_base58(group.leader.peer_id)
        response = await self.client.call(leader, HANDLER, request, timeout=timeout, limits=answer_limits(group))
        return parse_commit_answer(response.header, group)


__all__ = [
    "HANDLER",
    "Confirmations",
    "answer_limits",
    "commit_answer",
    "confirmation_request",
    "parse_commit_answer",
    "with_commit",
    "with_confirmations",
]
