"""Registering named unary and streaming handlers on a hivemind P2P instance, and their lifecycle.

Each handler is registered with the libp2p daemon as its own protocol
(``/hivemind_ext/<namespace>/<name>``), so the daemon routes each incoming stream straight to it;
:mod:`~hivemind_ext.p2p.serving` then serves the call. The server owns every call in progress
(asyncio's stream server starts them; the server adopts them), caps how many run at once per
handler, and at shutdown removes its handlers and cancels and awaits the calls.

Direct data path (:meth:`RPCServer.enable_direct`): the server also listens on a TCP socket and
serves calls that arrive there with a one-time token obtained over libp2p, encrypted by default
with the session key issued with the token (see :mod:`~hivemind_ext.p2p.direct_wire` and
:mod:`~hivemind_ext.p2p.direct_records`). With ``DirectConfig(plaintext=True)`` such calls are
authenticated but **not encrypted**. Several servers of one peer (an averager's all-reduce and its
state donor) serve through one listener, and so one port (:meth:`RPCServer.share_direct`): each
token names the namespace it was issued for, and a connection is served by that namespace's server.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from hivemind_ext.errors import (
    AuthenticationError,
    ClosedError,
    ConfigurationError,
    HivemindExtError,
    ProtocolError,
)
from hivemind_ext.p2p.deadlines import now, remaining, wait_until
from hivemind_ext.p2p.direct_records import SERVER
from hivemind_ext.p2p.direct_server import DirectConfig, DirectListener, TicketBook
from hivemind_ext.p2p.direct_transport import DirectStream, seal
from hivemind_ext.p2p.direct_wire import (
    ACCEPTED,
    REJECTED,
    TICKET_HANDLER,
    Transport,
    parse_ticket_request,
    read_handler_name,
    read_hello,
    ticket_response,
)
from hivemind_ext.p2p.framing import ByteReader, protocol_name
from hivemind_ext.p2p.messages import Limits, Message
from hivemind_ext.p2p.receive_budget import ReceiveBudget
from hivemind_ext.p2p.serving import (
    HandlerConfig,
    Route,
    RPCContext,
    StreamHandler,
    UnaryHandler,
    report,
    serve_call,
)
from hivemind_ext.p2p.stream import FramedStream
from hivemind_ext.p2p.tasks import TaskOwner
from hivemind_ext.p2p.wire_errors import ErrorKind

logger = logging.getLogger(__name__)

DEFAULT_CONTROL_TIMEOUT = 10.0  # registering / removing a handler is a round trip to the local daemon
# After its last frame, the server waits this long for the caller to hang up (see FramedStream.linger);
# after a call whose last response went out, until the call's deadline if that is later: on a thin link
# the caller may need many seconds to take the last responses out of the daemons' buffers, and closing
# our end before it has them resets the stream (it would lose their tail).
LINGER_SECONDS = 2.0
# A ticket request is a small header (a count) and a response is ~1.5 KiB: nothing bigger is accepted.
TICKET_HANDLER_CONFIG = HandlerConfig(
    limits=Limits(max_header_bytes=8192, max_payload_bytes=0), max_timeout=30.0, max_concurrent_calls=64
)
# A call over its peer's share (HandlerConfig.max_calls_per_peer) is refused after this long; one
# beyond twice that share is dropped at once.
BUSY_REFUSAL_DELAY = 1.0
SHUTDOWN_MIN_WAIT = 1.0  # cancelled calls get at least this long to finish, even if removal used up the timeout


class RPCServer:
    """Registers handlers on a P2P instance under ``namespace`` and serves them until :meth:`shutdown`.

    Usage::

        server = RPCServer(p2p, "averager")
        await server.add_unary("ping", ping)          # async def ping(request, ctx) -> Message
        await server.add_stream("reduce", reduce)     # async def reduce(requests, ctx): ... yield Message
        ...
        await server.shutdown()                       # removes handlers, cancels and awaits calls

    ``p2p`` may be a replica of a DHT's daemon connection (``await dht.replicate_p2p()``).
    """

    def __init__(self, p2p: P2P, namespace: str, *, config: HandlerConfig | None = None) -> None:
        protocol_name(namespace, "x")  # validates the namespace early
        self.p2p, self.namespace = p2p, namespace
        self.default_config = config if config is not None else HandlerConfig()
        self._routes: dict[str, Route] = {}
        self._calls = TaskOwner(f"RPCServer({namespace}) calls")
        self._direct: DirectListener | None = None
        self._tickets: TicketBook | None = None
        self._owns_direct = False  # False when the listener is another server's (share_direct)
        self._direct_sharers: dict[str, RPCServer] = {}  # namespace -> server using our listener
        self._direct_source: RPCServer | None = None  # the server whose listener we use
        self._pending_hellos = 0
        self.direct_refusals = 0  # direct connections refused after their hello (bad token or certificate)
        self._scopes: dict[str, RPCServer] = {}  # namespace -> open scope (see scope())
        self._parent: RPCServer | None = None
        # bytes of incomplete payloads per caller, shared with this server's scopes (see receive_budget)
        self.receive_budget = ReceiveBudget()

    @property
    def handlers(self) -> tuple[str, ...]:
        return tuple(self._routes)

    @property
    def scopes(self) -> tuple[str, ...]:
        """The namespaces of the scopes (see :meth:`scope`) that are open on this server."""
        return tuple(self._scopes)

    def scope(self, namespace: str, *, config: HandlerConfig | None = None) -> RPCServer:
        """A server for the handlers of one component under ``namespace``, on the same P2P instance.

        Several components of one peer (averagers, state donors, decentralized SGD) share one server
        this way (see :class:`~hivemind_ext.p2p.runtime.PeerRuntime`): each registers, serves and
        shuts down its own handlers on its scope, and shutting this server down shuts every scope
        still open. A namespace names one scope at a time, so two components cannot register
        handlers under the same protocol names (:class:`ConfigurationError`).
        """
        if self._calls.closing:
            raise ClosedError(f"RPCServer({self.namespace}) is shut down")
        if namespace == self.namespace or namespace in self._scopes:
            raise ConfigurationError(f"namespace {namespace!r} is already served on this peer")
        child = RPCServer(self.p2p, namespace, config=config)
        child._parent = self
        child.receive_budget = self.receive_budget
        self._scopes[namespace] = child
        return child

    @property
    def active_calls(self) -> int:
        return len(self._calls)

    async def add_unary(
        self,
        name: str,
        handler: UnaryHandler,
        *,
        config: HandlerConfig | None = None,
        timeout: float = DEFAULT_CONTROL_TIMEOUT,
    ) -> None:
        """Serves ``handler(request, ctx) -> Message`` as ``name``."""
        await self._add(name, "unary", handler, config, timeout)

    async def add_stream(
        self,
        name: str,
        handler: StreamHandler,
        *,
        config: HandlerConfig | None = None,
        timeout: float = DEFAULT_CONTROL_TIMEOUT,
    ) -> None:
        """Serves ``handler(requests, ctx)``, an async generator of responses, as ``name``."""
        await self._add(name, "stream", handler, config, timeout)

    async def _add(
        self,
        name: str,
        kind: Literal["unary", "stream"],
        handler: Any,
        config: HandlerConfig | None,
        timeout: float,
        *,
        reserved: bool = False,
    ) -> None:
        if self._calls.closing:
            raise ClosedError(f"RPCServer({self.namespace}) is shut down")
        if name == TICKET_HANDLER and not reserved:
            raise ConfigurationError(f"handler name {name!r} is reserved for the direct data path")
        if name in self._routes:
            raise ConfigurationError(f"handler {name!r} is already registered in namespace {self.namespace!r}")
        if not callable(handler):
            raise ConfigurationError(f"handler {name!r} must be callable, got {type(handler).__name__}")
        route = Route(name, protocol_name(self.namespace, name), kind, handler, config or self.default_config)
        self._routes[name] = route

        async def on_stream(info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await self._serve(route, info, reader, writer)
            except asyncio.CancelledError:
                # a call cut short by shutdown. Nobody awaits this task: asyncio's stream callback would
                # log a cancelled one as "Exception in callback ... CancelledError". End it quietly.
                return

        try:
            await wait_until(
                self.p2p.add_binary_stream_handler(route.protocol, on_stream), now() + timeout, f"registering {name}"
            )
        except BaseException:
            del self._routes[name]
            raise

    async def enable_direct(self, config: DirectConfig, *, timeout: float = DEFAULT_CONTROL_TIMEOUT) -> tuple[str, int]:
        """Also serves every handler over direct encrypted connections to callers holding a ticket;
        returns the advertised (host, port).

        Tickets are handed out over libp2p to the PeerID that asks, each token good for one
        connection and issued with a fresh session key that only that PeerID receives: the
        connection's records must authenticate under it (see direct_records). ``DirectConfig(plaintext=True)``
        serves plain TCP instead (authenticated, **not encrypted**: loopback or trusted networks
        only). Callers use it with ``RPCClient(..., prefer_direct=True)`` and fall back to libp2p
        whenever the direct path fails.
        """
        if not isinstance(config, DirectConfig):
            raise ConfigurationError(f"config must be a DirectConfig, got {type(config).__name__}")
        if self._calls.closing:
            raise ClosedError(f"RPCServer({self.namespace}) is shut down")
        if self._direct is not None:
            raise ConfigurationError(f"the direct data path of namespace {self.namespace!r} is already enabled")
        listener = DirectListener(config, self._serve_direct)
        await wait_until(listener.start(), now() + timeout, "starting the direct listener")
        self._direct, self._tickets, self._owns_direct = listener, TicketBook(config), True
        try:
            await self._add(TICKET_HANDLER, "unary", self._issue_tickets, TICKET_HANDLER_CONFIG, timeout, reserved=True)
        except BaseException:
            listener.stop_accepting()
            self._direct = self._tickets = None
            raise
        return listener.advertised

    async def share_direct(self, source: RPCServer, *, timeout: float = DEFAULT_CONTROL_TIMEOUT) -> tuple[str, int]:
        """Serves this server's handlers over ``source``'s direct listener (its port, tokens and
        settings) instead of a listener of its own; returns the advertised (host, port).

        Why: a fixed or forwarded port (``DirectConfig(port=..., advertise_port=...)``) can be bound
        and advertised once only, and every listener is one more port to open in a firewall. Tokens
        that this server issues name its namespace, so a connection presenting one reaches only this
        server's handlers. ``source`` must outlive this server's use of it (its shutdown closes the port)."""
        if self._calls.closing:
            raise ClosedError(f"RPCServer({self.namespace}) is shut down")
        if self._direct is not None:
            raise ConfigurationError(f"the direct data path of namespace {self.namespace!r} is already enabled")
        if source._direct is None or not source._owns_direct:
            raise ConfigurationError(f"namespace {source.namespace!r} has no direct listener of its own to share")
        if self.namespace in source._direct_sharers:
            raise ConfigurationError(f"namespace {self.namespace!r} already shares {source.namespace!r}'s listener")
        source._direct_sharers[self.namespace] = self
        self._direct, self._tickets, self._direct_source = source._direct, source._tickets, source
        try:
            await self._add(TICKET_HANDLER, "unary", self._issue_tickets, TICKET_HANDLER_CONFIG, timeout, reserved=True)
        except BaseException:
            self._stop_sharing()
            raise
        return self._direct.advertised

    def _stop_sharing(self) -> None:
        source = self._direct_source
        if source is not None and source._direct_sharers.get(self.namespace) is self:
            del source._direct_sharers[self.namespace]
        self._direct = self._tickets = self._direct_source = None

    @property
    def direct_address(self) -> tuple[str, int] | None:
        """(host, port) that callers connect to for the direct path, or None if it is not enabled."""
        return self._direct.advertised if self._direct is not None else None

    @property
    def direct_listener(self) -> DirectListener | None:
        """The direct data path's listener (None if it is not enabled); ``stop_accepting()`` on it
        closes the port while the server keeps serving over libp2p."""
        return self._direct

    async def remove(self, name: str, *, timeout: float = DEFAULT_CONTROL_TIMEOUT) -> None:
        """Stops accepting new calls to ``name`` (calls in progress run to completion)."""
        route = self._routes.pop(name, None)
        if route is None:
            raise ConfigurationError(f"no handler {name!r} in namespace {self.namespace!r}")
        await wait_until(self.p2p.remove_binary_stream_handler(route.protocol), now() + timeout, f"removing {name}")

    async def shutdown(self, *, timeout: float = DEFAULT_CONTROL_TIMEOUT) -> None:
        """Removes every handler from the daemon, then cancels the calls in progress and waits for them.

        Idempotent. A daemon that is already gone only makes the removal fail quietly (logged):
        the calls are cancelled regardless, so no task outlives the server. Raises
        DeadlineExceededError only if handler code swallows its cancellation past ``timeout``.
        """
        deadline = now() + timeout
        if self._direct is not None and self._owns_direct:
            self._direct.stop_accepting()
        self._stop_sharing()  # tokens for this namespace now find no server
        try:
            for scope in list(self._scopes.values()):
                try:
                    await scope.shutdown(timeout=max(remaining(deadline), SHUTDOWN_MIN_WAIT))
                except HivemindExtError as e:  # its handlers ignored cancellation: stop the others anyway
                    logger.warning(f"scope {scope.namespace} did not shut down cleanly: {e}")
            for name in list(self._routes):
                route = self._routes.pop(name)
                try:
                    await wait_until(
                        self.p2p.remove_binary_stream_handler(route.protocol), deadline, f"removing {name}"
                    )
                except Exception as e:  # the daemon may be dead already; the calls must be stopped anyway
                    logger.debug(f"could not remove handler {route.protocol}: {type(e).__name__}: {e}")
        finally:
            if self._parent is not None and self._parent._scopes.get(self.namespace) is self:
                del self._parent._scopes[self.namespace]
            await self._calls.aclose(timeout=max(remaining(deadline), SHUTDOWN_MIN_WAIT))

    async def __aenter__(self) -> RPCServer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    # ----- serving one call (runs in the task asyncio's stream server created for the connection)

    async def _serve(
        self, route: Route, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """One incoming libp2p stream, from adoption by this server to close; never raises but
        CancelledError (asyncio's stream server, which started this task, would only log it)."""
        if self._adopt_current_task(writer):
            stream = self._handler_stream(route, info.peer_id, reader, writer)
            await self._serve_adopted(route, info.peer_id, stream, "libp2p")

    def _handler_stream(
        self, route: Route, peer_id: PeerID, reader: ByteReader, writer: asyncio.StreamWriter
    ) -> FramedStream:
        """The framed stream a call to ``route`` is served on, over libp2p or the direct path: requests
        bounded by the handler's limits and charged to the caller's receive budget, answers by its
        answer limits."""
        limits = route.config.limits
        account = self.receive_budget.account(peer_id)
        return FramedStream(reader, writer, limits, account, send_limits=route.config.answer_limits)

    def _adopt_current_task(self, writer: asyncio.StreamWriter) -> bool:
        """Makes this server own the connection's task (so that shutdown() cancels and awaits it)."""
        task = asyncio.current_task()
        try:
            if task is None:
                raise ClosedError("no current task")
            self._calls.adopt(task)
        except ClosedError:
            writer.transport.abort()
            return False
        return True

    # ----- the direct data path

    async def _issue_tickets(self, request: Message, context: RPCContext) -> Message:
        """The ticket handler: tokens bound to the caller's libp2p identity (see direct_wire)."""
        listener, tickets = self._direct, self._tickets
        if listener is None or tickets is None:
            raise ClosedError("the direct data path is not enabled")
        try:
            count = parse_ticket_request(request.header)
        except ProtocolError as e:  # answered, not raised: a handler failure is logged as a warning
            return Message({"error": str(e)})
        tokens, keys = tickets.issue(context.peer_id, count, now(), self.namespace)
        reuse = listener.config.idle_timeout
        return Message(ticket_response(*listener.advertised, tickets.config.token_ttl, tokens, keys, reuse))

    async def _serve_direct(self, reader: DirectStream, writer: asyncio.StreamWriter) -> None:
        """One TCP connection: its hello (token + handler), then its calls, as if they came over
        libp2p: after a call that ended cleanly the connection waits (idle) for the caller's next
        handler name, for the same caller and namespace (see direct_wire)."""
        if not self._adopt_current_task(writer):
            return
        if self._tickets is None or self._pending_hellos >= self._tickets.config.max_pending_hellos:
            writer.transport.abort()
            return
        self._pending_hellos += 1
        try:
            accepted = await self._accept_hello(reader, writer, self._tickets)
        except asyncio.CancelledError:
            writer.transport.abort()
            raise
        finally:
            self._pending_hellos -= 1
        if accepted is None:
            writer.transport.abort()
            return
        route, peer_id, writer, server = accepted
        if route is None or peer_id is None:  # refused, with an answer
            FramedStream(reader, writer, Limits()).close()  # flushes the REJECTED byte, aborts if stuck
            return
        if server is not self and not server._adopt_current_task(writer):  # its shutdown must cancel the call
            return
        transport: Transport = "direct" if not self._tickets.config.plaintext else "direct-plaintext"
        listener = self._direct
        while True:
            stream = server._handler_stream(route, peer_id, reader, writer)
            if not await server._serve_adopted(route, peer_id, stream, transport, reusable=listener is not None):
                return  # the stream is closed
            assert listener is not None
            next_route = await self._next_direct_call(reader, writer, peer_id, server, listener)
            if next_route is None:
                return
            route = next_route

    async def _next_direct_call(
        self,
        reader: DirectStream,
        writer: asyncio.StreamWriter,
        peer_id: PeerID,
        server: RPCServer,
        listener: DirectListener,
    ) -> Route | None:
        """Waits (idle, at most the listener's idle_timeout) for the next handler name on a connection
        whose call ended cleanly; its route after answering ACCEPTED, or None once the connection is
        closed (the caller hung up or stayed idle too long, the idle bound dropped it, a malformed or
        refused name)."""
        if listener.stopped:
            writer.transport.abort()
            return None
        listener.idle.add(peer_id, writer)
        try:
            name = await read_handler_name(reader, now() + listener.config.idle_timeout)
        except asyncio.CancelledError:
            writer.transport.abort()
            raise
        except HivemindExtError as e:
            if reader.at_eof() and reader.exception() is None and not reader.buffered:
                writer.close()  # the caller hung up between calls: the normal end
            else:
                logger.debug(f"closing an idle direct connection of {peer_id}: {type(e).__name__}: {e}")
                writer.transport.abort()
            return None
        finally:
            listener.idle.discard(writer)
        route = server._routes.get(name) if self._serves_namespace(server) else None
        if route is None or name == TICKET_HANDLER:
            logger.debug(f"direct connection of {peer_id} to {server.namespace} closed: no handler {name!r}")
            self.direct_refusals += 1
            writer.write(REJECTED)
            FramedStream(reader, writer, Limits()).close()
            return None
        writer.write(ACCEPTED)
        return route

    def _serves_namespace(self, server: RPCServer) -> bool:
        """Whether ``server`` (this one or one sharing its listener) still serves over this listener."""
        return server is self or self._direct_sharers.get(server.namespace) is server

    async def _accept_hello(
        self, reader: DirectStream, writer: asyncio.StreamWriter, tickets: TicketBook
    ) -> tuple[Route | None, PeerID | None, asyncio.StreamWriter, RPCServer] | None:
        """The route, authenticated caller, (sealing) writer and serving server (this one or one
        sharing its listener, by the token's namespace) of a new connection, after
        acknowledging it; (None, ...) after a REJECTED answer (no such handler; an invalid token on
        a plaintext server); None, answering nothing, for anything else than a valid token whose
        first record authenticates under its key (an encrypted server cannot answer unauthenticated)."""
        deadline = now() + tickets.config.hello_timeout
        try:
            holder = tickets.redeem(await read_hello(reader, deadline), now())
            if holder is None and tickets.config.plaintext:
                self.direct_refusals += 1
                writer.write(REJECTED)
                return None, None, writer, self
            if holder is None:
                raise AuthenticationError("invalid, used or expired token")
            if holder.key is not None:  # from here on, records under the key only that caller holds
                reader, writer = seal(reader, writer, holder.key, SERVER)
            name = await read_handler_name(reader, deadline)
        except HivemindExtError as e:
            logger.debug(f"direct connection to {self.namespace} refused: {type(e).__name__}: {e}")
            if isinstance(e, AuthenticationError):
                self.direct_refusals += 1
            return None
        server = self if holder.namespace == self.namespace else self._direct_sharers.get(holder.namespace)
        route = server._routes.get(name) if server is not None else None
        if server is None or route is None or name == TICKET_HANDLER:
            logger.debug(f"direct connection to {holder.namespace} refused: no handler {name!r}")
            self.direct_refusals += 1
            writer.write(REJECTED)
            return None, holder.peer_id, writer, self
        writer.write(ACCEPTED)
        return route, holder.peer_id, writer, server

    async def _serve_adopted(
        self, route: Route, peer_id: PeerID, stream: FramedStream, transport: Transport, reusable: bool = False
    ) -> bool:
        """Serves one call on ``stream`` and closes it; returns False then. With ``reusable`` (a
        direct connection), a call that ended cleanly (see direct_wire) leaves the stream open and
        returns True: the connection may carry the caller's next call."""
        route.active_calls += 1
        clean = False
        route.calls_per_peer[peer_id] += 1
        linger = LINGER_SECONDS
        try:
            if route.active_calls > route.config.max_concurrent_calls:
                busy = ClosedError(f"{route.name} is serving {route.config.max_concurrent_calls} calls already")
                report(stream, ErrorKind.UNAVAILABLE, busy)
            elif route.calls_per_peer[peer_id] > route.config.max_calls_per_peer:
                limit = route.config.max_calls_per_peer
                if route.calls_per_peer[peer_id] > 2 * limit:
                    stream.abort()  # far over its share: the cheapest answer
                    return False
                # answered late, so that a caller that reopens at once does not spin on refusals
                await asyncio.sleep(BUSY_REFUSAL_DELAY)
                busy = ClosedError(f"{route.name} is serving {limit} calls of {peer_id} already")
                report(stream, ErrorKind.UNAVAILABLE, busy)
            else:
                answered_by = await serve_call(route, peer_id, stream, transport)
                if answered_by is not None:
                    linger = max(linger, answered_by - now())
                    if reusable and (route.kind == "unary" or stream.received_end):  # the caller may reuse it
                        # the call ends once its last frame left (one the caller does not read: not reused)
                        if stream.can_carry_next_call and await stream.flush(now() + linger):
                            clean = True
                            return True
                        stream.abort()  # at once (no linger): a caller that kept it sees it ended
                        return False
            await stream.linger(linger)
        except asyncio.CancelledError:
            report(stream, ErrorKind.UNAVAILABLE, ClosedError("the server is shutting down"))
            raise
        except Exception:  # a bug in this module: log it, keep serving others
            logger.exception(f"unexpected failure serving {route.protocol} to {peer_id}")
        finally:
            route.active_calls -= 1
            route.calls_per_peer[peer_id] -= 1
            if route.calls_per_peer[peer_id] <= 0:
                del route.calls_per_peer[peer_id]
            if not clean:
                stream.close()
            stream.mark_call_ended()
        return False
