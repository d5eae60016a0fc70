"""What the p2p layer carries: a :class:`Message` (msgpack map + raw payload) and its size :class:`Limits`.

The layer is generic: a header is any msgpack map, a payload any contiguous bytes-like object,
written to the stream without being copied into an intermediate buffer. Compressed tensors
travel as one message each; :func:`pack_tensor` / :func:`unpack_tensor` do the (tiny) conversion
for any object with the ``header()`` / ``payload_view()`` / ``from_wire()`` shape of
``hivemind_ext.compression.CompressedTensor`` (duck-typed, so this layer does not import the
compression layer above it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Protocol

from hivemind_ext.errors import ConfigurationError, ProtocolError

DEFAULT_MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_PAYLOAD_BYTES = 256 * 1024 * 1024
HARD_MAX_HEADER_BYTES = 2**32 - 1  # the frame stores header lengths as u32
DEFAULT_IDLE_TIMEOUT = 30.0


@dataclasses.dataclass(frozen=True)
class Limits:
    """Largest header and payload one message may have; checked before anything is allocated.

    A handler's limits bound what it accepts and what it answers; a call's limits bound what the
    caller sends and accepts back. Messages above the limit raise :class:`MessageTooLargeError`.
    ``idle_timeout``: once a frame has started to arrive, a peer that sends none of its bytes for
    this many seconds is cut off (ProtocolError), so a stalled frame cannot hold its buffer until
    the call's (possibly long) deadline.
    """

    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT

    def __post_init__(self) -> None:
        if type(self.max_header_bytes) is not int or not 1 <= self.max_header_bytes <= HARD_MAX_HEADER_BYTES:
            raise ConfigurationError(
                f"max_header_bytes must be an int in [1, 2**32 - 1], got {self.max_header_bytes!r}"
            )
        if type(self.max_payload_bytes) is not int or not 0 <= self.max_payload_bytes < 2**63:
            raise ConfigurationError(f"max_payload_bytes must be an int in [0, 2**63), got {self.max_payload_bytes!r}")
        if type(self.idle_timeout) not in (int, float) or not 0 < self.idle_timeout < math.inf:
            raise ConfigurationError(f"idle_timeout must be a positive number of seconds, got {self.idle_timeout!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class Message:
    """One unit of the protocol: a msgpack-serializable map plus optional raw bytes.

    On the sending side ``payload`` may be any contiguous bytes-like object (bytes, bytearray,
    memoryview, a numpy array...); it is written as is. A received message's payload is a
    ``bytearray`` that belongs to the receiver (writable, so tensors can alias it).
    """

    header: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    payload: Any = None

    def payload_view(self) -> memoryview:
        """The payload as a flat, byte-indexed memoryview (empty when there is no payload)."""
        if self.payload is None:
            return memoryview(b"")
        try:
            view = memoryview(self.payload)
        except TypeError as e:
            raise ProtocolError(f"payload must be a bytes-like object, got {type(self.payload).__name__}") from e
        if not view.contiguous:
            raise ProtocolError("payload must be a contiguous buffer")
        return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class WireTensor(Protocol):
    """The sending half of ``CompressedTensor``'s wire interface."""

    def header(self) -> dict[str, Any]: ...

    def payload_view(self) -> memoryview: ...


class WireTensorFactory(Protocol):
    """The receiving half: ``CompressedTensor.from_wire(header, payload)``."""

    def from_wire(self, header: Mapping[str, Any], payload: Any) -> Any: ...


TENSOR_KEY = "tensor"


def pack_tensor(tensor: WireTensor, **fields: Any) -> Message:
    """A message carrying a compressed tensor (its header under ``"tensor"``) plus extra header fields.

    The payload is the tensor's own memory (no copy); it must not be modified until sent.
    """
    if TENSOR_KEY in fields:
        raise ConfigurationError(f"{TENSOR_KEY!r} is reserved for the tensor's own header")
    return Message(header={TENSOR_KEY: tensor.header(), **fields}, payload=tensor.payload_view())


def unpack_tensor(message: Message, factory: WireTensorFactory) -> Any:
    """The compressed tensor carried by ``message``, rebuilt by ``factory.from_wire``.

    Typically ``unpack_tensor(msg, CompressedTensor)``; the factory validates the tensor header
    (``CompressedTensor`` raises ``CompressionError`` on a malformed one).
    """
    tensor_header = message.header.get(TENSOR_KEY)
    if not isinstance(tensor_header, Mapping):
        raise ProtocolError(f"message has no {TENSOR_KEY!r} map in its header")
    return factory.from_wire(tensor_header, message.payload if message.payload is not None else b"")
