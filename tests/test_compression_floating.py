"""Round trips, error bounds and edge cases of the float codecs: none, float16, bfloat16, scaled float16.

Error bounds asserted here (and relied on by users of these codecs):
- NoCompression: exact, for every dtype.
- Float16Compression: |decoded - x| <= 2^-11 |x| for |x| in float16's normal range [2^-14, 65504]
  (round to nearest with 11 significant bits), <= 2^-25 below it (subnormal spacing 2^-24);
  finite values beyond 65504 become +-65504.
- BFloat16Compression: |decoded - x| <= 2^-8 |x| in float32's normal range (8 significant bits).
- ScaledFloat16Compression, for x in a chunk with mean m and standard deviation s:
  |decoded - x| <= 2^-11 |x - m| + 2^-24 max(s, 2^-23) + 2^-21 (|x| + |m|) + eps(dtype) |x|
  (float16 rounding of (x - m) / max(s, eps32), its subnormal spacing, float32 arithmetic, and the
  final cast to the tensor's dtype). Relative precision is thus set by the spread within a chunk, not
  by the magnitude of the values.
"""

from __future__ import annotations

import math

import pytest
import torch

from hivemind_ext.compression import (
    BFloat16Compression,
    CompressedTensor,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    ScaledFloat16Compression,
    decompress,
)
from hivemind_ext.compression.base import DTYPES_BY_NAME
from hivemind_ext.errors import CompressionError, NonFiniteTensorError

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SHAPES = [(), (0,), (1,), (7,), (3, 0, 5), (3, 17, 5), (2, 1, 1, 9)]
LARGE_SHAPE = (1_000_003,)
SUPPORTED = {
    "none": list(DTYPES_BY_NAME.values()),
    "float16": [torch.float32, torch.float16, torch.float64],
    "bfloat16": FLOAT_DTYPES,
    "scaled_float16": FLOAT_DTYPES,
}
FLOAT_CODECS = [NoCompression(), Float16Compression(), BFloat16Compression(), ScaledFloat16Compression()]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def skip_without(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def make_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        tensor = torch.rand(shape, generator=generator) > 0.5
    elif dtype.is_floating_point:
        tensor = (torch.randn(shape, generator=generator, dtype=torch.float64) * 3).to(dtype)
    else:
        info = torch.iinfo(dtype)
        tensor = torch.randint(info.min, info.max, shape, generator=generator, dtype=torch.int64).to(dtype)
    return tensor.to(device)


def log_uniform(n: int, low: float, high: float, seed: int = 0) -> torch.Tensor:
    """Values with magnitudes spread evenly in log scale over [low, high], random signs, float64."""
    generator = torch.Generator().manual_seed(seed)
    magnitudes = torch.exp(
        torch.empty(n, dtype=torch.float64).uniform_(math.log(low), math.log(high), generator=generator)
    )
    signs = torch.randint(0, 2, (n,), generator=generator).to(torch.float64) * 2 - 1
    return magnitudes * signs


def round_trip(codec, tensor: torch.Tensor, device: str | None = None) -> torch.Tensor:
    message = codec.compress(tensor)
    assert message.payload.device.type == "cpu"
    decoded = decompress(message, device=device)
    assert decoded.shape == tensor.shape and decoded.dtype == tensor.dtype
    return decoded


def scaled_tolerance(x: torch.Tensor, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The module docstring's bound for ScaledFloat16Compression, element-wise, for flat float64 ``x``."""
    if x.numel() == 0:
        return x.clone()
    padded = torch.nn.functional.pad(x, (0, -x.numel() % chunk_size))
    counts = torch.full((padded.numel() // chunk_size,), float(chunk_size), dtype=torch.float64)
    counts[-1] -= padded.numel() - x.numel()
    chunks = padded.view(-1, chunk_size)
    means = chunks.sum(dim=1) / counts
    mask = (torch.arange(padded.numel()) < x.numel()).view(-1, chunk_size)
    stds = ((chunks - means[:, None]).square() * mask).sum(dim=1).div(counts).sqrt()
    m = means.repeat_interleave(chunk_size)[: x.numel()]
    s = stds.repeat_interleave(chunk_size)[: x.numel()].clamp_min(2**-23)
    eps = torch.finfo(dtype).eps if dtype != torch.float64 else 0.0
    return 2**-11 * (x - m).abs() + 2**-24 * s + 2**-21 * (x.abs() + m.abs()) + eps * x.abs()


# ----- exact round trips


@pytest.mark.parametrize("dtype", list(DTYPES_BY_NAME.values()), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_no_compression_is_exact_for_every_dtype(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = make_tensor(shape, dtype)
    assert torch.equal(round_trip(NoCompression(), tensor), tensor)


def test_no_compression_large_tensor_is_exact() -> None:
    tensor = make_tensor(LARGE_SHAPE, torch.float32)
    assert torch.equal(round_trip(NoCompression(), tensor), tensor)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_half_codecs_are_exact_on_their_own_dtype(shape: tuple[int, ...]) -> None:
    half = make_tensor(shape, torch.float16)
    assert torch.equal(round_trip(Float16Compression(), half), half)
    bhalf = make_tensor(shape, torch.bfloat16)
    assert torch.equal(round_trip(BFloat16Compression(), bhalf), bhalf)


@pytest.mark.parametrize("codec", FLOAT_CODECS, ids=repr)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_shapes_and_dtypes_survive_every_codec(codec, shape: tuple[int, ...]) -> None:
    for dtype in SUPPORTED[codec.codec_id]:
        tensor = make_tensor(shape, dtype)
        decoded = round_trip(codec, tensor)
        if tensor.is_floating_point() and tensor.numel():
            # loose sanity check; the precise bounds are asserted below
            assert torch.allclose(decoded.double(), tensor.double(), rtol=2**-7, atol=1e-3)


# ----- documented error bounds


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_float16_relative_error_in_the_normal_range(dtype: torch.dtype) -> None:
    x = log_uniform(100_000, 2**-14, 65504.0).to(dtype)
    decoded = round_trip(Float16Compression(), x).double()
    bound = (2**-11 + 2**-23) * x.double().abs()  # 2^-23: float64 -> float32 -> float16 double rounding
    assert bool(((decoded - x.double()).abs() <= bound).all())


def test_float16_absolute_error_below_the_normal_range() -> None:
    x = log_uniform(10_000, 1e-12, 2**-14)
    decoded = round_trip(Float16Compression(), x)
    assert bool(((decoded - x).abs() <= 2**-25 * (1 + 2**-10)).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16], ids=str)
def test_bfloat16_relative_error_in_the_normal_range(dtype: torch.dtype) -> None:
    low, high = (2**-14, 65504.0) if dtype == torch.float16 else (1e-30, 1e30)
    x = log_uniform(100_000, low, high).to(dtype)
    decoded = round_trip(BFloat16Compression(), x).double()
    bound = (2**-8 + 2**-23) * x.double().abs()
    assert bool(((decoded - x.double()).abs() <= bound).all())


SCALES_AND_OFFSETS = [(1.0, 0.0), (1e-6, 0.0), (1e-3, 5e-2), (1e4, -3e5), (1e-9, 0.0)]


@pytest.mark.parametrize("chunk_size", [1, 7, 4096])
@pytest.mark.parametrize(
    ("dtype", "scale", "offset"),
    [
        (dtype, scale, offset)
        for dtype in FLOAT_DTYPES
        for scale, offset in SCALES_AND_OFFSETS
        if dtype != torch.float16 or (scale * 10 <= 65504 and abs(offset) <= 65504)  # float16 can hold the input
    ],
)
def test_scaled_float16_error_bound(chunk_size: int, dtype: torch.dtype, scale: float, offset: float) -> None:
    x = (torch.randn(10_007, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * scale + offset).to(
        dtype
    )
    decoded = round_trip(ScaledFloat16Compression(chunk_size=chunk_size), x).double()
    reference = x.double()
    tolerance = scaled_tolerance(reference, chunk_size, dtype)
    assert bool(((decoded - reference).abs() <= tolerance).all())


def test_scaled_float16_large_tensor_error_bound() -> None:
    x = make_tensor(LARGE_SHAPE, torch.float32, seed=3) * 1e-5 + 1e-4
    decoded = round_trip(ScaledFloat16Compression(), x).double()
    tolerance = scaled_tolerance(x.double(), 4096, torch.float32)
    assert bool(((decoded - x.double()).abs() <= tolerance).all())


def test_large_tensor_half_codecs_error_bound() -> None:
    x = make_tensor(LARGE_SHAPE, torch.float32, seed=4)
    error = (round_trip(Float16Compression(), x) - x).abs()
    normal = x.abs() >= 2**-14
    assert bool((error[normal] <= 2**-11 * x.abs()[normal]).all())
    assert bool((error[~normal] <= 2**-25).all())
    error = (round_trip(BFloat16Compression(), x) - x).abs()
    assert bool((error <= 2**-8 * x.abs()).all())


def test_scaled_float16_keeps_precision_where_float16_underflows() -> None:
    x = torch.randn(4096, generator=torch.Generator().manual_seed(2)) * 1e-9
    plain = round_trip(Float16Compression(), x)
    scaled = round_trip(ScaledFloat16Compression(), x)
    assert bool((plain == 0).all())  # below float16's smallest subnormal
    assert float(((scaled - x).abs() / x.abs().max()).max()) < 1e-3


def test_scaled_float16_handles_huge_finite_values() -> None:
    # the squares of such values overflow float32: statistics fall back to float64, not to NonFiniteTensorError
    for scale in [1e19, 1e30, 1e37]:
        x = torch.randn(10_000, generator=torch.Generator().manual_seed(5)) * scale
        decoded = round_trip(ScaledFloat16Compression(), x)
        assert bool(torch.isfinite(decoded).all())
        assert float(((decoded - x).abs() / x.abs().max()).max()) < 1e-3
    constant = torch.full((100,), 3e38)
    assert torch.equal(round_trip(ScaledFloat16Compression(), constant), constant)


def test_scaled_float16_rejects_values_beyond_float32() -> None:
    with pytest.raises(CompressionError):
        ScaledFloat16Compression().compress(torch.tensor([1e39, 0.0], dtype=torch.float64))
    with pytest.raises(CompressionError):  # the spread within a chunk exceeds float32
        ScaledFloat16Compression().compress(torch.tensor([3e38, 3e38, -3e38]))
    extreme = torch.tensor([3e38, -3e38])  # the mean is 0: the spread fits float32
    assert torch.allclose(round_trip(ScaledFloat16Compression(), extreme), extreme, rtol=2**-11)


# ----- NaN, Inf and overflow


def special_values(dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), -2.5, 0.0], dtype=dtype)


@pytest.mark.parametrize("codec", FLOAT_CODECS[:3], ids=repr)
def test_nan_and_inf_are_carried(codec) -> None:
    for dtype in SUPPORTED[codec.codec_id]:
        if not dtype.is_floating_point:
            continue
        x = special_values(dtype)
        decoded = round_trip(codec, x)
        assert bool(decoded[1].isnan())
        assert decoded[2] == float("inf") and decoded[3] == -float("inf")
        assert torch.equal(decoded[[0, 4, 5]], x[[0, 4, 5]])


def test_bfloat16_of_float16_near_its_maximum_stays_finite() -> None:
    x = torch.tensor([65504.0, -65504.0, 65300.0, 2**-14, 2**-24], dtype=torch.float16)
    decoded = round_trip(BFloat16Compression(), x)
    assert decoded.tolist() == [65504.0, -65504.0, 65280.0, 2**-14, 2**-24]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_float16_clamps_finite_values_beyond_its_range(dtype: torch.dtype) -> None:
    big = 1e300 if dtype == torch.float64 else 1e38
    x = torch.tensor([65504.0, 65520.0, 1e5, -1e5, big, -big, float("inf"), 1.0], dtype=dtype)
    decoded = round_trip(Float16Compression(), x)
    assert decoded[:6].tolist() == [65504.0, 65504.0, 65504.0, -65504.0, 65504.0, -65504.0]
    assert decoded[6] == float("inf") and decoded[7] == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_bfloat16_clamps_finite_values_beyond_its_range(dtype: torch.dtype) -> None:
    bf16_max = torch.finfo(torch.bfloat16).max
    x = torch.tensor([torch.finfo(torch.float32).max, -3.4e38, -float("inf")], dtype=dtype)
    decoded = round_trip(BFloat16Compression(), x)
    assert decoded.tolist() == [bf16_max, -bf16_max, -float("inf")]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_scaled_float16_raises_on_non_finite(dtype: torch.dtype, bad: float) -> None:
    x = torch.randn(100).to(dtype)
    x[37] = bad
    for chunk_size in [1, 16, 4096]:
        with pytest.raises(NonFiniteTensorError):
            ScaledFloat16Compression(chunk_size=chunk_size).compress(x)


def test_scaled_float16_allow_inplace_with_non_finite_still_raises() -> None:
    x = torch.randn(100)
    x[3] = float("nan")
    with pytest.raises(NonFiniteTensorError):
        ScaledFloat16Compression().compress(x, allow_inplace=True)


# ----- buffers, frames and ownership


def mutate(tensor: torch.Tensor) -> None:
    if tensor.dtype == torch.bool:
        tensor.logical_not_()
    else:
        tensor.add_(1)


@pytest.mark.parametrize("codec", FLOAT_CODECS, ids=repr)
def test_decoding_a_read_only_frame_never_aliases_it(codec) -> None:
    for dtype in SUPPORTED[codec.codec_id]:
        tensor = make_tensor((5, 3), dtype)
        frame = codec.compress(tensor).to_bytes()
        assert isinstance(frame, bytes)
        snapshot = bytearray(frame)
        decoded = decompress(CompressedTensor.from_bytes(frame))
        mutate(decoded)
        assert bytearray(frame) == snapshot, f"decoding {dtype} returned a view into an immutable bytes frame"


@pytest.mark.parametrize("codec", FLOAT_CODECS, ids=repr)
def test_message_does_not_alias_its_input(codec) -> None:
    for dtype in SUPPORTED[codec.codec_id]:
        tensor = make_tensor((4, 6), dtype)
        original = tensor.clone()
        message = codec.compress(tensor)
        assert torch.equal(tensor, original), "compress without allow_inplace modified its input"
        before = decompress(message)
        mutate(tensor)
        assert torch.equal(decompress(message), before)


@pytest.mark.parametrize("codec", [*FLOAT_CODECS, ScaledFloat16Compression(chunk_size=3)], ids=repr)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_to_bytes_from_bytes_round_trip(codec, shape: tuple[int, ...]) -> None:
    tensor = make_tensor(shape, torch.float32)
    message = codec.compress(tensor)
    frame = message.to_bytes()
    for buffer in (frame, bytearray(frame), memoryview(frame)):
        restored = CompressedTensor.from_bytes(buffer)
        assert restored.header() == message.header()
        assert torch.equal(restored.payload, message.payload)
        assert torch.equal(decompress(restored), decompress(message))
    restored = CompressedTensor.from_wire(message.header_bytes(), message.payload_view())
    assert torch.equal(decompress(restored), decompress(message))


def test_frame_payload_is_aligned_and_sized() -> None:
    message = ScaledFloat16Compression(chunk_size=3).compress(torch.randn(10))
    frame = message.to_bytes()
    header = message.header_bytes()
    payload_start = 4 + len(header) + (-(4 + len(header)) % 8)
    assert payload_start % 8 == 0
    assert len(frame) == payload_start + message.payload.numel()
    assert message.nbytes == len(header) + message.payload.numel()


# ----- dtypes and inputs the codecs refuse


@pytest.mark.parametrize(
    ("codec", "dtype"),
    [
        (Float16Compression(), torch.bfloat16),
        (Float16Compression(), torch.int64),
        (Float16Compression(), torch.bool),
        (BFloat16Compression(), torch.int32),
        (ScaledFloat16Compression(), torch.int64),
        (ScaledFloat16Compression(), torch.uint8),
        (NoCompression(), torch.complex64),
    ],
    ids=str,
)
def test_unsupported_dtype_raises(codec, dtype: torch.dtype) -> None:
    with pytest.raises(CompressionError, match="support"):
        codec.compress(torch.zeros(3, dtype=dtype))


@pytest.mark.parametrize("codec", FLOAT_CODECS, ids=repr)
def test_non_tensor_input_raises(codec) -> None:
    with pytest.raises(CompressionError):
        codec.compress([1.0, 2.0])


def test_decoding_a_dtype_the_codec_cannot_carry_raises() -> None:
    message = Float16Compression().compress(torch.ones(4))
    header = dict(message.header(), dtype="int64")
    with pytest.raises(CompressionError):
        decompress(CompressedTensor.from_wire(header, message.payload_view()))


def test_scaled_float16_rejects_bad_chunk_sizes() -> None:
    for chunk_size in [0, -1, 2**31 + 1, 1.5, "4096", True]:
        with pytest.raises(CompressionError):
            ScaledFloat16Compression(chunk_size=chunk_size)


def test_no_compression_rejects_invalid_bool_bytes() -> None:
    message = NoCompression().compress(torch.tensor([True, False, True]))
    payload = bytearray(message.payload_view())
    payload[1] = 2
    with pytest.raises(CompressionError):
        decompress(CompressedTensor.from_wire(message.header(), payload))


def test_estimate_compression_ratio() -> None:
    info = CompressionInfo(shape=(1000,), dtype=torch.float32)
    assert NoCompression().estimate_compression_ratio(info) == 1.0
    assert Float16Compression().estimate_compression_ratio(info) == 0.5
    assert BFloat16Compression().estimate_compression_ratio(info) == 0.5
    assert 0.5 < ScaledFloat16Compression().estimate_compression_ratio(info) < 0.52
    assert Float16Compression().estimate_compression_ratio(CompressionInfo(shape=(10,), dtype=torch.float64)) == 0.25


def test_allow_inplace_gives_the_same_result() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(6))
    for codec in FLOAT_CODECS:
        expected = decompress(codec.compress(x.clone()))
        assert torch.equal(decompress(codec.compress(x.clone(), allow_inplace=True)), expected)


def test_non_contiguous_input() -> None:
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))[:, ::2]
    for codec in FLOAT_CODECS:  # a strided view encodes exactly like its contiguous copy
        assert torch.equal(round_trip(codec, x), round_trip(codec, x.contiguous()))


# ----- CUDA (skipped without a device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", [*FLOAT_CODECS, ScaledFloat16Compression(chunk_size=7)], ids=repr)
def test_device_round_trip_matches_cpu(codec, device: str) -> None:
    skip_without(device)
    for dtype in SUPPORTED[codec.codec_id]:
        for shape in [(), (0,), (7,), (3, 17, 5), (100_003,)]:
            cpu_tensor = make_tensor(shape, dtype, seed=7)
            tensor = cpu_tensor.to(device)
            encoded = codec.encode(tensor)
            assert encoded.payload.device == tensor.device
            message = codec.compress(tensor)
            assert message.payload.device.type == "cpu"
            decoded = decompress(message, device=device)
            assert decoded.device == tensor.device
            assert decoded.shape == tensor.shape and decoded.dtype == tensor.dtype
            reference = decompress(codec.compress(cpu_tensor))
            if codec.codec_id == "scaled_float16":  # reductions may round differently on the device
                tolerance = scaled_tolerance(cpu_tensor.double().reshape(-1), codec.chunk_size, dtype).view(shape)
                assert bool(((decoded.cpu().double() - cpu_tensor.double()).abs() <= tolerance).all())
            else:
                assert torch.equal(decoded.cpu(), reference)


@pytest.mark.parametrize("device", DEVICES)
def test_device_nan_and_inf(device: str) -> None:
    skip_without(device)
    for codec in FLOAT_CODECS[:3]:
        x = special_values(torch.float32).to(device)
        decoded = decompress(codec.compress(x), device=device)
        assert bool(decoded[1].isnan()) and decoded[2].item() == float("inf") and decoded[3].item() == -float("inf")
    with pytest.raises(NonFiniteTensorError):
        ScaledFloat16Compression().compress(special_values(torch.float32).to(device))
    clamped = decompress(Float16Compression().compress(torch.tensor([1e6, -1e6], device=device)))
    assert clamped.tolist() == [65504.0, -65504.0]
