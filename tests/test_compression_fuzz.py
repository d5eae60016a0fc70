"""Fuzzing the decoders: whatever arrives from the network, decoding either raises a CompressionError
or returns a tensor with exactly the shape and dtype that the header announces.

Any other exception, a hang (caught by hypothesis' deadline), a result larger than its payload can
justify, or a result that aliases a read-only frame is a bug. Inputs are random frames, and valid
messages from every example codec (see codec_examples.py) with their header fields, header bytes
and payloads mutated.
"""

from __future__ import annotations

import functools
import math
import random
import struct
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from codec_examples import codec_examples, wrapper_examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hivemind_ext.compression import CODECS, Codec, CompressedTensor, CompressionInfo, decompress
from hivemind_ext.compression.base import DTYPES_BY_NAME
from hivemind_ext.errors import CompressionError

FUZZ = settings(
    max_examples=250,
    deadline=2000,  # milliseconds per example: generous for a loaded 2-core CI machine, far below a hang
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MAX_VALUES_PER_PAYLOAD_BYTE = 8  # no codec packs more values than 8 per byte (a 1-bit codec would)

INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1
ABSURD_INTS = [0, 1, -1, 2, 3, 7, 255, 256, 2**31 - 1, 2**31, 2**32, 2**40, 2**40 + 1, 2**62, 2**63 - 1, INT64_MIN]
ABSURD_INTS += [UINT64_MAX]
ODD_NAMES = ["", "nonexistent", "NONE", "float8", "complex64", "none\0", "Float16Compression", "int128", "qint8"]
SPECIAL_FLOAT32 = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, -1.0, 3e38, -3e38, 1e-45, 1e-40]
SPECIAL_FLOAT64 = [*SPECIAL_FLOAT32, 1.7e308, -1.7e308, 5e-324]


# ----- valid messages to start from


def example_tensors(codec: Codec) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    dtypes = [d for d in DTYPES_BY_NAME.values() if _supports(codec, d)]
    tensors = []
    for dtype in dtypes:
        for shape in [(), (0,), (5,), (3, 7), (2, 1, 33), (130,)]:
            values = torch.randn(shape, generator=generator, dtype=torch.float64) * 4
            tensors.append(
                values.to(dtype) if dtype.is_floating_point or dtype == torch.bool else values.round().to(dtype)
            )
    return tensors


def _supports(codec: Codec, dtype: torch.dtype) -> bool:
    try:
        codec.check_tensor(torch.zeros(1, dtype=dtype))
    except CompressionError:
        return False
    return True


def example_messages() -> Iterator[tuple[Codec, torch.Tensor, CompressedTensor]]:
    """(codec, tensor, message) for every example codec and every dtype it supports, on CPU."""
    for index, example in enumerate(codec_examples()):
        for tensor in example_tensors(example):
            codec = codec_examples()[index]  # a fresh instance: no ErrorFeedback residual of another shape
            try:  # key None: the PerTensorCompression examples map it
                yield codec, tensor, codec.compress(tensor, CompressionInfo.from_tensor(tensor))
            except CompressionError:  # a dtype that a wrapper's inner codec refuses
                continue


@functools.cache
def valid_messages() -> tuple[tuple[dict[str, Any], bytes], ...]:
    """(header, payload bytes) of messages from every example codec, for every dtype it supports."""
    return tuple((message.header(), bytes(message.payload_view())) for _, _, message in example_messages())


@pytest.fixture(autouse=True, scope="module")
def valid_messages_built() -> None:
    """Builds the cache outside the tests, so that building it does not count against the deadline."""
    valid_messages()


# ----- checking one decode


def frame_of(header: Any, payload: bytes) -> bytes:
    packed = msgpack.packb(header, use_bin_type=True)
    return struct.pack("<I", len(packed)) + packed + b"\0" * (-(4 + len(packed)) % 8) + payload


def assert_allowed_outcome(decode: Callable[[], tuple[CompressedTensor, torch.Tensor]], frame: bytes | None) -> None:
    """Decoding raises CompressionError, or gives a tensor matching the header (and not aliasing ``frame``)."""
    try:
        message, result = decode()
    except CompressionError:
        return
    assert isinstance(result, torch.Tensor)
    assert tuple(result.shape) == message.shape and result.dtype == message.dtype
    # a sparse codec announces a larger (still bounded) expansion: see SparseTopK.MAX_VALUES_PER_PAYLOAD_BYTE
    expansion = getattr(CODECS[message.codec], "MAX_VALUES_PER_PAYLOAD_BYTE", MAX_VALUES_PER_PAYLOAD_BYTE)
    assert result.numel() <= expansion * message.payload.numel() + 1, "result larger than payload"
    if frame is not None and result.numel():
        frame_start = np.frombuffer(frame, dtype=np.uint8).ctypes.data
        storage = result.untyped_storage()
        start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        assert end <= frame_start or start >= frame_start + len(frame), "result aliases a read-only frame"


def check_frame(frame: bytes) -> None:
    def decode() -> tuple[CompressedTensor, torch.Tensor]:
        message = CompressedTensor.from_bytes(frame)
        return message, decompress(message)

    assert_allowed_outcome(decode, frame)


def check_header_and_payload(header: Any, payload: bytes) -> None:
    """Both ways into the decoder: a packed frame (read-only bytes), and from_wire with a writable buffer."""
    try:
        frame = frame_of(header, payload)
    except (OverflowError, TypeError, ValueError):  # not representable in msgpack: cannot arrive on the wire
        frame = None
    if frame is not None:
        check_frame(frame)

    def decode_from_wire() -> tuple[CompressedTensor, torch.Tensor]:
        message = CompressedTensor.from_wire(header, bytearray(payload))
        return message, decompress(message)

    assert_allowed_outcome(decode_from_wire, None)


# ----- strategies

leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(INT64_MIN, UINT64_MAX),
    st.sampled_from(ABSURD_INTS),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(ODD_NAMES + sorted(CODECS) + sorted(DTYPES_BY_NAME)),
    st.binary(max_size=8),
)
wild_values = st.recursive(
    leaves,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
dims = st.one_of(st.integers(0, 12), st.sampled_from(ABSURD_INTS), st.integers(INT64_MIN, UINT64_MAX))
shapes = st.one_of(
    st.lists(dims, max_size=40),
    st.sampled_from([[1] * 33, [0] * 33, [2**20, 2**20, 2**20], [2**40, 2], [2**40, 0], [-1], [-1, -1], [1.0], [True]]),
    wild_values,
)


def mutate_header(data: st.DataObject, header: dict[str, Any]) -> dict[str, Any] | Any:
    header = dict(header)  # copies of the containers that may be modified in place:
    if isinstance(header.get("params"), dict):
        header["params"] = dict(header["params"])
    if isinstance(header.get("shape"), list):
        header["shape"] = list(header["shape"])
    params = header.get("params") if isinstance(header.get("params"), dict) else None
    shape = header.get("shape") if isinstance(header.get("shape"), list) else None
    kind = data.draw(
        st.sampled_from(["codec", "dtype", "shape", "dim", "params", "param", "drop", "extra", "replace"]), "header"
    )
    if kind == "codec":
        header["codec"] = data.draw(st.one_of(st.sampled_from(sorted(CODECS) + ODD_NAMES), wild_values))
    elif kind == "dtype":
        header["dtype"] = data.draw(st.one_of(st.sampled_from(sorted(DTYPES_BY_NAME) + ODD_NAMES), wild_values))
    elif kind == "shape":
        header["shape"] = data.draw(shapes)
    elif kind == "dim" and shape:  # one dimension off: numel mismatch, or an equal numel reshaped
        index = data.draw(st.integers(0, len(shape) - 1))
        shape[index] = data.draw(st.one_of(st.sampled_from([0, 1, 2]), dims))
    elif kind == "params":
        header["params"] = data.draw(
            st.one_of(st.dictionaries(st.text(max_size=12), wild_values, max_size=4), wild_values)
        )
    elif kind == "param" and params:
        name = data.draw(st.sampled_from(sorted(params)))
        params[name] = data.draw(st.one_of(st.sampled_from(ABSURD_INTS), wild_values))
    elif kind == "drop" and params:
        del params[data.draw(st.sampled_from(sorted(params)))]
    elif kind == "extra":
        target = params if params is not None and data.draw(st.booleans()) else header
        name = data.draw(st.one_of(st.sampled_from(["chunk_size", "extra", "codec", "scale"]), st.text(max_size=8)))
        target[name] = data.draw(wild_values)
    elif kind == "replace":  # the whole header is something else
        return data.draw(st.one_of(wild_values, st.dictionaries(st.text(max_size=8), wild_values, max_size=5)))
    return header


def mutate_payload(data: st.DataObject, payload: bytes) -> bytes:
    buffer = bytearray(payload)
    kinds = ["truncate", "extend", "flip", "float32", "float64", "float16", "random"]
    kind = data.draw(st.sampled_from(kinds), "payload")
    if kind == "truncate" and buffer:
        del buffer[data.draw(st.integers(0, len(buffer) - 1)) :]
    elif kind == "extend":
        buffer += data.draw(st.binary(min_size=1, max_size=64))
    elif kind == "flip" and buffer:
        for _ in range(data.draw(st.integers(1, 8))):
            buffer[data.draw(st.integers(0, len(buffer) - 1))] = data.draw(st.integers(0, 255))
    elif kind == "float32" and len(buffer) >= 4:  # NaN / Inf / extreme scales in float sections
        for _ in range(data.draw(st.integers(1, 4))):
            offset = 4 * data.draw(st.integers(0, len(buffer) // 4 - 1))
            buffer[offset : offset + 4] = struct.pack("<f", data.draw(st.sampled_from(SPECIAL_FLOAT32)))
    elif kind == "float64" and len(buffer) >= 8:  # the scale sections of float64 tensors
        for _ in range(data.draw(st.integers(1, 4))):
            offset = 8 * data.draw(st.integers(0, len(buffer) // 8 - 1))
            buffer[offset : offset + 8] = struct.pack("<d", data.draw(st.sampled_from(SPECIAL_FLOAT64)))
    elif kind == "float16" and len(buffer) >= 2:
        for _ in range(data.draw(st.integers(1, 4))):
            offset = 2 * data.draw(st.integers(0, len(buffer) // 2 - 1))
            buffer[offset : offset + 2] = data.draw(
                st.sampled_from([b"\x00\x7e", b"\x00\x7c", b"\x00\xfc", b"\xff\x7b"])
            )
    elif kind == "random":  # random bytes of exactly the right size reach the decoder itself
        rng = random.Random(data.draw(st.integers(0, 2**32 - 1)))
        buffer = bytearray(rng.randbytes(len(buffer)))
    return bytes(buffer)


def corrupt_frame(data: st.DataObject, frame: bytes) -> bytes:
    buffer = bytearray(frame)
    kind = data.draw(st.sampled_from(["header_bytes", "length", "truncate"]), "frame")
    (header_length,) = struct.unpack_from("<I", frame)
    if kind == "header_bytes":
        for _ in range(data.draw(st.integers(1, 6))):
            buffer[4 + data.draw(st.integers(0, header_length - 1))] = data.draw(st.integers(0, 255))
    elif kind == "length":
        new_length = data.draw(st.one_of(st.integers(0, header_length + 16), st.sampled_from([2**16, 2**32 - 1])))
        buffer[:4] = struct.pack("<I", new_length)
    elif kind == "truncate":
        del buffer[data.draw(st.integers(0, len(buffer))) :]
    return bytes(buffer)


# ----- tests


def test_every_registered_codec_has_an_example() -> None:
    registered = {codec_id for codec_id, cls in CODECS.items() if cls.__module__.startswith("hivemind_ext.")}
    covered = {example.codec_id for example in codec_examples() if example.codec_id is not None}
    assert registered <= covered, f"add examples of {sorted(registered - covered)} to tests/codec_examples.py"
    assert len(wrapper_examples()) >= 4


def test_every_example_codec_round_trips() -> None:
    for codec, tensor, message in example_messages():
        decoded = decompress(CompressedTensor.from_bytes(message.to_bytes()))
        assert decoded.shape == tensor.shape and decoded.dtype == tensor.dtype, codec


@FUZZ
@given(frame=st.binary(max_size=512))
def test_random_bytes(frame: bytes) -> None:
    check_frame(frame)


@FUZZ
@given(header=st.binary(max_size=256), payload=st.binary(max_size=256))
def test_random_header_bytes_in_a_well_formed_frame(header: bytes, payload: bytes) -> None:
    check_frame(struct.pack("<I", len(header)) + header + b"\0" * (-(4 + len(header)) % 8) + payload)


def valid_params(codec_id: str) -> list[dict[str, Any]]:
    return [header["params"] for header, _ in valid_messages() if header["codec"] == codec_id] or [{}]


@FUZZ
@given(
    codec_id=st.sampled_from(sorted(CODECS)),
    dtype=st.sampled_from(sorted(DTYPES_BY_NAME)),
    shape=st.lists(st.integers(0, 9), max_size=3),
    data=st.data(),
)
def test_plausible_headers_with_random_payloads(
    codec_id: str, dtype: str, shape: list[int], data: st.DataObject
) -> None:
    params = data.draw(
        st.one_of(
            st.sampled_from(valid_params(codec_id)),
            st.dictionaries(st.sampled_from(["chunk_size", "block_size", "bits"]), st.integers(-2, 40)),
        )
    )
    numel = math.prod(shape)
    size = data.draw(st.one_of(st.integers(0, 12 * numel + 64), st.sampled_from([2 * numel, 4 * numel, numel])))
    header = {"codec": codec_id, "dtype": dtype, "shape": shape, "params": params}
    check_header_and_payload(header, random.Random(size).randbytes(size))


@FUZZ
@given(data=st.data())
def test_mutated_headers(data: st.DataObject) -> None:
    header, payload = data.draw(st.sampled_from(valid_messages()), "message")
    for _ in range(data.draw(st.integers(1, 3))):
        header = mutate_header(data, header)
        if not isinstance(header, dict):
            break
    check_header_and_payload(header, payload)


@FUZZ
@given(data=st.data())
def test_mutated_payloads(data: st.DataObject) -> None:
    header, payload = data.draw(st.sampled_from(valid_messages()), "message")
    for _ in range(data.draw(st.integers(1, 3))):
        payload = mutate_payload(data, payload)
    check_header_and_payload(header, payload)


@FUZZ
@given(data=st.data())
def test_mutated_headers_and_payloads(data: st.DataObject) -> None:
    header, payload = data.draw(st.sampled_from(valid_messages()), "message")
    header = mutate_header(data, header)
    check_header_and_payload(header, mutate_payload(data, payload))


@FUZZ
@given(data=st.data())
def test_corrupted_frames(data: st.DataObject) -> None:
    header, payload = data.draw(st.sampled_from(valid_messages()), "message")
    check_frame(corrupt_frame(data, frame_of(header, payload)))


@pytest.mark.parametrize("codec_id", sorted(CODECS))
def test_each_codec_rejects_each_kind_of_bad_header(codec_id: str) -> None:
    """Deterministic corner cases for every codec, beyond what the random search happens to hit."""
    for dtype in sorted(DTYPES_BY_NAME):
        for shape in [[], [0], [1], [3], [2**40], [2**20] * 3, [1] * 33, [-1], [2**64 - 1]]:
            for params in [{}, {"chunk_size": 1}, {"chunk_size": 0}, {"chunk_size": -1}, {"chunk_size": 2**63 - 1}]:
                for size in {0, 1, 8, 64, 2 * max(0, math.prod(shape)) if math.prod(shape) < 100 else 3}:
                    header = {"codec": codec_id, "dtype": dtype, "shape": shape, "params": params}
                    check_header_and_payload(header, bytes(size))


def test_empty_shape_with_huge_dimensions_is_rejected() -> None:
    # found by hypothesis: numel is 0, but strides of the view would overflow int64
    header = {"codec": "none", "dtype": "float32", "shape": [0, 4, 4, 4, 2**31 - 1, 2**26 + 1], "params": {}}
    with pytest.raises(CompressionError):
        decompress(CompressedTensor.from_wire(header, b""))
