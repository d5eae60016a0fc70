"""The caller's half of the opt-in direct data path: tickets per peer, TCP connect and hello.

See :mod:`~hivemind_ext.p2p.direct_wire` for the protocol. :meth:`DirectConnector.connect` either
returns a TCP connection whose hello the server accepted, or None: it never raises for a failed
attempt (no ticket handler, refused, unreachable, timed out, rejected), so that the caller falls
back to libp2p transparently. A peer whose direct path failed is not tried again for
``retry_after`` seconds, so a peer without it costs one failed attempt, not one per call.

Tickets are fetched ``tokens_per_ticket`` at a time (one libp2p round trip serves that many
connections) and used until shortly before they expire.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable

from hivemind.p2p import PeerID

from hivemind_ext.errors import ConfigurationError, HivemindExtError
from hivemind_ext.p2p.deadlines import check_durations, now, wait_until
from hivemind_ext.p2p.direct_transport import DirectStream, open_direct_connection
from hivemind_ext.p2p.direct_wire import ACCEPTED, MAX_TOKENS_PER_TICKET, encode_hello, parse_ticket_response
from hivemind_ext.p2p.messages import Message

logger = logging.getLogger(__name__)

# Stop using a token this long before the server forgets it (the server's clock started earlier).
TOKEN_EXPIRY_MARGIN = 2.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class DirectClientConfig:
    """How a caller uses the direct data path.

    :param ticket_timeout: the ticket call over libp2p gives up after this long
    :param connect_timeout: TCP connect plus hello and its acknowledgement give up after this long
    :param retry_after: after a failure, the peer is reached over libp2p only for this long
    :param tokens_per_ticket: tokens fetched per ticket call
    :param max_peers: peers whose tickets are remembered (least recently used are forgotten)
    """

    ticket_timeout: float = 5.0
    connect_timeout: float = 3.0
    retry_after: float = 60.0
    tokens_per_ticket: int = 8
    max_peers: int = 1024

    def __post_init__(self) -> None:
        check_durations(self, "ticket_timeout", "connect_timeout", "retry_after")
        if type(self.tokens_per_ticket) is not int or not 1 <= self.tokens_per_ticket <= MAX_TOKENS_PER_TICKET:
            raise ConfigurationError(f"tokens_per_ticket must be an int in 1..{MAX_TOKENS_PER_TICKET}")
        if type(self.max_peers) is not int or self.max_peers < 1:
            raise ConfigurationError(f"max_peers must be a positive int, got {self.max_peers!r}")


@dataclasses.dataclass
class _PeerTickets:
    host: str = ""
    port: int = 0
    tokens: collections.deque[tuple[bytes, float]] = dataclasses.field(default_factory=collections.deque)
    failed_until: float = -math.inf  # time.monotonic(), like the token expiry times
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)


# (peer, request, deadline) -> the ticket response, over libp2p
TicketCall = Callable[[PeerID, Message, float], Awaitable[Message]]
Connection = tuple[DirectStream, asyncio.StreamWriter]


class DirectConnector:
    """Opens direct TCP connections to peers' handlers, with tickets fetched through ``ticket_call``."""

    def __init__(self, ticket_call: TicketCall, config: DirectClientConfig | None = None) -> None:
        self.config = config if config is not None else DirectClientConfig()
        self._ticket_call = ticket_call
        self._peers: collections.OrderedDict[PeerID, _PeerTickets] = collections.OrderedDict()

    def is_failing(self, peer_id: PeerID) -> bool:
        """True while ``peer_id`` is not tried directly after a failure (callable from any thread)."""
        state = self._peers.get(peer_id)
        return state is not None and time.monotonic() < state.failed_until

    async def connect(self, peer_id: PeerID, handler: str, deadline: float) -> Connection | None:
        """A connection to ``handler`` on ``peer_id`` whose hello was accepted, or None (use libp2p)."""
        state = self._state(peer_id)
        if time.monotonic() < state.failed_until:
            return None
        try:
            token = await self._take_token(peer_id, state, deadline)
            return await wait_until(
                self._open(state.host, state.port, token, handler),
                min(deadline, now() + self.config.connect_timeout),
                f"direct connection to {peer_id}",
            )
        except (HivemindExtError, ConnectionError, OSError) as e:
            logger.debug(f"direct path to {peer_id} failed, using libp2p: {type(e).__name__}: {e}")
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

    async def _take_token(self, peer_id: PeerID, state: _PeerTickets, deadline: float) -> bytes:
        async with state.lock:  # concurrent calls to one peer share one ticket call
            while state.tokens and state.tokens[0][1] <= time.monotonic():
                state.tokens.popleft()
            if not state.tokens:
                asked_at = time.monotonic()
                request = Message({"count": self.config.tokens_per_ticket})
                response = await self._ticket_call(peer_id, request, min(deadline, now() + self.config.ticket_timeout))
                host, port, ttl, tokens = parse_ticket_response(response.header)
                expires_at = asked_at + ttl - TOKEN_EXPIRY_MARGIN
                state.host, state.port = host, port
                state.tokens.extend((token, expires_at) for token in tokens)
            return state.tokens.popleft()[0]

    @staticmethod
    async def _open(host: str, port: int, token: bytes, handler: str) -> Connection:
        reader, writer = await open_direct_connection(host, port)
        try:
            writer.write(encode_hello(token, handler))
            answer = await reader.readexactly(1)
        except asyncio.IncompleteReadError:
            writer.transport.abort()
            raise ConnectionRefusedError("the server closed the direct connection during the hello") from None
        except BaseException:
            writer.transport.abort()
            raise
        if answer != ACCEPTED:
            writer.transport.abort()
            raise ConnectionRefusedError("the server rejected the direct token")
        return reader, writer
