"""Lossless and floating-point codecs: none, float16, bfloat16, and float16 with per-chunk scaling.

NaN and Inf: :class:`NoCompression`, :class:`Float16Compression` and :class:`BFloat16Compression`
carry them through unchanged, so a receiver can detect a broken tensor. Finite values beyond the
float16 (bfloat16) range are clamped to its largest finite value (they never become Inf).
:class:`ScaledFloat16Compression` cannot represent them and raises :class:`NonFiniteTensorError`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from hivemind_ext.compression.base import (
    ALL_DTYPES,
    Codec,
    CompressionInfo,
    aligned,
    require_exact_params,
    require_int_param,
)
from hivemind_ext.compression.chunks import expand_per_chunk, num_chunks, split_chunks
from hivemind_ext.errors import CompressionError, NonFiniteTensorError

FP16_MAX = torch.finfo(torch.float16).max
FP32_EPS = torch.finfo(torch.float32).eps


def decode_float16(payload: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """A float16 payload's values as ``dtype``: written into ``out`` where given, else a new tensor."""
    halves = view_bytes_as(payload, torch.float16)
    return halves.to(dtype) if out is None else out.copy_(halves)


def view_bytes_as(section: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterprets a uint8 section as ``dtype`` without a copy when its offset allows, else with one."""
    try:
        return section.view(dtype)
    except RuntimeError:  # storage offset not a multiple of the item size
        return section.clone().view(dtype)


def to_float16_clamped(flat: torch.Tensor) -> torch.Tensor:
    """Casts to float16, clamping finite values to the float16 range while keeping NaN and +-Inf."""
    return to_half_clamped(flat, torch.float16)


def to_half_clamped(flat: torch.Tensor, half_dtype: torch.dtype) -> torch.Tensor:
    """Casts to float16 or bfloat16, clamping finite values to its range while keeping NaN and +-Inf."""
    half = flat.to(half_dtype)
    limit = torch.finfo(half_dtype).max
    if torch.finfo(flat.dtype).max > limit and bool(torch.isinf(half).any()):
        # rare path: some finite values overflowed (or were Inf already); clamp only the finite ones,
        # in half_dtype itself (bfloat16 cannot hold 65504, so clamping before the cast could still overflow)
        overflowed = torch.isinf(half) & torch.isfinite(flat)
        half.masked_fill_(overflowed & (flat > 0), limit).masked_fill_(overflowed & (flat < 0), -limit)
    return half


class NoCompression(Codec):
    """Sends the raw bytes of the tensor, of any dtype."""

    codec_id = "none"
    supported_dtypes = ALL_DTYPES

    def _encode(self, flat: torch.Tensor, allow_inplace: bool) -> tuple[torch.Tensor, dict[str, Any]]:
        return flat.contiguous().view(torch.uint8), {}

    @classmethod
    def payload_nbytes(cls, numel: int, dtype: torch.dtype, params: Mapping[str, Any]) -> int:
        return numel * dtype.itemsize

    @classmethod
    def _decode(cls, payload: torch.Tensor, numel: int, dtype: torch.dtype, params: Mapping[str, Any]) -> torch.Tensor:
        if dtype == torch.bool and numel and bool((payload > 1).any()):
            # a bool tensor holding other bytes than 0/1 breaks torch's invariants (True != True)
            raise CompressionError("NoCompression: a bool payload holds bytes other than 0 and 1")
        return view_bytes_as(payload, dtype)


class Float16Compression(Codec):
    """Casts to float16 on the tensor's device (2 bytes per value); decodes to the original dtype."""

    codec_id = "float16"
    supported_dtypes = frozenset({torch.float32, torch.float64, torch.float16})
    decodes_into_output = True

    def _encode(self, flat: torch.Tensor, allow_inplace: bool) -> tuple[torch.Tensor, dict[str, Any]]:
        return to_float16_clamped(flat).view(torch.uint8), {}

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
        return decode_float16(payload, dtype, out)


class BFloat16Compression(Codec):
    """Casts to bfloat16 (2 bytes per value, float32's range, 8 bits of mantissa); keeps NaN and Inf."""

    codec_id = "bfloat16"

    def _encode(self, flat: torch.Tensor, allow_inplace: bool) -> tuple[torch.Tensor, dict[str, Any]]:
        return to_half_clamped(flat, torch.bfloat16).view(torch.uint8), {}

    @classmethod
    def payload_nbytes(cls, numel: int, dtype: torch.dtype, params: Mapping[str, Any]) -> int:
        return 2 * numel

    @classmethod
    def _decode(cls, payload: torch.Tensor, numel: int, dtype: torch.dtype, params: Mapping[str, Any]) -> torch.Tensor:
        values = view_bytes_as(payload, torch.bfloat16)
        # float16 tensors near +-65504 round up beyond float16's range in bfloat16: clamp, do not make Inf
        return to_half_clamped(values, dtype) if dtype == torch.float16 else values.to(dtype)


def _per_chunk(body: torch.Tensor, tail: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Applies a row reduction to split_chunks' (body [k, chunk], tail [r]) parts: [num_chunks] stats."""
    stats = reduce(body)
    return torch.cat([stats, reduce(tail.view(1, -1))]) if tail.numel() else stats


class ScaledFloat16Compression(Codec):
    """Float16 after subtracting each chunk's mean and dividing by its standard deviation.

    Relative precision is then independent of the tensor's magnitude (tiny gradients do not underflow).
    Payload: means float32[C] | stds float32[C] | values float16[N], C = ceil(N / chunk_size).
    Raises NonFiniteTensorError for tensors with NaN or Inf.
    """

    codec_id = "scaled_float16"
    MAX_CHUNK_SIZE = 2**31

    def __init__(self, chunk_size: int = 4096):
        if type(chunk_size) is not int or not 1 <= chunk_size <= self.MAX_CHUNK_SIZE:
            raise CompressionError(f"chunk_size must be an integer in [1, {self.MAX_CHUNK_SIZE}], got {chunk_size!r}")
        self.chunk_size = chunk_size

    def nominal_params(self, info: CompressionInfo) -> dict[str, Any]:
        return {"chunk_size": self.chunk_size}

    def _encode(self, flat: torch.Tensor, allow_inplace: bool) -> tuple[torch.Tensor, dict[str, Any]]:
        numel, chunk = flat.numel(), self.chunk_size
        chunks = num_chunks(numel, chunk)
        x = flat.to(torch.float32, copy=not allow_inplace)
        body, tail = split_chunks(x, chunk)
        means = _per_chunk(body, tail, lambda rows: rows.mean(dim=1))
        if not bool(torch.isfinite(means).all()):  # NaN / Inf in x, or finite values whose float32 sum overflows
            if not bool(torch.isfinite(flat).all()):
                raise NonFiniteTensorError(
                    "ScaledFloat16Compression cannot encode NaN or Inf; use Float16Compression "
                    "or BFloat16Compression to carry them"
                )
            if not bool(torch.isfinite(x).all()):
                raise CompressionError("ScaledFloat16Compression: float64 values beyond the float32 range")
            means = _per_chunk(body, tail, lambda rows: rows.mean(dim=1, dtype=torch.float64)).float()
        mean_body, mean_tail = expand_per_chunk(means, numel, chunk)
        body.sub_(mean_body)
        tail.sub_(mean_tail)
        sizes = torch.full((chunks,), float(chunk), device=x.device)
        if numel % chunk:
            sizes[-1] = numel % chunk
        norms = _per_chunk(body, tail, lambda rows: torch.linalg.vector_norm(rows, dim=1))
        stds = norms / sizes.sqrt()
        if not bool(torch.isfinite(stds).all()):  # |x| beyond ~1e19: squares overflow float32
            if not bool(torch.isfinite(x).all()):  # x - mean overflowed
                raise CompressionError("ScaledFloat16Compression: values spread beyond the float32 range in a chunk")
            norms = _per_chunk(body, tail, lambda rows: torch.linalg.vector_norm(rows, dim=1, dtype=torch.float64))
            stds = (norms / sizes.double().sqrt()).float()
        stds.clamp_min_(FP32_EPS)
        std_body, std_tail = expand_per_chunk(stds, numel, chunk)
        body.div_(std_body)
        tail.div_(std_tail)
        stats_bytes = aligned(4 * chunks)
        payload = torch.empty(2 * stats_bytes + 2 * numel, dtype=torch.uint8, device=x.device)
        payload[: 4 * chunks].view(torch.float32).copy_(means)
        payload[stats_bytes : stats_bytes + 4 * chunks].view(torch.float32).copy_(stds)
        payload[2 * stats_bytes :].view(torch.float16).copy_(x.clamp_(-FP16_MAX, FP16_MAX))
        return payload, {"chunk_size": chunk}

    @classmethod
    def check_params(cls, params: Mapping[str, Any], numel: int) -> None:
        require_exact_params(params, {"chunk_size"}, cls.__name__)
        require_int_param(params, "chunk_size", 1, cls.MAX_CHUNK_SIZE, cls.__name__)

    @classmethod
    def payload_nbytes(cls, numel: int, dtype: torch.dtype, params: Mapping[str, Any]) -> int:
        return 2 * aligned(4 * num_chunks(numel, params["chunk_size"])) + 2 * numel

    @classmethod
    def _decode(cls, payload: torch.Tensor, numel: int, dtype: torch.dtype, params: Mapping[str, Any]) -> torch.Tensor:
        chunk = params["chunk_size"]
        chunks = num_chunks(numel, chunk)
        stats_bytes = aligned(4 * chunks)
        means = view_bytes_as(payload[: 4 * chunks], torch.float32)
        stds = view_bytes_as(payload[stats_bytes : stats_bytes + 4 * chunks], torch.float32)
        if not bool(torch.isfinite(means).all() & torch.isfinite(stds).all()):
            raise CompressionError("ScaledFloat16Compression: non-finite scale in the message")
        x = view_bytes_as(payload[2 * stats_bytes :], torch.float16).to(torch.float32)
        body, tail = split_chunks(x, chunk)
        std_body, std_tail = expand_per_chunk(stds, numel, chunk)
        mean_body, mean_tail = expand_per_chunk(means, numel, chunk)
        body.mul_(std_body).add_(mean_body)
        tail.mul_(std_tail).add_(mean_tail)
        return x.to(dtype)


__all__ = [
    "BFloat16Compression",
    "Float16Compression",
    "NoCompression",
    "ScaledFloat16Compression",
]
