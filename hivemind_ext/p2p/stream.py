"""A libp2p stream seen as two directions of frames, with the transport tuned for bulk transfers.

One :class:`FramedStream` may be used by one sending and one receiving task at the same time
(each direction has its own lock, so frames never interleave even if several tasks send). It
does not decide what a failure means for the stream: the server and the client do, and always
end with :meth:`close` (graceful) or :meth:`abort` (immediate).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from typing import Any

from hivemind_ext.errors import DeadlineExceededError, PeerUnreachableError, ProtocolError
from hivemind_ext.p2p.deadlines import now, wait_until
from hivemind_ext.p2p.framing import (
    ByteReader,
    Frame,
    FrameKind,
    encode_frame_head,
    read_frame,
    write_frame,
    write_frame_nowait,
)
from hivemind_ext.p2p.messages import Limits
from hivemind_ext.p2p.receive_budget import ReceiveAccount

# The transport buffers this much before drain() blocks: a few write chunks in flight keep the
# daemon's socket busy while Python prepares the next chunk (asyncio's default is only 64 KiB).
# The read side is left at asyncio's default: hivemind creates the StreamReader (64 KiB limit),
# and raising it through the private attribute measured no gain here (Python drains the daemon's
# socket faster than the daemon fills it).
WRITE_BUFFER_HIGH = 4 * 1024 * 1024
WRITE_BUFFER_LOW = 1024 * 1024
# After a graceful close, the transport gets this long to flush before it is aborted, so a peer
# that stops reading cannot pin our buffers forever.
CLOSE_GRACE_SECONDS = 10.0
LINGER_READ_BYTES = 256 * 1024


def tune_transport(writer: asyncio.StreamWriter) -> None:
    """Raises the stream's write buffer limits for bulk transfers (see WRITE_BUFFER_HIGH)."""
    with contextlib.suppress(AttributeError, NotImplementedError, RuntimeError):
        writer.transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH, low=WRITE_BUFFER_LOW)


def _abort_if_still_flushing(transport: asyncio.BaseTransport) -> None:
    # A transport whose graceful close finished has nothing buffered; aborting it again would be
    # an error on some event loops, so only a transport still holding data is aborted.
    with contextlib.suppress(AttributeError, RuntimeError):
        if isinstance(transport, asyncio.WriteTransport) and transport.get_write_buffer_size() > 0:
            transport.abort()


class FramedStream:
    """Frames over one (reader, writer) pair: a libp2p stream opened through the daemon, or a direct TCP stream."""

    def __init__(
        self,
        reader: ByteReader,
        writer: asyncio.StreamWriter,
        limits: Limits,
        account: ReceiveAccount | None = None,
        send_limits: Limits | None = None,
        preamble: bytes | None = None,
    ) -> None:
        """``preamble``: bytes the peer sends before its first frame, checked by the first receive
        (the ACCEPTED byte of a reused direct connection, see direct_wire); anything else fails it
        with a ProtocolError."""
        tune_transport(writer)
        self.reader, self.writer, self.limits = reader, writer, limits
        self.send_limits = send_limits if send_limits is not None else limits  # what this side may send
        # what incomplete payloads of this stream hold, charged to the sender's budget (server side)
        self.account = account if account is not None else ReceiveAccount()
        self._send_lock = asyncio.Lock()
        self._send_interrupted = False
        self._finished_sending = False  # an END or ERROR frame went out: nothing may follow it
        self._receive_lock = asyncio.Lock()
        self._preamble = preamble
        self.received_end = False  # an END frame was received: the peer sends nothing more on this call
        # takes the connection back for another call (a direct connection's, set by the client)
        self.release: Callable[[], None] | None = None
        self._released = False  # the connection was handed on: close() and abort() leave it alone
        self._call_ended: asyncio.Future[None] | None = None
        self._call_over = False

    async def send(
        self,
        kind: FrameKind,
        header: Mapping[Any, Any],
        payload: memoryview,
        deadline: float,
        idle_timeout: float | None = None,
    ) -> None:
        """Writes one frame. Size and type checks happen before the first byte is written, so a
        ProtocolError (or MessageTooLargeError) from here leaves the stream intact. ``idle_timeout``:
        see :func:`~hivemind_ext.p2p.framing.write_frame`."""
        head = encode_frame_head(kind, header, payload.nbytes, self.send_limits)
        await self.send_encoded(head, payload, deadline, idle_timeout)
        if kind in (FrameKind.END, FrameKind.ERROR):
            self._finished_sending = True

    async def send_encoded(
        self, head: bytes, payload: memoryview, deadline: float, idle_timeout: float | None = None
    ) -> None:
        """Writes a frame whose head was encoded (and checked) in advance by ``encode_frame_head``."""
        async with self._send_lock:
            self._send_interrupted = True  # stays set if the write fails midway: a partial frame was sent
            await write_frame(self.writer, head, payload, deadline=deadline, idle_timeout=idle_timeout)
            self._send_interrupted = False

    @property
    def can_send(self) -> bool:
        """False once the stream is closing, has sent its END / ERROR frame, or had a frame write
        interrupted (anything more would reach the peer as garbage)."""
        return not (
            self._send_interrupted or self._finished_sending or self._send_lock.locked() or self.writer.is_closing()
        )

    def send_nowait(self, kind: FrameKind, header: Mapping[Any, Any]) -> bool:
        """Queues a payload-less frame without waiting, if the stream can take one (for OPEN and error
        frames); returns whether it did."""
        if not self.can_send:
            return False
        write_frame_nowait(self.writer, kind, header)
        if kind in (FrameKind.END, FrameKind.ERROR):
            self._finished_sending = True
        return True

    async def receive(self, deadline: float, idle_timeout: float | None = None) -> Frame:
        """The next frame, by ``deadline``; ``idle_timeout``: see :func:`~hivemind_ext.p2p.framing.read_frame`."""
        async with self._receive_lock:
            if self._preamble is not None:
                await self._receive_preamble(deadline)
            frame = await read_frame(
                self.reader, limits=self.limits, deadline=deadline, account=self.account, idle_timeout=idle_timeout
            )
            if frame.kind is FrameKind.END:
                self.received_end = True
            return frame

    @property
    def preamble_pending(self) -> bool:
        """True until the preamble (if any) was received: a stream that fails meanwhile reached no
        handler (the server dispatches a call only after its ACCEPTED byte, see direct_wire)."""
        return self._preamble is not None

    async def receive_preamble(self, deadline: float) -> None:
        """Reads the preamble now, if it is still to come (else the first :meth:`receive` does)."""
        async with self._receive_lock:
            if self._preamble is not None:
                await self._receive_preamble(deadline)

    async def _receive_preamble(self, deadline: float) -> None:
        expected = self._preamble
        assert expected is not None
        try:
            received = await wait_until(self.reader.readexactly(len(expected)), deadline, "reading a stream's preamble")
        except asyncio.IncompleteReadError:
            raise PeerUnreachableError("the stream ended before its first frame") from None
        except (ConnectionError, OSError) as e:
            raise PeerUnreachableError(f"the stream broke before its first frame: {type(e).__name__}") from e
        if received != expected:
            raise ProtocolError(f"the peer refused the call (answered {received!r} before its first frame)")
        self._preamble = None

    @property
    def reusable(self) -> bool:
        """Whether the connection under this stream may carry another call (the caller's check, once
        the server has ended the call): nothing is left half written or unread, and the connection
        is still open (only a direct connection can be)."""
        reader_clean = getattr(self.reader, "reusable", None)
        return self.can_carry_next_call and reader_clean is not None and bool(reader_clean)

    @property
    def can_carry_next_call(self) -> bool:
        """The server's check after a call that ended cleanly: nothing is left half written, no read
        is in progress and the connection did not fail. Bytes already received are allowed: they are
        the caller's next call, which may follow our END at once."""
        exception = getattr(self.reader, "exception", None)
        return (
            self._preamble is None
            and not self._send_interrupted
            and not self._send_lock.locked()
            and not self._receive_lock.locked()
            and not self.writer.is_closing()
            and (exception is None or exception() is None)
        )

    async def wait_peer_gone(self) -> bool:
        """Waits until the peer closes the stream (True) or sends more bytes (False), consuming them.

        A unary server runs this beside the handler: a caller that hangs up (or was cancelled)
        stops the handler at once instead of at its deadline.
        """
        async with self._receive_lock:
            try:
                return not await self.reader.read(1)
            except (ConnectionError, OSError):
                return True

    async def linger(self, seconds: float) -> None:
        """Reads and drops incoming bytes until the peer closes the stream, for at most ``seconds``.

        Closing our end while the peer is still sending makes the daemon reset the stream, which
        can destroy our last frames (an END, or the ERROR that explains a rejection) before the
        peer reads them. Waiting for the peer to hang up first, as HTTP servers do, avoids that.
        """
        if self.writer.is_closing():
            return
        try:
            await wait_until(self._discard_until_eof(), now() + seconds, "lingering")
        except (DeadlineExceededError, ConnectionError, OSError):
            pass  # a peer that keeps the stream open gets no more of our time

    async def _discard_until_eof(self) -> None:
        async with self._receive_lock:
            while await self.reader.read(LINGER_READ_BYTES):
                pass

    @property
    def closing(self) -> bool:
        return self.writer.is_closing()

    def close(self) -> None:
        """Flushes what was written, then closes; aborts if the flush takes longer than the grace period
        (or at once if a frame was cut short: flushing half a frame helps no one)."""
        if self._released or self.writer.is_closing():
            return
        if self._send_interrupted:
            self.abort()
            return
        self.writer.close()
        asyncio.get_running_loop().call_later(CLOSE_GRACE_SECONDS, _abort_if_still_flushing, self.writer.transport)

    def call_ended(self) -> asyncio.Future[None]:
        """Done once the server is through with the call on this stream: the stream closed, or (a
        direct connection kept for the next call) the call's last frame flushed to the socket."""
        if self._call_ended is None:
            self._call_ended = asyncio.get_running_loop().create_future()
            if self._call_over:
                self._call_ended.set_result(None)
        return self._call_ended

    def mark_call_ended(self) -> None:
        self._call_over = True
        if self._call_ended is not None and not self._call_ended.done():
            self._call_ended.set_result(None)

    async def flush(self, deadline: float) -> bool:
        """Waits (until ``deadline`` at most) until what was written has left for the socket; whether
        it did (False: the deadline passed or the stream broke; don't use the stream for another
        call then). Nothing else may write meanwhile.

        Transports tell their protocol only when the write buffer falls to the low-water mark
        (``resume_writing``, what ``drain`` waits for), so the mark is 0 while this waits and
        WRITE_BUFFER_HIGH / LOW again after."""
        transport = self.writer.transport
        if transport.is_closing():
            return False
        if transport.get_write_buffer_size() == 0:
            return True
        try:
            transport.set_write_buffer_limits(high=0, low=0)  # pauses the protocol until the buffer is empty
            await wait_until(self.writer.drain(), deadline, "flushing a stream")
        except (DeadlineExceededError, ConnectionError, OSError, RuntimeError):
            return False
        finally:
            tune_transport(self.writer)
        return transport.get_write_buffer_size() == 0 and not transport.is_closing()

    def release_or_close(self) -> None:
        """After a call that ended cleanly: hands the connection to ``release`` if it can carry
        another call (:attr:`reusable`), else closes it. The stream is not used afterwards."""
        release, self.release = self.release, None
        if release is not None and self.reusable:
            self._released = True
            release()
        else:
            self.close()

    def abort(self) -> None:
        """Closes immediately, dropping anything not yet written (for interrupted or broken streams)."""
        if self._released:
            return
        self.writer.transport.abort()
