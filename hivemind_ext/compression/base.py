"""The codec interface, the self-describing compressed message, and the codec registry.

A codec turns a tensor into a :class:`CompressedTensor`: a small header (codec id, dtype, shape,
codec parameters) plus one flat ``uint8`` payload. Compression runs on the tensor's own device;
only the finished payload is copied to host memory. Decoding dispatches on the codec id written
in the header, so a receiver needs no knowledge of the sender's configuration, and it validates
every field before it allocates anything: a malformed message raises :class:`CompressionError`.

Payload layout convention: a codec's payload is a concatenation of sections, each starting at a
multiple of 8 bytes from the payload start, so that float sections can be viewed without copies.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import struct
import warnings
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import msgpack
import torch

from hivemind_ext.errors import CompressionError

# torch.frombuffer warns (once) that read-only buffers give writable tensors. Decoders never write
# into the payload, and decoded tensors that would alias a read-only payload are copied (see decompress).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

MAX_NDIM = 32
MAX_NUMEL = 2**40  # far above any real tensor, far below int64 overflow in size arithmetic
MAX_HEADER_BYTES = 64 * 1024
ALIGNMENT = 8

DTYPES_BY_NAME: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
NAMES_BY_DTYPE = {dtype: name for name, dtype in DTYPES_BY_NAME.items()}
FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})
ALL_DTYPES = frozenset(DTYPES_BY_NAME.values())

Key = Any


class TensorRole(enum.Enum):
    """What a tensor is to the model; :class:`RoleAdaptiveCompression` picks a codec by it."""

    ACTIVATION = enum.auto()
    PARAMETER = enum.auto()
    GRADIENT = enum.auto()
    OPTIMIZER = enum.auto()
    UNSPECIFIED = enum.auto()


@dataclasses.dataclass(frozen=True)
class CompressionInfo:
    """What a codec may know about a tensor besides its values: its key, full shape, dtype and role.

    If a tensor is sliced into parts, ``shape`` and ``dtype`` still describe the whole tensor and
    ``part_index`` / ``part_size`` locate the part; ``part_offset``, where known, is where the part
    starts in the flattened tensor (the same part index may cover other values in another round, e.g.
    when an all-reduce's part sizes change: error feedback locates its residuals by offset).
    ``aggregate`` is True for the average an all-reduce owner sends back, so that error feedback keeps
    the residual of the average apart from the residual of this peer's own contributions.
    """

    key: Key = None
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32
    role: TensorRole = TensorRole.UNSPECIFIED
    part_index: int = 0
    part_size: int | None = None
    part_offset: int | None = None
    aggregate: bool = False

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor, key: Key = None, **kwargs: Any) -> CompressionInfo:
        return cls(key=key, shape=tuple(tensor.shape), dtype=tensor.dtype, **kwargs)

    def numel(self) -> int:
        return math.prod(self.shape)

    def get_part(self, part_index: int, part_size: int | None, part_offset: int | None = None) -> CompressionInfo:
        return dataclasses.replace(self, part_index=part_index, part_size=part_size, part_offset=part_offset)


@dataclasses.dataclass(frozen=True, eq=False)
class CompressedTensor:
    """A compressed tensor: header fields plus a flat uint8 payload in host memory.

    ``writable`` tells whether the payload's memory belongs to this message (True for messages made
    by a codec, or read from a writable buffer). Decoding never returns a tensor that aliases a
    payload that is not writable.
    """

    codec: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    params: Mapping[str, Any]
    payload: torch.Tensor  # uint8, 1-D, contiguous; in host memory except right after Codec.encode
    writable: bool = True

    def to_host(self) -> CompressedTensor:
        """This message with its payload in host memory (one device-to-host copy of the compressed bytes)."""
        if self.payload.device.type == "cpu":
            return self
        return dataclasses.replace(self, payload=self.payload.to("cpu"))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: payload plus packed header."""
        return self.payload.numel() + len(self.header_bytes())

    def header(self) -> dict[str, Any]:
        return {
            "codec": self.codec,
            "dtype": NAMES_BY_DTYPE[self.dtype],
            "shape": list(self.shape),
            "params": dict(self.params),
        }

    def header_bytes(self) -> bytes:
        return msgpack.packb(self.header(), use_bin_type=True)

    def payload_view(self) -> memoryview:
        """The payload as a zero-copy memoryview, ready to be written to a stream."""
        return memoryview(self.payload.numpy()).cast("B")

    def to_bytes(self) -> bytes:
        """One self-contained frame: u32 header length, header, padding to 8 bytes, payload."""
        header = self.header_bytes()
        padding = -(4 + len(header)) % ALIGNMENT
        return b"".join((struct.pack("<I", len(header)), header, b"\0" * padding, self.payload_view()))

    @classmethod
    def from_wire(cls, header: bytes | Mapping[str, Any], payload: Any) -> CompressedTensor:
        """Builds a message from a header (packed or already unpacked) and a payload buffer, validating
        the generic fields. Codec-specific parameters and the payload size are checked on decoding."""
        if isinstance(header, bytes | bytearray | memoryview):
            header = unpack_header(header)
        fields = _validate_header(header)
        try:
            view = memoryview(payload).cast("B")
        except TypeError as e:
            raise CompressionError(
                f"payload must be a contiguous bytes-like object, got {type(payload).__name__}"
            ) from e
        if view.nbytes == 0:
            tensor = torch.empty(0, dtype=torch.uint8)
        else:
            tensor = torch.frombuffer(view, dtype=torch.uint8)
        return cls(*fields, payload=tensor, writable=not view.readonly)

    @classmethod
    def from_bytes(cls, frame: bytes | bytearray | memoryview) -> CompressedTensor:
        """Inverse of :meth:`to_bytes`."""
        view = memoryview(frame).cast("B")
        if view.nbytes < 4:
            raise CompressionError(f"frame of {view.nbytes} bytes is too short to hold a header length")
        (header_length,) = struct.unpack_from("<I", view)
        if header_length > MAX_HEADER_BYTES or 4 + header_length > view.nbytes:
            raise CompressionError(f"header length {header_length} does not fit a frame of {view.nbytes} bytes")
        payload_start = 4 + header_length + (-(4 + header_length) % ALIGNMENT)
        if payload_start > view.nbytes:
            raise CompressionError("frame is truncated inside the header padding")
        return cls.from_wire(bytes(view[4 : 4 + header_length]), view[payload_start:])


def unpack_header(raw: bytes | bytearray | memoryview) -> Any:
    if len(raw) > MAX_HEADER_BYTES:
        raise CompressionError(f"header of {len(raw)} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0)
    except Exception as e:  # msgpack raises several unrelated types for malformed input
        raise CompressionError(f"header is not valid msgpack: {e}") from e


def _validate_header(header: Any) -> tuple[str, torch.dtype, tuple[int, ...], dict[str, Any]]:
    if not isinstance(header, Mapping) or set(header) != {"codec", "dtype", "shape", "params"}:
        raise CompressionError(f"header must be a map with keys codec, dtype, shape, params; got {header!r:.200}")
    codec, dtype_name, shape, params = header["codec"], header["dtype"], header["shape"], header["params"]
    if not isinstance(codec, str) or codec not in CODECS:
        raise CompressionError(f"unknown codec {codec!r:.100}; known: {sorted(CODECS)}")
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES_BY_NAME:
        raise CompressionError(f"unsupported dtype {dtype_name!r:.100}")
    if not isinstance(shape, list | tuple) or len(shape) > MAX_NDIM:
        raise CompressionError(f"shape must be a list of at most {MAX_NDIM} dimensions, got {shape!r:.200}")
    if not all(type(dim) is int and 0 <= dim <= MAX_NUMEL for dim in shape):
        raise CompressionError(f"shape dimensions must be integers in [0, {MAX_NUMEL}], got {shape!r:.200}")
    if math.prod(dim for dim in shape if dim) > MAX_NUMEL:  # zero dims too: strides must not overflow
        raise CompressionError(f"shape {shape} is too large (more than {MAX_NUMEL} elements without its zeros)")
    if not isinstance(params, Mapping) or not all(isinstance(key, str) for key in params):
        raise CompressionError(f"params must be a map with string keys, got {params!r:.200}")
    return codec, DTYPES_BY_NAME[dtype_name], tuple(shape), dict(params)


CODECS: dict[str, type[Codec]] = {}


class Codec(ABC):
    """Base class of all codecs. Subclasses implement :meth:`_encode`, :meth:`_decode`,
    :meth:`payload_nbytes` and, if they take parameters, :meth:`validate_params`.

    ``codec_id`` names the wire format; a subclass with a ``codec_id`` registers itself for decoding.
    """

    codec_id: ClassVar[str | None] = None
    supported_dtypes: ClassVar[frozenset[torch.dtype]] = FLOAT_DTYPES
    # True where ``_decode`` takes ``out=``: it then writes the decoded values into that tensor (1-D,
    # contiguous, of the message's dtype and size) instead of allocating one (see decompress_into)
    decodes_into_output: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        codec_id = cls.__dict__.get("codec_id")
        if codec_id is not None:
            if codec_id in CODECS:
                raise TypeError(f"codec id {codec_id!r} is already registered by {CODECS[codec_id].__name__}")
            CODECS[codec_id] = cls

    # ----- encoding (runs on the tensor's device)

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo | None = None, allow_inplace: bool = False
    ) -> CompressedTensor:
        """Compresses ``tensor`` on its own device and returns the message with the payload in host memory.

        :param info: the tensor's key, role and full shape; adaptive codecs and error feedback use it
        :param allow_inplace: the codec may overwrite ``tensor`` to save memory and time
        """
        return self.encode(tensor, info, allow_inplace).to_host()

    def encode(
        self, tensor: torch.Tensor, info: CompressionInfo | None = None, allow_inplace: bool = False
    ) -> CompressedTensor:
        """Like :meth:`compress`, but leaves the payload on the tensor's device (see ErrorFeedback).

        The message never aliases ``tensor``'s memory unless ``allow_inplace`` is True.
        """
        self.check_tensor(tensor)
        tensor = tensor.detach()
        flat = tensor.reshape(-1)
        private_copy = flat.numel() > 0 and not _shares_memory(flat, tensor)  # reshape copied a strided tensor
        payload, params = self._encode(flat, allow_inplace=allow_inplace or private_copy)
        if not (allow_inplace or private_copy) and payload.numel() > 0 and _shares_memory(payload, tensor):
            payload = payload.clone()  # e.g. NoCompression, or float16 input to Float16Compression
        return CompressedTensor(self.codec_id, tensor.dtype, tuple(tensor.shape), params, payload)

    def check_tensor(self, tensor: Any) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise CompressionError(f"{type(self).__name__} compresses torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in self.supported_dtypes:
            supported = sorted(NAMES_BY_DTYPE[d] for d in self.supported_dtypes)
            raise CompressionError(f"{type(self).__name__} does not support {tensor.dtype}; supported: {supported}")
        if tensor.is_sparse or tensor.is_quantized or tensor.is_complex():
            raise CompressionError(f"{type(self).__name__} compresses dense real tensors only")

    @abstractmethod
    def _encode(self, flat: torch.Tensor, allow_inplace: bool) -> tuple[torch.Tensor, dict[str, Any]]:
        """Returns (payload: 1-D uint8 tensor on flat's device, params) for a 1-D tensor."""

    # ----- decoding (class-level: everything needed is in the message)

    @classmethod
    def validate_params(cls, params: Mapping[str, Any], numel: int, dtype: torch.dtype) -> None:
        """Raises CompressionError unless the dtype and ``params`` are what this codec writes."""
        if dtype not in cls.supported_dtypes:
            raise CompressionError(f"{cls.__name__} cannot carry dtype {dtype}")
        cls.check_params(params, numel)

    @classmethod
    def check_params(cls, params: Mapping[str, Any], numel: int) -> None:
        """Codec-specific parameter checks; the default accepts no parameters."""
        require_exact_params(params, set(), cls.__name__)

    @classmethod
    @abstractmethod
    def payload_nbytes(cls, numel: int, dtype: torch.dtype, params: Mapping[str, Any]) -> int:
        """The exact payload size for a tensor of ``numel`` elements; called after validate_params."""

    @classmethod
    @abstractmethod
    def _decode(cls, payload: torch.Tensor, numel: int, dtype: torch.dtype, params: Mapping[str, Any]) -> torch.Tensor:
        """Returns a 1-D tensor of ``numel`` elements of ``dtype`` on payload's device (where the class
        sets ``decodes_into_output``, it also takes ``out=``, such a tensor to write into and return)."""

    def decompress(self, message: CompressedTensor, device: torch.device | str | None = None) -> torch.Tensor:
        """Decodes any registered codec's message (dispatching on its codec id)."""
        return decompress(message, device=device)

    def extract(self, message: CompressedTensor) -> torch.Tensor:
        """hivemind's name for :meth:`decompress`."""
        return decompress(message)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        """Compressed size over raw size, estimated without compressing; lower is smaller."""
        numel = max(info.numel(), 1)
        params = self.nominal_params(info)
        return self.payload_nbytes(numel, info.dtype, params) / (numel * info.dtype.itemsize)

    def nominal_params(self, info: CompressionInfo) -> dict[str, Any]:
        """The params this codec would write for a tensor described by ``info`` (for size estimates)."""
        return {}

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


def decompress(message: CompressedTensor, device: torch.device | str | None = None) -> torch.Tensor:
    """Decodes a message from any registered codec on ``device`` (default: CPU).

    Only the compressed payload is moved to the device; decoding runs there.
    """
    codec_cls, payload = _checked_payload(message, device)
    flat = codec_cls._decode(payload, message.numel, message.dtype, message.params)
    if not message.writable and flat.numel() > 0 and _shares_memory(flat, payload):
        flat = flat.clone()
    return flat.view(message.shape)


def decompress_into(message: CompressedTensor, out: torch.Tensor) -> torch.Tensor:
    """Decodes ``message`` into ``out`` (contiguous, on any device, with the message's number of
    elements; a dtype other than the message's is converted to) and returns ``out``.

    Where the codec decodes into a given tensor (``decodes_into_output``) and the dtypes match, the
    values are written straight into ``out``: no decoded temporary is allocated (page-faulted) and
    copied, which saves one pass over the values wherever a caller keeps them in a tensor of its own
    (the all-reduce's output chunks). ``out`` must not overlap the payload.
    """
    if not isinstance(out, torch.Tensor) or not out.is_contiguous():
        raise CompressionError("decompress_into needs a contiguous output tensor")
    codec_cls, payload = _checked_payload(message, out.device)
    if out.numel() != message.numel:
        raise CompressionError(f"an output of {out.numel()} elements for a message of {message.numel}")
    flat = out.view(-1)
    if codec_cls.decodes_into_output and out.dtype == message.dtype:
        codec_cls._decode(payload, message.numel, message.dtype, message.params, out=flat)
    else:
        flat.copy_(codec_cls._decode(payload, message.numel, message.dtype, message.params))
    return out


def _checked_payload(message: CompressedTensor, device: torch.device | str | None) -> tuple[type[Codec], torch.Tensor]:
    """The message's codec class and its payload on ``device``, once its params and size are valid."""
    if not isinstance(message, CompressedTensor):
        raise CompressionError(f"expected a CompressedTensor, got {type(message).__name__}")
    codec_cls = CODECS.get(message.codec)
    if codec_cls is None:
        raise CompressionError(f"unknown codec {message.codec!r}; known: {sorted(CODECS)}")
    numel, dtype, params = message.numel, message.dtype, message.params
    codec_cls.validate_params(params, numel, dtype)
    expected = codec_cls.payload_nbytes(numel, dtype, params)
    payload = message.payload
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise CompressionError("payload must be a 1-D uint8 tensor")
    if payload.numel() != expected:
        kind = "truncated" if payload.numel() < expected else "oversized"
        raise CompressionError(
            f"{kind} payload for {message.codec} {list(message.shape)} {dtype}: "
            f"{payload.numel()} bytes, expected {expected}"
        )
    if device is not None and torch.device(device) != payload.device:
        payload = payload.to(device, non_blocking=payload.is_pinned())
    return codec_cls, payload


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def aligned(nbytes: int) -> int:
    """Rounds a section size up to the payload alignment."""
    return nbytes + (-nbytes % ALIGNMENT)


def require_int_param(params: Mapping[str, Any], name: str, low: int, high: int, owner: str) -> int:
    value = params.get(name)
    if type(value) is not int or not low <= value <= high:
        raise CompressionError(f"{owner}: parameter {name!r} must be an integer in [{low}, {high}], got {value!r:.50}")
    return value


def require_exact_params(params: Mapping[str, Any], names: set[str], owner: str) -> None:
    if set(params) != names:
        raise CompressionError(f"{owner}: expected parameters {sorted(names)}, got {sorted(params)}")
