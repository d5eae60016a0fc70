"""Where every value goes in a butterfly all-reduce round: parts, chunks and the layout fingerprint.

Pure functions of the tensors' shapes and dtypes, the group's member roles and the chunk size, so
every member computes the same layout from the same inputs, and tests drive them directly.

**The chunk size follows the group's links** (:func:`round_chunk_bytes`). A round's pipeline drains
at its end: after the last chunk of a part reaches its owner, the owner still sends that chunk's
average to each of the N - 1 other members, and every member receives the last averaged chunk of
every part; that tail is about (N - 1) chunks through the slowest link, time in which the links
carry nothing else. With 2 MiB chunks over 100 Mbit/s links that is 0.5 s against a 2 s round; at
20 Mbit/s, 2.5 s against 10 s. Smaller chunks shorten the tail but cost a fixed amount of CPU each
(framing, headers, a reducer call), which dominates on loopback and fast links. So each round uses
the largest chunk whose tail through the slowest declared link (members that declared nothing are
taken as typical) takes at most
:data:`DRAIN_SECONDS`: ``DRAIN_SECONDS x B_min / (N - 1)`` bytes, rounded down to a multiple of
:data:`CHUNK_QUANTUM_BYTES` (at least one quantum) and at most the configured ``part_size_bytes``:
about 384 KiB at 100 Mbit/s, 64 KiB at 20 Mbit/s, the configured 2 MiB from a few Gbit/s up. A group
in which nobody declared a bandwidth (every peer's first round) uses ``part_size_bytes``. Every
member computes it from the member list that matchmaking gave all of them, so all agree; the layout
fingerprint covers it, so members that do not agree refuse each other's streams. A member that
declares a tiny bandwidth can only make the group's chunks as small as one quantum.

The tensors are seen as one flat vector (their flattened values, one tensor after the other).
:func:`~hivemind_ext.averaging.allreduce.partition.part_sizes` cuts it into one part per member, in member
order, sized to minimize the round's predicted time given the members' bandwidths (client-mode
members get empty parts, and so may slow members). Each part is then cut at
tensor boundaries and into chunks of at most ``part_size_bytes`` (as hivemind does), by the chunker
that state sharing uses too (:func:`~hivemind_ext.averaging.tensor_layout.chunk_tensors`), so that

- a chunk is a view of one input tensor: it is compressed without a copy, with its own tensor's
  :class:`~hivemind_ext.compression.CompressionInfo` (key, role, shape; ``part_index`` = the chunk's
  position among its tensor's chunks, ``part_offset`` = where it starts in its tensor), so adaptive
  codecs and error feedback work per tensor (error feedback by offset: chunk positions move when part
  sizes change);
- a chunk of the result is written straight into its output tensor.

Example: tensors of 5 and 3 values, two members with equal bandwidth, 2 values per chunk::

    flat:    [a0 a1 a2 a3 a4 | b0 b1 b2]
    parts:   [a0 a1 a2 a3] owned by member 0, [a4 b0 b1 b2] owned by member 1
    chunks:  part 0: a[0:2], a[2:4];   part 1: a[4:5], b[0:2], b[2:3]
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import torch

from hivemind_ext.averaging.allreduce.partition import MemberRole, part_bounds, part_sizes
from hivemind_ext.averaging.allreduce.throughput import BITS_PER_MEGABIT
from hivemind_ext.averaging.matchmaking.group import Member, capped_bandwidth
from hivemind_ext.averaging.tensor_layout import (
    ChunkSpec,
    TensorSpec,
    chunk_tensors,
    encode_tensor_list,
    tensor_offsets,
)
from hivemind_ext.compression.base import NAMES_BY_DTYPE
from hivemind_ext.errors import ConfigurationError

FINGERPRINT_BYTES = 16
DRAIN_SECONDS = 0.1  # the pipeline's tail (N - 1 chunks through the slowest link) may take this long
CHUNK_QUANTUM_BYTES = 64 * 1024  # chunk sizes chosen per round are multiples of this (and at least this)


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
    """Roles for part_sizes; a member that declared no bandwidth gets the mean of the declared ones.
    Declared bandwidths count as at most :data:`.group.MAX_BANDWIDTH` (the board caps them as it
    parses them; a member list built elsewhere is capped here), so no sum below overflows."""
    declared = [capped_bandwidth(m.bandwidth) for m in members if m.bandwidth is not None and not m.client_mode]
    default = sum(declared) / len(declared) if declared else 1.0
    return [
        MemberRole(
            bandwidth=capped_bandwidth(m.bandwidth) if m.bandwidth is not None else default,
            client_mode=m.client_mode,
            auxiliary=m.auxiliary,
        )
        for m in members
    ]


def round_chunk_bytes(members: Sequence[Member], limit: int) -> int:
    """The chunk size of a round of ``members``, at most ``limit`` bytes (the configured
    ``part_size_bytes``): see the module docstring. Bandwidths are in Mbit/s, as declared."""
    declared = [m.bandwidth for m in members if m.bandwidth is not None]  # the others: a typical link
    if len(members) < 2 or not declared:
        return limit
    slowest = capped_bandwidth(min(declared))
    fitting = DRAIN_SECONDS * slowest * BITS_PER_MEGABIT / 8 / (len(members) - 1)
    if fitting >= limit:  # (and before int(): 1e308 Mbit/s made it inf, and int(nan) a bare ValueError)
        return limit
    return min(limit, max(CHUNK_QUANTUM_BYTES, int(fitting // CHUNK_QUANTUM_BYTES) * CHUNK_QUANTUM_BYTES))


def plan_round_layout(tensors: Sequence[TensorSpec], members: Sequence[Member], limit: int) -> RoundLayout:
    """The layout of a round of ``members``: parts by their bandwidths, chunks of
    :func:`round_chunk_bytes` (at most ``limit``, the configured ``part_size_bytes``)."""
    return plan_layout(tensors, member_roles(members), round_chunk_bytes(members, limit))


def plan_layout(tensors: Sequence[TensorSpec], roles: Sequence[MemberRole], part_size_bytes: int) -> RoundLayout:
    """The layout every member of a group computes for the same tensors, roles and chunk size."""
    tensors = tuple(tensors)
    offsets = tensor_offsets(tensors)
    pieces = [0] * len(tensors)  # chunks handed out so far, per tensor
    parts = []
    for owner, (start, end) in enumerate(part_bounds(part_sizes(offsets[-1], roles))):
        chunks = chunk_tensors(tensors, part_size_bytes, start, end, offsets=offsets, pieces=pieces)
        parts.append(PartSpec(owner, start, end, tuple(chunks)))
    return RoundLayout(tensors, tuple(parts), part_size_bytes, fingerprint(tensors, parts, part_size_bytes))


def fingerprint(tensors: Sequence[TensorSpec], parts: Sequence[PartSpec], part_size_bytes: int) -> bytes:
    """A short digest of the layout: two members agree on every chunk iff their fingerprints match."""
    description = msgpack.packb(
        [encode_tensor_list(tensors), [[p.start, p.end] for p in parts], part_size_bytes], use_bin_type=True
    )
    return hashlib.sha256(description).digest()[:FINGERPRINT_BYTES]


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
