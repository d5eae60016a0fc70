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
The payload's buffer then grows as its bytes arrive, charged to the sender's receive budget, and a
frame whose bytes stop coming for ``Limits.idle_timeout`` is cut off (see
:mod:`~hivemind_ext.p2p.payload`, :mod:`~hivemind_ext.p2p.receive_budget`, :mod:`~hivemind_ext.p2p.idle`).
On the writing side the
prefix and header go out as one small buffer and the payload is written from the caller's own
memory in chunks, each followed by ``drain()`` so that the transport never buffers (copies) more
than a bounded amount and every chunk is subject to the deadline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import struct
from collections.abc import Mapping
from typing import Any

import msgpack

from hivemind_ext.errors import ConfigurationError, MessageTooLargeError, PeerUnreachableError, ProtocolError
from hivemind_ext.p2p.deadlines import wait_until
from hivemind_ext.p2p.idle import unless_idle
from hivemind_ext.p2p.messages import Limits
from hivemind_ext.p2p.payload import RECEIVE_BUFFERS as RECEIVE_BUFFERS  # re-exported: tests clear the pool
from hivemind_ext.p2p.payload import ByteReader, Progress, read_payload
from hivemind_ext.p2p.payload import ReceiveBuffers as ReceiveBuffers
from hivemind_ext.p2p.receive_budget import ReceiveAccount

MAGIC = b"hx"
VERSION = 1
PREFIX = struct.Struct("<2sBBIQ")
PREFIX_BYTES = PREFIX.size  # 16

# Payload bytes handed to the transport per write() before awaiting drain(): large enough that the
# per-chunk Python overhead is negligible, small enough that the transport's copy stays bounded.
WRITE_CHUNK_BYTES = 1024 * 1024
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


async def write_frame(
    writer: asyncio.StreamWriter,
    head: bytes,
    payload: memoryview,
    *,
    deadline: float,
    idle_timeout: float | None = None,
) -> None:
    """Writes one frame (``head`` from :func:`encode_frame_head`, then ``payload`` from the caller's
    memory) and waits until the transport has taken it, or raises at ``deadline``; with
    ``idle_timeout``, also (StalledWriteError) once the transport has taken none of its bytes for
    that long: a slow link that keeps draining is alive, a peer that stopped reading is not."""
    await wait_until(_write_watched(writer, head, payload, idle_timeout), deadline, "writing a frame")


async def _write_watched(
    writer: asyncio.StreamWriter, head: bytes, payload: memoryview, idle_timeout: float | None
) -> None:
    progress = WriteProgress(writer)
    work = _write_frame(writer, head, payload, progress)
    if idle_timeout is None:
        return await work
    return await unless_idle(work, idle_timeout, progress, "while we wrote a frame", writing=True)


class WriteProgress:
    """Bytes of one frame that the transport has passed on (written, less what it still buffers)."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.transport = writer.transport
        self.written = 0

    def __call__(self) -> int:
        try:
            return self.written - self.transport.get_write_buffer_size()
        except (AttributeError, RuntimeError):  # a closed transport: progress stops, the write fails anyway
            return self.written


async def _write_frame(writer: asyncio.StreamWriter, head: bytes, payload: memoryview, progress: WriteProgress) -> None:
    try:
        if payload.nbytes <= COALESCE_BYTES:
            writer.write(head + payload)  # copying a few KiB is cheaper than a second send() syscall
            progress.written += len(head) + payload.nbytes
        else:
            writer.write(head)
            progress.written += len(head)
            for start in range(0, payload.nbytes, WRITE_CHUNK_BYTES):
                piece = payload[start : start + WRITE_CHUNK_BYTES]
                writer.write(piece)
                progress.written += piece.nbytes
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
    reader: ByteReader,
    *,
    limits: Limits,
    deadline: float,
    account: ReceiveAccount | None = None,
    idle_timeout: float | None = None,
) -> Frame:
    """Reads one frame, or raises at ``deadline``.

    Raises :class:`PeerUnreachableError` if the stream ends cleanly before the frame starts,
    :class:`ProtocolError` if it is malformed, cut short or stalls for ``limits.idle_timeout``
    inside the frame, :class:`MessageTooLargeError` if it declares more than ``limits`` allow
    (before allocating) or the sender's ``account`` is over its budget. With ``idle_timeout``, a
    frame that is due must also keep coming: no byte of it (its start included) for that long
    raises :class:`~hivemind_ext.p2p.idle.IdleStreamError`, however far ``deadline`` is.
    """
    account = account if account is not None else ReceiveAccount()
    try:
        return await wait_until(_read_watched(reader, limits, account, idle_timeout), deadline, "reading a frame")
    finally:
        account.release()


async def _read_watched(
    reader: ByteReader, limits: Limits, account: ReceiveAccount, idle_timeout: float | None
) -> Frame:
    progress = Progress(reader)
    work = _read_frame(reader, limits, account, progress)
    if idle_timeout is None:
        return await work
    return await unless_idle(work, idle_timeout, progress, "while a frame was due")


async def _read_frame(reader: ByteReader, limits: Limits, account: ReceiveAccount, progress: Progress) -> Frame:
    try:
        prefix = await reader.readexactly(PREFIX_BYTES)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            raise PeerUnreachableError("the peer closed the stream") from None
        raise ProtocolError(f"stream ended inside a frame prefix ({len(e.partial)} of {PREFIX_BYTES} bytes)") from None
    except (ConnectionError, OSError) as e:
        raise PeerUnreachableError(f"stream broke while reading: {type(e).__name__}: {e}") from e
    progress.filled += PREFIX_BYTES
    kind, header_nbytes, payload_nbytes = decode_prefix(prefix, limits)
    try:
        return await unless_idle(
            _read_body(reader, kind, header_nbytes, payload_nbytes, account, progress),
            limits.idle_timeout,
            progress,
            "inside a frame",
        )
    except asyncio.IncompleteReadError as e:
        raise ProtocolError(f"stream ended inside a frame header ({len(e.partial)} of {header_nbytes} bytes)") from None
    except (ConnectionError, OSError) as e:
        raise PeerUnreachableError(f"stream broke while reading: {type(e).__name__}: {e}") from e


async def _read_body(
    reader: ByteReader,
    kind: FrameKind,
    header_nbytes: int,
    payload_nbytes: int,
    account: ReceiveAccount,
    progress: Progress,
) -> Frame:
    header = unpack_header(await reader.readexactly(header_nbytes))
    progress.filled += header_nbytes
    return Frame(kind, header, await read_payload(reader, payload_nbytes, account, progress))


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
