"""Top-k sparsification with low-bit values: a codec for pseudo-gradients (as in SparseLoCo).

DiLoCo-style pseudo-gradients (and gradients) carry most of their energy in few entries. This codec
sends, per chunk of ``chunk_size`` values, only the ``k`` entries of largest magnitude, each as its
index inside the chunk and a ``bits``-bit value: 1 sign bit and ``bits - 1`` bits of magnitude on an
even grid between the chunk's smallest and largest kept magnitudes. Everything else decodes to zero.
Wrapped in :class:`~hivemind_ext.compression.ErrorFeedback`, what was not sent (the dropped entries
and the rounding of the kept ones) stays in the residual and is sent in a later round: see
:class:`SparseTopK` for how that plays out in an all-reduce.

All work is vectorized torch ops on the tensor's own device (``topk``, ``sort``, ``gather``, bit
packing by whole columns of rows of eight codes): no Python loop over chunks or values; one host sync
to check the kept magnitudes are finite (encoding) and one to validate a message (decoding). On CPU,
``torch.topk`` takes most of the encoding time; decoding is a zero fill plus one ``index_copy_``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from hivemind_ext.compression.base import (
    Codec,
    CompressionInfo,
    aligned,
    require_exact_params,
    require_int_param,
)
from hivemind_ext.compression.bitpack import pack_bits, packed_nbytes, unpack_bits
from hivemind_ext.compression.floating import view_bytes_as
from hivemind_ext.compression.minmax import finite_or_zero, new_output, stats_dtype, to_work_dtype
from hivemind_ext.errors import CompressionError, ConfigurationError, NonFiniteTensorError

MAX_CHUNK_SIZE = 1 << 16  # indices of at most 16 bits
MAX_SPARSITY = 256  # chunk_size <= MAX_SPARSITY * k: at least 1 value in 256 is kept (density >= 0.39%)
MIN_BITS, MAX_BITS = 2, 8


@dataclasses.dataclass(frozen=True)
class SparseLayout:
    """Sizes of a message for ``numel`` values: ``full_chunks`` chunks of ``chunk_size`` values keep ``k``
    each, the last ``tail`` values (a shorter chunk) keep ``tail_k``; each kept value is one code of
    ``width`` bits (its index in the chunk, then its sign, then its magnitude level)."""

    numel: int
    chunk_size: int
    k: int
    bits: int

    @property
    def full_chunks(self) -> int:
        return self.numel // self.chunk_size

    @property
    def tail(self) -> int:
        return self.numel - self.full_chunks * self.chunk_size

    @property
    def tail_k(self) -> int:
        """The tail keeps the same share of its values as a full chunk, rounded up (at least one)."""
        return -(-self.k * self.tail // self.chunk_size)

    @property
    def chunks(self) -> int:
        return self.full_chunks + (self.tail > 0)

    @property
    def kept(self) -> int:
        return self.full_chunks * self.k + self.tail_k

    @property
    def index_bits(self) -> int:
        """Bits of an index inside a chunk; a tensor shorter than a chunk needs only its own length's."""
        return (min(self.numel, self.chunk_size) - 1).bit_length() if self.numel else 0

    @property
    def width(self) -> int:
        return self.index_bits + self.bits

    def stats_nbytes(self, dtype: torch.dtype) -> int:
        return aligned(self.chunks * stats_dtype(dtype).itemsize)

    def payload_nbytes(self, dtype: torch.dtype) -> int:
        return 2 * self.stats_nbytes(dtype) + packed_nbytes(self.kept, self.width)


class SparseTopK(Codec):
    """Top-k per chunk with ``bits``-bit values and bit-packed indices; use it inside
    :class:`~hivemind_ext.compression.ErrorFeedback` (``ErrorFeedback(SparseTopK(density=0.02))``).

    :param density: the share of each chunk's values that is sent (``k = round(density * chunk_size)``,
      at least 1; at least 1/256 of the values)
    :param bits: bits per kept value, 2 to 8: a sign bit and ``bits - 1`` bits of magnitude
    :param chunk_size: values per chunk (at most 65536); each chunk has its own magnitude range

    Payload: lo S[C] | hi S[C] | codes, with C chunks, S = float64 for float64 tensors else float32,
    sections 8-byte aligned. ``lo_c``/``hi_c`` are the smallest and largest kept magnitudes of chunk c.
    The codes section holds, for each chunk in order, its kept values in increasing index order, each a
    ``width``-bit code ``index << bits | sign << (bits - 1) | level`` packed LSB first (see
    :mod:`~hivemind_ext.compression.bitpack`); ``width = ceil(log2(min(chunk_size, N)))`` + ``bits``. The
    last, shorter chunk of t values keeps ``ceil(k * t / chunk_size)``. A kept value decodes to
    ``±(lo_c + (level + 1/2) * (hi_c - lo_c) / 2**(bits - 1))``, every other value to 0.

    Size: about ``density * (log2(chunk_size) + bits) + 64 / chunk_size`` bits per value: 0.30 bits for
    the defaults (2%, 2 bits, 4096), 108x smaller than float32; 1.5% gives 0.23 bits (142x).

    Error bound, per chunk c: a kept value is off by at most half a level, ``(hi_c - lo_c) / 2**bits``
    (plus float rounding); a dropped value ``x`` is off by ``|x| <= lo_c``. A chunk with fewer than k
    nonzero values keeps some zeros, which decode to ``±lo_c + half a level``. NaN or Inf raise
    :class:`NonFiniteTensorError`: they are always among the top k (the magnitudes of NaNs are positive
    NaNs, which torch.topk ranks above every number), so the chunk's ``hi`` shows them.

    **In an all-reduce.** Each sender's slice of a part arrives compressed; the owner decodes it to a
    dense chunk (zeros where nothing was sent) and adds it to the weighted sum, so the average is the
    exact weighted mean of what the senders sent (its support is the union of theirs, up to
    members x k values per chunk). The owner then sends the average back compressed with the same
    codec, i.e. re-sparsified to k values per chunk, so that the result costs the same few bytes as a
    contribution: a densified result (e.g. float16, 16 bits per value) would be ~50x larger than the
    sparse one and would dominate every member's upload on a thin link. What re-sparsifying drops is
    not lost if the codec is wrapped in ErrorFeedback: the owner keeps the dropped part of the average
    in a residual of its own (``CompressionInfo.aggregate``) and adds it to its next average of those
    values ("double error feedback", as in DoubleSqueeze). Residuals are located by offset in their
    tensor, so they survive part sizes changing between rounds (parts follow measured bandwidth): a
    member's unsent values wait for its next slice that covers them, an owner's dropped average for its
    next part that does. The owner's own slice enters its part uncompressed. Every member decodes the
    same result messages, so all members still end with identical values. Use it with the weighted
    mean: robust aggregators compare contributions value by value (TrimmedMean would trim the few
    nonzero values of each coordinate toward zero) or as vectors (CenteredClip would see the owner's
    dense slice far from the sparse ones).

    Decoding validates everything before use: parameters, payload size, finite ``0 <= lo <= hi`` (and
    ``hi`` within the range of the tensor's dtype), indices inside their chunk and strictly increasing
    (hence no duplicates). A decoded tensor has at most :attr:`MAX_VALUES_PER_PAYLOAD_BYTE` values per
    payload byte (the density floor of 1/256 guarantees it), so a small message cannot announce a
    giant tensor.
    """

    codec_id = "sparse_topk"
    #: bound on decoded values per payload byte (about 121 at the worst chunk size and minimal density)
    MAX_VALUES_PER_PAYLOAD_BYTE: ClassVar[int] = 128

    def __init__(self, density: float = 0.02, bits: int = 2, chunk_size: int = 4096):
        if type(chunk_size) is not int or not 1 <= chunk_size <= MAX_CHUNK_SIZE:
            raise ConfigurationError(f"chunk_size must be an integer in [1, {MAX_CHUNK_SIZE}], got {chunk_size!r}")
        if type(bits) is not int or not MIN_BITS <= bits <= MAX_BITS:
            raise ConfigurationError(f"bits must be an integer in [{MIN_BITS}, {MAX_BITS}], got {bits!r}")
        if not isinstance(density, int | float) or isinstance(density, bool) or not 0 < density <= 1:
            raise ConfigurationError(f"density must be a number in (0, 1], got {density!r}")
        k = min(chunk_size, max(1, round(density * chunk_size)))
        if chunk_size > MAX_SPARSITY * k:
            raise ConfigurationError(
                f"density {density} keeps {k} of {chunk_size} values; at least 1 in {MAX_SPARSITY} must be kept"
            )
        self.density, self.bits, self.chunk_size, self.k = float(density), bits, chunk_size, k

    def nominal_params(self, info: CompressionInfo) -> dict[str, Any]:
        return {"chunk_size": self.chunk_size, "k": self.k, "bits": self.bits}

    @classmethod
    def check_params(cls, params: Mapping[str, Any], numel: int) -> None:
        require_exact_params(params, {"chunk_size", "k", "bits"}, cls.__name__)
        chunk_size = require_int_param(params, "chunk_size", 1, MAX_CHUNK_SIZE, cls.__name__)
        k = require_int_param(params, "k", 1, chunk_size, cls.__name__)
        require_int_param(params, "bits", MIN_BITS, MAX_BITS, cls.__name__)
        if chunk_size > MAX_SPARSITY * k:
            raise CompressionError(f"{cls.__name__}: k={k} of chunk_size={chunk_size} is below the density floor")

    @classmethod
    def payload_nbytes(cls, numel: int, dtype: torch.dtype, params: Mapping[str, Any]) -> int:
        return _layout(numel, params).payload_nbytes(dtype)

    # ----- encoding

    def _encode(self, flat: torch.Tensor, allow_inplace: bool) -> tuple[torch.Tensor, dict[str, Any]]:
        params = {"chunk_size": self.chunk_size, "k": self.k, "bits": self.bits}
        layout = _layout(flat.numel(), params)
        x = to_work_dtype(flat)  # float32 (float64 for float64); never written to
        blocks = _blocks(layout)
        # per block: (indices [rows, k] ascending, values [rows, k]) of the k largest magnitudes of each row
        picked = [
            _top_k(x[block.start : block.start + block.rows * block.length].view(block.rows, -1), block.k)
            for block in blocks
        ]
        stats_nbytes = layout.stats_nbytes(flat.dtype)
        payload = new_output(layout.payload_nbytes(flat.dtype), torch.uint8, flat.device)
        payload[: 2 * stats_nbytes].zero_()  # padding included: messages never carry stale memory
        if not picked:
            return payload, params
        magnitudes = [values.abs() for _, values in picked]
        lo = torch.cat([m.amin(dim=1) for m in magnitudes])  # [C]
        hi = torch.cat([m.amax(dim=1) for m in magnitudes])  # [C]; NaN / Inf would be kept, and show here
        if not bool(torch.isfinite(hi).all()):
            raise NonFiniteTensorError(f"{type(self).__name__} cannot encode NaN or Inf")
        stats = stats_dtype(flat.dtype)
        payload[: lo.numel() * stats.itemsize].view(stats).copy_(lo)
        payload[stats_nbytes : stats_nbytes + hi.numel() * stats.itemsize].view(stats).copy_(hi)
        levels = 1 << (self.bits - 1)
        inverse_step = finite_or_zero(levels / (hi - lo))  # 0 where all kept magnitudes are equal
        codes = []
        for block, (indices, values), mags in zip(blocks, picked, magnitudes, strict=True):
            chunks = slice(block.first_chunk, block.first_chunk + block.rows)
            level = mags.sub_(lo[chunks, None]).mul_(inverse_step[chunks, None]).floor_().clamp_(0, levels - 1)
            sign = (values < 0).to(torch.int64)
            codes.append(((indices << self.bits) | (sign << (self.bits - 1)) | level.to(torch.int64)).view(-1))
        payload[2 * stats_nbytes :] = pack_bits(torch.cat(codes), layout.width)
        return payload, params

    # ----- decoding

    @classmethod
    def _decode(cls, payload: torch.Tensor, numel: int, dtype: torch.dtype, params: Mapping[str, Any]) -> torch.Tensor:
        layout = _layout(numel, params)
        stats, stats_nbytes = stats_dtype(dtype), layout.stats_nbytes(dtype)
        out = new_output(numel, dtype, payload.device).zero_()  # huge pages for a large CPU output
        if numel == 0:
            return out
        lo = view_bytes_as(payload[: layout.chunks * stats.itemsize], stats)
        hi = view_bytes_as(payload[stats_nbytes : stats_nbytes + layout.chunks * stats.itemsize], stats)
        codes = unpack_bits(payload[2 * stats_nbytes :], layout.kept, layout.width)
        bits, levels = layout.bits, 1 << (layout.bits - 1)
        step = (hi - lo) / levels  # exact: levels is a power of two
        checks = [torch.isfinite(lo).all(), torch.isfinite(hi).all(), (lo >= 0).all(), (hi >= lo).all()]
        checks.append((hi <= torch.finfo(dtype).max).all())  # a float16 tensor's values fit float16
        positions, values = [], []
        for block in _blocks(layout):
            block_codes = codes[block.first_code : block.first_code + block.rows * block.k].view(block.rows, block.k)
            indices = block_codes >> bits  # [rows, k]
            checks.append((indices[:, -1] < block.length).all())  # each row's largest index, if ascending
            if block.k > 1:
                checks.append((indices[:, 1:] > indices[:, :-1]).all())
            starts = torch.arange(block.rows, device=payload.device).mul_(layout.chunk_size).add_(block.start)
            positions.append((indices + starts[:, None]).view(-1))
            chunks = slice(block.first_chunk, block.first_chunk + block.rows)
            magnitude = ((block_codes & (levels - 1)).to(stats) + 0.5).mul_(step[chunks, None]).add_(lo[chunks, None])
            negative = ((block_codes >> (bits - 1)) & 1).bool()
            values.append(torch.where(negative, -magnitude, magnitude).view(-1))
        if not all(torch.stack(checks).tolist()):
            raise CompressionError(
                f"{cls.__name__}: malformed message (chunk ranges must be finite with 0 <= lo <= hi within "
                f"{dtype}'s range; indices strictly increasing inside their chunk)"
            )
        out.index_copy_(0, torch.cat(positions), torch.cat(values).to(dtype))
        return out


@dataclasses.dataclass(frozen=True)
class _Block:
    """Chunks of one length, as rows: ``rows`` chunks of ``length`` values from value ``start`` on,
    keeping ``k`` each; their codes start at code ``first_code``, their ranges at ``first_chunk``."""

    start: int
    rows: int
    length: int
    k: int
    first_code: int
    first_chunk: int


def _blocks(layout: SparseLayout) -> list[_Block]:
    """The full chunks (if any), then the tail (if any)."""
    blocks = []
    if layout.full_chunks:
        blocks.append(_Block(0, layout.full_chunks, layout.chunk_size, layout.k, 0, 0))
    if layout.tail:
        start = layout.full_chunks * layout.chunk_size
        blocks.append(_Block(start, 1, layout.tail, layout.tail_k, layout.full_chunks * layout.k, layout.full_chunks))
    return blocks


def _top_k(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k entries of largest magnitude in each row of ``rows`` [m, n]: (indices [m, k] in increasing
    order, int64; their values [m, k])."""
    indices = rows.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    return indices, rows.gather(1, indices)


def _layout(numel: int, params: Mapping[str, Any]) -> SparseLayout:
    return SparseLayout(numel, params["chunk_size"], params["k"], params["bits"])


__all__ = ["SparseLayout", "SparseTopK"]
