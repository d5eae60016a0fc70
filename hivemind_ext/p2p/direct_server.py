"""The server's half of the direct data path: its settings, its tokens and keys, its TCP listener.

See :mod:`~hivemind_ext.p2p.direct_wire` for the protocol and why it exists, and
:mod:`~hivemind_ext.p2p.direct_records` for the encryption. By default every connection is
AEAD records under a key issued with its token; ``DirectConfig(plaintext=True)`` serves plain TCP
instead (for loopback or trusted networks only). Every call that arrives directly is authenticated
by a one-time token (and, encrypted, its key) that the caller obtained over libp2p, so a handler
sees the same ``ctx.peer_id`` either way.

:class:`TicketBook` is pure bookkeeping (issue, redeem, expire), tested without a network.
:class:`DirectListener` owns the server socket; the RPC server owns the connections it accepts.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import ipaddress
import logging
import secrets
from collections.abc import Awaitable, Callable

from hivemind.p2p import PeerID

from hivemind_ext.errors import ConfigurationError
from hivemind_ext.p2p.bounded_idle import BoundedIdle
from hivemind_ext.p2p.deadlines import check_durations
from hivemind_ext.p2p.direct_records import new_session_key
from hivemind_ext.p2p.direct_transport import DirectStream, start_direct_server
from hivemind_ext.p2p.direct_wire import TOKEN_BYTES

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DirectConfig:
    """Settings of a server's direct data path (encrypted by default, authenticated through libp2p).

    :param host: IP address to listen on (e.g. ``"127.0.0.1"``, or ``"0.0.0.0"`` for every interface)
    :param port: TCP port to listen on (0: any free port)
    :param advertise_host: the address callers should connect to (default: ``host``; required
      when listening on a wildcard address such as ``0.0.0.0``)
    :param advertise_port: the port callers should connect to (default: the bound port), e.g. a
      port forwarded to this one by a NAT router
    :param plaintext: serve plain TCP instead of encrypted records: anyone on the path can read and alter the
      data. An explicit opt-in, for loopback or trusted networks; callers must opt in too
      (``DirectClientConfig(allow_plaintext=True)``) or they use libp2p
    :param token_ttl: a token not redeemed within this many seconds is forgotten
    :param max_tokens_per_peer: outstanding tokens per caller; issuing more drops its oldest
    :param max_tokens: outstanding tokens in all; issuing more drops the oldest
    :param hello_timeout: a new connection must present its token within this time
    :param max_pending_hellos: connections still in their hello beyond this many are dropped at
      once, which bounds what a flood of idle connections can cost
    :param idle_timeout: after a call ends cleanly, its connection waits this long for the caller's
      next call (a handler name, then the call), then closes; callers are told this in their
      tickets and let their idle connections go sooner
    :param max_idle_per_peer: idle connections kept per caller; beyond this its oldest is closed
    :param max_idle: idle connections kept in all; beyond this the oldest is closed
    """

    host: str
    port: int = 0
    advertise_host: str | None = None
    advertise_port: int | None = None
    plaintext: bool = False
    token_ttl: float = 60.0
    max_tokens_per_peer: int = 64
    max_tokens: int = 4096
    hello_timeout: float = 5.0
    max_pending_hellos: int = 64
    idle_timeout: float = 30.0
    max_idle_per_peer: int = 16
    max_idle: int = 256

    def __post_init__(self) -> None:
        for name in ("host", "advertise_host"):
            value = getattr(self, name)
            if value is None and name == "advertise_host":
                continue
            try:
                ipaddress.ip_address(value)
            except (TypeError, ValueError):
                raise ConfigurationError(f"{name} must be an IP address, got {value!r}") from None
        if ipaddress.ip_address(self.advertised_host).is_unspecified:
            raise ConfigurationError(f"listening on {self.host}: pass advertise_host, the address callers can reach")
        if type(self.port) is not int or not 0 <= self.port <= 65535:
            raise ConfigurationError(f"port must be an int in 0..65535, got {self.port!r}")
        if self.advertise_port is not None and (
            type(self.advertise_port) is not int or not 1 <= self.advertise_port <= 65535
        ):
            raise ConfigurationError(f"advertise_port must be an int in 1..65535, got {self.advertise_port!r}")
        if not isinstance(self.plaintext, bool):
            raise ConfigurationError(f"plaintext must be a bool, got {self.plaintext!r}")
        check_durations(self, "token_ttl", "hello_timeout", "idle_timeout")
        for name in ("max_tokens_per_peer", "max_tokens", "max_pending_hellos", "max_idle_per_peer", "max_idle"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigurationError(f"{name} must be a positive int, got {value!r}")

    @property
    def advertised_host(self) -> str:
        return self.advertise_host if self.advertise_host is not None else self.host


@dataclasses.dataclass(frozen=True)
class TicketHolder:
    """Whom a token was issued to (a libp2p identity), the session key issued with it, which
    only that identity received (None for a plaintext server), and the namespace whose handlers the
    token opens (one listener can serve several servers, see ``RPCServer.share_direct``)."""

    peer_id: PeerID
    key: bytes | None
    namespace: str = ""


class TicketBook:
    """One-time tokens, each bound to the libp2p PeerID that asked for it, with its session key
    (encrypted servers) and an expiry time.

    Times are on whatever monotonic clock the caller passes (the event loop's in practice).
    """

    def __init__(self, config: DirectConfig) -> None:
        self.config = config
        # token -> (holder, expires at); insertion order is issue order, so the oldest come first
        self._tokens: collections.OrderedDict[bytes, tuple[TicketHolder, float]] = collections.OrderedDict()
        self._per_peer: collections.Counter[PeerID] = collections.Counter()

    def __len__(self) -> int:
        return len(self._tokens)

    def issue(
        self, peer_id: PeerID, count: int, now: float, namespace: str = ""
    ) -> tuple[list[bytes], list[bytes] | None]:
        """``count`` fresh tokens for ``peer_id`` into ``namespace``, valid until ``now + token_ttl``,
        and their session keys (None for a plaintext server)."""
        self.expire(now)
        tokens = [secrets.token_bytes(TOKEN_BYTES) for _ in range(count)]
        keys = None if self.config.plaintext else [new_session_key() for _ in range(count)]
        for i, token in enumerate(tokens):
            if self._per_peer[peer_id] >= self.config.max_tokens_per_peer:
                self._drop_oldest_of(peer_id)
            if len(self._tokens) >= self.config.max_tokens:
                self._forget(next(iter(self._tokens)))
            holder = TicketHolder(peer_id, keys[i] if keys is not None else None, namespace)
            self._tokens[token] = (holder, now + self.config.token_ttl)
            self._per_peer[peer_id] += 1
        return tokens, keys

    def redeem(self, token: bytes, now: float) -> TicketHolder | None:
        """Whom a valid token was issued to, consuming it; None if unknown, used or expired."""
        entry = self._tokens.get(token)
        if entry is None:
            return None
        self._forget(token)
        holder, expires_at = entry
        return holder if now < expires_at else None

    def expire(self, now: float) -> None:
        """Forgets every expired token (they expire in issue order, so this stops at the first live one)."""
        while self._tokens:
            token, (_, expires_at) = next(iter(self._tokens.items()))
            if expires_at > now:
                return
            self._forget(token)

    def _drop_oldest_of(self, peer_id: PeerID) -> None:
        for token, (holder, _) in self._tokens.items():
            if holder.peer_id == peer_id:
                self._forget(token)
                return

    def _forget(self, token: bytes) -> None:
        holder, _ = self._tokens.pop(token)
        peer_id = holder.peer_id
        self._per_peer[peer_id] -= 1
        if self._per_peer[peer_id] <= 0:
            del self._per_peer[peer_id]


ConnectionCallback = Callable[[DirectStream, asyncio.StreamWriter], Awaitable[None]]


def _close_idle(peer_id: PeerID, writer: asyncio.StreamWriter) -> None:
    logger.debug(f"closing an idle direct connection of {peer_id} (an idle bound, or the listener stopped)")
    writer.transport.abort()  # its task, waiting for the next call, sees the end and finishes


class DirectListener:
    """A server socket whose connections go to ``on_connection`` (which must own and close them).

    It keeps the connections that wait for their caller's next call, for every server sharing it:
    bounded per caller and in all (a caller cannot hold more than ``max_idle_per_peer`` of them
    open however many it made, see :class:`~hivemind_ext.p2p.bounded_idle.BoundedIdle`);
    :meth:`stop_accepting` closes them too, so that callers stop using the direct path."""

    def __init__(self, config: DirectConfig, on_connection: ConnectionCallback) -> None:
        self.config, self._on_connection = config, on_connection
        self._server: asyncio.AbstractServer | None = None
        self.port = 0  # the bound port, once started
        self.accepted = 0  # connections accepted in all
        self.stopped = False  # stop_accepting() was called
        self.idle: BoundedIdle[PeerID, asyncio.StreamWriter] = BoundedIdle(
            config.max_idle_per_peer, config.max_idle, _close_idle
        )

    @property
    def advertised(self) -> tuple[str, int]:
        """(host, port) that callers connect to."""
        port = self.config.advertise_port if self.config.advertise_port is not None else self.port
        return self.config.advertised_host, port

    async def start(self) -> None:
        """Binds and listens (the event loop sets TCP_NODELAY on every accepted connection)."""
        self._server = await start_direct_server(self._accept, self.config.host, self.config.port)
        sockets = self._server.sockets
        self.port = int(sockets[0].getsockname()[1]) if sockets else self.config.port

    async def _accept(self, reader: DirectStream, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        await self._on_connection(reader, writer)

    def stop_accepting(self) -> None:
        """Closes the listening socket and the idle connections (connections in a call are left to their owner)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        self.stopped = True
        self.idle.drop_all()
