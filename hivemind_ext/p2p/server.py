"""Registering named unary and streaming handlers on a hivemind P2P instance, and their lifecycle.

Each handler is registered with the libp2p daemon as its own protocol
(``/hivemind_ext/<namespace>/<name>``), so the daemon routes each incoming stream straight to it;
:mod:`~hivemind_ext.p2p.serving` then serves the call. The server owns every call in progress
(asyncio's stream server starts them; the server adopts them), caps how many run at once per
handler, and at shutdown removes its handlers and cancels and awaits the calls.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from hivemind_ext.errors import ClosedError, ConfigurationError
from hivemind_ext.p2p.deadlines import now, remaining, wait_until
from hivemind_ext.p2p.framing import protocol_name
from hivemind_ext.p2p.serving import HandlerConfig, Route, StreamHandler, UnaryHandler, report, serve_call
from hivemind_ext.p2p.stream import FramedStream
from hivemind_ext.p2p.tasks import TaskOwner
from hivemind_ext.p2p.wire_errors import ErrorKind

logger = logging.getLogger(__name__)

DEFAULT_CONTROL_TIMEOUT = 10.0  # registering / removing a handler is a round trip to the local daemon
# After its last frame, the server waits this long for the caller to hang up (see FramedStream.linger).
LINGER_SECONDS = 2.0
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

    @property
    def handlers(self) -> tuple[str, ...]:
        return tuple(self._routes)

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
        self, name: str, kind: Literal["unary", "stream"], handler: Any, config: HandlerConfig | None, timeout: float
    ) -> None:
        if self._calls.closing:
            raise ClosedError(f"RPCServer({self.namespace}) is shut down")
        if name in self._routes:
            raise ConfigurationError(f"handler {name!r} is already registered in namespace {self.namespace!r}")
        if not callable(handler):
            raise ConfigurationError(f"handler {name!r} must be callable, got {type(handler).__name__}")
        route = Route(name, protocol_name(self.namespace, name), kind, handler, config or self.default_config)
        self._routes[name] = route

        async def on_stream(info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._serve(route, info, reader, writer)

        try:
            await wait_until(
                self.p2p.add_binary_stream_handler(route.protocol, on_stream), now() + timeout, f"registering {name}"
            )
        except BaseException:
            del self._routes[name]
            raise

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
        try:
            for name in list(self._routes):
                route = self._routes.pop(name)
                try:
                    await wait_until(
                        self.p2p.remove_binary_stream_handler(route.protocol), deadline, f"removing {name}"
                    )
                except Exception as e:  # the daemon may be dead already; the calls must be stopped anyway
                    logger.debug(f"could not remove handler {route.protocol}: {type(e).__name__}: {e}")
        finally:
            await self._calls.aclose(timeout=max(remaining(deadline), SHUTDOWN_MIN_WAIT))

    async def __aenter__(self) -> RPCServer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    # ----- serving one call (runs in the task asyncio's stream server created for the connection)

    async def _serve(
        self, route: Route, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """One incoming stream, from adoption by this server to close; never raises but CancelledError
        (asyncio's stream server, which started this task, would only log it)."""
        task = asyncio.current_task()
        try:
            if task is None:
                raise ClosedError("no current task")
            self._calls.adopt(task)  # so that shutdown() cancels and awaits this call
        except ClosedError:
            writer.transport.abort()
            return
        stream = FramedStream(reader, writer, route.config.limits)
        route.active_calls += 1
        try:
            if route.active_calls > route.config.max_concurrent_calls:
                busy = ClosedError(f"{route.name} is serving {route.config.max_concurrent_calls} calls already")
                report(stream, ErrorKind.UNAVAILABLE, busy)
            else:
                await serve_call(route, info.peer_id, stream)
            await stream.linger(LINGER_SECONDS)
        except asyncio.CancelledError:
            report(stream, ErrorKind.UNAVAILABLE, ClosedError("the server is shutting down"))
            raise
        except Exception:  # a bug in this module: log it, keep serving others
            logger.exception(f"unexpected failure serving {route.protocol} to {info.peer_id}")
        finally:
            route.active_calls -= 1
            stream.close()
