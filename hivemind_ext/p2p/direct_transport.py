"""A TCP stream for the direct data path that receives payloads straight into their final buffer.

Why: asyncio's StreamReader copies every received byte three times (the event loop's recv into
a fresh bytes object, that into the reader's buffer, that into the caller's buffer). Over the
direct path the peers' own CPU is the bottleneck, so :class:`DirectStream` is a
``BufferedProtocol``: while :meth:`DirectStream.readexactly_into` waits, the kernel writes the
bytes into the caller's buffer itself (one copy, the unavoidable one); other reads (frame
prefixes and headers, the hello) go through a small internal buffer. That buffer reads ahead at
most ``DEFAULT_LIMIT`` bytes (then reading pauses and the data waits in the kernel's socket buffer)
so that little of a large payload that arrives before its reader asks for it takes the extra copies
through the internal buffer: with 1 MiB of read-ahead, about half of every 2 MiB all-reduce chunk
did (in one A/B run of benchmarks/averaging.py, "none" over direct, the four peer processes used
4.1 CPU-s with 1 MiB and 3.8 CPU-s with 64 KiB).

Encrypted connections (the default, :meth:`DirectStream.start_records`) receive AEAD records
(:mod:`~hivemind_ext.p2p.direct_records`) into the record buffer instead, and a record that fits
in the waiting reader's buffer is decrypted straight into it: the kernel's copy and the
decryption, nothing else.

A :class:`DirectStream` is the reader half that :class:`~hivemind_ext.p2p.stream.FramedStream`
needs (``read``, ``readexactly``, ``readexactly_into``, ``at_eof``, ``exception``); the writer half
is a standard ``asyncio.StreamWriter`` over the same transport, for which this class provides
the write flow control (``_drain_helper``) that asyncio's ``FlowControlMixin`` would. It must not
derive from ``asyncio.Protocol`` (as that mixin does): uvloop would then deliver data through
``data_received`` instead of ``get_buffer``. One task reads at a time (FramedStream's receive lock
guarantees it).
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from hivemind_ext.errors import HivemindExtError, ProtocolError
from hivemind_ext.p2p.direct_records import RecordOpener, RecordSealer, SealedWriter

STAGING_BYTES = 64 * 1024  # receive buffer for bytes that no readexactly_into() is waiting for
DEFAULT_LIMIT = 64 * 1024  # reading pauses while this much is buffered and unread
LAZY_RECORD_BYTES = 64 * 1024  # larger records stay sealed until a reader asks for their bytes

Connection = tuple["DirectStream", asyncio.StreamWriter]


class DirectStream(asyncio.BufferedProtocol):
    """The reading side of one TCP connection, receiving into the reader's buffer where it can."""

    def __init__(self, limit: int = DEFAULT_LIMIT, on_connected: Callable[[Connection], Any] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._limit, self._on_connected = limit, on_connected
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._staging = memoryview(bytearray(STAGING_BYTES))
        self._target: memoryview | None = None  # the buffer readexactly_into() is filling
        self._target_filled = 0
        self.bytes_received = 0  # in all, for idle detection (see framing)
        self._waiter: asyncio.Future[None] | None = None
        self._eof = False
        self._exception: BaseException | None = None
        self._reading_paused = False
        self._closed = self._loop.create_future()
        self._writing_paused = False
        self._connection_lost = False
        self._records: RecordOpener | None = None  # set once the connection is sealed
        self._drain_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        # called once the peer ends or breaks the connection (set by whoever keeps it idle)
        self.on_end: Callable[[], Any] | None = None

    # ----- protocol callbacks (called by the event loop)

    def connection_made(self, transport: Any) -> None:  # a TCP transport (asyncio's or uvloop's)
        self.transport = transport
        if self._on_connected is not None:
            self._on_connected((self, asyncio.StreamWriter(transport, self, None, self._loop)))

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._records is not None:
            return self._records.buffer()
        if self._target is not None:
            return self._target[self._target_filled :]  # never empty: the target is released once full
        return self._staging

    def buffer_updated(self, nbytes: int) -> None:
        self.bytes_received += nbytes
        if self._records is not None:
            self._records.received(nbytes)
            self._open_records()
            return
        if self._target is not None:
            self._target_filled += nbytes
            if self._target_filled >= self._target.nbytes:
                self._target = None
                self._wake()
            return
        self._buffer += self._staging[:nbytes]
        self._buffered()

    def _buffered(self) -> None:
        full = len(self._buffer) > self._limit or (self._records is not None and self._records.complete)
        if full and not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()
        self._wake()

    def _open_records(self, eager: bool = False) -> None:
        """Opens the complete records: straight into the waiting reader's buffer where it fits, else
        into the internal buffer (then what the reader waits for is copied out of it). A large
        record that no reader waits for yet (unless ``eager``) stays sealed, and reading pauses,
        until the reader comes: it is then decrypted straight into the reader's buffer."""
        records = self._records
        try:
            while records is not None and (size := records.next_record()) is not None:
                target = self._target
                if target is not None and target.nbytes - self._target_filled >= size:
                    records.open_into(target[self._target_filled : self._target_filled + size])
                    self._target_filled += size
                elif target is None and not eager and (size > LAZY_RECORD_BYTES or len(self._buffer) > self._limit):
                    break
                else:
                    plain = records.open(size)
                    taken = 0
                    if target is not None:
                        taken = target.nbytes - self._target_filled
                        target[self._target_filled :] = plain[:taken]
                        self._target_filled += taken
                    self._buffer += plain[taken:]
                if target is not None and self._target_filled >= target.nbytes:
                    self._target = None
        except HivemindExtError as e:
            self._fail(e)
        self._buffered()

    def _fail(self, error: BaseException) -> None:
        """Ends the connection because of what it carried (an unauthentic or malformed record)."""
        if self._exception is None:
            self._exception = error
        self._records = None
        if self.transport is not None:
            self.transport.abort()
        self._wake()

    def start_records(self, key: bytes, receive_direction: int) -> None:
        """From now on the peer's bytes are AEAD records sealed with ``key`` in ``receive_direction``;
        bytes already received (past what was read) are the first of them."""
        self._records = RecordOpener(key, receive_direction)
        pending, self._buffer = self._buffer, bytearray()
        with memoryview(pending) as data:
            while data.nbytes and self._records is not None:
                space = self._records.buffer()
                taken = min(space.nbytes, data.nbytes)
                space[:taken] = data[:taken]
                self._records.received(taken)
                data = data[taken:]
                self._open_records()

    def _check_ended_between_records(self) -> None:
        if self._records is not None and self._records.inside_record and self._exception is None:
            self._exception = ProtocolError("the direct connection ended inside a record")

    def eof_received(self) -> bool:
        self._eof = True
        self._check_ended_between_records()
        self._wake()
        self._ended_now()
        return True  # keep the transport open for writing, as asyncio's StreamReaderProtocol does

    def connection_lost(self, exc: Exception | None) -> None:
        self._connection_lost = True
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_exception(exc if exc is not None else ConnectionResetError("connection lost"))
        self._eof = True
        self._check_ended_between_records()
        if exc is not None and self._exception is None:
            self._exception = exc
        if self._records is not None:
            self._records.release()  # its buffer serves the process's next connections (if no record is left in it)
        self._wake()
        if not self._closed.done():
            self._closed.set_result(None)
        self._ended_now()

    def _ended_now(self) -> None:
        on_end, self.on_end = self.on_end, None
        if on_end is not None:
            on_end()

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)

    # ----- what asyncio.StreamWriter expects of its protocol

    async def _drain_helper(self) -> None:
        if self._connection_lost:
            raise ConnectionResetError("connection lost")
        if not self._writing_paused:
            return
        waiter = self._loop.create_future()
        self._drain_waiters.append(waiter)
        try:
            await waiter
        finally:
            self._drain_waiters.remove(waiter)

    def _get_close_waiter(self, stream: object) -> asyncio.Future[None]:
        return self._closed  # StreamWriter.wait_closed() awaits this

    # ----- reading (called by the one reading task)

    def exception(self) -> BaseException | None:
        return self._exception

    def at_eof(self) -> bool:
        return self._ended() and not self._buffer

    @property
    def reusable(self) -> bool:
        """Nothing received is left unread, no read is waiting, and the connection has not ended
        or failed: it sits between two calls (see direct_wire)."""
        records = self._records
        return (
            not self._eof
            and self._exception is None
            and not self._connection_lost
            and not self._buffer
            and self._target is None
            and self._waiter is None
            and (records is None or not (records.inside_record or records.complete))
            and self.transport is not None
            and not self.transport.is_closing()
        )

    @property
    def buffered(self) -> int:
        """Bytes received and not yet read (reading ahead pauses once this passes the limit)."""
        return len(self._buffer)

    async def read(self, n: int) -> bytes:
        """Up to ``n`` bytes as soon as any are available; b"" at end of stream."""
        while not self._buffer:
            self._raise_if_failed()
            if self._ended():
                return b""
            await self._wait()
        data = bytes(self._buffer[:n])
        self._consume(len(data))
        return data

    async def readexactly(self, n: int) -> bytes:
        while len(self._buffer) < n:
            self._raise_if_failed()
            if self._ended():
                partial = bytes(self._buffer)
                self._consume(len(partial))
                raise asyncio.IncompleteReadError(partial, n)
            await self._wait()
        data = bytes(self._buffer[:n])
        self._consume(n)
        return data

    async def readexactly_into(self, view: memoryview) -> None:
        """Fills all of ``view``; raises IncompleteReadError if the stream ends first."""
        taken = min(len(self._buffer), view.nbytes)
        if taken:
            with memoryview(self._buffer) as source:
                view[:taken] = source[:taken]
            self._consume(taken)
        if taken == view.nbytes:
            return
        self._raise_if_failed()
        if self._ended():
            raise asyncio.IncompleteReadError(b"", view.nbytes)  # the partial bytes are in ``view``
        self._target, self._target_filled = view[taken:], 0
        try:
            while self._target is not None:
                self._raise_if_failed()
                if self._ended():
                    raise asyncio.IncompleteReadError(b"", view.nbytes)
                await self._wait()
        finally:
            self._target = None  # also on cancellation: later bytes go to the internal buffer

    def _consume(self, nbytes: int) -> None:
        del self._buffer[:nbytes]
        if self._records is not None and self._records.complete:
            return  # reading resumes once that record is opened
        if self._reading_paused and len(self._buffer) <= self._limit and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()

    def _ended(self) -> bool:
        """The stream ended and no record is left to open."""
        return self._eof and not (self._records is not None and self._records.complete)

    def _raise_if_failed(self) -> None:
        if self._exception is not None:
            raise self._exception

    async def _wait(self) -> None:
        if self._waiter is not None:
            raise RuntimeError("two tasks are reading one DirectStream at once")
        if self._records is not None and self._records.complete:  # a record waited for the reader
            self._open_records(eager=True)
            return
        if self._reading_paused and self.transport is not None:  # waiting while paused would never end
            self._reading_paused = False
            self.transport.resume_reading()
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


async def open_direct_connection(host: str, port: int) -> Connection:
    """Connects to ``host:port`` over plain TCP; (reader, writer) like ``asyncio.open_connection``."""
    return await start_client_session(await connect_tcp(host, port))


async def connect_tcp(host: str, port: int) -> socket.socket:
    """A connected non-blocking TCP socket to ``host`` (an IP address literal) and ``port``.

    Separate from :func:`start_client_session` so that a caller can tell a peer it cannot reach
    from a peer that refuses its hello. The caller bounds the wait."""
    loop = asyncio.get_running_loop()
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # the event loop sets TCP_NODELAY only on sockets made with proto=IPPROTO_TCP: without it a
        # call's small frames waited for the ACK of the previous ones (40 ms of delayed ACK on Linux)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        await loop.sock_connect(sock, (host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def seal(reader: DirectStream, writer: asyncio.StreamWriter, key: bytes, own_direction: int) -> Connection:
    """The connection, encrypted from here on both ways with ``key`` (see direct_records): this
    side seals as ``own_direction`` and opens the other direction's records."""
    reader.start_records(key, 1 - own_direction)
    return reader, SealedWriter(writer, reader, RecordSealer(key, own_direction))


async def start_client_session(sock: socket.socket) -> Connection:
    """(reader, writer) over a connected socket."""
    loop = asyncio.get_running_loop()
    try:
        transport, protocol = await loop.create_connection(DirectStream, sock=sock)
    except BaseException:
        sock.close()
        raise
    return protocol, asyncio.StreamWriter(transport, protocol, None, loop)


async def start_direct_server(
    on_connection: Callable[[DirectStream, asyncio.StreamWriter], Awaitable[None]],
    host: str,
    port: int,
) -> asyncio.AbstractServer:
    """Listens on ``host:port``; runs ``on_connection(reader, writer)`` in a new task per connection
    (like ``asyncio.start_server``; the callback must adopt and finish its task)."""
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()  # strong references until each task is done

    def connected(connection: Connection) -> None:
        task = loop.create_task(on_connection(*connection))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    return await loop.create_server(
        lambda: DirectStream(on_connected=connected),
        host,
        port,
        reuse_address=True,
    )
