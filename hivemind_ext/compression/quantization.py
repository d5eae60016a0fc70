"""8-bit quantizing codecs with hivemind's names, computed on the tensor's own device with torch ops.

- :class:`Uniform8BitQuantization`: 256 equal buckets over mean +- a few standard deviations;
- :class:`Quantile8BitQuantization`: 256 buckets between (approximate) quantiles of the values;
- :class:`BlockwiseQuantization`: 255 evenly spaced levels per block, scaled by the block's absmax.

The first two send a codebook of 256 values followed by one code per value. In the quantile codec the
codebook holds the mean of the values in each bucket; in the uniform one, the midpoint of each inner
bucket (no pass over the data needed) and the mean of each of the two outer buckets, which absorb the
clipped outliers. None of them can represent NaN or Inf: compressing them raises
:class:`NonFiniteTensorError`, detected from statistics the codec computes anyway (the minimum and
maximum, the block absmax), never with an extra pass over the data. Decoding a message whose codebook
or scales are not finite raises :class:`CompressionError`.

On CPU, large tensors are processed in tiles (see :mod:`hivemind_ext.compression.minmax`). Encoding
and decoding wait for the device once, to check small statistics (on CUDA, each torch.bincount of the
quantile codec also reads its maximum back; on CPU, where waiting costs nothing, the uniform codec
also reads back which blocks of values may fall in its outer buckets).
"""

from __future__ import annotations

import math
import struct
import sys
from abc import abstractmethod
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
from hivemind_ext.compression.chunks import chunk_amin_amax, num_chunks
from hivemind_ext.compression.floating import view_bytes_as
from hivemind_ext.compression.minmax import (
    MAX_CHUNK_SIZE,
    affine_per_chunk,
    check_chunk_size,
    chunk_range,
    decode_in_tiles,
    finite_or_zero,
    new_output,
    stats_dtype,
    tile_slices,
    to_work_dtype,
)
from hivemind_ext.errors import CompressionError, ConfigurationError, NonFiniteTensorError

CODEBOOK_SIZE = 256
GOLDEN_RATIO_FRACTION = (math.sqrt(5) - 1) / 2
SAMPLE_RUN = 64
# integer types of the same width as float types: for radix sorting and for copying pairs of codebook values
SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def non_finite_error(owner: str) -> NonFiniteTensorError:
    return NonFiniteTensorError(f"{owner} cannot encode NaN or Inf; use Float16Compression to carry them")


def sample_values(x: torch.Tensor, size: int) -> torch.Tensor:
    """About ``size`` values of ``x`` at deterministic, evenly scattered positions (all of x if it is small).

    The values come in runs of 64 consecutive ones (a cache line holds 16 float32 values: a gather of
    scattered single values from a tensor out of cache costs as much as a pass over it). Run i starts in
    the i-th of ``size / 64`` equal strata of x, at the offset frac(i * 0.618...) within it (the
    golden-ratio sequence): no random state, no aliasing with the rows of a flattened matrix (as a
    fixed stride would have), identical on every device.
    """
    if x.numel() <= size:
        return x
    runs = max(size // SAMPLE_RUN, 1)
    strata = torch.arange(runs, dtype=torch.float64, device=x.device)
    starts = torch.mul(strata, GOLDEN_RATIO_FRACTION).frac_().add_(strata).mul_((x.numel() - SAMPLE_RUN) / runs)
    offsets = torch.arange(SAMPLE_RUN, device=x.device)
    return x[(starts.long().unsqueeze(1) + offsets).view(-1)]


def sort_floats(values: torch.Tensor) -> torch.Tensor:
    """``torch.sort(values).values`` for finite float32 / float64 values, sorted as integer keys.

    On CPU torch sorts floats by comparison and integers by radix: 128K float32 values take 10 ms one
    way and 0.6 ms the other. The key of a float is its bit pattern with the magnitude bits flipped
    when the sign bit is set, so that integer order is float order (-0.0 just below +0.0).
    """
    int_dtype = SAME_WIDTH_INT[values.element_size()]
    flip = torch.iinfo(int_dtype).max  # all bits but the sign bit
    bits = values.view(int_dtype)
    keys = torch.where(bits < 0, bits ^ flip, bits)
    ordered = torch.sort(keys).values
    return torch.where(ordered < 0, ordered ^ flip, ordered).view(values.dtype)  # the map is its own inverse


def finfo(x: torch.Tensor) -> torch.finfo:
    return torch.finfo(x.dtype)


def round_to(value: float, dtype: torch.dtype) -> float:
    """A Python float rounded to float32 (to nearest) if dtype is float32, as a kernel given it would."""
    return struct.unpack("f", struct.pack("f", value))[0] if dtype == torch.float32 else value


def check_finite_and_width(x: torch.Tensor, owner: str) -> tuple[torch.Tensor, bool]:
    """One host sync on the min and max of a non-empty x: raises NonFiniteTensorError if x holds NaN or
    Inf (min and max propagate them). Returns max |x| (a 0-d tensor) and whether sums over x may
    overflow x's dtype."""
    magnitude = torch.stack(torch.aminmax(x)).abs().max()
    finite, wide = torch.stack(
        [torch.isfinite(magnitude), magnitude.double() * x.numel() >= torch.finfo(x.dtype).max / 4]
    ).tolist()
    if not finite:
        raise non_finite_error(owner)
    return magnitude, wide


def inverse_width(width: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """1 / width, with the width raised to at least max|x| * 2**-100 (and the smallest normal float):
    x / width and the offsets then stay far from overflow. Narrower buckets would split rounding noise."""
    floor = (magnitude * 2.0**-100).clamp_min_(torch.finfo(width.dtype).tiny)
    return torch.maximum(width, floor).reciprocal_()


def outer_blocks(y: torch.Tensor, codes: torch.Tensor, block_size: int) -> torch.Tensor:
    """The values of y in the blocks of ``block_size`` consecutive codes that hold a 0 or a 255, and
    those of the last, shorter block if any, concatenated."""
    full = y.numel() // block_size * block_size
    # 255 + 1 wraps around to 0 in uint8: a block's minimum of codes + 1 is at most 1 iff it holds 0 or 255
    flagged = torch.add(codes[:full], 1).view(-1, block_size).amin(dim=1) <= 1
    return torch.cat([y[:full].view(-1, block_size)[flagged].view(-1), y[full:]])


def to_codes(values: torch.Tensor, codes: torch.Tensor, scratch: torch.Tensor | None) -> None:
    """``codes.copy_(values)`` for values in [0, 256): truncates. On CPU, through an int16 ``scratch``
    of values' size: torch's float -> uint8 cast is not vectorized there, and the two casts take 2/5 of its time."""
    if scratch is None:
        codes.copy_(values)
    else:
        codes.copy_(scratch.copy_(values))


def lookup(table: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """``table[codes]`` for uint8 codes and a table of 256 values, computed tile by tile on CPU.

    Values of 2 or 4 bytes are looked up two at a time: each pair of codes, read as one int16, indexes
    a table of all 65536 pairs of values, which halves the work of the gather (the slow part on CPU).
    """
    out = new_output(codes.numel(), table.dtype, codes.device)
    pairs = codes.numel() // 2
    pair_dtype = SAME_WIDTH_INT.get(2 * table.element_size())
    paired = pair_dtype is not None and sys.byteorder == "little" and pairs > 0 and codes.data_ptr() % 2 == 0
    if paired:
        # pair_table[a + 256 * b] = (table[a], table[b]): codes a, b at increasing addresses read as one
        # little-endian int16 (negative for b >= 128, hence the mask), and out's values a, b as one wide int
        items = table.view(SAME_WIDTH_INT[table.element_size()])
        pair_table = torch.stack([items.repeat(CODEBOOK_SIZE), items.repeat_interleave(CODEBOOK_SIZE)], dim=1)
        _gather(
            pair_table.view(pair_dtype).view(-1),
            codes[: 2 * pairs].view(torch.int16),
            out[: 2 * pairs].view(pair_dtype),
            0xFFFF,
        )
    if not paired or codes.numel() % 2:
        done = 2 * pairs if paired else 0
        _gather(table, codes[done:], out[done:], None)
    return out


def _gather(table: torch.Tensor, index: torch.Tensor, out: torch.Tensor, mask: int | None) -> None:
    """out[i] = table[index[i] & mask], converting the index to int32 tile by tile."""
    tiles = tile_slices(index.numel(), 1, index.device)
    buffer = torch.empty(tiles[0].stop - tiles[0].start, dtype=torch.int32, device=index.device)
    for tile in tiles:
        tile_index = buffer[: tile.stop - tile.start].copy_(index[tile])
        if mask is not None:
            tile_index.bitwise_and_(mask)
        torch.index_select(table, 0, tile_index, out=out[tile])


class _CodebookQuantization(Codec):
    """Shared wire format of Uniform8BitQuantization and Quantile8BitQuantization.

    Payload: codebook S[256] | codes uint8[N], where S is float64 for float64 tensors and float32
    otherwise, and the codes section starts at a multiple of 8 bytes. Value i decodes to codebook[code_i].
    """

    @classmethod
    def _codebook_nbytes(cls, dtype: torch.dtype) -> int:
        return aligned(CODEBOOK_SIZE * stats_dtype(dtype).itemsize)

    @classmethod
    def payload_nbytes(cls, numel: int, dtype: torch.dtype, params: Mapping[str, Any]) -> int:
        return cls._codebook_nbytes(dtype) + numel

    def _encode(self, flat: torch.Tensor, allow_inplace: bool) -> tuple[torch.Tensor, dict[str, Any]]:
        stats = stats_dtype(flat.dtype)
        x = to_work_dtype(flat)
        offset = self._codebook_nbytes(flat.dtype)
        payload = new_output(offset + x.numel(), torch.uint8, x.device)
        payload[:offset].zero_()  # padding included: messages never carry stale memory
        if x.numel():
            codebook = self._quantize(x, payload[offset:])
            payload[: CODEBOOK_SIZE * stats.itemsize].view(stats).copy_(codebook)
        return payload, {}

    @abstractmethod
    def _quantize(self, x: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Writes the codes of the non-empty 1-D ``x`` (float32 or float64) and returns the codebook [256]
        in x's dtype; raises NonFiniteTensorError if x holds NaN or Inf."""

    @classmethod
    def _decode(cls, payload: torch.Tensor, numel: int, dtype: torch.dtype, params: Mapping[str, Any]) -> torch.Tensor:
        stats = stats_dtype(dtype)
        codebook = view_bytes_as(payload[: CODEBOOK_SIZE * stats.itemsize], stats)
        if not bool(torch.isfinite(codebook).all()):
            raise CompressionError(f"{cls.__name__}: the codebook contains NaN or Inf")
        return lookup(codebook.to(dtype), payload[cls._codebook_nbytes(dtype) :])


class Uniform8BitQuantization(_CodebookQuantization):
    """256 equal buckets spanning mean +- range_in_sigmas / 2 standard deviations; values beyond them
    fall in the first or last bucket. Inner buckets decode to their midpoint, the two outer ones to the
    mean of their values (so outliers pull them outward).

    Payload: codebook S[256] | codes uint8[N] (S = float64 for float64 tensors, else float32).
    The mean and the standard deviation are estimated from 16K evenly scattered values: they only place
    the buckets, and the bound below holds whatever they are.

    Error bound: with step = range_in_sigmas * std / 256 (raised to at least max|x| * 2**-100), a value
    in an inner bucket (codes 1..254, values within mean - 127.5 step .. mean + 126.5 step) decodes to
    the bucket's midpoint, mean + (code - 128) * step: |x - x'| <= step / 2, plus float rounding (a few
    ulps of max|x| + 256 step in float32, float64 for float64 tensors, and the rounding of x' to x's
    dtype). A value in an outer bucket (codes 0 and 255) decodes to the mean of the values with its
    code. Every x' lies between min(x) and max(x). NaN or Inf raise :class:`NonFiniteTensorError`.

    hivemind's default range is 6 standard deviations and it decodes every bucket to its mean; ours is 8
    (mean +- 4 std): on normal data it lowers the relative error from 1.6% to 0.9%, since clipped tails
    cost more than wider buckets. Inner buckets are narrow enough that their midpoints do as well as
    their means (0.91-0.93% either way on normal data), and need no pass over the values; the outer
    buckets' means are summed, on CPU, only over the blocks of 256 values that hold outer codes.
    """

    codec_id = "uniform_8bit"
    RANGE_IN_SIGMAS: ClassVar[float] = 8.0
    SAMPLE_SIZE: ClassVar[int] = 1 << 14
    BLOCK_SIZE: ClassVar[int] = 256  # on CPU, outer values are looked for in the blocks that hold outer codes

    def __init__(self, range_in_sigmas: float | None = None):
        value = self.RANGE_IN_SIGMAS if range_in_sigmas is None else range_in_sigmas
        if not isinstance(value, int | float) or not 0 < value < math.inf:
            raise ConfigurationError(f"range_in_sigmas must be a positive finite number, got {value!r}")
        self.range_in_sigmas = float(value)

    def _quantize(self, x: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        low, high, mean, std = self._statistics(x)
        # bucket k (k = 1..254) holds y = x * scale + bias in [k, k + 1), with bias = 128.5 - mean * scale:
        # its code is trunc(y) clamped to [0, 255] (the cast to uint8 truncates). Both are rounded to x's
        # dtype here, as the kernels would, so that the midpoints below are those of the buckets applied.
        width = min(max(std * self.range_in_sigmas / CODEBOOK_SIZE, max(-low, high) * 2.0**-100), finfo(x).max)
        scale = round_to(1 / max(width, finfo(x).tiny), x.dtype)  # x * scale cannot overflow: <= 2**100
        bias = round_to(CODEBOOK_SIZE / 2 + 0.5 - mean * scale, x.dtype)
        # outer buckets: y < 1 (code 0) and y >= 255, i.e. y > top, the float just below 255 (code 255)
        top = CODEBOOK_SIZE - 1 - (CODEBOOK_SIZE // 2) * finfo(x).eps
        on_cpu = x.device.type == "cpu"
        tiles = tile_slices(x.numel(), self.BLOCK_SIZE, x.device)
        y_tile, clamped_tile = torch.empty(2, tiles[0].stop - tiles[0].start, dtype=x.dtype, device=x.device)
        narrow = torch.empty_like(y_tile, dtype=torch.int16) if on_cpu else None
        # every entry as the y of its bucket's midpoint mapped back, x = (y - bias) / scale, and clamped to
        # [min x, max x], which holds every value of every bucket: never a larger error, and never an
        # overflow to Inf (the midpoint of an empty bucket of float64 values near the limit). Host data is
        # copied to the device before the loop, where the copies need not wait for its kernels.
        codebook = [min(max((k + 0.5 - bias) / scale, low), high) for k in range(CODEBOOK_SIZE)]
        codebook = torch.tensor(codebook, dtype=torch.float64, device=x.device)
        offsets = torch.tensor([1 - bias, top - bias], dtype=torch.float64, device=x.device)
        bias_tensor = torch.tensor(bias, dtype=x.dtype, device=x.device)
        sums, counts = [], []  # per tile: [sum of y - 1 over code 0, of y - top over code 255], their counts
        for tile in tiles:
            size, tile_codes = tile.stop - tile.start, codes[tile]
            y = torch.add(bias_tensor, x[tile], alpha=scale, out=y_tile[:size])  # one pass, not a mul and an add
            clamped = torch.clamp(y, 0, CODEBOOK_SIZE - 0.5, out=clamped_tile[:size])
            to_codes(clamped, tile_codes, None if narrow is None else narrow[:size])
            # the few outer values: on CPU, those of the blocks holding code 0 or 255 (a host sync, free there)
            outer = outer_blocks(y, tile_codes, self.BLOCK_SIZE) if on_cpu else y
            # float32 sums suffice: only the outer values are nonzero, all of one sign
            below, above = torch.clamp(outer, max=1).sub_(1), torch.clamp(outer, min=top).sub_(top)
            sums.append(torch.stack([below.sum(), above.sum()]).double())
            counts.append(torch.stack([torch.count_nonzero(below), torch.count_nonzero(above)]))
        # the outer buckets' means, mapped back likewise (an empty bucket gets its inner border: unused)
        outer_means = sum(sums) / sum(counts).clamp_min(1)
        codebook[[0, -1]] = outer_means.add_(offsets).div_(scale).clamp_(low, high)
        return codebook.to(x.dtype)

    def _statistics(self, x: torch.Tensor) -> tuple[float, float, float, float]:
        """(min, max, mean, std) of a non-empty x, with one host sync; raises NonFiniteTensorError if x
        holds NaN or Inf (min and max propagate them). The mean and std are those of 16K evenly
        scattered values: they only place the buckets."""
        low_high = torch.stack(torch.aminmax(x)).double()
        # moments of the sample scaled by max |x| (squares of float64 values near 1e308 would overflow)
        # and shifted by its first value (float64 sums of squares of values far from 0 would lose the spread)
        sample = sample_values(x, self.SAMPLE_SIZE).double() / low_high.abs().max()  # never x itself
        deviations = sample - sample[0]
        moments = torch.stack([sample[0], deviations.sum(), deviations.dot(deviations)])
        low, high, first, total, squares = torch.cat([low_high, moments]).tolist()
        if not math.isfinite(low) or not math.isfinite(high):
            raise non_finite_error(type(self).__name__)
        magnitude = max(-low, high)
        if magnitude == 0:
            return low, high, 0.0, 0.0
        size = sample.numel()
        variance = max(squares / size - (total / size) ** 2, 0.0)
        return low, high, (first + total / size) * magnitude, math.sqrt(variance) * magnitude

    def nominal_params(self, info: CompressionInfo) -> dict[str, Any]:
        return {}


class Quantile8BitQuantization(_CodebookQuantization):
    """256 buckets with about equally many values each, bounded by quantiles estimated from 128K evenly
    scattered values; each code decodes to the mean of the values in its bucket.

    Payload: codebook S[256] | codes uint8[N] (S = float64 for float64 tensors, else float32).

    To find each value's bucket fast on any device, the 255 borders are snapped to a uniform grid of
    65536 fine bins between the outermost borders, and a 64 KB table maps fine bins to buckets: a
    border moves by at most one fine bin, a small change next to the sampling error of the quantiles.
    (hivemind computes exact quantiles of chunks of 100K values and takes quantiles of those; its
    relative error on normal data is 2.6%, ours 2.1%.)

    Error bound: every value decodes to the mean of the values that share its code, so |x - x'| is at
    most the spread of its bucket; buckets are intervals, so codes are monotone in x. NaN or Inf raise
    :class:`NonFiniteTensorError` (detected from the tensor's minimum and maximum).
    """

    codec_id = "quantile_8bit"
    QUANTILE_SAMPLE_SIZE: ClassVar[int] = 1 << 17
    FINE_BINS: ClassVar[int] = 1 << 16

    def _quantize(self, x: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Writes the codes of x tile by tile and returns the codebook: each bucket's mean, summed in
        float64 as the tiles go (float32 sums of many similar values drift, and stall beyond 2**24)."""
        magnitude, wide = check_finite_and_width(x, type(self).__name__)
        scale, bias, table = self._fine_grid(x, magnitude)
        tiles = tile_slices(x.numel(), 1, x.device)
        tile_numel = tiles[0].stop - tiles[0].start
        scratch = torch.empty(tile_numel, dtype=x.dtype, device=x.device)
        index = torch.empty(tile_numel, dtype=torch.int32, device=x.device)
        weights = torch.empty(tile_numel, dtype=torch.float64, device=x.device)
        # float64 sums of float32 values cannot overflow; those of float64 values near 1e308 can
        weight_scale = x.numel() if wide and x.dtype == torch.float64 else 1
        sums = torch.zeros(CODEBOOK_SIZE, dtype=torch.float64, device=x.device)
        for tile in tiles:
            size, tile_codes = tile.stop - tile.start, codes[tile]
            fine = torch.mul(x[tile], scale, out=scratch[:size]).add_(bias).clamp_(0, self.FINE_BINS - 1)
            torch.index_select(table, 0, index[:size].copy_(fine), out=tile_codes)  # copy_ truncates
            tile_weights = weights[:size].copy_(x[tile])
            if weight_scale != 1:
                tile_weights.div_(weight_scale)
            sums += torch.bincount(tile_codes, weights=tile_weights, minlength=CODEBOOK_SIZE)
        counts = torch.bincount(codes, minlength=CODEBOOK_SIZE).clamp_min_(1)
        return (sums / counts).mul_(weight_scale).to(x.dtype)  # unused codes decode to 0

    def _fine_grid(self, x: torch.Tensor, magnitude: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scale, bias, table): value v falls in fine bin trunc(v * scale + bias), clamped to
        [0, FINE_BINS - 1], and table[bin] (uint8) is the bucket of the bin's centre. The grid spans the
        outermost borders with one more bin beyond each."""
        sample = sort_floats(sample_values(x, self.QUANTILE_SAMPLE_SIZE))
        # quantiles (j - 1/2) / 255 for j = 1..255: inner buckets hold 1/255 of the values, the outer two
        # (unbounded, so costlier per value) half as much; on normal data the error drops by a fifth
        levels = torch.arange(CODEBOOK_SIZE - 1, dtype=torch.float64, device=x.device).add_(0.5)
        positions = levels.mul_(sample.numel() / (CODEBOOK_SIZE - 1)).long()
        borders = sample[positions]  # [255], nondecreasing
        first, last = borders[0], borders[-1]
        inner_bins = self.FINE_BINS - 2
        scale = inverse_width(last / inner_bins - first / inner_bins, magnitude)  # no overflow in last - first
        bias = 1 - first * scale  # bin 1 starts at the first border
        centres = torch.arange(self.FINE_BINS, dtype=torch.float64, device=x.device).add_(0.5)
        centres.sub_(bias.double()).div_(scale.double())
        table = torch.searchsorted(borders.double(), centres, right=True).to(torch.uint8)
        return scale, bias, table

    def nominal_params(self, info: CompressionInfo) -> dict[str, Any]:
        return {}


class BlockwiseQuantization(Codec):
    """8-bit quantization per block of ``block_size`` values scaled by the block's largest magnitude
    (absmax), in pure torch (hivemind's needs bitsandbytes). Codes 1..255 stand for the 255 evenly
    spaced levels from -absmax to +absmax, code 128 for zero exactly.

    Payload: absmax S[B] | codes uint8[N], B = ceil(N / block_size), S = float64 for float64 tensors
    and float32 otherwise, sections 8-byte aligned. Value i of block b decodes to
    (code_i - 128) * absmax_b / 127.

    Error bound: |x - x'| <= absmax_b / 127 / 2 for every value of block b, plus float rounding; zeros
    stay exactly zero, and so does a block whose absmax is below 127 / float32 max (~3.7e-37). NaN or
    Inf raise :class:`NonFiniteTensorError`.

    Compared with hivemind's (bitsandbytes' dynamic 8-bit code), evenly spaced levels halve the mean
    squared error on normal data (relative error 0.87% instead of 1.30%).
    """

    codec_id = "blockwise_8bit"
    HALF_LEVELS = 127
    ZERO_CODE = 128

    def __init__(self, block_size: int = 4096):
        self.block_size = check_chunk_size(block_size, "block_size")

    def nominal_params(self, info: CompressionInfo) -> dict[str, Any]:
        return {"block_size": self.block_size}

    @classmethod
    def check_params(cls, params: Mapping[str, Any], numel: int) -> None:
        require_exact_params(params, {"block_size"}, cls.__name__)
        require_int_param(params, "block_size", 1, MAX_CHUNK_SIZE, cls.__name__)

    @classmethod
    def _scales_nbytes(cls, numel: int, dtype: torch.dtype, block_size: int) -> int:
        return aligned(num_chunks(numel, block_size) * stats_dtype(dtype).itemsize)

    @classmethod
    def payload_nbytes(cls, numel: int, dtype: torch.dtype, params: Mapping[str, Any]) -> int:
        return cls._scales_nbytes(numel, dtype, params["block_size"]) + numel

    def _encode(self, flat: torch.Tensor, allow_inplace: bool) -> tuple[torch.Tensor, dict[str, Any]]:
        block, stats = self.block_size, stats_dtype(flat.dtype)
        x = to_work_dtype(flat)
        mins, maxs = chunk_amin_amax(x, block)
        absmax = torch.maximum(mins.neg_(), maxs)  # NaN propagates through all three
        if not bool(torch.isfinite(absmax).all()):
            raise non_finite_error(type(self).__name__)
        offset = self._scales_nbytes(x.numel(), flat.dtype, block)
        payload = new_output(offset + x.numel(), torch.uint8, x.device)
        payload[:offset].zero_()  # padding included: messages never carry stale memory
        payload[: absmax.numel() * stats.itemsize].view(stats).copy_(absmax)
        self._write_codes(x, finite_or_zero(self.HALF_LEVELS / absmax), payload[offset:])
        return payload, {"block_size": block}

    def _write_codes(self, x: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor) -> None:
        block = self.block_size
        biases = torch.full_like(scales, self.ZERO_CODE + 0.5)
        tiles = tile_slices(x.numel(), block, x.device)
        scratch = torch.empty(tiles[0].stop - tiles[0].start, dtype=x.dtype, device=x.device)
        for tile in tiles:
            levels, blocks = scratch[: tile.stop - tile.start], chunk_range(tile, block)
            # x * 127 / absmax + 128.5 lies in [1.5, 255.5]; the cast to uint8 truncates: round to nearest
            affine_per_chunk(x[tile], levels, block, scales[blocks], biases[blocks])
            codes[tile].copy_(levels)

    @classmethod
    def _decode(cls, payload: torch.Tensor, numel: int, dtype: torch.dtype, params: Mapping[str, Any]) -> torch.Tensor:
        block, stats = params["block_size"], stats_dtype(dtype)
        absmax = view_bytes_as(payload[: num_chunks(numel, block) * stats.itemsize], stats)
        if not bool((torch.isfinite(absmax) & (absmax >= 0)).all()):
            raise CompressionError(f"{cls.__name__}: block scales must be finite and non-negative")
        codes, steps = payload[cls._scales_nbytes(numel, dtype, block) :], absmax / cls.HALF_LEVELS

        def decode_tile(values: torch.Tensor, start: int) -> None:
            tile = slice(start, start + values.numel())
            values.copy_(codes[tile]).sub_(cls.ZERO_CODE)
            # (code - 128) * step, not code * step - 128 * step: 255 * step overflows for absmax near the limit
            affine_per_chunk(values, values, block, steps[chunk_range(tile, block)], None)

        return decode_in_tiles(numel, dtype, stats, block, payload.device, decode_tile)


__all__ = ["BlockwiseQuantization", "Quantile8BitQuantization", "Uniform8BitQuantization"]
