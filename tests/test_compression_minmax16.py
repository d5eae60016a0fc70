"""Float16OrMinMax16: same bytes as Float16Compression, never a larger squared error, the same values on
every device, and typed errors for hostile headers.

Bounds asserted here: the sum of squared errors is at most Float16Compression's (up to the expectation
n * step^2 / 12 that the codec compares against float16's exact error); where minmax16 is picked, each
value is off by at most half a step, (max - min) / 131070, plus float32 rounding of the arithmetic.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from hivemind_ext.compression import (
    CompressedTensor,
    CompressionInfo,
    Float16Compression,
    Float16OrMinMax16,
    decompress,
)
from hivemind_ext.errors import CompressionError

CODEC = Float16OrMinMax16()
FLOAT16 = Float16Compression()
N = 100_003
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def skip_without(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def sample(kind: str, numel: int = N, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    normal = torch.randn(numel, generator=generator)
    if kind == "normal":
        return normal
    if kind == "uniform_ranged":  # one sign, far from zero: float16's weak spot
        return 300 + 500 * torch.rand(numel, generator=generator)
    if kind == "sqrt_linspace":  # hivemind's test tensor
        return torch.linspace(300, 800, numel) ** 0.5
    if kind == "tiny":  # float16 subnormals
        return normal * 1e-6
    if kind == "huge":  # beyond float16's range
        return normal * 1e6
    if kind == "heavy_tailed":  # Cauchy-like within float16's range: float16 keeps relative precision
        return normal / torch.rand(numel, generator=generator).clamp_min(1e-4) * 1e-3
    if kind == "spike":
        values = normal * 1e-3
        values[numel // 2] = 100.0
        return values
    if kind == "constant":
        return torch.full((numel,), 0.1)
    raise ValueError(kind)


KINDS = ["normal", "uniform_ranged", "sqrt_linspace", "tiny", "huge", "heavy_tailed", "spike", "constant"]


def squared_error(decoded: torch.Tensor, x: torch.Tensor) -> float:
    return float(torch.sum((decoded.double() - x.double()) ** 2))


def round_trip(codec: Any, x: torch.Tensor) -> tuple[CompressedTensor, torch.Tensor]:
    message = codec.compress(x, CompressionInfo.from_tensor(x))
    return message, decompress(CompressedTensor.from_bytes(message.to_bytes()), device=x.device)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_error_is_at_most_float16s(kind: str, dtype: torch.dtype) -> None:
    x = sample(kind).to(dtype)
    message, decoded = round_trip(CODEC, x)
    _, reference = round_trip(FLOAT16, x)
    assert decoded.shape == x.shape and decoded.dtype == dtype
    assert message.payload.numel() == 2 * x.numel()  # float16's bytes
    ours, float16s = squared_error(decoded, x), squared_error(reference, x)
    if message.params["scheme"] == "minmax16":
        step = message.params["step"]
        assert ours <= float16s
        error = (decoded.double() - x.double()).abs().max().item()
        assert error <= step / 2 + 2 * 2**-24 * x.abs().max().item()
    else:
        assert torch.equal(decoded, reference)  # float16 picked: exactly Float16Compression's values


@pytest.mark.parametrize(
    ("kind", "scheme", "gain"),
    [
        ("normal", "minmax16", 10),
        ("uniform_ranged", "minmax16", 1000),
        ("sqrt_linspace", "minmax16", 1000),
        ("tiny", "minmax16", 1000),
        ("huge", "minmax16", 1000),
        ("constant", "minmax16", math.inf),
        ("heavy_tailed", "float16", 1),
        ("spike", "float16", 1),
    ],
)
def test_picks_the_more_precise_encoding(kind: str, scheme: str, gain: float) -> None:
    """``gain``: float16's squared error over ours, at least."""
    x = sample(kind)
    message, decoded = round_trip(CODEC, x)
    assert message.params["scheme"] == scheme
    ours, float16s = squared_error(decoded, x), squared_error(round_trip(FLOAT16, x)[1], x)
    assert float16s >= gain * ours if ours else float16s > 0


def test_float16_tensors_stay_float16_and_exact() -> None:
    x = sample("normal").to(torch.float16)
    message, decoded = round_trip(CODEC, x)
    assert message.params == {"scheme": "float16"} and torch.equal(decoded, x)


@pytest.mark.parametrize("shape", [(), (0,), (1,), (3, 0, 5), (3, 17, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_round_trip_keeps_shape_and_dtype(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    message, decoded = round_trip(CODEC, x)
    assert decoded.shape == x.shape and decoded.dtype == dtype
    assert message.nbytes == FLOAT16.compress(x).nbytes + len(message.header_bytes()) - len(
        FLOAT16.compress(x).header_bytes()
    )
    if x.numel():
        assert (decoded.double() - x.double()).abs().max() <= 2**-11 * x.abs().max().double()


def test_the_input_is_not_modified() -> None:
    x = sample("normal")
    before = x.clone()
    CODEC.compress(x, allow_inplace=True)
    assert torch.equal(x, before)


def test_nan_and_inf_are_carried_like_float16() -> None:
    x = torch.tensor([1.5, float("nan"), float("inf"), -float("inf"), 1e6, -1e6, 0.25])
    message, decoded = round_trip(CODEC, x)
    assert message.params["scheme"] == "float16"
    assert torch.equal(decoded.isnan(), x.isnan())
    assert decoded[2] == math.inf and decoded[3] == -math.inf
    assert decoded[4] == 65504 and decoded[5] == -65504  # finite values are clamped, never Inf
    assert decoded[0] == 1.5 and decoded[6] == 0.25


def test_range_beyond_float32_falls_back_to_float16() -> None:
    x = torch.tensor([-3e38, 3e38, 1.0])
    message, decoded = round_trip(CODEC, x)
    assert message.params["scheme"] == "float16" and decoded.tolist() == [-65504.0, 65504.0, 1.0]


def test_decoding_is_the_correctly_rounded_float32_arithmetic() -> None:
    """lo + code * step as two correctly rounded float32 operations: what every device computes."""
    x = sample("uniform_ranged")
    message, decoded = round_trip(CODEC, x)
    codes = message.payload.view(torch.uint16).to(torch.float64)
    lo, step = message.params["lo"], message.params["step"]
    product = (codes * step).to(torch.float32)  # exact in float64 (16 x 24 bits), then rounded once
    expected = (product.double() + lo).to(torch.float32)  # float64 then float32: innocuous double rounding
    assert torch.equal(decoded, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_every_device_decodes_the_same_bits(device: str) -> None:
    skip_without(device)
    x = sample("sqrt_linspace")
    message = CODEC.compress(x)
    assert torch.equal(decompress(message, device=device).cpu(), decompress(message))
    on_device = CODEC.compress(x.to(device))
    assert on_device.params["scheme"] == "minmax16"
    assert squared_error(decompress(on_device), x) <= squared_error(decompress(FLOAT16.compress(x)), x)


def test_estimated_ratio_is_float16s() -> None:
    info = CompressionInfo(shape=(1000,), dtype=torch.float32)
    assert CODEC.estimate_compression_ratio(info) == FLOAT16.estimate_compression_ratio(info) == 0.5


# ----- hostile headers


def valid_minmax16_message() -> CompressedTensor:
    message = CODEC.compress(sample("normal", 10))
    assert message.params["scheme"] == "minmax16"
    return message


BAD_PARAMS: list[dict[str, Any]] = [
    {},
    {"scheme": "float32"},
    {"scheme": 1},
    {"scheme": None},
    {"scheme": "float16", "lo": 0.0},
    {"scheme": "minmax16"},
    {"scheme": "minmax16", "lo": 0.0},
    {"scheme": "minmax16", "step": 1.0},
    {"scheme": "minmax16", "lo": 0.0, "step": 1.0, "extra": 1},
    {"scheme": "minmax16", "lo": 0, "step": 1.0},  # an int, not a float
    {"scheme": "minmax16", "lo": 0.0, "step": True},
    {"scheme": "minmax16", "lo": "0", "step": 1.0},
    {"scheme": "minmax16", "lo": float("nan"), "step": 1.0},
    {"scheme": "minmax16", "lo": 0.0, "step": float("inf")},
    {"scheme": "minmax16", "lo": -float("inf"), "step": 1.0},
    {"scheme": "minmax16", "lo": 0.1, "step": 1.0},  # not a float32 number
    {"scheme": "minmax16", "lo": 1e39, "step": 1.0},
    {"scheme": "minmax16", "lo": 0.0, "step": -1.0},
    {"scheme": "minmax16", "lo": 0.0, "step": 1e36},  # code 65535 overflows float32
    {"scheme": "minmax16", "lo": 3e38, "step": 1e34},
]


@pytest.mark.parametrize("params", BAD_PARAMS, ids=range(len(BAD_PARAMS)))
def test_hostile_params_raise_compression_error(params: dict[str, Any]) -> None:
    message = valid_minmax16_message()
    header = {**message.header(), "params": params}
    with pytest.raises(CompressionError):
        decompress(CompressedTensor.from_wire(header, bytes(message.payload_view())))


def test_minmax16_is_refused_for_float16_tensors_and_wrong_sizes() -> None:
    message = valid_minmax16_message()
    payload = bytes(message.payload_view())
    with pytest.raises(CompressionError):
        decompress(CompressedTensor.from_wire({**message.header(), "dtype": "float16"}, payload))
    with pytest.raises(CompressionError):
        decompress(CompressedTensor.from_wire({**message.header(), "dtype": "bfloat16"}, payload))
    for wrong in (b"", payload[:-2], payload + bytes(2)):
        with pytest.raises(CompressionError):
            decompress(CompressedTensor.from_wire(message.header(), wrong))


def test_extreme_but_valid_params_decode_to_finite_values() -> None:
    header = {"codec": CODEC.codec_id, "dtype": "float32", "shape": [3], "params": {}}
    top = float(torch.finfo(torch.float32).max)
    step = float(torch.tensor(top / 65536, dtype=torch.float32))
    header["params"] = {"scheme": "minmax16", "lo": 0.0, "step": step}
    codes = torch.tensor([0, 1, 65535], dtype=torch.int32).to(torch.uint16)
    decoded = decompress(CompressedTensor.from_wire(header, codes.view(torch.uint8).numpy().tobytes()))
    assert torch.isfinite(decoded).all() and decoded[0] == 0


def late_decision_sample() -> torch.Tensor:
    """Three quarters integers in [-1000, 1000] (float16 holds them exactly), then integers + 0.3
    (float16 is off by up to 0.25 there): float16's error is zero over the first slices it sums."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randint(-1000, 1001, (200_000,), generator=generator).float()
    x[150_000:] += 0.3
    return x


@pytest.mark.parametrize("kind", [*KINDS, "late"])
def test_the_choice_is_the_exact_comparison_of_squared_errors(kind: str) -> None:
    """float16's error is summed only until it exceeds minmax16's (see the module docstring): the
    scheme must still be the one the whole tensor's exact errors pick, however late that shows."""
    x = late_decision_sample() if kind == "late" else sample(kind)
    message = CODEC.compress(x)
    float16_error = float(torch.sum((x.half().double() - x.double()) ** 2))
    lo, hi = x.min().item(), x.max().item()
    step = torch.tensor((hi - lo) / 65535, dtype=torch.float32).item()
    minmax16_wins = x.numel() * step * step / 12 < float16_error  # Inf where float16 overflows ("huge")
    assert message.params["scheme"] == ("minmax16" if minmax16_wins else "float16")
    if kind == "late":
        assert minmax16_wins and float(torch.sum((x[:150_000].half().double() - x[:150_000].double()) ** 2)) == 0
