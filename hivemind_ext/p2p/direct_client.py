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
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import socket
import time
from collections.abc import Awaitable, Callable

from hivemind.p2p import PeerID

from hivemind_ext.errors import (
    AuthenticationError,
    ConfigurationError,
    HivemindExtError,
    PeerUnreachableError,
    ProtocolError,
)
from hivemind_ext.p2p.deadlines import check_durations, now, wait_until
from hivemind_ext.p2p.direct_records import CALLER
from hivemind_ext.p2p.direct_transport import DirectStream, connect_tcp, seal, start_client_session
from hivemind_ext.p2p.direct_wire import (
    ACCEPTED,
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
    """

    ticket_timeout: float = 5.0
    connect_timeout: float = 3.0
    retry_after: float = 60.0
    tokens_per_ticket: int = 8
    max_peers: int = 1024
    allow_plaintext: bool = False

    def __post_init__(self) -> None:
        check_durations(self, "ticket_timeout", "connect_timeout", "retry_after")
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
    failed_until: float = -math.inf  # time.monotonic(), like the token expiry times
    last_failure: HivemindExtError | None = None
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)


# (peer, request, deadline) -> the ticket response, over libp2p
TicketCall = Callable[[PeerID, Message, float], Awaitable[Message]]
Connection = tuple[DirectStream, asyncio.StreamWriter]


class DirectConnector:
    """Opens direct connections to peers' handlers, with tickets fetched through ``ticket_call``
    (over libp2p: the session keys arrive only over that authenticated channel)."""

    def __init__(self, ticket_call: TicketCall, config: DirectClientConfig | None = None) -> None:
        self.config = config if config is not None else DirectClientConfig()
        self._ticket_call = ticket_call
        self._peers: collections.OrderedDict[PeerID, _PeerTickets] = collections.OrderedDict()

    def is_failing(self, peer_id: PeerID) -> bool:
        """True while ``peer_id`` is not tried directly after a failure (callable from any thread)."""
        state = self._peers.get(peer_id)
        return state is not None and time.monotonic() < state.failed_until

    def last_failure(self, peer_id: PeerID) -> HivemindExtError | None:
        """Why the last direct attempt to ``peer_id`` failed (a typed error), or None."""
        state = self._peers.get(peer_id)
        return state.last_failure if state is not None else None

    async def connect(self, peer_id: PeerID, handler: str, deadline: float) -> tuple[Connection, Transport] | None:
        """A connection to ``handler`` on ``peer_id`` whose hello was accepted, and which path it is;
        or None (use libp2p)."""
        state = self._state(peer_id)
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
            return connection, "direct" if token[1] is not None else "direct-plaintext"
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
                state.host, state.port = ticket.host, ticket.port
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
