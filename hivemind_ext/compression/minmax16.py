"""Float16 or 16-bit min-max quantization, whichever is more precise for the tensor at hand.

:class:`Float16OrMinMax16` spends the same 2 bytes per value as :class:`Float16Compression` and picks,
per compressed tensor, the encoding with the smaller sum of squared errors:

- ``float16``: the values cast to float16 (relative error up to 2⁻¹¹, whatever their scale);
- ``minmax16``: each value becomes the nearest of 65536 evenly spaced points from the tensor's minimum
  to its maximum (uint16 codes; the minimum and the step are two float32 numbers in the header), so the
  error is at most half a step, (max - min) / 131070, whatever the values' magnitude.

Measured on 512K float32 values (an all-reduce chunk), mean squared errors, float16 vs minmax16:
normal values 4.3e-8 vs 1.7e-9; values of one sign away from zero, such as hivemind's test tensor
sqrt(linspace(300, 800)), 2.0e-5 vs 2.3e-9; but heavy tails (Student's t with one degree of freedom
times 0.01, whose range is 640 times its root mean square) 1.4e-6 vs 5.2e-4, where float16 keeps every
value's relative precision and minmax16 would lose it for most values. The maximum absolute error
would always pick minmax16 (half a step is at most max|x| / 65535, while float16 is off by up to
max|x| / 2048 at the largest value), heavy tails included: the squared error is the criterion that
keeps float16 there, and it is what an average's error is measured in (hivemind's tests, an averaged
model's distance).

The minmax16 error is its expectation, n · step² / 12 (rounding to a grid of that step); float16's is
summed exactly, slice by slice, only until it exceeds that (on typical values, within the first few
percent of the tensor: the float16 payload is then not made for the rest). One pass reads the minimum
and maximum first (one host synchronization), one per slice reads the error so far. Values that
float16 holds exactly (float16 tensors, or no error at all) stay float16; NaN, Inf, and ranges that
overflow float32 stay float16 too (it carries them, clamping finite values to ±65504 like
:class:`Float16Compression`).

Decoding computes ``min + code * step`` as separate, correctly rounded float32 operations (no fused
multiply-add), so every device decodes a message to the same bits: members of an all-reduce that
decode the owner's one message end the round with identical values (minmax16 is not used where
decoding would meet float32 subnormals, which some devices flush to zero). The all-reduce uses this
codec for float32 and float64 chunks wherever the round's codec is :class:`Float16Compression`: for
the average each owner sends back, and for the senders' slices it is computed from (see
:func:`hivemind_ext.averaging.allreduce.round_state.chunk_codec`).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from typing import Any

import torch

from hivemind_ext.compression.base import Codec, CompressionInfo, require_exact_params
from hivemind_ext.compression.floating import FP16_MAX, decode_float16, view_bytes_as
from hivemind_ext.compression.minmax import CPU_TILE_NUMEL, DEVICE_TILE_NUMEL, decode_in_tiles, new_output, tile_slices
from hivemind_ext.errors import CompressionError

LEVELS = 2**16
FLOAT16 = "float16"
MINMAX16 = "minmax16"
FP32_MAX = torch.finfo(torch.float32).max
FP32_TINY = torch.finfo(torch.float32).tiny  # the smallest normal float32
FIRST_SLICE_NUMEL = 1 << 15  # float16's error is summed over slices from this size, doubling up to a tile


class Float16OrMinMax16(Codec):
    """2 bytes per value: float16, or uint16 codes over the tensor's [min, max], whichever has the
    smaller squared error (see the module docstring). Decodes to the original dtype.

    Params: ``{"scheme": "float16"}`` (payload float16[N]) or ``{"scheme": "minmax16", "lo": min,
    "step": step}`` (payload uint16[N], value = lo + code * step, lo and step float32 numbers).
    """

    codec_id = "float16_or_minmax16"
    supported_dtypes = frozenset({torch.float32, torch.float64, torch.float16})
    decodes_into_output = True

    def nominal_params(self, info: CompressionInfo) -> dict[str, Any]:
        return {"scheme": FLOAT16}

    def _encode(self, flat: torch.Tensor, allow_inplace: bool) -> tuple[torch.Tensor, dict[str, Any]]:
        numel = flat.numel()
        payload = new_output(2 * numel, torch.uint8, flat.device)
        halves = payload.view(torch.float16)
        if flat.dtype == torch.float16 or numel == 0:  # float16 holds them exactly
            halves.copy_(flat)
            return payload, {"scheme": FLOAT16}
        lo, hi = torch.stack(torch.aminmax(flat)).float().tolist()  # float32 numbers; NaN where flat holds NaN
        step = _minmax_step(lo, hi)
        if step is not None and _float16_error_exceeds(flat, halves, numel * step * step / 12):
            _quantize(flat, payload.view(torch.uint16), lo, step)
            return payload, {"scheme": MINMAX16, "lo": lo, "step": step}
        if step is None:  # NaN, Inf or a huge range: finite values beyond ±65504 may have become Inf
            halves.copy_(flat)
            overflowed = torch.isinf(halves) & torch.isfinite(flat)
            halves.masked_fill_(overflowed & (flat > 0), FP16_MAX).masked_fill_(overflowed & (flat < 0), -FP16_MAX)
        return payload, {"scheme": FLOAT16}

    @classmethod
    def validate_params(cls, params: Mapping[str, Any], numel: int, dtype: torch.dtype) -> None:
        super().validate_params(params, numel, dtype)
        if params["scheme"] == MINMAX16 and dtype == torch.float16:
            raise CompressionError(f"{cls.__name__}: float16 tensors are sent as float16, not minmax16")

    @classmethod
    def check_params(cls, params: Mapping[str, Any], numel: int) -> None:
        scheme = params.get("scheme")
        if scheme == FLOAT16:
            require_exact_params(params, {"scheme"}, cls.__name__)
        elif scheme == MINMAX16:
            require_exact_params(params, {"scheme", "lo", "step"}, cls.__name__)
            lo, step = _float32_param(params, "lo"), _float32_param(params, "step")
            if step < 0 or _decoded_top(lo, step) is None:
                raise CompressionError(
                    f"{cls.__name__}: lo {lo!r} and step {step!r} must give finite float32 values up to code 65535"
                )
        else:
            raise CompressionError(f"{cls.__name__}: scheme must be {FLOAT16!r} or {MINMAX16!r}, got {scheme!r:.50}")

    @classmethod
    def payload_nbytes(cls, numel: int, dtype: torch.dtype, params: Mapping[str, Any]) -> int:
        return 2 * numel

    @classmethod
    def _decode(
        cls,
        payload: torch.Tensor,
        numel: int,
        dtype: torch.dtype,
        params: Mapping[str, Any],
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if params["scheme"] == FLOAT16:
            return decode_float16(payload, dtype, out)
        codes = view_bytes_as(payload, torch.uint16)
        lo = torch.tensor(params["lo"], dtype=torch.float32, device=payload.device)
        step = torch.tensor(params["step"], dtype=torch.float32, device=payload.device)

        def decode_tile(values: torch.Tensor, start: int) -> None:
            # three correctly rounded operations (never a fused multiply-add): the same bits on every device
            values.copy_(codes[start : start + values.numel()])
            values.mul_(step)
            values.add_(lo)

        return decode_in_tiles(numel, dtype, torch.float32, 1, payload.device, decode_tile, out)


def _float16_error_exceeds(flat: torch.Tensor, halves: torch.Tensor, bound: float) -> bool:
    """Whether float16's sum of squared errors on ``flat`` exceeds ``bound`` (minmax16's), computed
    while writing ``flat`` cast to float16 into ``halves``. Slices of growing size, each while it is
    in cache, with one host synchronization per slice: the sum only grows, so it stops at the first
    slice where the partial sum exceeds the bound. On typical values (float16's error 25x minmax16's)
    that is within the first few percent of the tensor, and the float16 payload, which minmax16 then
    replaces, is not made for the rest. Where float16 wins, the whole payload is written and the
    comparison is the exact one of the module docstring (where float16 overflows, its error is Inf)."""
    numel = flat.numel()
    tile_numel = CPU_TILE_NUMEL if flat.device.type == "cpu" else DEVICE_TILE_NUMEL
    scratch = torch.empty(min(numel, tile_numel), dtype=torch.float32, device=flat.device)
    error, start, size = 0.0, 0, FIRST_SLICE_NUMEL
    while start < numel:
        stop = min(start + size, numel)
        values, half, difference = flat[start:stop], halves[start:stop], scratch[: stop - start]
        half.copy_(values)
        torch.sub(half, values, out=difference)  # Inf where float16 overflowed
        error += float(torch.dot(difference, difference))
        if error > bound:
            return True
        start, size = stop, min(2 * size, scratch.numel())
    return False


def _minmax_step(lo: float, hi: float) -> float | None:
    """The float32 step of 65535 intervals from lo to hi, or None where minmax16 cannot encode the
    tensor (NaN or Inf, or a range beyond float32's) or where decoding would meet subnormal numbers,
    which some devices flush to zero (values that small are float16 zeros anyway)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    step = _as_float32((hi - lo) / (LEVELS - 1))
    if not math.isfinite(step) or _decoded_top(lo, step) is None:
        return None
    if 0 < step < FP32_TINY or 0 < abs(lo) < FP32_TINY:
        return None
    return step


def _quantize(flat: torch.Tensor, codes: torch.Tensor, lo: float, step: float) -> None:
    """codes = round((flat - lo) / step), in [0, 65535] (all zeros for a constant tensor).

    For float32 values, lo and hi are exact and the step is within 2⁻²⁴ of (hi - lo) / 65535, so the
    scaled values lie in [0, 65535.01] and need no clamp; float64 values may lie a float32 rounding
    beyond lo or hi, and are clamped.
    """
    if step == 0:
        codes.zero_()
        return
    tiles = tile_slices(flat.numel(), 1, flat.device)
    scratch = torch.empty(tiles[0].stop, dtype=torch.float32, device=flat.device)
    for tile in tiles:
        scaled = scratch[: tile.stop - tile.start]
        torch.sub(flat[tile], lo, out=scaled)
        scaled.div_(step).round_()
        if flat.dtype != torch.float32:
            scaled.clamp_(0, LEVELS - 1)
        codes[tile].copy_(scaled)


def _as_float32(value: float) -> float:
    """``value`` rounded to float32 (Inf beyond its range)."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _float32_param(params: Mapping[str, Any], name: str) -> float:
    value = params[name]
    if type(value) is not float or not math.isfinite(value) or _as_float32(value) != value:
        raise CompressionError(f"Float16OrMinMax16: {name!r} must be a finite float32 number, got {value!r:.50}")
    return value


def _decoded_top(lo: float, step: float) -> float | None:
    """What code 65535 decodes to (in float32, as the decoder computes it), None if it is not finite."""
    product = _as_float32((LEVELS - 1) * step)  # exact in float64, then rounded once, as in float32
    top = _as_float32(lo + product) if math.isfinite(product) else math.inf
    return top if math.isfinite(top) and abs(top) <= FP32_MAX else None


__all__ = ["Float16OrMinMax16"]
