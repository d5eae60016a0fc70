"""Reading one frame's payload: into a buffer that grows as the bytes arrive, charged to a budget.

See :func:`read_payload`. Buffers of a common size come from :data:`RECEIVE_BUFFERS`, which hands a
buffer out again once nothing references it any more (a fresh multi-MiB buffer costs a page fault
per 4 KiB: for an all-reduce round, as much CPU as the copy of the data itself).
"""

from __future__ import annotations

import asyncio
import sys
import threading

from hivemind_ext.errors import ProtocolError
from hivemind_ext.p2p.direct_transport import DirectStream
from hivemind_ext.p2p.receive_budget import ReceiveAccount

# What frames are read from: a libp2p stream's StreamReader, or the direct path's TCP stream.
ByteReader = asyncio.StreamReader | DirectStream

# Upper bound on one read() from the StreamReader while filling a payload; read() returns what is
# buffered, so this only caps the size of the temporary bytes object.
READ_CHUNK_BYTES = 4 * 1024 * 1024
# A payload's buffer starts at this size (or the payload's, if smaller: allocated at once, pooled)
# and grows by GROWTH_FACTOR whenever it is full: what a stalled sender costs is bounded by what it
# sent, never by what it announced. At 4, the copies on growth add at most a third of a large payload.
EAGER_PAYLOAD_BYTES = 4 * 1024 * 1024
GROWTH_FACTOR = 4


class Progress:
    """Counts the bytes a frame has received so far, for :func:`~hivemind_ext.p2p.idle.unless_idle`."""

    def __init__(self, reader: ByteReader) -> None:
        self.reader = reader
        self.filled = 0  # payload bytes copied out of a StreamReader (a DirectStream counts its own)

    def __call__(self) -> int:
        reader = self.reader
        return reader.bytes_received if isinstance(reader, DirectStream) else self.filled


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


async def read_payload(reader: ByteReader, nbytes: int, account: ReceiveAccount, progress: Progress) -> bytearray:
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


async def _fill(reader: ByteReader, buffer: bytearray, start: int, stop: int, progress: Progress) -> None:
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
