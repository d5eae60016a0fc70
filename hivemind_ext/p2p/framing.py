"""The frame format, and reading / writing single frames on an asyncio stream.

Frame layout (all integers little-endian)::

    offset  size  field
    0       2     magic  b"hx"          -- rejects streams that are not ours at the first bytes
    2       1     version (1)
    3       1     kind   (FrameKind: OPEN, MESSAGE, END, ERROR)
    4       4     header length H (u32), H >= 1
    8       8     payload length P (u64)
    16      H     header: one msgpack map
    16+H    P     payload: raw bytes (tensor data), not interpreted by this layer

A call is one libp2p stream (protocol id ``/hivemind_ext/<namespace>/<handler>``) carrying:

    unary:   caller -> OPEN {"timeout": s}, MESSAGE          server -> MESSAGE | ERROR
    stream:  caller -> OPEN {"timeout": s}, MESSAGE*, END    server -> MESSAGE*, END | ERROR

with both directions of a streaming call flowing at the same time. An ERROR frame's header is
``{"kind", "type", "message"}`` (see :mod:`~hivemind_ext.p2p.wire_errors`). Nothing follows an
END or ERROR frame; a caller that goes away simply closes the stream.

The 16-byte prefix is read first and both lengths are checked against :class:`Limits` before a
single byte is allocated for them, so a peer that declares a 2**63-byte payload costs nothing.
The payload is then read straight into one preallocated ``bytearray``; large ones come from
:data:`RECEIVE_BUFFERS`, which hands a buffer out again once nothing references it any more (a
fresh multi-MiB buffer costs a page fault per 4 KiB: for an all-reduce round, as much CPU as the
copy of the data itself). On the writing side the
prefix and header go out as one small buffer and the payload is written from the caller's own
memory in chunks, each followed by ``drain()`` so that the transport never buffers (copies) more
than a bounded amount and every chunk is subject to the deadline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import struct
import sys
import threading
from collections.abc import Mapping
from typing import Any

import msgpack

from hivemind_ext.errors import ConfigurationError, MessageTooLargeError, PeerUnreachableError, ProtocolError
from hivemind_ext.p2p.deadlines import wait_until
from hivemind_ext.p2p.direct_transport import DirectStream
from hivemind_ext.p2p.messages import Limits
from hivemind_ext.p2p.receive_budget import ReceiveAccount

# What frames are read from: a libp2p stream's StreamReader, or the direct path's TCP stream.
ByteReader = asyncio.StreamReader | DirectStream

MAGIC = b"hx"
VERSION = 1
PREFIX = struct.Struct("<2sBBIQ")
PREFIX_BYTES = PREFIX.size  # 16

# Payload bytes handed to the transport per write() before awaiting drain(): large enough that the
# per-chunk Python overhead is negligible, small enough that the transport's copy stays bounded.
WRITE_CHUNK_BYTES = 1024 * 1024
# Upper bound on one read() from the StreamReader while filling a payload; read() returns what is
# buffered, so this only caps the size of the temporary bytes object.
READ_CHUNK_BYTES = 4 * 1024 * 1024
# A payload's buffer starts at this size (or the payload's, if smaller: allocated at once, pooled)
# and grows by GROWTH_FACTOR whenever it is full: what a stalled sender costs is bounded by what it
# sent, never by what it announced. At 4, the copies on growth add at most a third of a large payload.
EAGER_PAYLOAD_BYTES = 4 * 1024 * 1024
GROWTH_FACTOR = 4
# Payloads up to this size are sent in the same write() as the prefix and header.
COALESCE_BYTES = 16 * 1024


class FrameKind(enum.IntEnum):
    OPEN = 1  # first frame a caller sends: {"timeout": seconds}
    MESSAGE = 2  # a request or a response
    END = 3  # the sender will send no more messages on this stream
    ERROR = 4  # the sender failed; header says why (see wire_errors), the stream ends


@dataclasses.dataclass(frozen=True, eq=False)
class Frame:
    kind: FrameKind
    header: dict[Any, Any]
    payload: bytearray


def pack_header(header: Mapping[Any, Any], limits: Limits) -> bytes:
    """Serializes a header map, enforcing the header limit on the sending side."""
    if not isinstance(header, Mapping):
        raise ProtocolError(f"a message header must be a map, got {type(header).__name__}")
    try:
        packed = msgpack.packb(header if isinstance(header, dict) else dict(header), use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ProtocolError(f"message header is not msgpack-serializable: {e}") from e
    if len(packed) > limits.max_header_bytes:
        raise MessageTooLargeError(f"header of {len(packed)} bytes exceeds the limit of {limits.max_header_bytes}")
    return packed


def encode_frame_head(kind: FrameKind, header: Mapping[Any, Any], payload_nbytes: int, limits: Limits) -> bytes:
    """Prefix + packed header of a frame, after checking both sizes against the sender's limits.

    Everything that can reject a message happens here, before a stream is touched, so a refused
    message never leaves half a frame behind.
    """
    packed_header = pack_header(header, limits)
    if payload_nbytes > limits.max_payload_bytes:
        raise MessageTooLargeError(f"payload of {payload_nbytes} bytes exceeds the limit of {limits.max_payload_bytes}")
    return PREFIX.pack(MAGIC, VERSION, kind, len(packed_header), payload_nbytes) + packed_header


def decode_prefix(prefix: bytes, limits: Limits) -> tuple[FrameKind, int, int]:
    """(kind, header length, payload length) from a frame prefix; raises before any allocation."""
    magic, version, kind, header_nbytes, payload_nbytes = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise ProtocolError(f"not a hivemind_ext frame (magic {magic!r})")
    if version != VERSION:
        raise ProtocolError(f"unsupported frame version {version} (this peer speaks {VERSION})")
    try:
        frame_kind = FrameKind(kind)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None
    if header_nbytes == 0:
        raise ProtocolError("empty frame header (a header is a msgpack map of at least 1 byte)")
    if header_nbytes > limits.max_header_bytes:
        raise MessageTooLargeError(
            f"declared header of {header_nbytes} bytes exceeds the limit of {limits.max_header_bytes}"
        )
    if payload_nbytes > limits.max_payload_bytes:
        raise MessageTooLargeError(
            f"declared payload of {payload_nbytes} bytes exceeds the limit of {limits.max_payload_bytes}"
        )
    return frame_kind, header_nbytes, payload_nbytes


def unpack_header(raw: bytes) -> dict[Any, Any]:
    """Deserializes a received header; anything but a well-formed msgpack map is a ProtocolError."""
    try:
        # ext types are refused (they could smuggle arbitrary objects through hooks); str/bin keys only
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_ext_len=0)
    except Exception as e:  # msgpack raises many unrelated types on malformed input (ValueError, TypeError, ...)
        raise ProtocolError(f"frame header is not valid msgpack: {type(e).__name__}: {e}"[:300]) from None
    if not isinstance(header, dict):
        raise ProtocolError(f"frame header must be a msgpack map, got {type(header).__name__}")
    return header


async def write_frame(writer: asyncio.StreamWriter, head: bytes, payload: memoryview, *, deadline: float) -> None:
    """Writes one frame (``head`` from :func:`encode_frame_head`, then ``payload`` from the caller's
    memory) and waits until the transport has taken it, or raises at ``deadline``."""
    await wait_until(_write_frame(writer, head, payload), deadline, "writing a frame")


async def _write_frame(writer: asyncio.StreamWriter, head: bytes, payload: memoryview) -> None:
    try:
        if payload.nbytes <= COALESCE_BYTES:
            writer.write(head + payload)  # copying a few KiB is cheaper than a second send() syscall
        else:
            writer.write(head)
            for start in range(0, payload.nbytes, WRITE_CHUNK_BYTES):
                writer.write(payload[start : start + WRITE_CHUNK_BYTES])
                await writer.drain()
        await writer.drain()
    except (ConnectionError, OSError) as e:
        raise PeerUnreachableError(f"stream broke while writing: {type(e).__name__}: {e}") from e


def write_frame_nowait(writer: asyncio.StreamWriter, kind: FrameKind, header: Mapping[Any, Any]) -> None:
    """Queues a small payload-less frame without waiting (OPEN before a request; error frames)."""
    if writer.is_closing():
        return  # the stream is already gone; the peer sees it closed instead
    writer.write(encode_frame_head(kind, header, 0, Limits()))


async def read_frame(
    reader: ByteReader, *, limits: Limits, deadline: float, account: ReceiveAccount | None = None
) -> Frame:
    """Reads one frame, or raises at ``deadline``.

    Raises :class:`PeerUnreachableError` if the stream ends cleanly before the frame starts,
    :class:`ProtocolError` if it is malformed, cut short or stalls for ``limits.idle_timeout``
    inside the frame, :class:`MessageTooLargeError` if it declares more than ``limits`` allow
    (before allocating) or the sender's ``account`` is over its budget.
    """
    account = account if account is not None else ReceiveAccount()
    try:
        return await wait_until(_read_frame(reader, limits, account), deadline, "reading a frame")
    finally:
        account.release()


async def _read_frame(reader: ByteReader, limits: Limits, account: ReceiveAccount) -> Frame:
    try:
        prefix = await reader.readexactly(PREFIX_BYTES)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            raise PeerUnreachableError("the peer closed the stream") from None
        raise ProtocolError(f"stream ended inside a frame prefix ({len(e.partial)} of {PREFIX_BYTES} bytes)") from None
    except (ConnectionError, OSError) as e:
        raise PeerUnreachableError(f"stream broke while reading: {type(e).__name__}: {e}") from e
    kind, header_nbytes, payload_nbytes = decode_prefix(prefix, limits)
    progress = _Progress(reader)
    watchdog = _IdleWatchdog(limits.idle_timeout, progress)
    try:
        async with asyncio.timeout(None) as timeout:
            watchdog.start(timeout)
            header = unpack_header(await reader.readexactly(header_nbytes))
            payload = await _read_payload(reader, payload_nbytes, account, progress)
    except TimeoutError:
        if not watchdog.fired:
            raise
        raise ProtocolError(f"the peer sent nothing for {limits.idle_timeout} s inside a frame") from None
    except asyncio.IncompleteReadError as e:
        raise ProtocolError(f"stream ended inside a frame header ({len(e.partial)} of {header_nbytes} bytes)") from None
    except (ConnectionError, OSError) as e:
        raise PeerUnreachableError(f"stream broke while reading: {type(e).__name__}: {e}") from e
    finally:
        watchdog.stop()
    return Frame(kind, header, payload)


class _Progress:
    """Counts the bytes a frame has received so far, for the idle watchdog."""

    def __init__(self, reader: ByteReader) -> None:
        self.reader = reader
        self.filled = 0  # payload bytes copied out of a StreamReader (a DirectStream counts its own)

    def __call__(self) -> int:
        reader = self.reader
        return reader.bytes_received if isinstance(reader, DirectStream) else self.filled


class _IdleWatchdog:
    """Expires an ``asyncio.timeout`` once ``progress()`` has not moved for ``seconds`` (one timer
    per ``seconds``, not per read, so it costs nothing on a busy stream)."""

    def __init__(self, seconds: float, progress: _Progress) -> None:
        self.seconds, self.progress = seconds, progress
        self.fired = False
        self._timeout: asyncio.Timeout | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._last = -1

    def start(self, timeout: asyncio.Timeout) -> None:
        self._timeout, self._last = timeout, self.progress()
        self._handle = asyncio.get_running_loop().call_later(self.seconds, self._check)

    def _check(self) -> None:
        if self._timeout is None:
            return
        current = self.progress()
        if current == self._last:
            self.fired = True
            self._timeout.reschedule(asyncio.get_running_loop().time())
            return
        self._last = current
        self._handle = asyncio.get_running_loop().call_later(self.seconds, self._check)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle = self._timeout = None


def _references(bucket: list[bytearray], index: int) -> int:
    return sys.getrefcount(bucket[index])


# What _references() counts for a buffer that only the pool's list holds (the list's reference plus
# the temporaries of the call), measured through the same code path, so it is right on any CPython.
_UNREFERENCED = _references([bytearray(1)], 0)


class ReceiveBuffers:
    """Payload buffers of at least ``min_bytes`` (and at most a quarter of ``max_bytes``), reused.

    A buffer handed out by :meth:`take` belongs to its receiver (messages, tensors that alias it)
    for as long as anything references it; once nothing does, its reference count says so and it
    is handed out again, already paged in and without being zeroed (:func:`_read_payload` fills it
    completely before anyone sees it, or raises and drops it). The pool keeps at most ``max_bytes``
    of buffers; beyond that, and for other sizes, :meth:`take` allocates as usual. Thread-safe:
    several event loops of one process share it.
    """

    def __init__(self, max_bytes: int, min_bytes: int) -> None:
        self.max_bytes, self.min_bytes = max_bytes, min_bytes
        self._buckets: dict[int, list[bytearray]] = {}
        self._held = 0  # bytes in all buckets
        self._lock = threading.Lock()

    @property
    def held_bytes(self) -> int:
        return self._held

    def take(self, nbytes: int) -> bytearray:
        """A buffer of exactly ``nbytes`` that nothing else references (contents unspecified if reused)."""
        if not self.min_bytes <= nbytes <= self.max_bytes // 4:
            return bytearray(nbytes)
        with self._lock:
            bucket = self._buckets.get(nbytes)
            if bucket is None:
                bucket = self._buckets[nbytes] = []
            for index in range(len(bucket)):
                if _references(bucket, index) == _UNREFERENCED:
                    return bucket[index]
            if self._held + nbytes > self.max_bytes:
                self._evict(self._held + nbytes - self.max_bytes)
            if self._held + nbytes > self.max_bytes:
                return bytearray(nbytes)
            buffer = bytearray(nbytes)
            bucket.append(buffer)
            self._held += nbytes
            return buffer

    def clear(self) -> None:
        """Forgets every buffer (those still in use stay valid: their holders keep them alive)."""
        with self._lock:
            self._buckets.clear()
            self._held = 0

    def _evict(self, nbytes: int) -> None:
        """Drops unreferenced buffers, of any size, until ``nbytes`` were freed or none is left."""
        freed = 0
        for size, bucket in list(self._buckets.items()):
            index = 0
            while index < len(bucket) and freed < nbytes:
                if _references(bucket, index) == _UNREFERENCED:
                    del bucket[index]
                    freed += size
                    self._held -= size
                else:
                    index += 1
            if not bucket:
                del self._buckets[size]
            if freed >= nbytes:
                return


RECEIVE_BUFFERS = ReceiveBuffers(max_bytes=128 * 1024 * 1024, min_bytes=128 * 1024)


async def _read_payload(reader: ByteReader, nbytes: int, account: ReceiveAccount, progress: _Progress) -> bytearray:
    """The payload, in a buffer that grows as its bytes arrive (never from the announced size alone).

    Payloads up to ``EAGER_PAYLOAD_BYTES`` are read into one buffer taken at once (from the pool);
    larger ones start with that much and grow by ``GROWTH_FACTOR`` each time the buffer is full,
    so a sender that stalls holds at most ``GROWTH_FACTOR`` times what it sent (or the first step).
    Every allocation is charged to ``account`` first. On failure, nothing that the error's
    traceback keeps alive references the buffer (see :func:`_forget_frames`).
    """
    buffer: bytearray | None = None
    try:
        capacity = min(nbytes, EAGER_PAYLOAD_BYTES)
        account.charge(capacity)
        buffer = RECEIVE_BUFFERS.take(capacity)
        filled = 0
        while True:
            await _fill(reader, buffer, filled, capacity, progress)
            filled = capacity
            if filled == nbytes:
                return buffer
            capacity = min(nbytes, capacity * GROWTH_FACTOR)
            account.charge(capacity)
            grown = RECEIVE_BUFFERS.take(capacity) if capacity == nbytes else bytearray(capacity)
            grown[:filled] = buffer
            buffer, grown = grown, None  # the old buffer is freed (or back in the pool) here
            account.release(filled)
    except BaseException as error:
        buffer = None  # this frame stays referenced from the traceback: it must not hold the payload
        _forget_frames(error)
        raise


async def _fill(reader: ByteReader, buffer: bytearray, start: int, stop: int, progress: _Progress) -> None:
    """Fills ``buffer[start:stop]`` from the stream."""
    with memoryview(buffer) as whole:
        view = whole[start:stop]
        try:
            if isinstance(reader, DirectStream):  # the kernel writes the payload straight into ``view``
                try:
                    await reader.readexactly_into(view)
                except asyncio.IncompleteReadError:
                    raise ProtocolError(f"stream ended inside a payload at byte {start} or later") from None
                return
            filled = 0
            while filled < view.nbytes:
                received = await readinto(reader, view[filled:])
                if not received:
                    raise ProtocolError(f"stream ended inside a payload ({start + filled} bytes in)")
                filled += received
                progress.filled += received
        finally:
            view.release()


def _forget_frames(error: BaseException) -> None:
    """Drops the tracebacks of ``error`` and of the errors it chains to.

    A failed read's frames hold views of its payload buffer; an error kept anywhere (a request
    stream remembers its error, and a frame of its own traceback often references it back: a
    reference cycle) would keep them, and the buffer, alive until the cycle collector runs. The
    messages say what went wrong; the frames below the payload reader add nothing for the caller.
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        current.__traceback__ = None
        pending += [current.__cause__, current.__context__]


# asyncio.StreamReader.read(n) returns ``bytes(self._buffer[:n])``: two copies (a bytearray slice,
# then bytes) before the caller's own copy into its buffer. Copying straight out of the reader's
# buffer saves both; it relies on StreamReader internals that have not changed since Python 3.7,
# so it is used only where they are present, with read() as the fallback.
_FAST_READINTO = all(hasattr(asyncio.StreamReader, name) for name in ("_wait_for_data", "_maybe_resume_transport"))


async def readinto(reader: asyncio.StreamReader, view: memoryview) -> int:
    """Reads up to ``len(view)`` bytes into ``view`` as soon as any are available; 0 at end of stream.

    Like ``read()`` followed by a copy, but without read()'s two intermediate objects when the
    reader is a plain asyncio.StreamReader (one memcpy from the reader's buffer into ``view``).
    """
    if not view.nbytes:
        return 0
    buffer = getattr(reader, "_buffer", None) if _FAST_READINTO and type(reader) is asyncio.StreamReader else None
    if not isinstance(buffer, bytearray):
        chunk = await reader.read(min(view.nbytes, READ_CHUNK_BYTES))
        view[: len(chunk)] = chunk
        return len(chunk)
    exception = reader.exception()
    if exception is not None:
        raise exception
    if not buffer and not reader.at_eof():
        await reader._wait_for_data("readinto")
        buffer = reader._buffer
    taken = min(len(buffer), view.nbytes)
    with memoryview(buffer) as source:
        view[:taken] = source[:taken]
    del buffer[:taken]  # cheap: CPython drops a bytearray's prefix without moving the rest
    reader._maybe_resume_transport()
    return taken


PROTOCOL_PREFIX = "/hivemind_ext"
MAX_NAMESPACE_LENGTH = 200  # of a namespace or handler name in a protocol id


def protocol_name(namespace: str, name: str) -> str:
    """The libp2p protocol id under which handler ``name`` of ``namespace`` is served."""
    for what, value in (("namespace", namespace), ("handler name", name)):
        if (
            not isinstance(value, str)
            or not 1 <= len(value) <= MAX_NAMESPACE_LENGTH
            or not value.isprintable()
            or " " in value
        ):
            raise ConfigurationError(
                f"{what} must be 1-{MAX_NAMESPACE_LENGTH} printable characters without spaces, got {value!r:.100}"
            )
    return f"{PROTOCOL_PREFIX}/{namespace}/{name}"


def open_header(timeout: float) -> dict[str, float]:
    """The OPEN frame's header: how long the caller will wait, so the server can stop when it gives up.

    A relative timeout, not an absolute time: the two peers' clocks are not synchronized.
    """
    return {"timeout": float(timeout)}


def parse_open(frame: Frame) -> float:
    """The caller's timeout from its OPEN frame; anything else is a ProtocolError."""
    if frame.kind is not FrameKind.OPEN:
        raise ProtocolError(f"a call must start with an OPEN frame, got {frame.kind.name}")
    timeout = frame.header.get("timeout")
    if type(timeout) not in (int, float) or not 0 < timeout < float("inf"):
        raise ProtocolError(f"OPEN frame needs a positive finite 'timeout', got {timeout!r:.50}")
    return float(timeout)
