"""Serving one call: what a handler sees, how its requests are read and its responses written.

:func:`serve_call` runs once per incoming stream (see :mod:`~hivemind_ext.p2p.framing` for the
frames). It never trusts the caller: the OPEN frame must arrive within ``open_timeout``, every
later wait is bounded by the call's deadline (the caller's timeout, capped by ``max_timeout``),
sizes are checked before allocation, and any failure - malformed input, a handler exception, a
deadline - ends only that call, with a typed ERROR frame when the stream can still carry one.
Handler exceptions cross the wire as their class name and text, never as a traceback.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

from hivemind.p2p import PeerID

from hivemind_ext.errors import (
    ConfigurationError,
    DeadlineExceededError,
    HivemindExtError,
    PeerUnreachableError,
    ProtocolError,
)
from hivemind_ext.p2p.deadlines import check_durations, now, remaining, wait_until
from hivemind_ext.p2p.direct_wire import REUSE_END_KEY, Transport
from hivemind_ext.p2p.framing import FrameKind, encode_frame_head, parse_open
from hivemind_ext.p2p.messages import Limits, Message
from hivemind_ext.p2p.stream import FramedStream
from hivemind_ext.p2p.tasks import TaskOwner
from hivemind_ext.p2p.wire_errors import ErrorKind, error_header, error_kind_of

logger = logging.getLogger(__name__)

# how long a direct streaming call whose handler finished waits for the caller's END (see _await_caller_end)
CALLER_END_GRACE = 0.25


@dataclasses.dataclass(frozen=True)
class RPCContext:
    """What a handler knows about the call besides the request."""

    peer_id: PeerID  # the caller, as authenticated by libp2p (not self-declared)
    handler: str  # the handler's name within its namespace
    deadline: float  # on the loop clock (see deadlines.now); the server stops the handler at this time
    # "direct": encrypted, "direct-plaintext": plain TCP (both authenticated through libp2p)
    transport: Transport = "libp2p"

    def time_left(self) -> float:
        return remaining(self.deadline)


UnaryHandler = Callable[[Message, RPCContext], Awaitable[Message]]
StreamHandler = Callable[[AsyncIterator[Message], RPCContext], AsyncIterator[Message]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class HandlerConfig:
    """Per-handler limits.

    :param limits: largest request the handler accepts, and largest response it may send unless
      ``answer_limits`` is given
    :param answer_limits: largest response it may send, where answers can be larger than what the
      handler should accept (a matchmaking leader's commit lists every member of a group; the
      confirmation that asks for it is a few dozen bytes)
    :param max_timeout: a caller may ask for a longer timeout, but the handler is stopped after this
    :param open_timeout: a new stream must send its OPEN frame within this time (a peer that opens
      streams and stays silent ties up nothing for longer)
    :param max_concurrent_calls: calls beyond this many at once are refused at once with an
      "unavailable" ERROR frame (PeerUnreachableError for the caller), which bounds what a flood
      of streams can cost (payload buffers grow as bytes arrive, see framing)
    :param max_calls_per_peer: calls from one peer beyond this many at once are refused the same
      way, so that one caller cannot take every slot
    """

    limits: Limits = dataclasses.field(default_factory=Limits)
    answer_limits: Limits | None = None
    max_timeout: float = 300.0
    open_timeout: float = 10.0
    max_concurrent_calls: int = 256
    max_calls_per_peer: int = 64

    def __post_init__(self) -> None:
        if not isinstance(self.limits, Limits):
            raise ConfigurationError(f"limits must be a Limits, got {type(self.limits).__name__}")
        if self.answer_limits is not None and not isinstance(self.answer_limits, Limits):
            raise ConfigurationError(f"answer_limits must be a Limits, got {type(self.answer_limits).__name__}")
        check_durations(self, "max_timeout", "open_timeout")
        for name in ("max_concurrent_calls", "max_calls_per_peer"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigurationError(f"{name} must be a positive int, got {value!r}")


@dataclasses.dataclass
class Route:
    """A registered handler and its settings; ``active_calls`` is maintained by the server."""

    name: str
    protocol: str
    kind: Literal["unary", "stream"]
    handler: Callable[..., Any]
    config: HandlerConfig
    active_calls: int = 0
    calls_per_peer: collections.Counter[PeerID] = dataclasses.field(default_factory=collections.Counter)


class _HandlerFailed(Exception):
    """Internal: wraps an exception raised by handler code, to tell it apart from transport errors."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


class RequestStream:
    """The requests of a streaming call, as an async iterator handed to the handler.

    Frames are read lazily, as the handler asks for them, so a handler that answers as it reads
    uses both directions at once. A malformed or unexpected frame raises a ProtocolError and
    poisons the iterator: the server then reports that error, whatever the handler did with it.
    """

    def __init__(self, stream: FramedStream, deadline: float) -> None:
        self._stream, self._deadline = stream, deadline
        self._ended = False
        self.error: HivemindExtError | None = None

    def __aiter__(self) -> RequestStream:
        return self

    def call_ended(self) -> asyncio.Future[None]:
        """Done once the server is through with this call (see ``FramedStream.call_ended``): a
        handler that must know its responses were delivered waits for this, not for its task,
        which may go on serving the caller's next call on the same direct connection."""
        return self._stream.call_ended()

    @property
    def ended(self) -> bool:
        """The caller's END arrived (and nothing failed): every request was read."""
        return self._ended and self.error is None

    async def __anext__(self) -> Message:
        message = await self.receive()
        if message is None:
            raise StopAsyncIteration
        return message

    async def receive(self, *, idle_timeout: float | None = None) -> Message | None:
        """The next request, or None once the caller has ended its requests (by the call's deadline).

        ``idle_timeout``: also fails (IdleStreamError, a ProtocolError) once no byte of the request
        has arrived for this long: a caller that keeps sending, however slowly, is waited for."""
        if self.error is not None:
            raise self.error
        if self._ended:
            return None
        try:
            frame = await self._stream.receive(self._deadline, idle_timeout)
            if frame.kind is FrameKind.END:
                self._ended = True
                return None
            if frame.kind is not FrameKind.MESSAGE:
                raise ProtocolError(f"unexpected {frame.kind.name} frame in a request stream")
        except HivemindExtError as e:
            self.error = e
            raise
        return Message(frame.header, frame.payload)


async def serve_call(
    route: Route, peer_id: PeerID, stream: FramedStream, transport: Transport = "libp2p"
) -> float | None:
    """Serves one call on a freshly opened stream; reports every failure to the caller, raises only
    CancelledError. Returns the call's deadline if its last response went out, else None (the server
    then waits at most that long for the caller to take it all and hang up, see ``RPCServer``)."""
    try:
        caller_timeout = parse_open(await stream.receive(now() + route.config.open_timeout))
    except HivemindExtError as e:
        _report_layer_error(stream, e, route, peer_id)
        return None
    deadline = now() + min(caller_timeout, route.config.max_timeout)
    context = RPCContext(peer_id=peer_id, handler=route.name, deadline=deadline, transport=transport)
    if route.kind == "unary":
        answered = await _serve_unary(route, stream, context)
    else:
        answered = await _serve_stream(route, stream, context)
    return deadline if answered else None


async def _serve_unary(route: Route, stream: FramedStream, context: RPCContext) -> bool:
    try:
        frame = await stream.receive(context.deadline)
        if frame.kind is not FrameKind.MESSAGE:
            raise ProtocolError(f"expected a request MESSAGE frame, got {frame.kind.name}")
    except HivemindExtError as e:
        _report_layer_error(stream, e, route, context.peer_id)
        return False
    try:
        response = await _unless_caller_leaves(
            stream,
            wait_until(
                _call_handler(route.handler, Message(frame.header, frame.payload), context),
                context.deadline,
                f"handler {route.name}",
            ),
        )
        await stream.send_encoded(*_encode_response(response, stream), context.deadline)
        return True
    except _HandlerFailed as failure:
        _report_handler_error(stream, failure.error, route, context)
    except HivemindExtError as e:
        _report_layer_error(stream, e, route, context.peer_id)
    return False


async def _serve_stream(route: Route, stream: FramedStream, context: RPCContext) -> bool:
    requests = RequestStream(stream, context.deadline)
    try:
        await wait_until(_pump_responses(route, requests, stream, context), context.deadline, f"handler {route.name}")
        if requests.error is not None:  # the handler swallowed a broken request stream: don't pretend success
            raise requests.error
        # a direct connection whose requests all arrived may carry the caller's next call: the END says
        # so, since only this side knows whether the handler read the caller's END (see direct_wire)
        if context.transport != "libp2p" and not requests.ended:
            await _await_caller_end(requests)
        end = {REUSE_END_KEY: True} if context.transport != "libp2p" and requests.ended else {}
        await stream.send(FrameKind.END, end, memoryview(b""), context.deadline)
        return True
    except _HandlerFailed as failure:
        if requests.error is not None:  # the handler failed because the request stream did
            _report_layer_error(stream, requests.error, route, context.peer_id)
        else:
            _report_handler_error(stream, failure.error, route, context)
    except HivemindExtError as e:
        _report_layer_error(stream, requests.error or e, route, context.peer_id)
    return False


async def _await_caller_end(requests: RequestStream) -> None:
    """A handler may finish just before the caller's END arrives (the all-reduce owner answers once
    it has every chunk, while the sender's END is still behind its last one): waits a little for
    it, so that the connection can carry the caller's next call. Anything else than an END in time
    (a request the handler left unread, silence, an error) leaves the call not reusable."""
    with contextlib.suppress(HivemindExtError):
        await wait_until(requests.receive(), now() + CALLER_END_GRACE, "waiting for the caller's END")


def _encode_response(response: Any, stream: FramedStream) -> tuple[bytes, memoryview]:
    """Checks and encodes what a handler returned; a bad response (wrong type, unserializable
    header, over the handler's own limits) is the handler's failure, reported as such."""
    try:
        if not isinstance(response, Message):
            raise TypeError(f"handler produced {type(response).__name__}, not a Message")
        payload = response.payload_view()
        return encode_frame_head(FrameKind.MESSAGE, response.header, payload.nbytes, stream.send_limits), payload
    except (TypeError, ProtocolError) as e:
        raise _HandlerFailed(e) from e


async def _unless_caller_leaves(stream: FramedStream, handler_call: Awaitable[Message]) -> Message:
    """Runs a unary handler while watching the stream; stops it if the caller hangs up or sends more."""
    async with TaskOwner("unary call") as owner:
        handler_task = owner.spawn(handler_call, report_errors=False)
        watch_task = owner.spawn(stream.wait_peer_gone(), report_errors=False)
        await asyncio.wait((handler_task, watch_task), return_when=asyncio.FIRST_COMPLETED)
        if handler_task.done():
            return handler_task.result()
    if watch_task.result():
        raise PeerUnreachableError("the caller closed the stream before the response")
    raise ProtocolError("unexpected data after a unary request")


async def _call_handler(handler: UnaryHandler, request: Message, context: RPCContext) -> Message:
    """Runs handler code, wrapping what it raises so the caller can tell handler bugs from transport errors."""
    try:
        return await handler(request, context)
    except Exception as e:
        raise _HandlerFailed(e) from e


async def _pump_responses(route: Route, requests: RequestStream, stream: FramedStream, context: RPCContext) -> None:
    """Runs a stream handler, writing each response it yields as soon as it is yielded."""
    try:
        responses = route.handler(requests, context)
    except Exception as e:
        raise _HandlerFailed(e) from e
    if not hasattr(responses, "__anext__"):
        raise _HandlerFailed(TypeError(f"stream handler returned {type(responses).__name__}, not an async iterator"))
    try:
        while True:
            try:
                response = await responses.__anext__()
            except StopAsyncIteration:
                return
            except Exception as e:
                raise _HandlerFailed(e) from e
            await stream.send_encoded(*_encode_response(response, stream), context.deadline)
    finally:
        await _close_handler_generator(route, responses)


async def _close_handler_generator(route: Route, responses: Any) -> None:
    """Runs the handler's cleanup (its ``finally`` blocks); a failure there is logged, not reported,
    so it cannot hide the outcome the caller is about to receive."""
    aclose = getattr(responses, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception as e:
        logger.warning(f"stream handler {route.protocol} failed while closing: {type(e).__name__}: {e}", exc_info=e)


def report(stream: FramedStream, kind: ErrorKind, exc: BaseException) -> None:
    """Queues an ERROR frame describing ``exc``, if the stream can still carry one (best effort:
    the stream is closed right after, and a caller that is gone needs no explanation)."""
    stream.send_nowait(FrameKind.ERROR, error_header(kind, exc))


def _report_layer_error(stream: FramedStream, exc: HivemindExtError, route: Route, peer_id: PeerID) -> None:
    """Reports a transport / protocol failure (logged at debug level: a hostile peer must not flood the logs)."""
    logger.debug(f"{route.protocol} call from {peer_id} failed: {type(exc).__name__}: {exc}")
    if isinstance(exc, PeerUnreachableError):
        return  # the caller is gone; there is no one to tell
    report(stream, error_kind_of(exc, from_handler=False), exc)


def _report_handler_error(stream: FramedStream, exc: Exception, route: Route, context: RPCContext) -> None:
    if isinstance(exc, DeadlineExceededError) and context.time_left() <= 0:
        kind = ErrorKind.DEADLINE  # the handler ran out of the caller's time, which is not a handler bug
    else:
        kind = ErrorKind.HANDLER
        logger.warning(
            f"handler {route.protocol} failed for {context.peer_id}: {type(exc).__name__}: {exc}", exc_info=exc
        )
    report(stream, kind, exc)
