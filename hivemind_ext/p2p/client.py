"""Calling handlers served by :class:`~hivemind_ext.p2p.server.RPCServer` on other peers.

Three ways to call, all bounded by one deadline (``timeout`` seconds or an absolute ``deadline``
on the loop clock; the client's ``default_timeout`` if neither is given):

- :meth:`RPCClient.call`: one request, one response;
- :meth:`RPCClient.open_stream`: a :class:`ClientStream` to send and receive messages at will,
  from two tasks at once if needed (the butterfly all-reduce streams chunks up and reduced chunks
  down the same stream);
- :meth:`RPCClient.stream`: requests from an iterable, sent by an owned background task while
  the caller iterates the responses.

Any failure raises a typed error (see ``hivemind_ext.errors``); an ERROR frame from the server
becomes the exception its kind names (``RemoteError`` for a handler exception). A failed,
cancelled or timed-out operation closes the stream: it cannot be resumed mid-frame.

With ``prefer_direct=True`` a call first tries the peer's direct data path (AES-GCM records under
session keys handed out over libp2p, see :mod:`~hivemind_ext.p2p.direct_wire`) and falls back to
libp2p whenever that path is unavailable; :meth:`RPCClient.transports_since` tells which path the
calls to each peer took.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Any

from hivemind.p2p import P2P, P2PDaemonError, PeerID

from hivemind_ext.errors import (
    ClosedError,
    ConfigurationError,
    DeadlineExceededError,
    HivemindExtError,
    PeerUnreachableError,
    ProtocolError,
)
from hivemind_ext.p2p.deadlines import now, remaining, resolve_deadline, wait_until
from hivemind_ext.p2p.direct_client import DirectClientConfig, DirectConnector
from hivemind_ext.p2p.direct_wire import ACCEPTED, REUSE_END_KEY, TICKET_HANDLER, Transport
from hivemind_ext.p2p.framing import Frame, FrameKind, encode_frame_head, open_header, protocol_name
from hivemind_ext.p2p.messages import Limits, Message
from hivemind_ext.p2p.stream import FramedStream
from hivemind_ext.p2p.tasks import TaskOwner
from hivemind_ext.p2p.wire_errors import exception_from_error_header

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 30.0
MAX_TRANSPORT_RECORDS = 1024  # peers whose latest transport is remembered (see RPCClient.transports_since)
# After a write fails because the server closed the stream, how long to look for the ERROR frame
# that probably explains why (e.g. "request too large"), before reporting the broken stream.
ERROR_FRAME_GRACE_SECONDS = 1.0


class RPCClient:
    """Calls handlers registered under ``namespace`` on other peers through the local daemon ``p2p``.

    :param limits: default largest message this client sends or accepts (per call: ``limits=``)
    :param default_timeout: applies to calls that pass neither ``timeout`` nor ``deadline``
    :param prefer_direct: open calls over the server's direct path where it offers one (see
      ``RPCServer.enable_direct``), falling back to libp2p
    :param direct_config: timeouts, caching and plaintext policy of the direct path (with ``prefer_direct``)
    """

    def __init__(
        self,
        p2p: P2P,
        namespace: str,
        *,
        limits: Limits | None = None,
        default_timeout: float = DEFAULT_TIMEOUT,
        prefer_direct: bool = False,
        direct_config: DirectClientConfig | None = None,
    ) -> None:
        protocol_name(namespace, "x")  # validates the namespace early
        if not isinstance(default_timeout, int | float) or not 0 < default_timeout < float("inf"):
            raise ConfigurationError(f"default_timeout must be a positive finite number, got {default_timeout!r}")
        self.p2p, self.namespace = p2p, namespace
        self.limits = limits if limits is not None else Limits()
        self.default_timeout = default_timeout
        if not isinstance(prefer_direct, bool):
            raise ConfigurationError(f"prefer_direct must be a bool, got {prefer_direct!r}")
        self.direct = DirectConnector(self._call_for_ticket, direct_config) if prefer_direct else None
        # peer -> (loop time, transport) of the latest call opened to it; bounded like the connector's peers
        self._transports: collections.OrderedDict[PeerID, tuple[float, Transport]] = collections.OrderedDict()

    def transports_since(self, moment: float) -> dict[PeerID, Transport]:
        """Which path the latest call to each peer took ("direct", "direct-plaintext" or "libp2p"),
        for the peers called at or after ``moment`` (the event loop's clock, see ``deadlines.now``)."""
        return {peer: transport for peer, (opened, transport) in self._transports.items() if opened >= moment}

    async def call(
        self,
        peer_id: PeerID,
        name: str,
        request: Message,
        *,
        timeout: float | None = None,
        deadline: float | None = None,
        limits: Limits | None = None,
    ) -> Message:
        """Sends ``request`` to handler ``name`` on ``peer_id`` and returns its response."""
        deadline = resolve_deadline(timeout, deadline, self.default_timeout)
        limits = limits if limits is not None else self.limits
        payload = request.payload_view()
        head = encode_frame_head(FrameKind.MESSAGE, request.header, payload.nbytes, limits)  # refuse before connecting
        stream = await self._open(peer_id, name, deadline, limits)
        try:
            return await self._call_on(stream, peer_id, head, payload, deadline)
        except PeerUnreachableError as e:
            if not stream.preamble_pending:
                raise
            # a reused connection ended before the server took the call (it closed the connection
            # while idle, just as the call was sent): no handler saw it, so call again on a fresh one
            logger.debug(f"{name}@{peer_id}: the reused direct connection ended first ({e}), calling again")
        stream = await self._open(peer_id, name, deadline, limits, reuse=False)
        return await self._call_on(stream, peer_id, head, payload, deadline)

    async def _call_on(
        self, stream: FramedStream, peer_id: PeerID, head: bytes, payload: memoryview, deadline: float
    ) -> Message:
        try:
            try:
                await stream.send_encoded(head, payload, deadline)
            except PeerUnreachableError as e:
                explanation = await _explain_broken_stream(stream, peer_id, deadline)
                if explanation is None:
                    raise
                raise explanation from e
            frame = await stream.receive(deadline)
            if frame.kind is FrameKind.MESSAGE:
                stream.release_or_close()  # the call ended cleanly: a direct connection may carry the next
                return Message(frame.header, frame.payload)
            if frame.kind is FrameKind.ERROR:
                raise exception_from_error_header(frame.header, str(peer_id))
            raise ProtocolError(f"{peer_id} answered a unary call with a {frame.kind.name} frame")
        except BaseException:
            stream.abort()
            raise
        finally:
            stream.close()

    async def open_stream(
        self,
        peer_id: PeerID,
        name: str,
        *,
        timeout: float | None = None,
        deadline: float | None = None,
        limits: Limits | None = None,
        direct: bool = True,
    ) -> ClientStream:
        """Opens a streaming call to handler ``name`` on ``peer_id``; the deadline bounds the whole call.

        Use as ``async with await client.open_stream(...) as stream:`` so that it is closed on exit.
        ``direct=False`` keeps this call on libp2p even where this client prefers the direct path.
        On a reused direct connection this waits for the server's ACCEPTED byte (one round trip)
        before returning, so that the requests, which cannot be sent again, only go to a call the
        server took (a connection the server closed meanwhile is replaced by a fresh one).
        """
        deadline = resolve_deadline(timeout, deadline, self.default_timeout)
        limits = limits if limits is not None else self.limits
        stream = await self._open(peer_id, name, deadline, limits, direct)
        if stream.preamble_pending:
            try:
                await stream.receive_preamble(deadline)
            except PeerUnreachableError as e:
                stream.abort()
                logger.debug(f"{name}@{peer_id}: the reused direct connection ended first ({e}), opening a fresh one")
                stream = await self._open(peer_id, name, deadline, limits, direct, reuse=False)
            except BaseException:
                stream.abort()
                raise
        return ClientStream(stream, peer_id, name, deadline)

    @contextlib.asynccontextmanager
    async def stream(
        self,
        peer_id: PeerID,
        name: str,
        requests: AsyncIterable[Message] | Iterable[Message],
        *,
        timeout: float | None = None,
        deadline: float | None = None,
        limits: Limits | None = None,
    ) -> AsyncIterator[ClientStream]:
        """Streams ``requests`` to handler ``name`` from a background task; yields the stream to iterate responses::

            async with client.stream(peer, "reduce", chunks, timeout=30) as responses:
                async for response in responses: ...

        If sending fails (including an exception raised by ``requests``), iterating the responses
        raises that error. Leaving the block cancels the sender and closes the stream.
        """
        call = await self.open_stream(peer_id, name, timeout=timeout, deadline=deadline, limits=limits)
        async with call, TaskOwner(f"requests to {name}@{peer_id}") as owner:
            owner.spawn(call._send_all_or_fail(requests), name=f"send {name} to {peer_id}")
            yield call

    async def _open(
        self,
        peer_id: PeerID,
        name: str,
        deadline: float,
        limits: Limits,
        direct_allowed: bool = True,
        *,
        reuse: bool = True,
    ) -> FramedStream:
        """A stream for the call, its OPEN frame sent: over a direct connection (an idle one unless
        not ``reuse``: its :attr:`~FramedStream.preamble_pending` until the server's ACCEPTED byte is
        read) where this client prefers it and the peer offers one, else over libp2p."""
        direct = None
        if self.direct is not None and direct_allowed and name != TICKET_HANDLER:
            direct = await self.direct.connect(peer_id, name, deadline, reuse=reuse)
        if direct is None:
            connection, transport = await self._open_libp2p(peer_id, name, deadline), "libp2p"
            stream = FramedStream(*connection, limits)
        else:
            connection, transport = direct.connection, direct.transport
            stream = FramedStream(*connection, limits, preamble=ACCEPTED if direct.reused else None)
            connector = self.direct
            assert connector is not None
            stream.release = functools.partial(connector.release, peer_id, connection, transport)
        if name != TICKET_HANDLER:
            self._record_transport(peer_id, transport)
        stream.send_nowait(FrameKind.OPEN, open_header(max(remaining(deadline), 1e-3)))
        return stream

    def close(self) -> None:
        """Closes the idle direct connections (calls in progress are not affected; later calls open new ones)."""
        if self.direct is not None:
            self.direct.close()

    def _record_transport(self, peer_id: PeerID, transport: Transport) -> None:
        self._transports[peer_id] = (now(), transport)
        self._transports.move_to_end(peer_id)
        while len(self._transports) > MAX_TRANSPORT_RECORDS:
            self._transports.popitem(last=False)

    async def _call_for_ticket(self, peer_id: PeerID, request: Message, deadline: float) -> Message:
        return await self.call(peer_id, TICKET_HANDLER, request, deadline=deadline, limits=Limits())

    async def _open_libp2p(
        self, peer_id: PeerID, name: str, deadline: float
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        protocol = protocol_name(self.namespace, name)
        try:
            _, reader, writer = await wait_until(
                self.p2p.call_binary_stream_handler(peer_id, protocol), deadline, f"opening {protocol} on {peer_id}"
            )
        except (P2PDaemonError, ConnectionError, OSError) as e:
            raise PeerUnreachableError(f"cannot open {protocol} on {peer_id}: {type(e).__name__}: {e}") from e
        return reader, writer


class ClientStream:
    """The caller's side of a streaming call: send requests, receive responses, in any order.

    One task may send while another receives. :meth:`end` tells the server that no more requests
    follow; :meth:`receive` returns ``None`` once the server has ended its responses. Every method
    accepts a ``timeout`` / ``deadline`` that can only shorten the call's own deadline.
    """

    def __init__(self, stream: FramedStream, peer_id: PeerID, name: str, deadline: float) -> None:
        self._stream, self.peer_id, self.name, self.deadline = stream, peer_id, name, deadline
        self._ended_requests = False
        self._ended_responses = False
        self._server_waits = False  # the server's END says it read ours and waits for the next call
        self._failure: BaseException | None = None

    @property
    def direct(self) -> bool:
        """Whether this call runs on a direct connection that may carry the next call once it ends cleanly."""
        return self._stream.release is not None

    def _deadline(self, timeout: float | None, deadline: float | None) -> float:
        if timeout is None and deadline is None:
            return self.deadline
        return min(self.deadline, resolve_deadline(timeout, deadline, 0.0))

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise ClosedError(
                f"stream {self.name}@{self.peer_id} has failed: {self._failure!r:.300}"
            ) from self._failure
        if self._stream.closing:
            raise ClosedError(f"stream {self.name}@{self.peer_id} is closed")

    def _fail(self, error: BaseException, *, abort: bool = True) -> None:
        if self._failure is None:
            self._failure = error
        if abort:
            self._stream.abort()

    async def send(
        self,
        message: Message,
        *,
        timeout: float | None = None,
        deadline: float | None = None,
        idle_timeout: float | None = None,
    ) -> None:
        """Sends one request (its payload is written from the caller's memory: don't modify it meanwhile).

        ``idle_timeout``: the send also fails (StalledWriteError, a DeadlineExceededError) once the
        peer has taken none of its bytes for this long, however far the deadline is: a large message
        on a slow link may take long, as long as it keeps moving."""
        if self._ended_requests:
            raise ClosedError(f"stream {self.name}@{self.peer_id}: send() after end()")
        payload, deadline = message.payload_view(), self._deadline(timeout, deadline)
        await self._send(FrameKind.MESSAGE, message.header, payload, deadline, idle_timeout)

    async def end(
        self, *, timeout: float | None = None, deadline: float | None = None, idle_timeout: float | None = None
    ) -> None:
        """Tells the server that no more requests follow (responses may still arrive)."""
        if self._ended_requests:
            return
        await self._send(FrameKind.END, {}, memoryview(b""), self._deadline(timeout, deadline), idle_timeout)
        self._ended_requests = True

    async def _send(
        self, kind: FrameKind, header: Any, payload: memoryview, deadline: float, idle_timeout: float | None
    ) -> None:
        self._check_usable()
        try:
            await self._stream.send(kind, header, payload, deadline, idle_timeout)
        except ProtocolError:
            raise  # raised before the first byte was written (invalid or oversized): the stream is intact
        except PeerUnreachableError as e:
            self._fail(e, abort=False)  # keep what was received: it may hold the server's ERROR frame
            raise
        except BaseException as e:
            self._fail(e)
            raise

    async def receive(
        self, *, timeout: float | None = None, deadline: float | None = None, idle_timeout: float | None = None
    ) -> Message | None:
        """The next response, or ``None`` once the server has ended the stream.

        ``idle_timeout``: also fails (IdleStreamError, a ProtocolError) once no byte of the response
        has arrived for this long, however far the deadline is (see ``framing.read_frame``)."""
        if self._ended_responses:
            return None
        try:
            frame = await self._stream.receive(self._deadline(timeout, deadline), idle_timeout)
        except BaseException as e:
            if self._failure is not None and not isinstance(e, asyncio.CancelledError | DeadlineExceededError):
                raise self._failure from None  # the sending side failed first; that is the real cause
            self._fail(e)
            raise
        return self._interpret(frame)

    def _interpret(self, frame: Frame) -> Message | None:
        if frame.kind is FrameKind.MESSAGE:
            return Message(frame.header, frame.payload)
        if frame.kind is FrameKind.END:
            self._ended_responses = True
            self._server_waits = frame.header.get(REUSE_END_KEY) is True
            return None
        error: HivemindExtError
        if frame.kind is FrameKind.ERROR:
            error = exception_from_error_header(frame.header, str(self.peer_id))
        else:
            error = ProtocolError(f"{self.peer_id} sent an unexpected {frame.kind.name} frame")
        self._fail(error)
        raise error

    def __aiter__(self) -> AsyncIterator[Message]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[Message]:
        while (message := await self.receive()) is not None:
            yield message

    async def send_all(
        self,
        requests: AsyncIterable[Message] | Iterable[Message],
        *,
        end: bool = True,
        timeout: float | None = None,
        deadline: float | None = None,
    ) -> None:
        """Sends every request (then END, unless ``end=False``), all before one deadline."""
        deadline = self._deadline(timeout, deadline)
        if isinstance(requests, AsyncIterable):
            async for message in requests:
                await self.send(message, deadline=deadline)
        else:
            for message in requests:
                await self.send(message, deadline=deadline)
        if end:
            await self.end(deadline=deadline)

    async def _send_all_or_fail(self, requests: AsyncIterable[Message] | Iterable[Message]) -> None:
        """Background sender of :meth:`RPCClient.stream`: a failure is recorded for the receiving side to raise."""
        try:
            await self.send_all(requests)
        except PeerUnreachableError as e:
            self._fail(e, abort=False)
        except Exception as e:  # includes exceptions from the caller's request iterator
            self._fail(e)

    async def aclose(self) -> None:
        """Closes the stream: gracefully after a clean finish (a direct connection is kept for the
        next call), at once otherwise. Never waits."""
        if self._failure is not None or not (self._ended_requests and self._ended_responses):
            self._stream.abort()
        elif self._server_waits:
            self._stream.release_or_close()
        else:
            self._stream.close()

    async def __aenter__(self) -> ClientStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


async def _explain_broken_stream(stream: FramedStream, peer_id: PeerID, deadline: float) -> HivemindExtError | None:
    """After a write failed, the ERROR frame the server sent before closing (if one arrives quickly)."""
    grace = min(deadline, asyncio.get_running_loop().time() + ERROR_FRAME_GRACE_SECONDS)
    try:
        frame = await stream.receive(grace)
    except HivemindExtError:
        return None
    if frame.kind is FrameKind.ERROR:
        return exception_from_error_header(frame.header, str(peer_id))
    return None
