"""SparseTopK: top-k per chunk with low-bit values, its bit packing, error feedback with it, and
malformed messages.

The kept set, the density and the error bound are checked against a reference computed here chunk by
chunk from the codec's docstring, independently of the codec's vectorized code.
"""

from __future__ import annotations

import dataclasses
import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hivemind_ext.compression import (
    CompressedTensor,
    CompressionInfo,
    ErrorFeedback,
    SparseTopK,
    decompress,
)
from hivemind_ext.compression.bitpack import MAX_WIDTH, pack_bits, packed_nbytes, unpack_bits
from hivemind_ext.compression.sparse import MAX_SPARSITY, SparseLayout
from hivemind_ext.errors import CompressionError, ConfigurationError, NonFiniteTensorError

pytestmark = pytest.mark.timeout(60)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def normal(numel: int, dtype: torch.dtype = torch.float32, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    values = torch.randn(numel, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (values * 3 + 0.5).to(dtype=dtype, device=device)


def round_trip(codec: SparseTopK, x: torch.Tensor) -> tuple[CompressedTensor, torch.Tensor]:
    message = codec.compress(x)
    return message, decompress(CompressedTensor.from_bytes(message.to_bytes()))


def check_against_reference(codec: SparseTopK, x: torch.Tensor, y: torch.Tensor) -> None:
    """Chunk by chunk: exactly k (tail: ceil(k * t / chunk)) values kept, the largest in magnitude (ties
    allowed either way), each within half a level of its value with its sign; all others decode to 0."""
    assert y.shape == x.shape and y.dtype == x.dtype
    xs, ys = x.reshape(-1).double(), y.reshape(-1).double()
    stats_eps = torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps
    for start in range(0, xs.numel(), codec.chunk_size):
        chunk_x, chunk_y = xs[start : start + codec.chunk_size], ys[start : start + codec.chunk_size]
        kept = chunk_y != 0
        expected_k = math.ceil(codec.k * chunk_x.numel() / codec.chunk_size)
        assert int(kept.sum()) == expected_k, f"chunk at {start}: {int(kept.sum())} kept, expected {expected_k}"
        magnitudes = chunk_x.abs()
        lo, hi = float(magnitudes[kept].min()), float(magnitudes[kept].max())
        if not kept.all():
            assert float(magnitudes[~kept].max()) <= lo, "a dropped value is larger than a kept one"
        half_level = (hi - lo) / 2**codec.bits
        slack = 4 * stats_eps * hi + torch.finfo(x.dtype).eps * chunk_y.abs()[kept]
        error = (chunk_x[kept] - chunk_y[kept]).abs()
        assert bool((error <= half_level + slack).all()), f"error {float(error.max())} > half a level {half_level}"
        assert bool((torch.sign(chunk_x[kept]) == torch.sign(chunk_y[kept])).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("density", "bits", "chunk_size", "numel"),
    [(0.02, 2, 4096, 10_000), (0.02, 4, 4096, 4096), (0.25, 3, 8, 61), (1.0, 8, 5, 12), (0.01, 2, 1000, 999)],
)
def test_round_trip_keeps_the_top_k_of_each_chunk_within_half_a_level(
    dtype: torch.dtype, density: float, bits: int, chunk_size: int, numel: int
) -> None:
    codec = SparseTopK(density=density, bits=bits, chunk_size=chunk_size)
    x = normal(numel, dtype, seed=numel)
    original = x.clone()
    message, y = round_trip(codec, x)
    assert torch.equal(x, original), "the input was modified"
    check_against_reference(codec, x, y)
    assert message.params == {"chunk_size": chunk_size, "k": codec.k, "bits": bits}
    assert message.payload.numel() == SparseLayout(numel, chunk_size, codec.k, bits).payload_nbytes(dtype)


@pytest.mark.parametrize("shape", [(), (0,), (1,), (3, 0), (2, 3, 7)])
def test_odd_shapes_round_trip(shape: tuple[int, ...]) -> None:
    x = normal(math.prod(shape), seed=1).view(shape)
    _, y = round_trip(SparseTopK(density=0.5, chunk_size=4), x)
    assert y.shape == x.shape
    check_against_reference(SparseTopK(density=0.5, chunk_size=4), x, y)


def test_defaults_compress_float32_more_than_100x_and_estimate_it_exactly() -> None:
    x = normal(1 << 20)
    message = SparseTopK().compress(x)
    assert x.numel() * 4 / message.nbytes > 100
    info = CompressionInfo.from_tensor(x)
    assert SparseTopK().estimate_compression_ratio(info) == message.payload.numel() / (x.numel() * 4)
    assert x.numel() * 4 / SparseTopK(density=0.015).compress(x).nbytes > 130


def test_equal_magnitudes_and_zeros_decode_exactly() -> None:
    x = torch.tensor([0.0, -2.0, 0.0, 2.0, 2.0, 0.0, 0.0, 0.0])  # chunk of 8 keeping 3: lo == hi == 2
    assert torch.equal(decompress(SparseTopK(density=3 / 8, chunk_size=8).compress(x)), x)
    assert torch.equal(decompress(SparseTopK(density=0.5, chunk_size=4).compress(torch.zeros(10))), torch.zeros(10))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_values_raise(bad: float) -> None:
    x = normal(5000)
    x[4321] = bad
    with pytest.raises(NonFiniteTensorError):
        SparseTopK().compress(x)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(density=0.0),
        dict(density=1.5),
        dict(density=math.nan),
        dict(density=True),
        dict(density=1 / 1000),  # keeps 4 of 4096: below 1 in 256
        dict(bits=1),
        dict(bits=9),
        dict(chunk_size=0),
        dict(chunk_size=1 << 17),
        dict(chunk_size=64.0),
    ],
)
def test_bad_configuration_raises(kwargs: dict) -> None:
    with pytest.raises(ConfigurationError):
        SparseTopK(**kwargs)


def test_error_feedback_sends_everything_eventually() -> None:
    """With ErrorFeedback, the sum of the decoded messages tracks the sum of the inputs: their difference
    is the last residual, which stays bounded; without it, the dropped mass is lost for good."""
    generator = torch.Generator().manual_seed(3)
    drift = torch.randn(2000, generator=generator, dtype=torch.float64).float()  # the same direction every round
    with_feedback, without = ErrorFeedback(SparseTopK(density=0.05, bits=2, chunk_size=500)), SparseTopK(0.05, 2, 500)
    sent, sent_without, total = torch.zeros(2000), torch.zeros(2000), torch.zeros(2000)
    errors = []
    for _ in range(150):
        x = drift + 0.5 * torch.randn(2000, generator=generator)
        total += x
        sent += decompress(with_feedback.compress(x))
        sent_without += decompress(without.compress(x))
        residual = with_feedback.residual()
        torch.testing.assert_close(total - sent, residual, atol=1e-3, rtol=1e-4)  # nothing lost, nothing added
        errors.append(float((total - sent).norm()))
    assert max(errors[50:]) < 1.5 * max(errors[:50]), "the residual keeps growing"
    assert errors[-1] / float(total.norm()) < 0.1
    assert float((total - sent_without).norm()) / float(total.norm()) > 0.5


def test_error_feedback_keeps_residuals_with_their_values_when_parts_move() -> None:
    """Parts located by offset (as in an all-reduce whose part sizes change every round): each part adds
    the residual of its own values, whatever part index it has, so the sum of what was sent is the sum of
    the inputs minus the one residual of the tensor; an owner's averages keep a residual of their own."""
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(10, 100, generator=generator)
    info = CompressionInfo.from_tensor(x, key="w")
    feedback = ErrorFeedback(SparseTopK(density=0.1, bits=2, chunk_size=16))
    sent = torch.zeros(1000)
    for rounds in range(1, 41):
        cuts = sorted(torch.randint(1, 1000, (3,), generator=generator).tolist())
        for index, (start, end) in enumerate(zip([0, *cuts], [*cuts, 1000], strict=True)):
            part = x.view(-1)[start:end]
            sent[start:end] += decompress(feedback.compress(part, info.get_part(index, end - start, start)))
        torch.testing.assert_close(rounds * x.view(-1) - sent, feedback.tensor_residual("w"), atol=1e-4, rtol=1e-5)
    assert float((sent / 40 - x.view(-1)).norm() / x.norm()) < 0.1
    residual = feedback.tensor_residual("w").clone()
    feedback.compress(x.view(-1)[:500], dataclasses.replace(info.get_part(0, 500, 0), aggregate=True))
    assert torch.equal(feedback.tensor_residual("w"), residual)
    assert feedback.tensor_residual("w", aggregate=True)[:500].abs().sum() > 0
    with pytest.raises(CompressionError):
        feedback.compress(x.view(-1)[:10], info.get_part(9, 10, 995))  # beyond the tensor


def test_restoring_a_snapshot_after_a_failed_round_counts_nothing_twice() -> None:
    """DiLoCo's retry after a failed round: the pseudo-gradient of both rounds is sent at once. With the
    residuals restored to before the failed round, what is sent over all successful rounds tracks the
    inputs exactly as if the failed round had never happened; without, it overshoots."""
    generator = torch.Generator().manual_seed(9)
    steps = [torch.randn(400, generator=generator) for _ in range(3)]
    info = CompressionInfo(key="w", shape=(400,)).get_part(0, 400, 0)
    overshoot = {}
    for restoring in (True, False):
        feedback = ErrorFeedback(SparseTopK(density=0.05, bits=4, chunk_size=100))
        sent = decompress(feedback.compress(steps[0], info))  # round 1 succeeds
        before = feedback.snapshot()
        feedback.compress(steps[1], info)  # round 2 fails: nothing it sent is applied
        if restoring:
            feedback.restore(before)
        sent += decompress(feedback.compress(steps[1] + steps[2], info))  # round 3 retries with both steps
        error = sum(steps) - sent - feedback.tensor_residual("w")
        overshoot[restoring] = float(error.abs().max())
    assert overshoot[True] < 1e-4
    assert overshoot[False] > 1.0  # the failed round's step, less what its message kept, counted twice


# ----- bit packing


@settings(max_examples=60, deadline=None, derandomize=True)
@given(width=st.integers(1, MAX_WIDTH), count=st.integers(0, 70), seed=st.integers(0, 2**32 - 1))
def test_bits_round_trip_and_leave_no_stray_bits(width: int, count: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << width, (count,), generator=generator, dtype=torch.int64)
    packed = pack_bits(codes, width)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(count, width)
    assert torch.equal(unpack_bits(packed, count, width), codes)
    reference = "".join(format(int(code), f"0{width}b")[::-1] for code in codes)  # LSB first
    reference += "0" * (-len(reference) % 8)
    expected = [int(reference[i : i + 8][::-1], 2) for i in range(0, len(reference), 8)]
    assert packed.tolist() == expected


# ----- malformed messages


def valid_message(numel: int = 20, dtype: torch.dtype = torch.float32) -> CompressedTensor:
    """chunk_size 8, k 2: chunks of 8, 8 and a tail of 4 keeping 1; width 3 + 3 bits."""
    return SparseTopK(density=0.25, bits=3, chunk_size=8).compress(normal(numel, dtype, seed=5))


def with_payload(message: CompressedTensor, payload: bytes | bytearray) -> CompressedTensor:
    return CompressedTensor.from_wire(message.header(), bytearray(payload))


def with_codes(message: CompressedTensor, indices: list[int]) -> CompressedTensor:
    """The message with its kept indices replaced (levels and signs zero)."""
    layout = SparseLayout(message.numel, **{name: message.params[name] for name in ("chunk_size", "k", "bits")})
    stats = 2 * layout.stats_nbytes(message.dtype)
    codes = torch.tensor(indices, dtype=torch.int64) << layout.bits
    return with_payload(message, bytes(message.payload_view()[:stats]) + bytes(pack_bits(codes, layout.width).numpy()))


def with_stat(message: CompressedTensor, section: int, chunk: int, value: float) -> CompressedTensor:
    layout = SparseLayout(message.numel, **{name: message.params[name] for name in ("chunk_size", "k", "bits")})
    payload = bytearray(message.payload_view())
    struct.pack_into("<f", payload, section * layout.stats_nbytes(message.dtype) + 4 * chunk, value)
    return with_payload(message, payload)


def test_valid_hand_built_codes_decode() -> None:
    decoded = decompress(with_codes(valid_message(), [0, 7, 2, 5, 3]))
    assert torch.equal(torch.nonzero(decoded).view(-1), torch.tensor([0, 7, 10, 13, 19]))


@pytest.mark.parametrize(
    "indices",
    [
        [0, 8, 2, 5, 3],  # index beyond its chunk
        [0, 7, 2, 5, 4],  # beyond the tail (4 values)
        [3, 3, 2, 5, 0],  # duplicate
        [5, 2, 2, 5, 0],  # decreasing
        [0, 7, 7, 5, 0],  # decreasing in the second chunk
    ],
)
def test_bad_indices_raise(indices: list[int]) -> None:
    with pytest.raises(CompressionError):
        decompress(with_codes(valid_message(), indices))


@pytest.mark.parametrize(
    ("section", "value"),
    [(0, math.nan), (1, math.nan), (0, math.inf), (1, math.inf), (0, -1.0), (0, 1e30)],  # lo > hi, lo < 0
)
def test_bad_ranges_raise(section: int, value: float) -> None:
    with pytest.raises(CompressionError):
        decompress(with_stat(valid_message(), section, 1, value))


def test_range_beyond_float16_raises() -> None:
    message = with_stat(valid_message(dtype=torch.float16), 1, 0, 1e6)  # hi of chunk 0 beyond 65504
    with pytest.raises(CompressionError):
        decompress(message)


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"chunk_size": 8, "k": 2},
        {"chunk_size": 8, "k": 2, "bits": 3, "extra": 1},
        {"chunk_size": 8, "k": 0, "bits": 3},
        {"chunk_size": 8, "k": 9, "bits": 3},
        {"chunk_size": 8, "k": 2, "bits": 1},
        {"chunk_size": 8, "k": 2, "bits": 9},
        {"chunk_size": 8, "k": 2.0, "bits": 3},
        {"chunk_size": 1 << 17, "k": 1 << 10, "bits": 3},
        {"chunk_size": 4096, "k": 15, "bits": 3},  # below the density floor
    ],
)
def test_bad_params_raise(params: dict) -> None:
    header = {**valid_message().header(), "params": params}
    with pytest.raises(CompressionError):
        decompress(CompressedTensor.from_wire(header, bytearray(valid_message().payload_view())))


@pytest.mark.parametrize("change", ["truncate", "extend", "huge_shape", "shape_without_payload"])
def test_wrong_lengths_and_huge_announced_sizes_raise(change: str) -> None:
    message = valid_message()
    header, payload = message.header(), bytes(message.payload_view())
    if change == "truncate":
        payload = payload[:-1]
    elif change == "extend":
        payload += b"\0"
    elif change == "huge_shape":
        header["shape"] = [2**40]
    else:
        header["shape"], payload = [1 << 30], b""
    with pytest.raises(CompressionError):
        decompress(CompressedTensor.from_wire(header, bytearray(payload)))


def test_values_per_payload_byte_stay_below_the_announced_bound() -> None:
    """At the density floor and every chunk size, a message decodes to at most MAX_VALUES_PER_PAYLOAD_BYTE
    values per payload byte: the codec cannot be used to announce a giant tensor in a small message."""
    worst = 0.0
    for chunk_size in [1, 2, 3, 255, 256, 257, 1000, 4096, 8191, 16384, 40000, 1 << 16]:
        k = -(-chunk_size // MAX_SPARSITY)
        for numel in [1, chunk_size - 1, chunk_size, 3 * chunk_size + 1, 10 * chunk_size]:
            for dtype in (torch.float32, torch.float64):
                if numel > 0:
                    nbytes = SparseLayout(numel, chunk_size, k, 2).payload_nbytes(dtype)
                    worst = max(worst, numel / nbytes)
    assert worst <= SparseTopK.MAX_VALUES_PER_PAYLOAD_BYTE
    assert worst > SparseTopK.MAX_VALUES_PER_PAYLOAD_BYTE / 2  # the bound is not vacuous


# ----- devices


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_runs_on_the_tensors_device(device: str, dtype: torch.dtype) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    codec = SparseTopK(density=0.02, bits=4)
    x = normal(300_001, dtype, seed=8, device=device)
    encoded = codec.encode(x)
    assert encoded.payload.device.type == device
    message = encoded.to_host()
    y = decompress(message, device=device)
    assert y.device.type == device and y.dtype == dtype
    check_against_reference(codec, x.cpu()[: 12 * 4096], y.cpu()[: 12 * 4096])  # whole chunks: a quick check
    assert torch.equal(decompress(message), y.cpu())
    cpu_message = codec.compress(x.cpu())
    assert cpu_message.params == message.params and cpu_message.payload.numel() == message.payload.numel()
    with_feedback = ErrorFeedback(codec)
    decoded = decompress(with_feedback.compress(x), device=device)
    assert with_feedback.residual().device.type == device
    torch.testing.assert_close(with_feedback.residual(), (x.float() - decoded.float()))
