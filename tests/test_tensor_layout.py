"""The shared tensor layout without a network: the tensor-list wire encoding (round trip and hostile
input), and the chunker's bounds as properties."""

from __future__ import annotations

import itertools

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hivemind_ext.averaging.tensor_layout import (
    MAX_TENSORS,
    ChunkSpec,
    TensorSpec,
    chunk_numel,
    chunk_tensors,
    encode_tensor_list,
    parse_tensor_list,
    tensor_offsets,
)
from hivemind_ext.compression.base import DTYPES_BY_NAME, MAX_NDIM, MAX_NUMEL
from hivemind_ext.compression.chunks import num_chunks, split_chunks
from hivemind_ext.errors import ProtocolError

FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
ALL = sorted(DTYPES_BY_NAME.values(), key=str)

specs_strategy = st.lists(
    st.builds(
        TensorSpec,
        shape=st.lists(st.integers(0, 6), max_size=3).map(tuple),
        dtype=st.sampled_from(ALL),
    ),
    max_size=8,
)


# ----- the wire encoding


@given(specs_strategy)
@settings(max_examples=100, deadline=None)
def test_tensor_list_round_trips_through_msgpack(specs: list[TensorSpec]) -> None:
    wire = msgpack.unpackb(msgpack.packb(encode_tensor_list(specs), use_bin_type=True), raw=False)
    assert parse_tensor_list(wire) == specs


def test_encoding_is_shape_then_dtype_name() -> None:
    """The order is part of the all-reduce's layout fingerprint: changing it changes every fingerprint."""
    assert encode_tensor_list([TensorSpec((2, 3), torch.float16), TensorSpec((), torch.int64)]) == [
        [[2, 3], "float16"],
        [[], "int64"],
    ]


@pytest.mark.parametrize(
    "rows",
    [
        None,
        "x",
        {"shape": [1]},
        [None],
        [[[3]]],  # no dtype
        [[[3], "float32", 1]],  # a third field
        [["float32", [3]]],  # the order of the other encoding
        [[[3], "complex64"]],  # unknown dtype
        [[[3], 7]],  # dtype not a string
        [[(3,), "float32"]],  # shape not a list
        [[[-1], "float32"]],  # negative size
        [[[True], "float32"]],  # a bool is not a size
        [[[2.0], "float32"]],  # neither is a float
        [[[MAX_NUMEL + 1], "float32"]],  # one dimension too large
        [[[1 << 21, 1 << 21], "float32"]],  # too many values in one tensor
        [[[MAX_NUMEL], "float32"], [[1], "float32"]],  # too many values in all
        [[[1] * (MAX_NDIM + 1), "float32"]],  # too many dimensions
        [[[1], "float32"]] * (MAX_TENSORS + 1),  # too many tensors
    ],
)
def test_hostile_tensor_lists_raise_protocol_errors(rows: object) -> None:
    with pytest.raises(ProtocolError):
        parse_tensor_list(rows)


def test_floats_only_and_byte_limit() -> None:
    rows = encode_tensor_list([TensorSpec((4,), torch.float32), TensorSpec((2,), torch.int64)])
    assert len(parse_tensor_list(rows)) == 2
    with pytest.raises(ProtocolError):
        parse_tensor_list(rows, floats_only=True)
    assert len(parse_tensor_list(rows, max_total_bytes=32)) == 2  # 4 * 4 + 2 * 8 bytes
    with pytest.raises(ProtocolError):
        parse_tensor_list(rows, max_total_bytes=31)


# ----- the chunker


def test_chunks_of_a_whole_state_restart_at_every_tensor() -> None:
    tensors = [TensorSpec((5,), torch.float32), TensorSpec((0,), torch.float32), TensorSpec((3,), torch.float64)]
    chunks = chunk_tensors(tensors, chunk_bytes=8)  # 2 float32 or 1 float64 per chunk
    assert chunks == [
        ChunkSpec(0, 0, 2, 0, 0),
        ChunkSpec(0, 2, 4, 1, 2),
        ChunkSpec(0, 4, 5, 2, 4),
        ChunkSpec(2, 0, 1, 0, 5),
        ChunkSpec(2, 1, 2, 1, 6),
        ChunkSpec(2, 2, 3, 2, 7),
    ]


@given(
    tensors=st.lists(
        st.builds(TensorSpec, shape=st.tuples(st.integers(0, 40)), dtype=st.sampled_from(FLOATS)), max_size=6
    ),
    chunk_bytes=st.integers(1, 70),
    cuts=st.lists(st.floats(0, 1), max_size=4),
)
@settings(max_examples=300, deadline=None)
def test_chunker_bounds(tensors: list[TensorSpec], chunk_bytes: int, cuts: list[float]) -> None:
    """Cutting the flat vector in consecutive ranges: every chunk is non-empty, inside one tensor, at
    most ``chunk_bytes`` raw bytes (or one value), placed at its offset in its range; together the
    chunks cover every value once, and each tensor's pieces are numbered 0, 1, 2, ... in order."""
    offsets = tensor_offsets(tensors)
    total = offsets[-1]
    bounds = [0, *sorted(round(cut * total) for cut in cuts), total]
    pieces = [0] * len(tensors)
    seen: dict[int, list[ChunkSpec]] = {index: [] for index in range(len(tensors))}
    for start, end in itertools.pairwise(bounds):
        chunks = chunk_tensors(tensors, chunk_bytes, start, end, pieces=pieces)
        position = start
        for chunk in chunks:
            spec = tensors[chunk.tensor]
            assert 0 <= chunk.start < chunk.end <= spec.numel
            assert chunk.numel <= chunk_numel(spec.dtype, chunk_bytes)
            assert chunk.numel * spec.dtype.itemsize <= chunk_bytes or chunk.numel == 1
            assert offsets[chunk.tensor] + chunk.start == position == start + chunk.offset
            position += chunk.numel
            seen[chunk.tensor].append(chunk)
        assert position == end
    for index, chunks in seen.items():
        assert [chunk.piece for chunk in chunks] == list(range(len(chunks)))
        assert all(a.end == b.start for a, b in itertools.pairwise(chunks))
        assert sum(chunk.numel for chunk in chunks) == tensors[index].numel
    assert pieces == [len(chunks) for chunks in seen.values()]


@given(numel=st.integers(0, 200), chunk_size=st.integers(1, 50))
@settings(max_examples=200, deadline=None)
def test_codec_chunks_are_the_chunker_s_chunks_of_one_tensor(numel: int, chunk_size: int) -> None:
    """compression.chunks (per-chunk codec statistics) cuts a flat tensor exactly as the layout's
    chunker cuts a tensor of ``chunk_size`` values per chunk."""
    flat = torch.arange(numel, dtype=torch.float32)
    chunks = chunk_tensors([TensorSpec((numel,), torch.float32)], chunk_bytes=4 * chunk_size)
    assert num_chunks(numel, chunk_size) == len(chunks)
    body, tail = split_chunks(flat, chunk_size)
    views = [*body, tail] if tail.numel() else list(body)
    assert [(int(v[0]), int(v[-1]) + 1) for v in views] == [(c.start, c.end) for c in chunks]
