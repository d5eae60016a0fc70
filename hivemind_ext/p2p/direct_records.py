"""AEAD records for the direct data path: AES-128-GCM with a session key handed out over libp2p.

Why: the direct path moves all-reduce data and state downloads over TCP connections between
peers, outside the libp2p daemon, so it needs its own encryption and authentication. TLS 1.3
(Python's ``ssl`` over asyncio) cost about 70% of the plaintext throughput here, mostly in copies
through asyncio's SSL buffers; AES-GCM from the ``cryptography`` package (OpenSSL underneath,
nothing home-made) encrypts at more than 10 GB/s and writes straight into our buffers.

Keys and identity: the ticket call (see :mod:`~hivemind_ext.p2p.direct_wire`) runs over a libp2p
stream that the daemons authenticate and encrypt (noise) with the peers' libp2p keys. With each
one-time token the server issues a fresh random 128-bit key (``secrets.token_bytes``); only the
server and the PeerID that made the ticket call know it. The token travels in clear in the
connection's hello (it only names the key); everything after the hello, both directions, is records::

    u32 length n (little-endian)      16 <= n <= MAX_RECORD_BYTES + TAG_BYTES
    n bytes: ciphertext || 16-byte GCM tag

with AAD = the 4 length bytes and nonce = 1 direction byte (:data:`CALLER`, :data:`SERVER`) || the
record's 11-byte big-endian counter in that direction (0, 1, 2, ...). One key serves one token and a
token one connection, and each direction counts its own records, so a (key, nonce) pair never
repeats. A record that fails to authenticate (altered, replayed, reordered, dropped, or sealed
with another key) is an :class:`~hivemind_ext.errors.AuthenticationError`; a length outside the
bounds (checked before anything is allocated) or a stream that ends inside a record is a
:class:`~hivemind_ext.errors.ProtocolError`. Either way the connection is closed.

What an on-path attacker can do: see the token, the handler-free hello, record lengths and timing;
delay, cut or corrupt the connection (the call fails with a typed error and the round goes on
without that pair; the token is spent). It cannot read or alter data undetected, nor use a token:
without the key its first record fails, and a server without the key cannot answer the caller.
"""

from __future__ import annotations

import asyncio
import collections
import struct
import threading
from typing import Any

from hivemind_ext.errors import AuthenticationError, ProtocolError

# AES-128-GCM, as TLS 1.3's default suite: a key is used for one connection only, so 128 bits is ample,
# and AES-128 takes 10 rounds to AES-256's 14 (about 10% less CPU per byte sealed here).
KEY_BYTES = 16
# keys a peer accepts in a ticket: ours, and AES-256 keys of peers that still issue those
ACCEPTED_KEY_BYTES = (16, 32)
TAG_BYTES = 16
NONCE_COUNTER_BYTES = 11
MAX_COUNTER = 2 ** (8 * NONCE_COUNTER_BYTES) - 1
# Plaintext per record: framing writes payloads in 1 MiB chunks (framing.WRITE_CHUNK_BYTES), one
# record each, so that a record fits a receiver's payload buffer and is decrypted straight into it.
MAX_RECORD_BYTES = 1024 * 1024
LENGTH = struct.Struct("<I")
CALLER, SERVER = 0, 1  # direction bytes: who sealed the record
STAGING_BYTES = 64 * 1024  # read-ahead while a record's length is unknown (bounds the bytes moved after it)
RECORD_BUFFER_BYTES = LENGTH.size + MAX_RECORD_BYTES + TAG_BYTES  # the largest record on the wire
POOLED_RECORD_BYTES = 64 * 1024  # records at least this large are sealed into reused buffers
# record buffers kept for reuse, per process (sized for an all-reduce's few concurrent connections);
# the transports' write buffer limits bound those in flight
MAX_FREE_BUFFERS = 16


def _aead(key: bytes) -> Any:
    # imported here: ``import hivemind_ext`` loads nothing beyond torch and hivemind (tests/test_startup.py)
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    if not isinstance(key, bytes) or len(key) not in ACCEPTED_KEY_BYTES:
        raise ProtocolError("a direct-path session key has 16 or 32 bytes (AES-128 or AES-256)")
    return AESGCM(key)


def _nonce(direction: int, counter: int) -> bytes:
    if counter > MAX_COUNTER:
        raise ProtocolError("the direct-path record counter is exhausted")
    return bytes((direction,)) + counter.to_bytes(NONCE_COUNTER_BYTES, "big")


class RecordSealer:
    """Seals one direction's bytes into records (the sending side)."""

    def __init__(self, key: bytes, direction: int) -> None:
        self._aead, self._direction, self._counter = _aead(key), direction, 0

    def seal(self, data: bytes | bytearray | memoryview) -> bytearray:
        """One record holding ``data`` (at most MAX_RECORD_BYTES), in a fresh buffer."""
        record = bytearray(sealed_size(_nbytes(data)))
        self.seal_into(data, memoryview(record))
        return record

    def seal_into(self, data: bytes | bytearray | memoryview, out: memoryview) -> int:
        """Seals ``data`` (at most MAX_RECORD_BYTES) as one record at the start of ``out`` (which
        must hold :func:`sealed_size` bytes); returns the record's size."""
        size = _nbytes(data)
        if size > MAX_RECORD_BYTES:
            raise ProtocolError(f"a direct-path record holds at most {MAX_RECORD_BYTES} bytes")
        end = sealed_size(size)
        LENGTH.pack_into(out, 0, size + TAG_BYTES)
        nonce = _nonce(self._direction, self._counter)
        self._counter += 1  # before encrypting: a failed call must not leave a nonce to reuse
        self._aead.encrypt_into(nonce, data, out[: LENGTH.size], out[LENGTH.size : end])
        return end


def sealed_size(size: int) -> int:
    """Bytes on the wire of a record holding ``size`` plaintext bytes."""
    return LENGTH.size + size + TAG_BYTES


def _nbytes(data: bytes | bytearray | memoryview) -> int:
    return data.nbytes if isinstance(data, memoryview) else len(data)


class RecordOpener:
    """Receives the other direction's records into one buffer and opens them (the receiving side).

    The event loop's protocol asks :meth:`buffer` where the next bytes go, reports them with
    :meth:`received`, then takes complete records with :meth:`next_record` and :meth:`open_into`.
    While a record's length is known, reads stop at its end, so a large record is never moved;
    the buffer grows to the largest announced record (at most MAX_RECORD_BYTES + 20 bytes).
    """

    def __init__(self, key: bytes, direction: int) -> None:
        self._aead, self._direction, self._counter = _aead(key), direction, 0
        self._buffer = bytearray(STAGING_BYTES)
        self._filled = 0
        self._end = 0  # the current record's end in the buffer, once its length is read (else 0)
        self._plain = bytearray(0)  # scratch for records that fit no reader's buffer

    @property
    def complete(self) -> bool:
        """Whether a whole record has arrived and is not opened yet."""
        return bool(self._end) and self._filled >= self._end

    @property
    def inside_record(self) -> bool:
        """Whether part of a record has arrived (the stream must not end here)."""
        return self._filled > 0

    def buffer(self) -> memoryview:
        if self._end and self._filled < self._end:  # inside a record: read up to its end, no further
            return memoryview(self._buffer)[self._filled : self._end]
        if len(self._buffer) < self._filled + STAGING_BYTES:  # only past a record left sealed (reading pauses)
            self._buffer += bytes(self._filled + STAGING_BYTES - len(self._buffer))
        return memoryview(self._buffer)[self._filled : self._filled + STAGING_BYTES]

    def received(self, nbytes: int) -> None:
        self._filled += nbytes

    def next_record(self) -> int | None:
        """The plaintext size of the next complete record, or None until it has arrived."""
        if not self._end:
            if self._filled < LENGTH.size:
                return None
            (sealed,) = LENGTH.unpack_from(self._buffer, 0)
            if not TAG_BYTES <= sealed <= MAX_RECORD_BYTES + TAG_BYTES:
                raise ProtocolError(f"a direct-path record announces {sealed} bytes (at most {MAX_RECORD_BYTES})")
            self._end = LENGTH.size + sealed
            if len(self._buffer) < self._end:  # grows once, to the largest record's size (from the shared pool)
                grown = FREE_RECORD_BUFFERS.take()
                grown[: self._filled] = memoryview(self._buffer)[: self._filled]
                self._buffer = grown
        if self._filled < self._end:
            return None
        return self._end - LENGTH.size - TAG_BYTES

    def open_into(self, out: memoryview) -> None:
        """Decrypts the complete record into ``out`` (exactly its plaintext size) and drops it."""
        with memoryview(self._buffer) as view:
            nonce = _nonce(self._direction, self._counter)
            try:
                self._aead.decrypt_into(nonce, view[LENGTH.size : self._end], view[: LENGTH.size], out)
            except Exception as e:  # cryptography's InvalidTag
                raise AuthenticationError("a direct-path record failed to authenticate") from e
            self._counter += 1
            rest = self._filled - self._end
            if rest:  # the read-ahead past a small record (at most STAGING_BYTES)
                view[:rest] = view[self._end : self._filled]
        self._filled, self._end = rest, 0

    def release(self) -> None:
        """Gives the record buffer back to the shared pool (the connection ended); only a buffer that
        holds no unopened record is given back, and this opener then receives nothing more."""
        if self._filled == 0 and len(self._buffer) == RECORD_BUFFER_BYTES:
            FREE_RECORD_BUFFERS.give_back([self._buffer])
            self._buffer = bytearray(0)

    def open(self, size: int) -> memoryview:
        """Decrypts the complete record (of ``size`` plaintext bytes) into a scratch buffer, valid
        until the next call."""
        if len(self._plain) < size:
            self._plain = bytearray(size)
        out = memoryview(self._plain)[:size]
        self.open_into(out)
        return out


class SendBuffers:
    """Reusable buffers for the records of one connection, so that sealing does not allocate (and
    the kernel zero-fill and map) a fresh megabyte per record.

    The transport keeps a reference to each buffer it has not sent yet (uvloop and asyncio queue the
    object, they do not copy it), so a buffer is reused only once the transport's queue is shorter
    than what was written after it: transports send in write order, so the bytes still queued are
    always the newest ones written. Sent buffers go to a pool that every connection of the process
    shares (:data:`FREE_RECORD_BUFFERS`, which also serves the receiving side's record buffers): an
    all-reduce opens new connections every round, and with a pool per connection each of them paid
    for fresh buffers (about 3% of a peer's event-loop time in a profile of
    ``benchmarks/averaging.py``)."""

    def __init__(self, transport: asyncio.WriteTransport) -> None:
        self._transport = transport
        self._in_flight: collections.deque[tuple[bytearray, int]] = collections.deque()  # write order
        self._in_flight_bytes = 0

    def take(self) -> bytearray:
        """A buffer of RECORD_BUFFER_BYTES that no transport reads."""
        self.reclaim()
        return FREE_RECORD_BUFFERS.take()

    def sent(self, buffer: bytearray, size: int) -> None:
        """``size`` bytes of ``buffer`` were just written to the transport."""
        self._in_flight.append((buffer, size))
        self._in_flight_bytes += size

    def reclaim(self) -> None:
        """Returns the buffers that the transport has sent to the shared pool (those it still holds
        stay with it, and are dropped with the connection)."""
        try:
            queued = self._transport.get_write_buffer_size()
        except (AttributeError, RuntimeError):  # a closed transport: what it held is gone with it
            return
        freed = []
        while self._in_flight and self._in_flight_bytes - self._in_flight[0][1] >= queued:
            buffer, size = self._in_flight.popleft()
            self._in_flight_bytes -= size
            freed.append(buffer)
        FREE_RECORD_BUFFERS.give_back(freed)


class FreeRecordBuffers:
    """Record buffers of RECORD_BUFFER_BYTES that no transport or opener holds, shared by the
    connections (and event loops) of a process, sending and receiving; at most ``max_buffers`` are
    kept. Thread-safe."""

    def __init__(self, max_buffers: int) -> None:
        self.max_buffers = max_buffers
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._free)

    def take(self) -> bytearray:
        with self._lock:
            if self._free:
                return self._free.pop()
        return bytearray(RECORD_BUFFER_BYTES)

    def give_back(self, buffers: list[bytearray]) -> None:
        if buffers:
            with self._lock:
                self._free += buffers[: self.max_buffers - len(self._free)]


FREE_RECORD_BUFFERS = FreeRecordBuffers(MAX_FREE_BUFFERS)


class SealedWriter(asyncio.StreamWriter):
    """An ``asyncio.StreamWriter`` whose writes leave as records (one per write, split at MAX_RECORD_BYTES)."""

    def __init__(self, writer: asyncio.StreamWriter, protocol: Any, sealer: RecordSealer) -> None:
        super().__init__(writer.transport, protocol, None, asyncio.get_running_loop())
        # kept alive with this one: a collected StreamWriter closes its transport
        self.plain_writer, self.sealer = writer, sealer
        self._buffers = SendBuffers(writer.transport)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        with memoryview(data) as view:
            view = view.cast("B")
            for start in range(0, view.nbytes, MAX_RECORD_BYTES):
                piece = view[start : start + MAX_RECORD_BYTES]
                if piece.nbytes < POOLED_RECORD_BYTES:  # headers and small messages: a small fresh buffer
                    self.transport.write(self.sealer.seal(piece))
                    continue
                buffer = self._buffers.take()
                size = self.sealer.seal_into(piece, memoryview(buffer))
                self.transport.write(memoryview(buffer)[:size])
                self._buffers.sent(buffer, size)

    def writelines(self, data: Any) -> None:
        for piece in data:
            self.write(piece)

    def close(self) -> None:
        self._buffers.reclaim()  # before the transport lets go of its queue: only sent buffers return
        super().close()


def new_session_key() -> bytes:
    """A fresh random key for one token's connection."""
    import secrets

    return secrets.token_bytes(KEY_BYTES)
