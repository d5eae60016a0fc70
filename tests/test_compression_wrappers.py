"""The adaptive wrappers, error feedback, and the conversion of hivemind's codec objects."""

from __future__ import annotations

import ast
import copy
import pickle
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import hivemind.compression as hc
import pytest
import torch

import hivemind_ext.compression as compression
from hivemind_ext.compression import (
    CODECS,
    BFloat16Compression,
    Codec,
    CompressionInfo,
    ErrorFeedback,
    Float16Compression,
    NoCompression,
    PerTensorCompression,
    RoleAdaptiveCompression,
    ScaledFloat16Compression,
    SizeAdaptiveCompression,
    TensorRole,
    as_codec,
    decompress,
)
from hivemind_ext.errors import CompressionError, ConfigurationError, NonFiniteTensorError

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
QUANTIZATION_NAMES = ["Uniform8BitQuantization", "Quantile8BitQuantization", "BlockwiseQuantization"]


def skip_without(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def randn(*shape: int, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


# ----- adaptive wrappers


def test_size_adaptive_chooses_by_numel_of_the_whole_tensor() -> None:
    codec = SizeAdaptiveCompression(10, less=NoCompression(), greater_equal=Float16Compression())
    assert codec.compress(torch.zeros(9)).codec == "none"
    assert codec.compress(torch.zeros(10)).codec == "float16"
    assert codec.compress(torch.zeros(2, 5)).codec == "float16"
    # a part of a large tensor is compressed like the whole tensor
    part_info = CompressionInfo(key="w", shape=(100,)).get_part(3, 4)
    assert codec.compress(torch.zeros(4), part_info).codec == "float16"
    assert codec.compress(torch.zeros(100), CompressionInfo(shape=(3,))).codec == "none"


def test_wrapper_messages_decode_through_the_registry() -> None:
    codec = SizeAdaptiveCompression(0, less=NoCompression(), greater_equal=ScaledFloat16Compression(chunk_size=4))
    x = randn(3, 7)
    message = codec.compress(x)
    assert message.codec == "scaled_float16" and message.payload.device.type == "cpu"
    assert torch.allclose(decompress(message), x, rtol=1e-3, atol=1e-3)
    assert torch.allclose(codec.extract(message), x, rtol=1e-3, atol=1e-3)
    assert codec.encode(x).codec == "scaled_float16"


def test_wrappers_have_no_codec_id() -> None:
    for cls in [SizeAdaptiveCompression, RoleAdaptiveCompression, PerTensorCompression, ErrorFeedback]:
        assert cls.codec_id is None
        assert cls not in CODECS.values()


def test_role_adaptive_chooses_by_role() -> None:
    codec = RoleAdaptiveCompression(gradient=Float16Compression(), optimizer=BFloat16Compression())
    x = randn(5)
    chosen = {role: codec.compress(x, CompressionInfo.from_tensor(x, role=role)).codec for role in TensorRole}
    assert chosen == {
        TensorRole.ACTIVATION: "none",
        TensorRole.PARAMETER: "none",
        TensorRole.GRADIENT: "float16",
        TensorRole.OPTIMIZER: "bfloat16",
        TensorRole.UNSPECIFIED: "none",
    }
    assert codec.compress(x).codec == "none"  # no info: UNSPECIFIED
    default = RoleAdaptiveCompression(parameter=NoCompression(), default=Float16Compression())
    assert default.compress(x, CompressionInfo.from_tensor(x, role=TensorRole.ACTIVATION)).codec == "float16"
    assert default.compress(x, CompressionInfo.from_tensor(x, role=TensorRole.PARAMETER)).codec == "none"


def test_role_adaptive_accepts_hivemind_roles_by_name() -> None:
    codec = RoleAdaptiveCompression(gradient=Float16Compression())
    info = CompressionInfo(shape=(3,), role=hc.TensorRole.GRADIENT)
    assert codec.compress(torch.ones(3), info).codec == "float16"
    with pytest.raises(CompressionError, match="role"):
        codec.compress(torch.ones(3), CompressionInfo(shape=(3,), role="gradient"))


def test_per_tensor_by_sequence_and_mapping() -> None:
    by_index = PerTensorCompression([NoCompression(), Float16Compression()])
    x = randn(4)
    assert by_index.compress(x, CompressionInfo.from_tensor(x, key=0)).codec == "none"
    assert by_index.compress(x, CompressionInfo.from_tensor(x, key=1)).codec == "float16"
    by_name = PerTensorCompression({"w": BFloat16Compression(), ("b", 1): NoCompression()})
    assert by_name.compress(x, CompressionInfo.from_tensor(x, key="w")).codec == "bfloat16"
    assert by_name.compress(x, CompressionInfo.from_tensor(x, key=("b", 1))).codec == "none"


@pytest.mark.parametrize("key", [2, -1, "0", None, 1.0, True])
def test_per_tensor_missing_index_raises(key) -> None:
    codec = PerTensorCompression([NoCompression(), Float16Compression()])
    with pytest.raises(CompressionError, match="no codec for tensor key"):
        codec.compress(torch.ones(2), CompressionInfo(key=key, shape=(2,)))


@pytest.mark.parametrize("key", ["x", None, ["unhashable"]])
def test_per_tensor_missing_key_raises(key) -> None:
    codec = PerTensorCompression({"w": Float16Compression()})
    with pytest.raises(CompressionError, match="no codec for tensor key"):
        codec.compress(torch.ones(2), CompressionInfo(key=key, shape=(2,)))
    with pytest.raises(CompressionError, match="known keys: 'w'"):
        codec.estimate_compression_ratio(CompressionInfo(key=key, shape=(2,)))


def test_per_tensor_without_info_hints_at_the_key() -> None:
    with pytest.raises(CompressionError, match=r"CompressionInfo\(key=...\)"):
        PerTensorCompression({"w": Float16Compression()}).compress(torch.ones(2))


def test_estimate_compression_ratio_delegates() -> None:
    info = CompressionInfo(key="w", shape=(1000,), role=TensorRole.GRADIENT)
    assert SizeAdaptiveCompression(10, NoCompression(), Float16Compression()).estimate_compression_ratio(info) == 0.5
    assert SizeAdaptiveCompression(10**4, NoCompression(), Float16Compression()).estimate_compression_ratio(info) == 1
    assert RoleAdaptiveCompression(gradient=Float16Compression()).estimate_compression_ratio(info) == 0.5
    assert PerTensorCompression({"w": BFloat16Compression()}).estimate_compression_ratio(info) == 0.5
    assert ErrorFeedback(Float16Compression()).estimate_compression_ratio(info) == 0.5


@pytest.mark.parametrize(
    "build",
    [
        lambda: SizeAdaptiveCompression(-1, NoCompression(), NoCompression()),
        lambda: SizeAdaptiveCompression(1.5, NoCompression(), NoCompression()),
        lambda: SizeAdaptiveCompression("10", NoCompression(), NoCompression()),
        lambda: SizeAdaptiveCompression(10, None, NoCompression()),
        lambda: SizeAdaptiveCompression(10, NoCompression(), "float16"),
        lambda: RoleAdaptiveCompression(gradient=Float16Compression),
        lambda: RoleAdaptiveCompression(default=None),
        lambda: PerTensorCompression("float16"),
        lambda: PerTensorCompression(NoCompression()),
        lambda: PerTensorCompression([NoCompression(), 3]),
        lambda: PerTensorCompression({"w": object()}),
        lambda: ErrorFeedback(None),
    ],
)
def test_invalid_wrapper_configuration_raises(build) -> None:
    with pytest.raises(ConfigurationError):
        build()


def test_wrappers_reject_non_tensors_and_bad_info() -> None:
    for codec in [SizeAdaptiveCompression(1, NoCompression(), NoCompression()), ErrorFeedback(Float16Compression())]:
        with pytest.raises(CompressionError):
            codec.compress([1.0])
        with pytest.raises(CompressionError):
            codec.compress(torch.ones(2), info={"key": "w"})


def test_wrappers_nest() -> None:
    inner = PerTensorCompression({"a": ErrorFeedback(Float16Compression()), "b": NoCompression()})
    codec = SizeAdaptiveCompression(4, less=NoCompression(), greater_equal=inner)
    x = randn(10)
    assert codec.compress(x, CompressionInfo.from_tensor(x, key="a")).codec == "float16"
    assert codec.compress(x, CompressionInfo.from_tensor(x, key="b")).codec == "none"
    assert codec.compress(x[:2], CompressionInfo.from_tensor(x[:2], key="c")).codec == "none"
    assert inner.tensor_compressions["a"].residual("a") is not None


def test_wrappers_repr() -> None:
    codec = SizeAdaptiveCompression(5, NoCompression(), ErrorFeedback(ScaledFloat16Compression(chunk_size=3)))
    assert repr(codec) == (
        "SizeAdaptiveCompression(threshold=5, less=NoCompression(), "
        "greater_equal=ErrorFeedback(codec=ScaledFloat16Compression(chunk_size=3)))"
    )
    assert "gradient=Float16Compression()" in repr(RoleAdaptiveCompression(gradient=Float16Compression()))


# ----- error feedback


class CoarseRounding(Codec):
    """A deliberately lossy test codec: rounds to multiples of 1/8 (biased for inputs between the steps).

    Registered only while this module's tests run (see ``coarse_rounding_registered``), so that other
    tests iterating over CODECS never meet it.
    """

    STEP = 0.125

    def _encode(self, flat: torch.Tensor, allow_inplace: bool) -> tuple[torch.Tensor, dict]:
        return flat.div(self.STEP).round().to(torch.float32).view(torch.uint8), {}

    @classmethod
    def payload_nbytes(cls, numel: int, dtype: torch.dtype, params) -> int:
        return 4 * numel

    @classmethod
    def _decode(cls, payload: torch.Tensor, numel: int, dtype: torch.dtype, params) -> torch.Tensor:
        return payload.view(torch.float32).mul(cls.STEP).to(dtype)


@pytest.fixture(autouse=True, scope="module")
def coarse_rounding_registered() -> Iterator[None]:
    CoarseRounding.codec_id = "test_coarse_rounding"
    CODECS[CoarseRounding.codec_id] = CoarseRounding
    yield
    del CODECS[CoarseRounding.codec_id]
    CoarseRounding.codec_id = None


def run_steps(codec: Codec, inputs: list[torch.Tensor], info: CompressionInfo | None = None) -> list[float]:
    """Max |sum of decoded - sum of inputs| (in float64) after each step."""
    sent = torch.zeros(inputs[0].shape, dtype=torch.float64)
    total = torch.zeros_like(sent)
    errors = []
    for x in inputs:
        sent += decompress(codec.compress(x, info)).double().cpu()
        total += x.double().cpu()
        errors.append(float((sent - total).abs().max()))
    return errors


def minmax_uint4() -> Codec | None:
    cls = getattr(compression, "MinMaxUInt4", None)
    return None if cls is None else cls(chunk_size=64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("inner", "step_error"),
    [
        (CoarseRounding(), CoarseRounding.STEP / 2),
        (BFloat16Compression(), 2**-8 * 4.0),
        (minmax_uint4(), 0.11 / 15 / 2),  # half a level of a 64-value chunk spanning < 0.11
    ],
    ids=["coarse", "bfloat16", "minmax_uint4"],
)
def test_error_feedback_keeps_the_running_sum_on_track(device: str, inner: Codec | None, step_error: float) -> None:
    skip_without(device)
    if inner is None:
        pytest.skip("MinMaxUInt4 is not in this tree yet")
    steps = 400
    generator = torch.Generator().manual_seed(11)
    bias = torch.rand(256, generator=generator) * 0.1 + 1.03  # values between the codec's steps: biased errors
    inputs = [(bias + 1e-4 * torch.randn(256, generator=generator)).to(device) for _ in range(steps)]
    plain = run_steps(inner, inputs)
    feedback = run_steps(ErrorFeedback(inner), inputs, CompressionInfo(key="grad", shape=(256,)))
    # with feedback the error is one step's compression error (of x + residual), whatever the number of steps
    assert max(feedback) <= 2 * step_error
    assert max(feedback[steps // 2 :]) <= 2 * step_error
    # without it, biased errors accumulate linearly
    assert plain[-1] > 1.8 * plain[steps // 2 - 1]
    assert plain[-1] > 20 * max(feedback)


def test_error_feedback_sum_identity() -> None:
    # sum of decoded == sum of inputs - final residual (exactly, up to float32 rounding)
    ef = ErrorFeedback(ScaledFloat16Compression(chunk_size=16))
    info = CompressionInfo(key="w", shape=(1000,))
    sent = torch.zeros(1000, dtype=torch.float64)
    total = torch.zeros_like(sent)
    for step in range(50):
        x = randn(1000, seed=step) * (1 + step)
        sent += decompress(ef.compress(x, info)).double()
        total += x.double()
    residual = ef.residual("w").double()
    assert torch.allclose(sent + residual, total, rtol=0, atol=1e-3)
    assert float(residual.abs().max()) > 0


def test_error_feedback_half_precision_input_feeds_back_the_cast_error() -> None:
    ef = ErrorFeedback(NoCompression())
    x = torch.full((8,), 1 / 3, dtype=torch.float16)
    info = CompressionInfo(key="h", shape=(8,), dtype=torch.float16)
    message = ef.compress(x, info)
    assert message.dtype == torch.float16
    residual = ef.residual("h")
    assert residual.dtype == torch.float32 and bool((residual == 0).all())  # lossless: nothing to feed back
    ef = ErrorFeedback(BFloat16Compression())
    for _ in range(3):
        assert ef.compress(x, info).dtype == torch.float16
    assert ef.residual("h").dtype == torch.float32 and float(ef.residual("h").abs().max()) > 0


def test_error_feedback_keys_and_parts_are_independent() -> None:
    ef = ErrorFeedback(CoarseRounding())
    a, b = torch.full((4,), 0.05), torch.full((6,), 0.1)
    ef.compress(a, CompressionInfo.from_tensor(a, key="a"))
    ef.compress(b, CompressionInfo.from_tensor(b, key="b"))
    part = CompressionInfo(key="a", shape=(10,)).get_part(1, 6)
    ef.compress(b, part)
    assert torch.allclose(ef.residual("a"), a)
    assert torch.allclose(ef.residual("b"), b - 0.125)
    assert torch.allclose(ef.residual("a", part_index=1), b - 0.125)
    assert ef.residual("missing") is None


def test_error_feedback_without_info_uses_key_none() -> None:
    ef = ErrorFeedback(CoarseRounding())
    x = torch.full((3,), 0.05)
    ef.compress(x)
    assert torch.allclose(ef.residual(None), x)
    second = decompress(ef.compress(x))  # 0.05 + 0.05 rounds to 0.125
    assert torch.allclose(second, torch.full((3,), 0.125))
    ef.reset()
    assert ef.residual(None) is None


def test_error_feedback_reset() -> None:
    ef = ErrorFeedback(CoarseRounding())
    x = torch.full((3,), 0.05)
    for key in ["a", "b"]:
        ef.compress(x, CompressionInfo.from_tensor(x, key=key))
        ef.compress(x, CompressionInfo.from_tensor(x, key=key).get_part(1, 3))
    ef.reset("a")
    assert ef.residual("a") is None and ef.residual("a", part_index=1) is None
    assert ef.residual("b") is not None and ef.residual("b", part_index=1) is not None
    ef.reset()
    assert ef.residual("b") is None and ef.residual("b", part_index=1) is None


@pytest.mark.parametrize(
    "changed",
    [torch.full((4,), 0.05), torch.full((2, 3), 0.05), torch.full((3,), 0.05, dtype=torch.float64)],
    ids=["shape", "shape-2d", "dtype"],
)
def test_error_feedback_resets_with_a_warning_when_a_key_changes(changed: torch.Tensor) -> None:
    ef = ErrorFeedback(CoarseRounding())
    ef.compress(torch.full((3,), 0.05), CompressionInfo(key="w"))
    with pytest.warns(RuntimeWarning, match="residual is dropped"):
        decoded = decompress(ef.compress(changed, CompressionInfo(key="w")))
    assert bool((decoded == 0).all())  # the old residual (0.05) was not added
    assert ef.residual("w").shape == changed.shape
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ef.compress(changed, CompressionInfo(key="w"))  # same again: no warning


def test_error_feedback_device_change_resets() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    ef = ErrorFeedback(CoarseRounding())
    ef.compress(torch.full((3,), 0.05), CompressionInfo(key="w"))
    with pytest.warns(RuntimeWarning, match="residual is dropped"):
        ef.compress(torch.full((3,), 0.05, device="cuda"), CompressionInfo(key="w"))
    assert ef.residual("w").device.type == "cuda"


@pytest.mark.parametrize("device", DEVICES)
def test_error_feedback_never_stores_non_finite_residuals(device: str) -> None:
    skip_without(device)
    ef = ErrorFeedback(Float16Compression())
    info = CompressionInfo(key="w", shape=(6,))
    x = torch.tensor([0.1, float("nan"), float("inf"), -float("inf"), 1e6, 1 / 3], device=device)
    decoded = decompress(ef.compress(x, info))
    assert bool(decoded[1].isnan()) and decoded[2] == float("inf") and decoded[3] == -float("inf")
    residual = ef.residual("w")
    assert residual.device.type == device and bool(torch.isfinite(residual).all())
    assert residual[1:4].tolist() == [0.0, 0.0, 0.0]
    assert residual[4].item() == 1e6 - 65504  # a finite overflow is fed back like any other error
    finite = torch.full((6,), 0.25, device=device)
    assert bool(torch.isfinite(decompress(ef.compress(finite, info))).all())
    assert bool(torch.isfinite(ef.residual("w")).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_error_feedback_on_half_tensors_near_their_maximum_stays_finite(dtype: torch.dtype) -> None:
    ef = ErrorFeedback(NoCompression())  # only the cast of x + residual to the half dtype loses anything
    top = torch.finfo(dtype).max
    info = CompressionInfo(key="h")
    ef.compress(torch.tensor([top, -top, 1 / 3], dtype=dtype), info)
    residual = torch.tensor([top / 1000, -top / 1000, 0.0])  # x + residual is beyond the half dtype's range
    ef.set_residual("h", residual, dtype=dtype)  # as after a lossy step
    decoded = decompress(ef.compress(torch.tensor([top, -top, top], dtype=dtype), info))
    assert decoded.tolist() == [top, -top, top]  # clamped, not Inf
    assert torch.allclose(ef.residual("h"), residual, rtol=1e-3)


def test_error_feedback_set_residual_is_used_by_the_next_step_and_checks_the_dtype() -> None:
    ef = ErrorFeedback(NoCompression())
    residual = torch.tensor([0.5, -0.25])
    ef.set_residual("w", residual, dtype=torch.float32, part_index=1)
    residual += 1  # set_residual keeps a copy
    assert ef.residual("w", part_index=1).tolist() == [0.5, -0.25] and ef.residual("w") is None
    info = CompressionInfo(key="w", part_index=1)
    assert decompress(ef.compress(torch.ones(2), info)).tolist() == [1.5, 0.75]
    with pytest.raises(ConfigurationError):
        ef.set_residual("w", torch.zeros(2), dtype=torch.float64)  # float64 tensors keep float64 residuals
    with pytest.raises(ConfigurationError):
        ef.set_residual("w", torch.zeros(2), dtype=torch.int64)


def test_error_feedback_keeps_the_residual_when_the_inner_codec_raises() -> None:
    ef = ErrorFeedback(ScaledFloat16Compression(chunk_size=2))
    info = CompressionInfo(key="w", shape=(4,))
    ef.compress(randn(4), info)
    before = ef.residual("w").clone()
    bad = randn(4, seed=1)
    bad[2] = float("nan")
    with pytest.raises(NonFiniteTensorError):
        ef.compress(bad, info)
    assert torch.equal(ef.residual("w"), before)


def test_error_feedback_does_not_modify_its_input() -> None:
    ef = ErrorFeedback(CoarseRounding())
    x = torch.full((5,), 0.05)
    for _ in range(3):
        ef.compress(x, allow_inplace=True)
        assert bool((x == 0.05).all())


def test_error_feedback_passes_non_float_tensors_through() -> None:
    ef = ErrorFeedback(NoCompression())
    x = torch.arange(10)
    assert torch.equal(decompress(ef.compress(x, CompressionInfo(key="i"))), x)
    assert ef.residual("i") is None
    with pytest.raises(CompressionError):
        ErrorFeedback(Float16Compression()).compress(x)


def test_error_feedback_rejects_unhashable_keys() -> None:
    with pytest.raises(CompressionError, match="hashable"):
        ErrorFeedback(Float16Compression()).compress(torch.ones(2), CompressionInfo(key=["w"]))


@pytest.mark.parametrize("device", DEVICES)
def test_error_feedback_encode_keeps_the_payload_on_the_device(device: str) -> None:
    skip_without(device)
    ef = ErrorFeedback(ScaledFloat16Compression(chunk_size=8))
    x = randn(100, device=device)
    message = ef.encode(x, CompressionInfo(key="w"))
    assert message.payload.device == x.device
    assert ef.residual("w").device == x.device
    assert ef.compress(x, CompressionInfo(key="w")).payload.device.type == "cpu"


def test_error_feedback_is_thread_safe() -> None:
    ef = ErrorFeedback(CoarseRounding())
    info = CompressionInfo(key="shared", shape=(64,))
    inputs = [randn(64, seed=seed) * 0.3 for seed in range(8)]
    sums = [torch.zeros(64, dtype=torch.float64) for _ in inputs]
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(inputs))

    def worker(index: int) -> None:
        try:
            barrier.wait()
            for _ in range(40):
                sums[index] += decompress(ef.compress(inputs[index], info)).double()
                ef.compress(inputs[index], CompressionInfo(key=index, shape=(64,)))  # private keys in parallel
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(index,)) for index in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    total_in = sum(40 * x.double() for x in inputs)
    # every update of the shared key was serialised: what was sent plus what is left is what came in
    assert torch.allclose(sum(sums) + ef.residual("shared").double(), total_in, atol=1e-4)


def test_error_feedback_pickles_with_its_residuals() -> None:
    ef = ErrorFeedback(CoarseRounding())
    ef.compress(torch.full((3,), 0.05), CompressionInfo(key="w"))
    for clone in [pickle.loads(pickle.dumps(ef)), copy.deepcopy(ef)]:
        assert torch.equal(clone.residual("w"), ef.residual("w"))
        decoded = decompress(clone.compress(torch.full((3,), 0.05), CompressionInfo(key="w")))
        assert torch.allclose(decoded, torch.full((3,), 0.125))


# ----- resolving hivemind codec objects


@pytest.mark.parametrize(
    ("theirs", "ours"),
    [
        (hc.NoCompression(), NoCompression),
        (hc.Float16Compression(), Float16Compression),
        (hc.ScaledFloat16Compression(), ScaledFloat16Compression),
    ],
)
def test_as_codec_maps_hivemind_float_codecs(theirs, ours: type) -> None:
    codec = as_codec(theirs)
    assert type(codec) is ours
    x = randn(10)
    assert torch.allclose(decompress(codec.compress(x)), x, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("name", QUANTIZATION_NAMES)
def test_as_codec_maps_hivemind_quantization_codecs(name: str) -> None:
    theirs = getattr(hc, name)()
    ours = getattr(compression, name, None)
    if ours is None:
        with pytest.raises(ConfigurationError, match=name):
            as_codec(theirs)
    else:
        assert type(as_codec(theirs)) is ours


def test_as_codec_uniform8bit_with_custom_range() -> None:
    theirs = hc.Uniform8BitQuantization()
    theirs.RANGE_IN_SIGMAS = 4
    ours = getattr(compression, "Uniform8BitQuantization", None)
    try:
        codec = as_codec(theirs)
    except ConfigurationError as e:
        assert "Uniform8BitQuantization" in str(e)
    else:
        assert ours is not None and type(codec) is ours
        assert codec.range_in_sigmas == 4  # set explicitly: kept; hivemind's default 6 maps to our default


def test_as_codec_passes_our_codecs_through() -> None:
    for codec in [NoCompression(), ScaledFloat16Compression(chunk_size=3), ErrorFeedback(Float16Compression())]:
        assert as_codec(codec) is codec


def test_as_codec_converts_hivemind_adaptive_codecs_recursively() -> None:
    size = as_codec(hc.SizeAdaptiveCompression(512, hc.NoCompression(), hc.Float16Compression()))
    assert isinstance(size, SizeAdaptiveCompression) and size.threshold == 512
    assert type(size.less) is NoCompression and type(size.greater_equal) is Float16Compression

    role = as_codec(
        hc.RoleAdaptiveCompression(
            gradient=hc.SizeAdaptiveCompression(10, hc.NoCompression(), hc.ScaledFloat16Compression()),
            optimizer=hc.Float16Compression(),
            default=hc.NoCompression(),
        )
    )
    assert isinstance(role, RoleAdaptiveCompression)
    gradient = role.role_compressions[TensorRole.GRADIENT]
    assert isinstance(gradient, SizeAdaptiveCompression) and type(gradient.greater_equal) is ScaledFloat16Compression
    assert type(role.role_compressions[TensorRole.OPTIMIZER]) is Float16Compression
    for other in [TensorRole.ACTIVATION, TensorRole.PARAMETER, TensorRole.UNSPECIFIED]:
        assert type(role.role_compressions[other]) is NoCompression

    by_list = as_codec(hc.PerTensorCompression([hc.Float16Compression(), hc.NoCompression()]))
    assert [type(c) for c in by_list.tensor_compressions] == [Float16Compression, NoCompression]
    by_dict = as_codec(hc.PerTensorCompression({"w": hc.ScaledFloat16Compression(), "b": hc.NoCompression()}))
    assert {k: type(c) for k, c in by_dict.tensor_compressions.items()} == {
        "w": ScaledFloat16Compression,
        "b": NoCompression,
    }


def test_our_wrappers_accept_hivemind_inner_codecs() -> None:
    codec = SizeAdaptiveCompression(4, less=hc.NoCompression(), greater_equal=hc.Float16Compression())
    assert type(codec.greater_equal) is Float16Compression
    assert type(ErrorFeedback(hc.Float16Compression()).codec) is Float16Compression


class FakeHivemindCodec:
    pass


FakeHivemindCodec.__module__ = "hivemind.compression.custom"


@pytest.mark.parametrize(
    ("obj", "hint"),
    [
        (None, "expected a hivemind_ext.compression codec"),
        ("float16", "expected a hivemind_ext.compression codec"),
        (Float16Compression, r"pass Float16Compression\(\)"),
        (hc.Float16Compression, "pass an instance"),
        (FakeHivemindCodec(), "no hivemind_ext equivalent"),
        (hc.SizeAdaptiveCompression(1, hc.NoCompression(), object()), "expected a hivemind_ext.compression codec"),
    ],
)
def test_as_codec_rejects_anything_else(obj, hint: str) -> None:
    with pytest.raises(ConfigurationError, match=hint):
        as_codec(obj)


def test_as_codec_rejects_cyclic_hivemind_configurations() -> None:
    cyclic = hc.PerTensorCompression([hc.NoCompression()])
    cyclic.tensor_compressions.append(cyclic)
    with pytest.raises(ConfigurationError, match="contains itself"):
        as_codec(cyclic)


def test_library_modules_do_not_import_hivemind_compression() -> None:
    package = Path(compression.__file__).parent
    for module in ["adaptive.py", "error_feedback.py", "resolve.py"]:
        tree = ast.parse((package / module).read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(name.startswith("hivemind.") or name == "hivemind" for name in names), (module, names)
