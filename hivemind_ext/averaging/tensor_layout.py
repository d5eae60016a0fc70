"""The one tensor layout that the all-reduce and state sharing share: which tensors (their specs),
how they are cut into chunks, and how a list of tensor specs travels over the wire.

Both subsystems move a list of tensors as chunks: element ranges ``[start, end)`` of one flattened
tensor, never spanning two tensors, of at most ``chunk_bytes`` raw bytes each. The all-reduce cuts
each member's part of the flat vector (see :mod:`~hivemind_ext.averaging.allreduce.layout`); state
sharing cuts the whole state at once (see :mod:`~hivemind_ext.averaging.state_sharing.snapshot`).
One chunker, :func:`chunk_tensors`, does both, so a chunk of a state and a chunk of a round obey the
same rules.

The wire encoding of a tensor list is ``[[[dims...], dtype name], ...]``, the order of
:class:`TensorSpec`'s fields. It is also the input of the all-reduce's layout fingerprint, so it
must not change without the fingerprint changing with it. :func:`parse_tensor_list` reads it from
an untrusted peer and raises :class:`~hivemind_ext.errors.ProtocolError` before anything is
allocated.

The element size of a dtype is torch's own ``dtype.itemsize`` (the codecs below this layer use it
too): no helper of our own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hivemind_ext.compression.base import DTYPES_BY_NAME, MAX_NDIM, MAX_NUMEL, NAMES_BY_DTYPE
from hivemind_ext.errors import ProtocolError

MAX_TENSORS = 1 << 20  # a tensor list received from a peer may not hold more tensors than this


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor (its values are not part of the layout)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tuple(tensor.shape), tensor.dtype)


@dataclass(frozen=True)
class ChunkSpec:
    """Values ``[start, end)`` of flattened tensor ``tensor``.

    ``piece`` is the chunk's position among the chunks of its tensor (what codecs see as
    ``CompressionInfo.part_index``); ``offset`` is where it begins within the range that was cut
    (an all-reduce part, or the whole flattened state).
    """

    tensor: int
    start: int
    end: int
    piece: int
    offset: int

    @property
    def numel(self) -> int:
        return self.end - self.start


def chunk_numel(dtype: torch.dtype, chunk_bytes: int) -> int:
    """Values per chunk of a tensor of ``dtype``: as many as fit in ``chunk_bytes`` uncompressed (at least one)."""
    return max(1, chunk_bytes // dtype.itemsize)


def tensor_offsets(tensors: Sequence[TensorSpec]) -> list[int]:
    """Where each tensor starts in the flat vector, plus its total length at the end."""
    offsets = [0]
    for spec in tensors:
        offsets.append(offsets[-1] + spec.numel)
    return offsets


def chunk_tensors(
    tensors: Sequence[TensorSpec],
    chunk_bytes: int,
    start: int = 0,
    end: int | None = None,
    *,
    offsets: Sequence[int] | None = None,
    pieces: list[int] | None = None,
) -> list[ChunkSpec]:
    """Cuts flat values ``[start, end)`` (default: all of them) at tensor boundaries and every
    :func:`chunk_numel` values.

    ``pieces`` counts the chunks handed out so far per tensor and is updated, so that cutting
    consecutive ranges one after the other numbers each tensor's chunks 0, 1, 2, ... across them.
    ``offsets`` may be passed to avoid recomputing :func:`tensor_offsets`.
    """
    offsets = tensor_offsets(tensors) if offsets is None else offsets
    end = offsets[-1] if end is None else end
    pieces = [0] * len(tensors) if pieces is None else pieces
    chunks: list[ChunkSpec] = []
    position = start
    tensor = _tensor_at(offsets, start)
    while position < end:
        while offsets[tensor + 1] <= position:  # skip empty tensors and the ones already passed
            tensor += 1
        stop = min(end, offsets[tensor + 1], position + chunk_numel(tensors[tensor].dtype, chunk_bytes))
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


# ----- the wire encoding of a tensor list


def encode_tensor_list(tensors: Sequence[TensorSpec]) -> list[list[object]]:
    """The tensors' shapes and dtypes as msgpack-able lists: ``[[[dims...], dtype name], ...]``."""
    return [[list(spec.shape), NAMES_BY_DTYPE[spec.dtype]] for spec in tensors]


def parse_tensor_list(
    rows: object, *, floats_only: bool = False, max_total_bytes: int | None = None
) -> list[TensorSpec]:
    """Inverse of :func:`encode_tensor_list` for a list received from a peer (untrusted).

    Rejects, with :class:`ProtocolError`: anything but a list of at most :data:`MAX_TENSORS`
    ``[shape, dtype]`` pairs; a dtype this library does not encode (or not a float one with
    ``floats_only``: only those can be averaged); more than ``MAX_NDIM`` dimensions or a dimension
    that is not an integer in ``[0, MAX_NUMEL]``; more than ``MAX_NUMEL`` values in all; more than
    ``max_total_bytes`` bytes in all.
    """
    if not isinstance(rows, list) or len(rows) > MAX_TENSORS:
        raise ProtocolError(f"a tensor list must be a list of at most {MAX_TENSORS} entries")
    specs, total_numel, total_bytes = [], 0, 0
    for row in rows:
        if not (isinstance(row, list) and len(row) == 2):
            raise ProtocolError(f"a tensor entry must be [shape, dtype], got {row!r:.100}")
        shape, dtype_name = row
        dtype = DTYPES_BY_NAME.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None or (floats_only and not dtype.is_floating_point):
            expected = "a float dtype" if floats_only else f"one of {sorted(DTYPES_BY_NAME)}"
            raise ProtocolError(f"a tensor entry names dtype {dtype_name!r:.50}, expected {expected}")
        if not isinstance(shape, list) or len(shape) > MAX_NDIM:
            raise ProtocolError(f"a shape must be a list of at most {MAX_NDIM} dimensions, got {shape!r:.100}")
        if not all(type(dim) is int and 0 <= dim <= MAX_NUMEL for dim in shape):
            raise ProtocolError(f"malformed shape {shape!r:.100}")
        spec = TensorSpec(tuple(shape), dtype)
        total_numel += spec.numel
        if total_numel > MAX_NUMEL:
            raise ProtocolError(f"the tensor list holds more than {MAX_NUMEL} values")
        total_bytes += spec.nbytes
        if max_total_bytes is not None and total_bytes > max_total_bytes:
            raise ProtocolError(f"the tensors hold more than {max_total_bytes} bytes")
        specs.append(spec)
    return specs
