"""The caller's half of the direct data path: tickets (tokens and session keys) per peer, connect and hello.

See :mod:`~hivemind_ext.p2p.direct_wire` for the protocol and :mod:`~hivemind_ext.p2p.direct_records`
for the encryption. :meth:`DirectConnector.connect` either returns a connection whose hello the
server accepted, or None: it never raises for a failed attempt (no ticket handler, refused,
unreachable, timed out, an answer not sealed with the token's key, rejected), so that the caller
falls back to libp2p transparently; the typed error of the last failure per peer is kept
(:meth:`DirectConnector.last_failure`) and logged at debug level. A peer whose direct path failed is
not tried again for ``retry_after`` seconds, so a peer without it costs one failed attempt, not one
per call.

Tickets are fetched ``tokens_per_ticket`` at a time (one libp2p round trip serves that many
connections) and used until shortly before they expire.

Reuse: a connection whose call ended cleanly comes back through :meth:`DirectConnector.release`
into an idle pool per peer (if the server's ticket offered reuse, see direct_wire); the next
:meth:`DirectConnector.connect` to that peer takes it instead of a token, a TCP connect and a hello,
sends the handler name and returns at once (the server's ACCEPTED byte is read before the first
response frame). Idle connections expire (``idle_timeout``, and sooner than the server's), are
bounded per peer and in all (:class:`~hivemind_ext.p2p.bounded_idle.BoundedIdle`), and leave the
pool as soon as the server ends them. The server may still end one just as a call is sent on it:
the caller (:class:`~hivemind_ext.p2p.client.RPCClient`) then calls again on a fresh connection
(``connect(..., reuse=False)``).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import math
import socket
import time
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from hivemind.p2p import PeerID

from hivemind_ext.errors import (
    AuthenticationError,
    ConfigurationError,
    HivemindExtError,
    PeerUnreachableError,
    ProtocolError,
)
from hivemind_ext.p2p.bounded_idle import BoundedIdle
from hivemind_ext.p2p.deadlines import check_durations, now, wait_until
from hivemind_ext.p2p.direct_records import CALLER
from hivemind_ext.p2p.direct_transport import DirectStream, connect_tcp, seal, start_client_session
from hivemind_ext.p2p.direct_wire import (
    ACCEPTED,
    MAX_HANDLER_NAME_BYTES,
    MAX_TOKENS_PER_TICKET,
    Transport,
    encode_handler_name,
    encode_hello,
    parse_ticket_response,
    ticket_request,
)
from hivemind_ext.p2p.messages import Message

logger = logging.getLogger(__name__)

# Stop using a token this long before the server forgets it (the server's clock started earlier).
TOKEN_EXPIRY_MARGIN = 2.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class DirectClientConfig:
    """How a caller uses the direct data path.

    :param ticket_timeout: the ticket call over libp2p gives up after this long
    :param connect_timeout: TCP connect, hello and its acknowledgement give up after this long
    :param retry_after: after a failure, the peer is reached over libp2p only for this long
    :param tokens_per_ticket: tokens fetched per ticket call
    :param max_peers: peers whose tickets are remembered (least recently used are forgotten)
    :param allow_plaintext: also use servers that offer a plaintext direct path (their data
      crosses the network unencrypted); off by default: such servers are reached over libp2p
    :param idle_timeout: a connection idle this long is closed (at most 3/4 of the server's own
      idle time from its ticket, so that the server does not close it under a new call)
    :param max_idle_per_peer: idle connections kept per peer (beyond this the oldest is closed)
    :param max_idle: idle connections kept in all (beyond this the oldest is closed)
    """

    ticket_timeout: float = 5.0
    connect_timeout: float = 3.0
    retry_after: float = 60.0
    tokens_per_ticket: int = 8
    max_peers: int = 1024
    allow_plaintext: bool = False
    idle_timeout: float = 20.0
    max_idle_per_peer: int = 8
    max_idle: int = 256

    def __post_init__(self) -> None:
        check_durations(self, "ticket_timeout", "connect_timeout", "retry_after", "idle_timeout")
        for name in ("max_idle_per_peer", "max_idle"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ConfigurationError(f"{name} must be a non-negative int, got {value!r}")
        if type(self.tokens_per_ticket) is not int or not 1 <= self.tokens_per_ticket <= MAX_TOKENS_PER_TICKET:
            raise ConfigurationError(f"tokens_per_ticket must be an int in 1..{MAX_TOKENS_PER_TICKET}")
        if type(self.max_peers) is not int or self.max_peers < 1:
            raise ConfigurationError(f"max_peers must be a positive int, got {self.max_peers!r}")
        if not isinstance(self.allow_plaintext, bool):
            raise ConfigurationError(f"allow_plaintext must be a bool, got {self.allow_plaintext!r}")


@dataclasses.dataclass
class _PeerTickets:
    host: str = ""
    port: int = 0
    # (token, its session key or None for plaintext, expiry time)
    tokens: collections.deque[tuple[bytes, bytes | None, float]] = dataclasses.field(default_factory=collections.deque)
    reuse: float | None = None  # how long this side keeps a connection idle (from the ticket); None: no reuse
    failed_until: float = -math.inf  # time.monotonic(), like the token expiry times
    last_failure: HivemindExtError | None = None
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)


# (peer, request, deadline) -> the ticket response, over libp2p
TicketCall = Callable[[PeerID, Message, float], Awaitable[Message]]
Connection = tuple[DirectStream, asyncio.StreamWriter]
# the client's idle time is at most this share of the server's (see DirectClientConfig.idle_timeout)
IDLE_SHARE_OF_SERVER = 0.75


class Opened(NamedTuple):
    """A direct connection ready for a call: a new one whose hello was accepted, or a reused one
    (``reused``) whose ACCEPTED byte for this call is still to be read before the first frame."""

    connection: Connection
    transport: Transport
    reused: bool


@dataclasses.dataclass(eq=False)
class _Idle:
    connection: Connection
    transport: Transport
    timer: asyncio.TimerHandle | None = None

    def usable(self) -> bool:
        reader, writer = self.connection
        return reader.reusable and not writer.is_closing()

    def close(self) -> None:
        self.stop_watching()
        self.connection[1].transport.abort()

    def stop_watching(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.connection[0].on_end = None


class DirectConnector:
    """Opens direct connections to peers' handlers, with tickets fetched through ``ticket_call``
    (over libp2p: the session keys arrive only over that authenticated channel)."""

    def __init__(self, ticket_call: TicketCall, config: DirectClientConfig | None = None) -> None:
        self.config = config if config is not None else DirectClientConfig()
        self._ticket_call = ticket_call
        self._peers: collections.OrderedDict[PeerID, _PeerTickets] = collections.OrderedDict()
        # idle connections, oldest first (a peer's newest is taken first)
        self._idle: BoundedIdle[PeerID, _Idle] = BoundedIdle(
            self.config.max_idle_per_peer, self.config.max_idle, lambda _, idle: idle.close()
        )
        self.opened = 0  # new connections whose hello was accepted
        self.reused = 0  # calls sent on an idle connection

    def idle_count(self, peer_id: PeerID | None = None) -> int:
        """Idle connections (to ``peer_id``, or in all)."""
        return len(self._idle) if peer_id is None else self._idle.count(peer_id)

    def release(self, peer_id: PeerID, connection: Connection, transport: Transport) -> None:
        """Takes back a connection whose call ended cleanly (the caller checked that nothing is left
        unread or half written): kept idle for the next call to ``peer_id`` where the server offers
        reuse and the bounds allow, else closed. It leaves the pool once it expires or the server
        ends it."""
        state = self._peers.get(peer_id)
        idle = _Idle(connection, transport)
        if state is None or state.reuse is None or not idle.usable():
            idle.close()
            return
        if not self._idle.add(peer_id, idle):
            return  # a bound is 0: closed at once
        seconds = min(self.config.idle_timeout, state.reuse * IDLE_SHARE_OF_SERVER)
        idle.timer = asyncio.get_running_loop().call_later(seconds, self._idle.drop, idle)
        connection[0].on_end = functools.partial(self._idle.drop, idle)

    def close(self) -> None:
        """Closes every idle connection (calls in progress keep theirs, closed when they end)."""
        self._idle.drop_all()

    def take_idle(self, peer_id: PeerID) -> _Idle | None:
        """The newest usable idle connection to ``peer_id``, taken out of the pool: the caller owns it
        (it calls on it, or closes it). Unusable ones met on the way are closed."""
        while (idle := self._idle.take(peer_id)) is not None:
            idle.stop_watching()
            if idle.usable():
                return idle
            idle.close()  # it broke without the protocol noticing yet: try the next one
        return None

    def is_failing(self, peer_id: PeerID) -> bool:
        """True while ``peer_id`` is not tried directly after a failure (callable from any thread)."""
        state = self._peers.get(peer_id)
        return state is not None and time.monotonic() < state.failed_until

    def last_failure(self, peer_id: PeerID) -> HivemindExtError | None:
        """Why the last direct attempt to ``peer_id`` failed (a typed error), or None."""
        state = self._peers.get(peer_id)
        return state.last_failure if state is not None else None

    async def connect(self, peer_id: PeerID, handler: str, deadline: float, *, reuse: bool = True) -> Opened | None:
        """A connection to ``handler`` on ``peer_id``: an idle one (the handler name sent, its
        ACCEPTED byte not yet read; not with ``reuse=False``) or a new one whose hello was accepted;
        or None (use libp2p)."""
        state = self._state(peer_id)
        reusable = reuse and 1 <= len(handler.encode()) <= MAX_HANDLER_NAME_BYTES
        idle = self.take_idle(peer_id) if reusable else None
        if idle is not None:
            idle.connection[1].write(encode_handler_name(handler))
            self.reused += 1
            return Opened(idle.connection, idle.transport, True)
        if time.monotonic() < state.failed_until:
            return None
        try:
            token = await self._take_token(peer_id, state, deadline)
            connection = await wait_until(
                self._open(state, token, handler),
                min(deadline, now() + self.config.connect_timeout),
                f"direct connection to {peer_id}",
            )
            state.last_failure = None
            self.opened += 1
            return Opened(connection, "direct" if token[1] is not None else "direct-plaintext", False)
        except (HivemindExtError, ConnectionError, OSError) as e:
            error = e if isinstance(e, HivemindExtError) else _typed(e)
            logger.debug(f"direct path to {peer_id} failed, using libp2p: {type(error).__name__}: {error}")
            state.last_failure = error
            state.tokens.clear()  # a rejected token may mean the server restarted: its other tokens are void too
            state.failed_until = time.monotonic() + self.config.retry_after
            return None

    def _state(self, peer_id: PeerID) -> _PeerTickets:
        state = self._peers.get(peer_id)
        if state is None:
            state = self._peers[peer_id] = _PeerTickets()
            while len(self._peers) > self.config.max_peers:
                self._peers.popitem(last=False)
        else:
            self._peers.move_to_end(peer_id)
        return state

    async def _take_token(self, peer_id: PeerID, state: _PeerTickets, deadline: float) -> tuple[bytes, bytes | None]:
        """(token, its session key or None for a plaintext server), fetching a ticket if none is left."""
        async with state.lock:  # concurrent calls to one peer share one ticket call
            while state.tokens and state.tokens[0][2] <= time.monotonic():
                state.tokens.popleft()
            if not state.tokens:
                asked_at = time.monotonic()
                request = Message(ticket_request(self.config.tokens_per_ticket))
                response = await self._ticket_call(peer_id, request, min(deadline, now() + self.config.ticket_timeout))
                ticket = parse_ticket_response(response.header)
                if ticket.keys is None and not self.config.allow_plaintext:
                    raise ProtocolError("the peer offers only a plaintext direct path (allow_plaintext is off)")
                state.host, state.port, state.reuse = ticket.host, ticket.port, ticket.reuse
                keys = ticket.keys if ticket.keys is not None else [None] * len(ticket.tokens)
                expiry = asked_at + ticket.ttl - TOKEN_EXPIRY_MARGIN
                state.tokens.extend((token, key, expiry) for token, key in zip(ticket.tokens, keys, strict=True))
            token, key, _ = state.tokens.popleft()
            return token, key

    async def _open(self, state: _PeerTickets, token: tuple[bytes, bytes | None], handler: str) -> Connection:
        sock = await connect_tcp(state.host, state.port)  # failing here: the peer is unreachable
        try:  # past this point the server is reached: a failure is a refusal of this caller (or a false server)
            return await self._session(sock, token, handler)
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            raise AuthenticationError(f"the server ended the direct connection before accepting it: {e!r}") from None

    async def _session(self, sock: socket.socket, token: tuple[bytes, bytes | None], handler: str) -> Connection:
        reader, writer = await start_client_session(sock)
        try:
            writer.write(encode_hello(token[0]))
            if token[1] is not None:  # the server's answer must authenticate under the key too
                reader, writer = seal(reader, writer, token[1], CALLER)
            writer.write(encode_handler_name(handler))
            answer = await reader.readexactly(1)
        except BaseException:
            writer.transport.abort()
            raise
        if answer != ACCEPTED:
            writer.transport.abort()
            raise AuthenticationError("the server rejected the direct token")
        return reader, writer


def _typed(error: OSError) -> HivemindExtError:
    return PeerUnreachableError(f"{type(error).__name__}: {error}")
