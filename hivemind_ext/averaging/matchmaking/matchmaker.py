"""Matchmaking: peers that average under one prefix find each other through hivemind's DHT and
agree on groups; the members of a group sealed by a leader that serves direct confirmations
(every averager but a client-mode one) confirm it by one libp2p call to that leader instead of
through the DHT (see :mod:`.confirmation`). Without ``confirmations`` the DHT is the only channel.

Usage (inside the averager's event loop)::

    config = MatchmakingConfig(prefix="run42_grads", target_group_size=4, min_group_size=2)
    matchmaker = Matchmaker(config, dht=dht)
    group = await matchmaker.look_for_group(deadline=get_dht_time() + 30)
    group.group_id, group.members, group.peer_ids  # the same on every member

The protocol
------------
All records of one group key (the prefix, plus the peer's group bits if it has any: see
:mod:`.group_key`; peers with different keys never meet) live under one DHT key (see :mod:`.board`);
every peer polls it with
``get(key, latest=True)`` every ``poll_interval``, five times as often while a group that includes
it is being formed and for the first ``EAGER_POLLS`` poll intervals after it starts looking (peers
of synchronous training start together), and feeds what it read to the pure state machine
:func:`.protocol.step`, which applies the grouping rule of :func:`.group.plan_groups`. Each
poll is one call into the DHT process (:func:`.dht_store.store_then_read`): the step's records are stored in
one ``store_many`` (one request per replica), and right after a declaration the board is read in
the same call, so peers that declared at the same moment see each other without waiting a poll.
Both the store and the read look for only the ``num_replicas`` nodes nearest to the board's key
(hivemind's default beam is its bucket size, 20: on a small swarm that visits every node, for every
poll of every peer), and a store returns once one replica took it (the others are written in the
background, and a read, which merges what every nearest node holds, finds it on that one); only the
leader's commit waits for every replica. Measured on 9 DHT nodes on loopback, 8 calls at once:
a store 35-70 ms instead of 85-90, a read 30 ms instead of 40-47.

1. **Declare.** A peer stores a declaration under a fresh attempt token: peer id, role, bandwidth,
   when it started looking (seniority), its scheduled time and deadline. The declaration expires
   after ``request_timeout`` and is refreshed while the peer waits, so a peer that dies is forgotten
   within ``request_timeout``; it never outlives the peer's deadline.
2. **Seal.** Each peer computes the groups from the declarations it sees. The first member (by peer
   id) of a planned group is its leader; only the leader acts: it stores a sealed group record
   (group id derived from the members' attempt tokens, ordered member list, a commit time) and
   marks its own attempt as joined.
3. **Confirm.** A looking peer that sees an open sealed group listing its current attempt joins it
   (the lowest group id if several list it) by overwriting its declaration with a ``joined``
   marker. This also withdraws the declaration: nobody plans with it any more. Joining a sealed
   group takes priority over sealing one's own, which is what makes diverging plans converge; a
   leader that sees a lower leader's open seal listing it gives way (abandons its own group and
   joins that one), and a member left out of a commit first joins another open seal listing it.
   In a *direct* group the member also calls the leader (:mod:`.confirmation`): the call is its
   confirmation, and the answer is the commit, so steps 4-5 take one round trip instead of three
   DHT calls; the marker is still stored (without waiting), for the other peers' plans.
4. **Commit.** The leader stores the commit (the members that confirmed, in the sealed order) as
   soon as every other member confirmed or visibly went elsewhere, and at the latest at the commit
   time (``request_timeout`` after sealing, earlier if a member's deadline is nearer). A commit
   with fewer than ``min_group_size`` members (or no member able to run the all-reduce) abandons
   the group, and so does a group sealed full before anyone's scheduled time that is no longer
   whole (its members and the peers it left over then form full groups instead of waiting for
   their scheduled time).
5. **Return.** The leader returns the committed group; a member returns when it reads a commit
   that lists it. A member left out of a commit, and the members of an abandoned group, look again
   under a new attempt token, keeping their seniority.

Why members agree: the commit is written once, by one peer, and it is the only thing any peer
returns, so everyone who returns a group id returns the same ordered member list. A member is
committed only after it confirmed, and a confirmed peer waits for the commit instead of joining
anything else, so no peer is committed to two groups of one round. Attempt tokens are new for
every try, so records of earlier rounds or attempts (alive in the DHT until about one and a half
``request_timeout`` after their group was sealed: see :mod:`.lifetimes`) never match; consecutive
rounds may reuse the prefix.

Timing: once the last of four peers has declared, the group is final after four reads: one slow
(the leader sees the last declaration: up to one ``poll_interval`` if it was idle, within a fast
poll if it declared at the same moment) and three fast (members see the seal, the leader sees the
confirmations, members see the commit), each one call into the DHT process of 5-20 ms on a loaded
loopback. Measured with 4 peer processes on loopback (2 cores, default ``poll_interval`` of 50 ms,
12 rounds per run, other jobs sharing the cores), from the moment the last peer started looking:
97-175 ms (run medians 114 and 155 ms) when all start together, against 151-261 ms (medians 165 and
179 ms) with one read per poll interval and separate stores; 105-192 ms (median 147 ms, before:
125-245, median 154) when the last peer starts 0.5 s after the others, whose idle polls then wait
up to one ``poll_interval`` before they see it. The rest is the four DHT round trips themselves.
For scale, hivemind 1.1.12's ``DecentralizedAverager.step`` (RPC matchmaking plus an all-reduce of
4 floats) took 140-180 ms per round on the same machine.

Pace: the protocol counts its windows in poll intervals, meant as a few reads of the board. The
matchmaker times every read (each call into the DHT process that reads the board, a timed-out one
included) and steps the protocol on a configuration whose ``poll_interval`` is its *pace*:
``max(poll_interval, R)``, ``R`` the 3rd quartile of its last 16 read durations, at most
``request_timeout / 4`` (:mod:`.pace`); it also pauses that long between reads. With fast reads the
pace is ``poll_interval`` and nothing changes; on a slow DHT (internet reads of 0.1-1 s, or a
saturated machine) windows stretch to as many reads as they were meant to hold. The estimate
carries over from round to round; a rise above ``poll_interval`` is logged at DEBUG.

Failure modes
-------------
- *A peer dies after declaring.* Its declaration lives on for up to ``request_timeout``. If it is
  sealed into a group, it never confirms; the leader stops waiting for it once its declaration
  shows a missed refresh (:data:`.protocol.STALE_LEFT`, a third of ``request_timeout`` late), at
  the commit time at the latest, and commits without it (a full group sealed before the scheduled
  time too: only a live member that went elsewhere makes it abandon). If it was the leader of a
  planned group, the member after it seals the group without it once it has waited a quarter of
  ``request_timeout`` (the next after half, and so on: :data:`.protocol.DEPUTY_FRACTION`); a
  slow but live leader that seals too wins, and the deputy gives way. Others are delayed by a
  fraction of ``request_timeout``, never hung.
- *The leader dies after sealing.* Its members wait for the commit until ``request_timeout`` past
  the commit time, mark their attempt as left, and look again.
- *Different views.* Peers may read slightly different snapshots and plan different groups; two
  leaders may then seal groups that share a member. The member joins one; the other leader sees
  its marker and commits without it (or abandons, if too few remain). Wasted work, not
  disagreement. A leader that would abandon its group waits (until its commit time at most) for
  a member whose marker names a group that committed without it: that member joins this group
  once it reads that commit (it used to abandon, and the two honest peers then left each other
  out of their plans for three request timeouts).
- *Lost writes or reads.* A lost confirmation looks like a member that did not confirm; a failed
  read skips one poll. A leader whose commit cannot be stored raises :class:`MatchmakingError`
  and (best effort) abandons the group; its members then act as for a dead leader.
- *Known gap: a commit nobody could read in time.* If a member gives up on a commit (its deadline,
  or ``request_timeout`` past the commit time) just as the leader commits it, the others run the
  group with a member that left. The all-reduce must exclude members that do not show up (as
  DESIGN.md requires of it). Large clock skew between peers (hivemind allows a few seconds) widens this window.
- *Split swarm (hivemind issue 624).* Peers that bootstrapped into two separate DHTs see two
  separate boards and form groups only within each half; nothing in matchmaking can see the other
  half. The library does not try to repair the DHT: every peer should bootstrap from the same
  initial peers, and the multi-peer tests check that every DHT reads every other DHT's stores
  before they start matchmaking. Records live under one key read with ``latest=True``, which merges
  the answers of all nodes that hold it, so within one connected DHT no peer misses the board.
- *Large swarms.* Every poll reads the whole board of the group key (about 1 KB per signed record:
  each peer's declaration or marker, each group's seal and commit, those of rounds that ended less
  than about 1.5 ``request_timeout`` ago included, see :mod:`.lifetimes`) from every node that
  holds it. With a ``target_group_size``, peers carry rotation coordinates and, given the swarm's
  size (``expected_group_size``), read and write only
  their shard's board, which expects between one and ``target_group_size`` groups; a peer its
  shard cannot place visits the sibling shards' boards, where a group with room takes it in, then
  falls back to the coarser shard's board (see :mod:`.rotation`). Group bits
  (``initial_group_bits``, ``set_group_bits``) split the board the way hivemind does instead.
- *Hostile writers.* The DHT is open: records are validated and malformed ones skipped. Every
  record is signed by its writer's RSA key and believed only if it speaks for the peer that signed
  it (:mod:`.authenticity`): nobody can overwrite, withdraw or forge another peer's declaration,
  seal or commit. A peer can still declare false roles or bandwidth for itself, and declare under
  peer ids it makes up (a Sybil), which delays groups by up to ``request_timeout`` as a dead peer does.
  A peer that declares and never acts (never seals as a planned leader, never confirms) is left
  out of the plans of the peers it stalled for a few request timeouts (:class:`.protocol.Looking`),
  so refreshing its declaration cannot hold a group back for ever. A peer does not join seals of a
  leader that failed it after it joined (:attr:`.protocol.Looking.shunned`), nor seals whose commit or
  start time no honest leader would choose (far ahead, after its own deadline or scheduled time:
  :func:`.group.plausible`; nor do such seals take it out of other peers' plans), and accepts no
  direct answer longer than a commit of its group (:func:`.confirmation.answer_limits`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import secrets
import time
from collections.abc import Callable
from typing import Any

from hivemind import DHT
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from hivemind_ext.averaging.matchmaking.authenticity import authenticate_board
from hivemind_ext.averaging.matchmaking.board import Write, board_key, parse_board
from hivemind_ext.averaging.matchmaking.confirmation import Confirmations, with_commit, with_confirmations
from hivemind_ext.averaging.matchmaking.dht_store import store_direct, store_then_read
from hivemind_ext.averaging.matchmaking.group import (
    Board,
    Commit,
    Declaration,
    GroupInfo,
    MatchmakingConfig,
    Member,
    SealedGroup,
)
from hivemind_ext.averaging.matchmaking.listed import ListedPeers
from hivemind_ext.averaging.matchmaking.pace import ReadPace
from hivemind_ext.averaging.matchmaking.protocol import (
    URGENT_POLL_FRACTION,
    Following,
    Leading,
    Looking,
    State,
    Step,
    fall_back,
    leader_failed,
    step,
    withdrawal,
)
from hivemind_ext.averaging.matchmaking.rotation import shard_depth
from hivemind_ext.errors import (
    ClosedError,
    ConfigurationError,
    DeadlineExceededError,
    MatchmakingError,
    PeerUnreachableError,
    ProtocolError,
    RemoteError,
)
from hivemind_ext.p2p.dht_calls import DHTCalls
from hivemind_ext.p2p.signing import OwnerBook, default_signing_key, install_signing, owner_marker, signed_subkey
from hivemind_ext.p2p.tasks import TaskOwner

logger = logging.getLogger(__name__)
COMMIT_ATTEMPTS = 3  # the commit is the one write that must land: members only ever return a committed group

__all__ = ["GroupInfo", "Matchmaker", "MatchmakingConfig", "Member"]


class Matchmaker:
    """Finds averaging groups for one peer: the I/O around :func:`.protocol.step`.

    :param config: how to look for groups (prefix, group sizes, timeouts, this peer's role).
    :param dht: a running hivemind DHT; the matchmaker only stores and reads records through it.
    :param peer_id: this peer's id as other members will address it; defaults to the DHT's.
    :param dht_calls: the peer runtime's DHT helper (default: one of the matchmaker's own around ``dht``).
    :param signing_key: the RSA key the DHT signs this peer's records with (default: this DHT's, see
        :func:`~hivemind_ext.p2p.signing.default_signing_key`).
    :param on_read: called with the bytes of records (signed subkeys and msgpack values) that each
        read of the board returned, e.g. ``RoundStats.record_board_read`` (what a poll costs).
    :param confirmations: direct confirmations with leaders over libp2p (see :mod:`.confirmation`;
        started, i.e. serving, for this peer to seal direct groups itself); None: the board only.
    """

    def __init__(
        self,
        config: MatchmakingConfig,
        *,
        dht: DHT,
        peer_id: PeerID | None = None,
        dht_calls: DHTCalls | None = None,
        signing_key: RSAPrivateKey | None = None,
        on_read: Callable[[int], None] | None = None,
        confirmations: Confirmations | None = None,
    ) -> None:
        self.config = config
        self.confirmations = confirmations
        self._on_read = on_read
        self.peer_id = peer_id if peer_id is not None else dht.peer_id
        self._dht_calls = dht_calls if dht_calls is not None else DHTCalls(dht)
        if signing_key is None:
            signing_key = default_signing_key(dht) if dht is not None else RSAPrivateKey()
        self._signing_key, self._owner = signing_key, owner_marker(signing_key)
        self._signer = self.peer_id.to_base58()
        self.owners = OwnerBook(own=(self._signer, self._owner))  # whose key speaks for which peer id
        self._protected: set[str] = set()  # board keys whose unsigned entries the DHT already refuses
        self._busy = False
        # who this peer has seen on its board lately (the all-reduce's admission reserves slots for them)
        self.listed = ListedPeers()
        # how long this peer's board reads take, over rounds: the protocol's pace (see .pace)
        self.read_pace = ReadPace()
        self._logged_pace = config.poll_interval

    def lists(self, peer: PeerID) -> bool:
        """Whether ``peer`` was on this peer's matchmaking board recently (see :mod:`.listed`)."""
        return self.listed.lists(peer, get_dht_time())

    @property
    def _key(self) -> str:
        """The board of the current search's group key (see :mod:`.group_key`)."""
        return board_key(self.config.group_key)

    async def look_for_group(
        self,
        *,
        deadline: float,
        scheduled_time: float | None = None,
        expected_group_size: int | None = None,
        group_bits: str | None = None,
        digits: tuple[int, ...] | None = None,
        bandwidth: float | None = None,
    ) -> GroupInfo:
        """Wait until this peer is committed to a group, and return it.

        :param deadline: DHT time (``hivemind.utils.get_dht_time()``) at which to give up.
        :param scheduled_time: DHT time from which a group smaller than ``target_group_size`` is
            acceptable; defaults to now + ``min_matchmaking_time`` (capped at the deadline). A group
            that was sealed ahead of it with every peer that was looking (see :mod:`.timing`) is
            returned at this time, so that its all-reduce starts on schedule.
        :param group_bits: look only among peers with these group bits (default: the config's).
        :param digits: this peer's rotation coordinates (see :mod:`.rotation`; default: the config's).
            With ``target_group_size`` set, ``expected_group_size`` is then the swarm's size, which
            chooses the shard (:func:`.rotation.shard_depth`).
        :param bandwidth: declare this bandwidth (default: the config's), e.g. a measured one
        :raises MatchmakingError: no group by the deadline (or another search of this matchmaker
            is still running, or the DHT is shut down).
        :raises ConfigurationError: a time that is not a finite number.
        :raises asyncio.CancelledError: after withdrawing this peer's records (best effort).
        """
        if self._busy:
            raise MatchmakingError("look_for_group is already running for this matchmaker")
        self._busy = True
        config = self.config
        try:
            if expected_group_size is not None and expected_group_size != config.expected_group_size:
                self.config = dataclasses.replace(config, expected_group_size=expected_group_size)
            if group_bits is not None and group_bits != config.group_bits:
                self.config = dataclasses.replace(self.config, group_bits=group_bits)
            if digits is not None:
                self.config = self._rotated(digits, expected_group_size)
            if bandwidth is not None and bandwidth != config.bandwidth:
                self.config = dataclasses.replace(self.config, bandwidth=bandwidth)
            declaration = self._declaration(deadline, scheduled_time)
            await self._install_signing(declaration.deadline)
            return await self._look(declaration)
        finally:
            self.config = config
            self._busy = False

    def _rotated(self, digits: tuple[int, ...], swarm_size: int | None) -> MatchmakingConfig:
        """The configuration with these coordinates and the shard that a swarm of this size calls for."""
        base = self.config.target_group_size
        depth = shard_depth(swarm_size, base) if digits and base is not None else 0
        return dataclasses.replace(self.config, digits=tuple(digits), shard_depth=min(depth, len(digits)))

    async def prepare(self, *, timeout: float) -> None:
        """Sets up record signing for the current board key ahead of the first search (the averager
        calls it at start), so that the first round does not spend its matchmaking time on it.

        :raises MatchmakingError: the DHT did not answer in time (the first search tries again)
        """
        await self._install_signing(get_dht_time() + timeout)

    async def _install_signing(self, deadline: float) -> None:
        """Once per board key: the DHT signs this peer's records and refuses unsigned entries there.

        A call into this peer's own DHT process, bounded by the search's deadline only: capped at
        ``request_timeout`` (1 s in tests), it failed whole searches at once on a loaded machine,
        and the peers planned with the failed one then waited for it until their deadline."""
        if self._key in self._protected:
            return
        timeout = max(0.0, deadline - get_dht_time())
        try:
            await install_signing(self._dht_calls, self._signing_key, protected_keys=(self._key,), timeout=timeout)
        except (ClosedError, DeadlineExceededError, PeerUnreachableError) as e:
            raise MatchmakingError(f"could not set up record signing in the DHT: {e}") from e
        self._protected.add(self._key)

    def _declaration(self, deadline: float, scheduled_time: float | None) -> Declaration:
        if not all(isinstance(t, (int, float)) and math.isfinite(t) for t in (deadline, scheduled_time or 0.0)):
            raise ConfigurationError(
                f"deadline and scheduled_time must be finite DHT times: {deadline!r}, {scheduled_time!r}"
            )
        now = get_dht_time()
        if deadline <= now:
            raise MatchmakingError(f"the deadline {deadline} has already passed (now {now})")
        ready_at = now + self.config.min_matchmaking_time if scheduled_time is None else scheduled_time
        member = Member(
            peer_id=self.peer_id.to_base58(),
            attempt=secrets.token_hex(8),
            bandwidth=self.config.bandwidth,
            client_mode=self.config.client_mode,
            auxiliary=self.config.auxiliary,
        )
        ready_at = min(ready_at, deadline)
        return Declaration(
            member,
            self.config.group_key,
            declared_at=now,
            ready_at=ready_at,
            deadline=deadline,
            fingerprint=self.config.fingerprint,
            digits=self.config.digits,
        )

    async def _look(self, declaration: Declaration) -> GroupInfo:
        state: State = Looking(declaration)
        board: Board | None = Board()  # nothing read yet: the first step only declares
        direct = self.confirmations is not None and self.confirmations.serving and not self.config.client_mode
        try:
            while True:
                now = get_dht_time()
                if now >= declaration.deadline:
                    raise MatchmakingError(f"no averaging group under {self.config.group_key!r} before the deadline")
                if not self._dht_calls.is_alive():  # its pipe would swallow our requests and never answer
                    raise MatchmakingError("the DHT process is not running")
                urgent = read_now = False
                config = self._paced()  # the protocol counts in reads: at this peer's pace
                if board is not None:  # None: the read failed, skip this poll
                    result = step(state, now, self._leader_view(state, board), config, direct=direct)
                    urgent = result.urgent
                    if type(result.state) is not type(state):
                        logger.debug("%s: %s -> %s", self.peer_id, type(state).__name__, type(result.state).__name__)
                    previous, state = state, result.state  # before the writes: if they are cancelled, withdraw from it
                    self._track_direct_group(previous, result)
                    if result.fall_back:  # my shard is too empty: on to a sibling's or the coarser shard's board
                        state, board = await self._fall_back(state.declaration, result.hop), Board()
                        continue
                    if result.group is not None:
                        await self._finish(state, result.writes, result.group, declaration.deadline)
                        await asyncio.sleep(max(0.0, min(result.start_at, declaration.deadline) - get_dht_time()))
                        return result.group
                    if _joined_direct_group(previous, state):
                        for write in result.writes:  # for the other peers' plans: the leader counts my call
                            self._store_nowait(write, self._key)
                        state, board = await self._ask_leader(state, declaration.deadline)
                        continue
                    # Having just (re)declared, read at once in the same call: peers that started at the
                    # same moment are on the board by now. After any other write, nobody has answered yet.
                    read_now = bool(result.writes) and isinstance(state, Looking)
                    if result.writes:
                        _, read = await self._exchange(result.writes, read_now, declaration.deadline)
                        # a direct group's leader that just sealed waits for its members' calls at once (on
                        # the board it sealed from): a read first held back the step on a call by up to
                        # a pause and a read (10-40 ms on a loaded loopback)
                        board = board if not read_now and _awaits_calls(self.confirmations, state) else read
                if not read_now:
                    pause = config.poll_interval * (URGENT_POLL_FRACTION if urgent else 1.0)
                    if _awaits_calls(self.confirmations, state) and board is not None:
                        board = await self._read_unless_called(board, declaration.deadline)
                        continue
                    await asyncio.sleep(max(0.0, min(pause, declaration.deadline - get_dht_time())))
                    _, board = await self._exchange((), True, declaration.deadline)
        except BaseException:
            self._withdraw(state)
            raise

    def _paced(self) -> MatchmakingConfig:
        """The configuration the protocol steps on: this peer's, at the pace of its reads (:mod:`.pace`)."""
        config = self.read_pace.paced(self.config)
        pace = config.poll_interval
        if pace > self.config.poll_interval and not 0.8 * self._logged_pace <= pace <= 1.25 * self._logged_pace:
            logger.debug(
                "%s: DHT reads take %.3f s: matchmaking paces at %.3f s instead of poll_interval %.3f s",
                self.peer_id,
                self.read_pace.estimate(),
                pace,
                self.config.poll_interval,
            )
            self._logged_pace = pace
        elif pace <= self.config.poll_interval:
            self._logged_pace = pace
        return config

    def _leader_view(self, state: State, board: Board) -> Board:
        """What the protocol steps on: the board, and for the leader of a direct group, the calls it
        received as its members' confirmations (see :func:`.confirmation.with_confirmations`)."""
        if self.confirmations is None or not _awaits_calls(self.confirmations, state):
            return board
        self.confirmations.changed.clear()  # calls from now on wake the next wait
        return with_confirmations(board, state.group, self.confirmations.confirmed(state.group.group_id))

    def _track_direct_group(self, previous: State, result: Step) -> None:
        """Opens this peer's desk for a direct group it just sealed, and answers its callers once the
        group is committed or abandoned."""
        if self.confirmations is None:
            return
        state = result.state
        if isinstance(previous, Leading) and previous.group.direct:
            if result.group is not None or not isinstance(state, Leading) or state.group != previous.group:
                members = result.group.members if result.group is not None else ()
                self.confirmations.settle(Commit(previous.group.group_id, tuple(m.key for m in members)))
        # a new direct group: sealed now, or resealed by its leader with a peer it took in (protocol._take_in)
        if isinstance(state, Leading) and state.group.direct and not _leads(previous, state.group):
            self.confirmations.open(state.group)

    async def _read_unless_called(self, board: Board, deadline: float) -> Board:
        """A direct group's leader reads the board once a poll interval (members that went elsewhere,
        a lower leader's seal listing it), and steps at once when a member calls, even mid-read
        (a read under load takes hundreds of milliseconds): the read is then dropped, and the last
        board is stepped on again with the new confirmation (see :meth:`_leader_view`)."""
        confirmations = self.confirmations
        if confirmations is None:
            return board
        pause = max(0.0, min(self._paced().poll_interval, deadline - get_dht_time()))
        async with TaskOwner("a direct leader's wait") as owner:
            called = owner.spawn(confirmations.changed.wait(), report_errors=False)
            read = owner.spawn(self._pause_then_read(pause, deadline), report_errors=False)
            await asyncio.wait((called, read), return_when=asyncio.FIRST_COMPLETED)
            if called.done() or not read.done():
                return board
        return read.result() or board

    async def _pause_then_read(self, pause: float, deadline: float) -> Board | None:
        await asyncio.sleep(pause)
        return (await self._exchange((), True, deadline))[1]

    async def _ask_leader(self, state: Following, deadline: float) -> tuple[State, Board | None]:
        """Confirms a direct group by calling its leader; returns the state to go on from and the
        board to step on next (None: read the board first).

        The leader's commit comes back on the board the protocol steps on, so it decides as if it
        had read the commit there (a member left out reads the board first: another seal may list
        it). A leader that refuses or answers with anything but a commit of the group is left
        (:func:`.protocol.leader_failed`), and so is one that does not answer until one
        ``request_timeout`` past its commit time; one that cannot be reached (or whose answer got
        lost on the way) is waited for on the board, where its commit lands too."""
        group, me = state.group, state.declaration.member.key
        timeout = min(group.commit_by + self.config.request_timeout, deadline) - get_dht_time()
        try:
            commit = await self.confirmations.confirm(group, me, timeout=max(0.0, timeout))
        except (ProtocolError, RemoteError, DeadlineExceededError) as e:
            # lying, refusing, or silent until one request_timeout past its commit time (as a dead one)
            logger.info("%s: leaving the group of %s: %s", self.peer_id, group.leader.peer_id, e)
            failed = leader_failed(state, get_dht_time(), self._paced())
            _, board = await self._exchange(failed.writes, True, deadline)
            return failed.state, board
        except PeerUnreachableError as e:
            logger.debug("%s: the leader %s is unreachable (%s): reading the board", self.peer_id, group.leader, e)
            return state, None
        board: Board | None = Board()
        if me not in commit.members:
            _, board = await self._exchange((), True, deadline)
        return state, with_commit(board or Board(), commit)

    async def _finish(self, state: State, writes: tuple[Write, ...], group: GroupInfo, deadline: float) -> None:
        """A leader's last step: its members have the commit of a direct group already (stored
        without waiting, for the others' plans; their answers leave before the caller's round starts,
        see :meth:`.Confirmations.let_answers_out`); a board group's commit must land first."""
        if isinstance(state, Leading) and state.group.direct:
            for write in writes:
                self._store_nowait(write, self._key)
            if self.confirmations is not None:
                await self.confirmations.let_answers_out(state.group.group_id)
        elif writes and not await self.commit(writes, group, deadline):
            # members would never read the commit; withdrawing abandons it
            raise MatchmakingError("the group's commit could not be stored in the DHT")

    async def _fall_back(self, declaration: Declaration, hop: int = 0) -> Looking:
        """Withdraws ``declaration`` from its shard's board and moves this search to the coarser shard,
        or with ``hop`` (:attr:`.protocol.Step.hop`) to the next sibling shard as a stray (see
        :mod:`.rotation`); returns the new state, whose next step declares there."""
        self.config, state, left = fall_back(declaration, get_dht_time(), self.config, hop)
        self._store_nowait(left, board_key(declaration.prefix))
        logger.debug("%s: shard %r too empty, moving to %r", self.peer_id, declaration.prefix, self._key)
        await self._install_signing(declaration.deadline)
        return state

    async def commit(self, writes: tuple[Write, ...], group: GroupInfo, deadline: float) -> bool:
        """Stores the leader's commit; True once the store succeeded or the commit is on the board.
        (The leader's last protocol step, run by :meth:`look_for_group`; public so that it can be
        tested alone, through a DHT that the constructor's ``dht_calls`` stands for.)

        Reading it back is the test that matters (members return a group when they read its commit),
        and a failed store does not mean it is absent: a store that waits for a slow replica may
        time out after others took it, and a replica that holds the commit refuses the same record
        again on a retry. Raising then would leave the members running the group without their
        leader, who would look for another group until its deadline.
        """
        group_id = group.group_id.hex()
        for _ in range(COMMIT_ATTEMPTS):  # a loaded DHT may time out a store: try again
            stored, _ = await self._exchange(writes, False, deadline, all_replicas=True)
            if stored:
                return True
            _, board = await self._exchange((), True, deadline)
            if board is not None and group_id in board.commits:
                return True
            if get_dht_time() >= deadline:
                break
            logger.debug("%s: storing the group's commit failed, retrying", self.peer_id)
        return False

    async def _exchange(
        self, writes: tuple[Write, ...], read: bool, deadline: float, *, all_replicas: bool = False
    ) -> tuple[bool, Board | None]:
        """Store ``writes`` (all in one DHT store), then, if ``read``, read the board: one call to the
        DHT process. Returns whether every write was stored, and the board (None if not read or the
        call failed). The protocol tolerates lost writes (except a leader's commit), so a failed
        write is only logged."""
        signed = tuple(dataclasses.replace(write, subkey=self._signed(write.subkey)) for write in writes)
        request = functools.partial(store_then_read, self._key, signed, read, all_replicas)
        # at most request_timeout, and never past the deadline (a DHT time: converted to the loop clock)
        timeout = max(0.0, min(self.config.request_timeout, deadline - get_dht_time()))
        started = time.monotonic()
        try:
            stored, entries = await self._dht_calls.run_coroutine(request, timeout=timeout)
        except ClosedError as e:
            raise MatchmakingError("the DHT process is not running") from e
        except DeadlineExceededError:  # the protocol tolerates a lost read or write: skip this poll
            logger.debug("a matchmaking DHT call timed out after %.3f s", timeout)
            if read:  # a read as slow as that, as far as the pace goes
                self.read_pace.record(time.monotonic() - started)
            return not writes, None
        except PeerUnreachableError as e:  # the DHT process reported a failure
            logger.warning("a matchmaking DHT call failed: %r", e.__cause__ or e)
            return not writes, None
        if read:
            self.read_pace.record(time.monotonic() - started)
        if not stored:
            logger.debug("some of the matchmaking records %s were not stored", [w.subkey for w in writes])
        if entries is None:
            return stored, None
        if self._on_read is not None:
            self._on_read(sum(_record_bytes(subkey, value) for subkey, value, _ in entries))
        now = get_dht_time()
        believed = authenticate_board(entries, self.owners, now)
        board = parse_board(self.config.group_key, believed, now, self.config.fingerprint)
        self.listed.update(board, now)
        return stored, board

    def _signed(self, subkey: Any) -> bytes:
        """The subkey a record of this peer is stored under: signed by its key, speaking for it."""
        return signed_subkey(subkey, self._signer, self._owner)

    def _withdraw(self, state: State) -> None:
        """Best effort, without waiting: the stores run in the DHT process even after we return."""
        if self.confirmations is not None and isinstance(state, Leading) and state.group.direct:
            self.confirmations.settle(Commit(state.group.group_id, ()))  # its callers look again at once
        if not self._dht_calls.is_alive():
            return
        for write in withdrawal(state, get_dht_time(), self.config):
            self._store_nowait(write, self._key)

    def _store_nowait(self, write: Write, key: str) -> None:
        """Best effort, without waiting: the store runs in the DHT process even after we return.

        It searches only the ``num_replicas`` nearest nodes, as every other matchmaking store does:
        a plain ``dht.store`` searches with hivemind's beam of 20, which on a small swarm visits every
        node, and every node that holds the board answers with the whole board, which the DHT
        process then validates record by record (RSA signatures). These stores are the members'
        markers and the leader's commit of a direct group, so that work landed right on the round's
        all-reduce (measured with benchmarks/scale.py's peers, 8 in one process, groups of 8: the
        DHT thread's CPU during each 4 KiB all-reduce went from 45 to 25 ms in 3-round runs, and
        from 108-114 to 99 ms in 8-round runs, whose boards hold more rounds' records). What is
        left there was mostly these stores' own search: each node it asks answers with the board, so
        now they skip it where they can (see :func:`.dht_store.store_direct`)."""
        try:
            signed = dataclasses.replace(write, subkey=self._signed(write.subkey))
            self._dht_calls.run_coroutine_nowait(functools.partial(store_direct, key, (signed,)))
        except Exception as e:  # a DHT that is already shut down cannot take the store
            logger.debug("could not store matchmaking record %s: %r", write.subkey, e)


def _awaits_calls(confirmations: Confirmations | None, state: State) -> bool:
    """Whether this peer leads a direct group: its members' calls, not only the board, move it on."""
    return confirmations is not None and isinstance(state, Leading) and state.group.direct


def _leads(state: State, group: SealedGroup) -> bool:
    """Whether ``state`` leads ``group`` already."""
    return isinstance(state, Leading) and state.group == group


def _joined_direct_group(previous: State, state: State) -> bool:
    """Whether this step joined a direct group (see :mod:`.confirmation`): its leader is called next."""
    joined = isinstance(state, Following) and state.group.direct
    return joined and not (isinstance(previous, Following) and previous.group == state.group)


def _record_bytes(subkey: Any, value: Any) -> int:
    """The size of one record as the DHT returned it (its subkey and its msgpack-encoded value)."""
    size = len(subkey) if isinstance(subkey, (bytes, str)) else 0
    try:
        return size + len(MSGPackSerializer.dumps(value))
    except Exception:  # a value msgpack cannot encode came from a hostile writer: count its subkey only
        return size
