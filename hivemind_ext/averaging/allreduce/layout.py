"""Where every value goes in a butterfly all-reduce round: parts, chunks and the layout fingerprint.

Pure functions of the tensors' shapes and dtypes, the group's member roles and the chunk size, so
every member computes the same layout from the same inputs, and tests drive them directly.

The tensors are seen as one flat vector (their flattened values, one tensor after the other).
:func:`~hivemind_ext.averaging.allreduce.partition.part_sizes` cuts it into one part per member, in member
order, in proportion to bandwidth (client-mode members get empty parts). Each part is then cut at
tensor boundaries and into chunks of at most ``part_size_bytes`` (as hivemind does), so that

- a chunk is a view of one input tensor: it is compressed without a copy, with its own tensor's
  :class:`~hivemind_ext.compression.CompressionInfo` (key, role, shape; ``part_index`` = the chunk's
  position among its tensor's chunks), so adaptive codecs and error feedback work per tensor;
- a chunk of the result is written straight into its output tensor.

Example: tensors of 5 and 3 values, two members with equal bandwidth, 2 values per chunk::

    flat:    [a0 a1 a2 a3 a4 | b0 b1 b2]
    parts:   [a0 a1 a2 a3] owned by member 0, [a4 b0 b1 b2] owned by member 1
    chunks:  part 0: a[0:2], a[2:4];   part 1: a[4:5], b[0:2], b[2:3]
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import torch

from hivemind_ext.averaging.allreduce.partition import MemberRole, part_bounds, part_sizes
from hivemind_ext.averaging.matchmaking.group import Member
from hivemind_ext.compression.base import DTYPES_BY_NAME, MAX_NDIM, MAX_NUMEL, NAMES_BY_DTYPE
from hivemind_ext.errors import ConfigurationError, ProtocolError

FINGERPRINT_BYTES = 16
MAX_TENSORS = 1 << 20  # a layout description received from a peer may not list more tensors than this


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one averaged tensor (its values are not part of the layout)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tuple(tensor.shape), tensor.dtype)


@dataclass(frozen=True)
class ChunkSpec:
    """One chunk: values ``[start, end)`` of flattened tensor ``tensor``, at ``offset`` within its part."""

    tensor: int
    start: int
    end: int
    piece: int  # position among the chunks of its tensor: CompressionInfo.part_index
    offset: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class PartSpec:
    """The part that member ``owner`` reduces: ``[start, end)`` of the flat vector, in chunks."""

    owner: int
    start: int
    end: int
    chunks: tuple[ChunkSpec, ...]

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """Chunk offsets within the part, as PartReducer takes them."""
        return [(chunk.offset, chunk.offset + chunk.numel) for chunk in self.chunks]


@dataclass(frozen=True)
class RoundLayout:
    tensors: tuple[TensorSpec, ...]
    parts: tuple[PartSpec, ...]  # one per member, in member order (empty for client-mode members)
    part_size_bytes: int
    fingerprint: bytes  # equal on two members iff they computed the same layout

    @property
    def total(self) -> int:
        return sum(spec.numel for spec in self.tensors)


def member_roles(members: Sequence[Member]) -> list[MemberRole]:
    """Roles for part_sizes; a member that declared no bandwidth gets the mean of the declared ones."""
    declared = [m.bandwidth for m in members if m.bandwidth is not None and not m.client_mode]
    default = sum(declared) / len(declared) if declared else 1.0
    return [
        MemberRole(
            bandwidth=float(m.bandwidth) if m.bandwidth is not None else default,
            client_mode=m.client_mode,
            auxiliary=m.auxiliary,
        )
        for m in members
    ]


def chunk_numel(dtype: torch.dtype, part_size_bytes: int) -> int:
    """Values per chunk of a tensor of ``dtype``: as many as fit in ``part_size_bytes`` uncompressed."""
    return max(1, part_size_bytes // torch.empty((), dtype=dtype).element_size())


def plan_layout(tensors: Sequence[TensorSpec], roles: Sequence[MemberRole], part_size_bytes: int) -> RoundLayout:
    """The layout every member of a group computes for the same tensors, roles and chunk size."""
    tensors = tuple(tensors)
    offsets = _tensor_offsets(tensors)
    total = offsets[-1]
    pieces = [0] * len(tensors)  # chunks handed out so far, per tensor
    parts = []
    for owner, (start, end) in enumerate(part_bounds(part_sizes(total, roles))):
        chunks = _chunks_of(start, end, tensors, offsets, pieces, part_size_bytes)
        parts.append(PartSpec(owner, start, end, tuple(chunks)))
    return RoundLayout(tensors, tuple(parts), part_size_bytes, fingerprint(tensors, parts, part_size_bytes))


def _tensor_offsets(tensors: Sequence[TensorSpec]) -> list[int]:
    offsets = [0]
    for spec in tensors:
        offsets.append(offsets[-1] + spec.numel)
    return offsets


def _chunks_of(
    start: int,
    end: int,
    tensors: Sequence[TensorSpec],
    offsets: Sequence[int],
    pieces: list[int],
    part_size_bytes: int,
) -> list[ChunkSpec]:
    """Cuts flat ``[start, end)`` at tensor boundaries and every ``chunk_numel`` values."""
    chunks: list[ChunkSpec] = []
    position = start
    tensor = _tensor_at(offsets, start)
    while position < end:
        while offsets[tensor + 1] <= position:  # skip empty tensors and the ones already passed
            tensor += 1
        stop = min(end, offsets[tensor + 1], position + chunk_numel(tensors[tensor].dtype, part_size_bytes))
        local = position - offsets[tensor]
        chunks.append(ChunkSpec(tensor, local, local + stop - position, pieces[tensor], position - start))
        pieces[tensor] += 1
        position = stop
    return chunks


def _tensor_at(offsets: Sequence[int], position: int) -> int:
    """Index of the first tensor whose values extend past ``position`` (binary search on offsets)."""
    low, high = 0, len(offsets) - 1
    while low < high:
        middle = (low + high) // 2
        if offsets[middle + 1] <= position:
            low = middle + 1
        else:
            high = middle
    return low


def fingerprint(tensors: Sequence[TensorSpec], parts: Sequence[PartSpec], part_size_bytes: int) -> bytes:
    """A short digest of the layout: two members agree on every chunk iff their fingerprints match."""
    description = msgpack.packb(
        [describe_tensors(tensors), [[p.start, p.end] for p in parts], part_size_bytes], use_bin_type=True
    )
    return hashlib.sha256(description).digest()[:FINGERPRINT_BYTES]


def describe_tensors(tensors: Sequence[TensorSpec]) -> list[list[object]]:
    """The tensors' shapes and dtypes as msgpack-able lists, to tell a peer that has no tensors."""
    return [[list(spec.shape), NAMES_BY_DTYPE[spec.dtype]] for spec in tensors]


def parse_tensor_specs(description: object) -> list[TensorSpec]:
    """Inverse of :func:`describe_tensors` for a description received from a peer (untrusted)."""
    if not isinstance(description, list) or len(description) > MAX_TENSORS:
        raise ProtocolError(f"tensor description must be a list of at most {MAX_TENSORS} entries")
    specs, total = [], 0
    for entry in description:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list)):
            raise ProtocolError(f"malformed tensor description entry {entry!r:.100}")
        shape, dtype_name = entry
        dtype = DTYPES_BY_NAME.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None or not dtype.is_floating_point:
            raise ProtocolError(f"tensor description names dtype {dtype_name!r:.50}, expected a float dtype")
        if len(shape) > MAX_NDIM or not all(type(d) is int and 0 <= d <= MAX_NUMEL for d in shape):
            raise ProtocolError(f"tensor description has an invalid shape {shape!r:.100}")
        spec = TensorSpec(tuple(shape), dtype)
        total += spec.numel
        if total > MAX_NUMEL:
            raise ProtocolError(f"tensor description holds more than {MAX_NUMEL} values")
        specs.append(spec)
    return specs


def check_float_tensors(tensors: Sequence[torch.Tensor]) -> list[TensorSpec]:
    """The specs of the tensors to average; only floating-point tensors can be averaged."""
    specs = []
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise ConfigurationError(f"tensor {index} is a {type(tensor).__name__}, not a torch.Tensor")
        if not tensor.dtype.is_floating_point or tensor.dtype not in NAMES_BY_DTYPE:
            raise ConfigurationError(f"tensor {index} has dtype {tensor.dtype}; only float tensors can be averaged")
        if tensor.is_sparse or tensor.is_complex():
            raise ConfigurationError(f"tensor {index} must be dense and real")
        specs.append(TensorSpec.of(tensor))
    return specs
