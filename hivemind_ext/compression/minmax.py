"""Per-chunk min-max quantization to 8 or 4 bits (Bagua's MinMaxUInt8), and the per-chunk affine
helpers that :mod:`hivemind_ext.compression.quantization` shares.

The flattened tensor is cut into chunks of ``chunk_size`` values (the last one may be shorter). Each
chunk keeps its minimum and maximum, and each value becomes the nearest of ``levels`` evenly spaced
points from the chunk's minimum to its maximum. Everything runs on the tensor's device with torch ops;
the only host synchronization is one check of the per-chunk statistics.

NaN and Inf cannot be represented: compressing them raises :class:`NonFiniteTensorError`, detected
from the chunk minima and maxima (which propagate them), without another pass over the data.
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys
from abc import abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch

from hivemind_ext.compression.base import (
    Codec,
    CompressionInfo,
    aligned,
    require_exact_params,
    require_int_param,
)
from hivemind_ext.compression.chunks import chunk_amin_amax, expand_per_chunk, num_chunks, split_chunks
from hivemind_ext.compression.floating import view_bytes_as
from hivemind_ext.errors import CompressionError, ConfigurationError, NonFiniteTensorError

# On CPU, codecs work through large tensors in tiles of this many values, reusing one scratch tensor per
# tile: a fresh 64 MB temporary costs more in page faults than the arithmetic done on it, while scratch
# tensors below 32 MB are recycled by the C allocator. Tiles are large (16 for 16M values) because each
# op is one parallel region and their count, not their size, is what a busy 2-core machine punishes.
CPU_TILE_NUMEL = 1 << 20
# On accelerators a tile only bounds the scratch memory (up to 16 bytes per value of a tile); tensors
# below 64M values take one pass of kernels, without Python-level iteration.
DEVICE_TILE_NUMEL = 1 << 26
MAX_CHUNK_SIZE = 2**31
HALF = 0.5  # scaling by a power of two is exact (save in the subnormal range)
HUGE_PAGE = 1 << 21  # transparent huge pages on x86-64 and most arm64 Linux kernels
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of scales and codebooks in the payload and of the arithmetic: float64 for float64 tensors
    (so they keep their precision), float32 for all others (exact for float16 and bfloat16 values)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def tile_slices(numel: int, granule: int, device: torch.device) -> list[slice]:
    """Consecutive slices covering ``range(numel)``, each starting at a multiple of ``granule``."""
    tile_numel = CPU_TILE_NUMEL if device.type == "cpu" else DEVICE_TILE_NUMEL
    if numel <= tile_numel:
        return [slice(0, numel)]
    step = max(1, tile_numel // granule) * granule
    return [slice(start, min(start + step, numel)) for start in range(0, numel, step)]


def chunk_range(tile: slice, chunk_size: int) -> slice:
    """The chunks that a tile starting at a chunk boundary covers."""
    return slice(tile.start // chunk_size, num_chunks(tile.stop, chunk_size))


@functools.cache
def _madvise() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


def new_output(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty``, except that a large CPU tensor asks Linux for transparent huge pages before it
    is first written (as torch's THP_MEM_ALLOC_ENABLE would): a fresh 64 MB output then takes 32 page
    faults instead of 16384, which on a VM cost more than decoding into it. Only a hint: where huge
    pages are off or unsupported, nothing changes."""
    out = torch.empty(numel, dtype=dtype, device=device)
    nbytes = numel * out.element_size()
    madvise = _madvise() if out.device.type == "cpu" and nbytes >= 2 * HUGE_PAGE else None
    if madvise is not None:
        start = -(-out.data_ptr() // HUGE_PAGE) * HUGE_PAGE  # whole huge pages inside the tensor only
        end = (out.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
        if end > start:
            madvise(start, end - start, MADV_HUGEPAGE)  # a failure (EINVAL without THP) changes nothing
    return out


def to_work_dtype(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` in :func:`stats_dtype` (itself if it has it already; a float16 tensor becomes float32)."""
    work = stats_dtype(flat.dtype)
    return flat if flat.dtype == work else new_output(flat.numel(), work, flat.device).copy_(flat)


def decode_in_tiles(
    numel: int,
    dtype: torch.dtype,
    work_dtype: torch.dtype,
    granule: int,
    device: torch.device,
    decode_tile: Callable[[torch.Tensor, int], None],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fills ``out`` (default: a new tensor) with the decoded values tile by tile, each tile while it is in cache.

    ``decode_tile(values, start)`` writes elements start .. start + len(values) of the result into
    ``values`` (of ``work_dtype``): the output itself when it has that dtype, else a scratch tile that
    is then cast into the output (no full-size temporary in float32 for a float16 result).
    """
    out = new_output(numel, dtype, device) if out is None else out
    tiles = tile_slices(numel, granule, device)
    scratch = None if dtype == work_dtype else torch.empty(tiles[0].stop, dtype=work_dtype, device=device)
    for tile in tiles:
        values = out[tile] if scratch is None else scratch[: tile.stop - tile.start]
        decode_tile(values, tile.start)
        if scratch is not None:
            out[tile].copy_(values)
    return out


def finite_or_zero(values: torch.Tensor) -> torch.Tensor:
    """Inverse steps for quantization: where a step is zero (a constant chunk) or so small that its
    inverse overflows, the scale is 0 and every value of the chunk gets code 0. (NaN and +-Inf become 0;
    one op, where isfinite and where took five: this runs once per message, on a few values.)"""
    return values.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def affine_per_chunk(
    x: torch.Tensor, out: torch.Tensor, chunk_size: int, scale: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """``out = x * scale[c] + bias[c]`` for the values x of every chunk c (no addition if bias is None).

    ``x`` and ``out`` (which may be x itself) are 1-D of equal size starting at a chunk boundary;
    ``scale`` and ``bias`` hold one value per chunk. Quantizing as x / step - min / step + 1/2 rather than
    (x - min) / step + 1/2 adds at most a few ulps of max(|x|, |min|) to the error, far below a step.
    (mul then add_ rather than addcmul: on CPU, torch's addcmul is 3x slower than the two together.)
    """
    numel = x.numel()
    biases = expand_per_chunk(bias, numel, chunk_size) if bias is not None else (None, None)
    scales = expand_per_chunk(scale, numel, chunk_size)
    for x_part, out_part, scale_part, bias_part in zip(
        split_chunks(x, chunk_size), split_chunks(out, chunk_size), scales, biases, strict=True
    ):
        if not x_part.numel():  # no full chunk, or no tail (as for the all-reduce's chunks)
            continue
        torch.mul(x_part, scale_part, out=out_part)
        if bias_part is not None:
            out_part.add_(bias_part)


def range_overflows(mins: torch.Tensor, maxs: torch.Tensor, owner: str, ranges: torch.Tensor | None = None) -> bool:
    """One host sync on the chunk statistics: raises NonFiniteTensorError if a chunk holds NaN or Inf,
    and returns whether max - min overflows in some chunk (values of both signs near the dtype's limit).

    ``ranges`` (maxs - mins, if the caller has them) are all finite and so is their sum in the common
    case, which one reduction proves: NaN or Inf in a chunk make its min or max, then its range, NaN
    or Inf (Inf - Inf is NaN). Only otherwise are the statistics looked at one by one.
    """
    ranges = maxs - mins if ranges is None else ranges
    if not ranges.numel() or math.isfinite(ranges.sum().item()):
        return False
    finite, range_finite = torch.stack(
        [(torch.isfinite(mins) & torch.isfinite(maxs)).all(), torch.isfinite(ranges).all()]
    ).tolist()
    if not finite:
        raise NonFiniteTensorError(f"{owner} cannot encode NaN or Inf; use Float16Compression to carry them")
    return not range_finite


def check_chunk_size(chunk_size: Any, what: str = "chunk_size") -> int:
    if type(chunk_size) is not int or not 1 <= chunk_size <= MAX_CHUNK_SIZE:
        raise ConfigurationError(f"{what} must be an integer in [1, {MAX_CHUNK_SIZE}], got {chunk_size!r}")
    return chunk_size


class _MinMaxQuantization(Codec):
    """Shared implementation of MinMaxUInt8 and MinMaxUInt4 (see the module docstring).

    Payload: mins S[C] | maxs S[C] | codes, with C = ceil(N / chunk_size), S = float64 for float64
    tensors and float32 otherwise, each section starting at a multiple of 8 bytes.
    """

    decodes_into_output = True

    LEVELS: ClassVar[int]
    BITS: ClassVar[int]
    DEFAULT_CHUNK_SIZE: ClassVar[int]

    def __init__(self, chunk_size: int | None = None):
        self.chunk_size = check_chunk_size(self.DEFAULT_CHUNK_SIZE if chunk_size is None else chunk_size)

    def nominal_params(self, info: CompressionInfo) -> dict[str, Any]:
        return {"chunk_size": self.chunk_size}

    @classmethod
    def codes_nbytes(cls, numel: int) -> int:
        return -(-numel * cls.BITS // 8)

    @classmethod
    def _stats_nbytes(cls, numel: int, dtype: torch.dtype, chunk_size: int) -> int:
        return aligned(num_chunks(numel, chunk_size) * stats_dtype(dtype).itemsize)

    @classmethod
    def check_params(cls, params: Mapping[str, Any], numel: int) -> None:
        require_exact_params(params, {"chunk_size"}, cls.__name__)
        require_int_param(params, "chunk_size", 1, MAX_CHUNK_SIZE, cls.__name__)

    @classmethod
    def payload_nbytes(cls, numel: int, dtype: torch.dtype, params: Mapping[str, Any]) -> int:
        return 2 * cls._stats_nbytes(numel, dtype, params["chunk_size"]) + cls.codes_nbytes(numel)

    def _encode(self, flat: torch.Tensor, allow_inplace: bool) -> tuple[torch.Tensor, dict[str, Any]]:
        chunk, numel, stats = self.chunk_size, flat.numel(), stats_dtype(flat.dtype)
        x = to_work_dtype(flat)
        mins, maxs = chunk_amin_amax(x, chunk)
        stats_nbytes = self._stats_nbytes(numel, flat.dtype, chunk)
        payload = new_output(2 * stats_nbytes + self.codes_nbytes(numel), torch.uint8, flat.device)
        mins_section, maxs_section = (
            payload[:stats_nbytes].view(stats),
            payload[stats_nbytes : 2 * stats_nbytes].view(stats),
        )
        mins_section[: mins.numel()].copy_(mins)
        maxs_section[: maxs.numel()].copy_(maxs)
        if mins.numel() < mins_section.numel():  # the padding: messages never carry stale memory
            mins_section[mins.numel() :].zero_()
            maxs_section[maxs.numel() :].zero_()
        ranges = maxs - mins
        if range_overflows(mins, maxs, type(self).__name__, ranges):
            x, mins, maxs = x * HALF, mins * HALF, maxs * HALF  # rare; decoding mirrors it (see _decode)
            ranges = maxs - mins
        scales = finite_or_zero(self.LEVELS / ranges)
        # the code of x is trunc(x * scale + bias), the level nearest to x (the cast to uint8 truncates)
        self._write_codes(x, scales, 0.5 - mins * scales, payload[2 * stats_nbytes :])
        return payload, {"chunk_size": chunk}

    def _write_codes(self, x: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, codes: torch.Tensor) -> None:
        """Writes the codes of ``x`` into the ``codes`` section, one tile at a time."""
        chunk = self.chunk_size
        tiles = tile_slices(x.numel(), self._granule(chunk), x.device)
        scratch = torch.empty(tiles[0].stop - tiles[0].start, dtype=x.dtype, device=x.device)
        for tile in tiles:
            levels, chunks = scratch[: tile.stop - tile.start], chunk_range(tile, chunk)
            affine_per_chunk(x[tile], levels, chunk, scales[chunks], biases[chunks])
            # x * scale + bias rounds by a few ulps of x * scale: in a chunk only a few hundred ulps of
            # its values wide (narrow and far from zero), that is levels, out of range at both ends,
            # and the cast to uint8 would wrap them to the chunk's other end. The tile is in cache: a
            # clamp costs a fifth of the cast it protects (and the CPU cast below gains more).
            levels.clamp_(0, self.LEVELS + 0.5)
            self._pack(levels, codes, tile.start)

    @staticmethod
    @abstractmethod
    def _pack(levels: torch.Tensor, codes: torch.Tensor, start: int) -> None:
        """Writes the codes of x[start : start + len(levels)] into the codes section; ``levels`` holds
        those values in level units plus 0.5, in [0, LEVELS + 0.5], and may be overwritten."""

    @classmethod
    def _decode(
        cls,
        payload: torch.Tensor,
        numel: int,
        dtype: torch.dtype,
        params: Mapping[str, Any],
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        chunk = params["chunk_size"]
        chunks = num_chunks(numel, chunk)
        stats, stats_nbytes = stats_dtype(dtype), cls._stats_nbytes(numel, dtype, chunk)
        mins = view_bytes_as(payload[: chunks * stats.itemsize], stats)
        maxs = view_bytes_as(payload[stats_nbytes : stats_nbytes + chunks * stats.itemsize], stats)
        ranges = maxs - mins
        # one host sync: ranges in [0, inf) prove the stats finite with min <= max (a NaN or Inf min or
        # max gives a NaN or infinite range, and a NaN range fails both comparisons)
        smallest, largest = torch.stack(torch.aminmax(ranges)).tolist() if chunks else (0.0, 0.0)
        range_finite = smallest >= 0 and largest < math.inf
        if not range_finite:
            valid = bool((torch.isfinite(mins) & torch.isfinite(maxs) & (mins <= maxs)).all())
            if not valid:
                raise CompressionError(f"{cls.__name__}: chunk minima and maxima must be finite with min <= max")
            # values of both signs near the dtype's limit: work on halves, then double
            mins, maxs = mins * HALF, maxs * HALF
            ranges = maxs - mins
        codes, steps = payload[2 * stats_nbytes :], ranges / cls.LEVELS

        def decode_tile(values: torch.Tensor, start: int) -> None:
            chunks = chunk_range(slice(start, start + values.numel()), chunk)
            cls._unpack(codes, values, start)
            affine_per_chunk(values, values, chunk, steps[chunks], mins[chunks])
            if not range_finite:
                values.mul_(2)

        return decode_in_tiles(numel, dtype, stats, cls._granule(chunk), payload.device, decode_tile, out)

    @staticmethod
    def _granule(chunk_size: int) -> int:
        """Tiles start at multiples of this: chunk boundaries that are also byte boundaries for 4 bits."""
        return chunk_size if chunk_size % 2 == 0 else 2 * chunk_size

    @staticmethod
    @abstractmethod
    def _unpack(codes: torch.Tensor, values: torch.Tensor, start: int) -> None:
        """Writes the code values of elements start .. start + len(values) of the codes section into
        ``values`` (a float tensor); ``start`` is even."""


class MinMaxUInt8(_MinMaxQuantization):
    """8-bit min-max quantization per chunk, as Bagua's MinMaxUInt8: 256 evenly spaced levels from each
    chunk's minimum to its maximum.

    Payload: mins S[C] | maxs S[C] | codes uint8[N] (C = ceil(N / chunk_size); S = float64 for float64
    tensors, else float32; sections 8-byte aligned). Value i of chunk c decodes to min_c + code_i * step_c
    with step_c = (max_c - min_c) / 255.

    Error bound: |x - x'| <= (max_c - min_c) / 255 / 2 for every value of chunk c, plus float rounding
    (a few ulps of max(|min_c|, |max_c|), and the final rounding to float16 / bfloat16). A constant chunk
    decodes exactly; a chunk narrower than 255 / float32 max (~7.5e-37) decodes to its minimum. NaN or
    Inf raise :class:`NonFiniteTensorError`.

    The default chunk of 4096 values keeps the scales at 0.2% of the payload; on CPU it compresses as
    fast as larger chunks, and its error on normal data is 8% below that of 16384-value chunks (a
    chunk's range grows with its size).
    """

    codec_id = "minmax_uint8"
    LEVELS = 255
    BITS = 8
    DEFAULT_CHUNK_SIZE = 4096

    @staticmethod
    def _pack(levels: torch.Tensor, codes: torch.Tensor, start: int) -> None:
        # on CPU, torch casts float to int16 and int16 to uint8 in a third of the time of float to uint8
        codes[start : start + levels.numel()].copy_(levels.to(torch.int16) if levels.device.type == "cpu" else levels)

    @staticmethod
    def _unpack(codes: torch.Tensor, values: torch.Tensor, start: int) -> None:
        values.copy_(codes[start : start + values.numel()])


class MinMaxUInt4(_MinMaxQuantization):
    """4-bit min-max quantization per chunk: 16 evenly spaced levels from each chunk's min to its max.

    Payload: mins S[C] | maxs S[C] | codes uint8[ceil(N / 2)] (as :class:`MinMaxUInt8`), two codes per
    byte: value 2j in the low nibble of byte j, value 2j + 1 in its high nibble (zero past the end).

    Error bound: |x - x'| <= (max_c - min_c) / 15 / 2 per chunk c, plus float rounding. A constant chunk
    decodes exactly. NaN or Inf raise :class:`NonFiniteTensorError`. The default chunk is smaller than
    MinMaxUInt8's (1024 values: scales are 1.6% of the payload) because with 16 levels the range of a
    chunk dominates the error.
    """

    codec_id = "minmax_uint4"
    LEVELS = 15
    BITS = 4
    DEFAULT_CHUNK_SIZE = 1024

    @staticmethod
    def _pack(levels: torch.Tensor, codes: torch.Tensor, start: int) -> None:
        numel, first_byte = levels.numel(), start // 2  # start is even: tiles hold whole bytes
        pairs = levels[: numel // 2 * 2].view(-1, 2)
        pairs[:, 1].trunc_()
        pairs[:, 0].add_(pairs[:, 1], alpha=16)  # low + 16 * high, truncated to an integer by the cast
        codes[first_byte : first_byte + numel // 2].copy_(pairs[:, 0])
        if numel % 2:
            codes[first_byte + numel // 2 :].copy_(levels[-1:])

    @staticmethod
    def _unpack(codes: torch.Tensor, values: torch.Tensor, start: int) -> None:
        numel, first_byte = values.numel(), start // 2
        pairs = values[: numel // 2 * 2].view(-1, 2)
        low, high = pairs[:, 0], pairs[:, 1]
        low.copy_(codes[first_byte : first_byte + numel // 2])  # whole bytes, split below
        torch.mul(low, 1 / 16, out=high).floor_()
        low.sub_(high, alpha=16)
        if numel % 2:  # the tensor's last value; a sender's stray high bits must not leave the level range
            values[-1:].copy_(codes[first_byte + numel // 2 :] & 15)


__all__ = ["MinMaxUInt4", "MinMaxUInt8"]
