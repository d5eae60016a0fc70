"""The all-reduce's pure parts without a network: the layout, the wire messages, the reducer's
explicit chunk bounds and late weights, the fast finiteness check, and each chunk's codec."""

from __future__ import annotations

import asyncio
import itertools
import math

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hivemind_ext.averaging.allreduce.layout import (
    CHUNK_QUANTUM_BYTES,
    member_roles,
    plan_layout,
    plan_round_layout,
    round_chunk_bytes,
)
from hivemind_ext.averaging.allreduce.partition import MemberRole
from hivemind_ext.averaging.allreduce.reducer import PartReducer, all_finite
from hivemind_ext.averaging.allreduce.round_state import chunk_codec
from hivemind_ext.averaging.allreduce.wire import (
    PROTOCOL_VERSION,
    join_message,
    pack_gather,
    parse_chunk,
    parse_join,
    parse_result_head,
    result_message,
    unpack_gather,
)
from hivemind_ext.averaging.matchmaking.group import MAX_BANDWIDTH, Member
from hivemind_ext.averaging.tensor_layout import TensorSpec, chunk_numel, parse_tensor_list
from hivemind_ext.compression import (
    BFloat16Compression,
    CompressionInfo,
    ErrorFeedback,
    Float16Compression,
    Float16OrMinMax16,
    MinMaxUInt8,
    NoCompression,
    PerTensorCompression,
    SizeAdaptiveCompression,
)
from hivemind_ext.errors import ConfigurationError, ProtocolError
from hivemind_ext.p2p import Message, pack_tensor

F32, F16, F64 = torch.float32, torch.float16, torch.float64


def specs(*shapes, dtype=F32):
    return [TensorSpec(tuple(shape), dtype) for shape in shapes]


def test_chunks_never_span_tensors_and_cover_every_part() -> None:
    tensors = specs((5,), (0,), (3,), (10,))
    layout = plan_layout(tensors, [MemberRole(1.0)] * 3, part_size_bytes=8)  # 2 float32 values per chunk
    assert [(p.start, p.end) for p in layout.parts] == [(0, 6), (6, 12), (12, 18)]
    part0 = [(c.tensor, c.start, c.end, c.piece, c.offset) for c in layout.parts[0].chunks]
    assert part0 == [(0, 0, 2, 0, 0), (0, 2, 4, 1, 2), (0, 4, 5, 2, 4), (2, 0, 1, 0, 5)]
    part1 = [(c.tensor, c.start, c.end, c.piece, c.offset) for c in layout.parts[1].chunks]
    assert part1 == [(2, 1, 3, 1, 0), (3, 0, 2, 0, 2), (3, 2, 4, 1, 4)]
    for part in layout.parts:
        assert sum(c.numel for c in part.chunks) == part.size
        assert part.bounds[0][0] == 0 and part.bounds[-1][1] == part.size


@given(
    shapes=st.lists(st.integers(0, 50), max_size=6),
    dtypes=st.lists(st.sampled_from([F32, F16, F64]), min_size=6, max_size=6),
    bandwidths=st.lists(st.sampled_from([0.5, 1.0, 3.0]), min_size=1, max_size=5),
    clients=st.lists(st.booleans(), min_size=5, max_size=5),
    part_size_bytes=st.integers(1, 64),
)
@settings(max_examples=200, deadline=None)
def test_layout_invariants(shapes, dtypes, bandwidths, clients, part_size_bytes) -> None:
    tensors = [TensorSpec((n,), dtype) for n, dtype in zip(shapes, dtypes, strict=False)]
    roles = [MemberRole(b, client_mode=c) for b, c in zip(bandwidths, clients, strict=False)]
    if all(role.client_mode for role in roles):
        with pytest.raises(ConfigurationError):
            plan_layout(tensors, roles, part_size_bytes)
        return
    layout = plan_layout(tensors, roles, part_size_bytes)
    seen = {i: [] for i in range(len(tensors))}
    for part, role in zip(layout.parts, roles, strict=True):
        if role.client_mode:
            assert part.size == 0 and not part.chunks
        for chunk in part.chunks:
            assert 0 < chunk.numel <= chunk_numel(tensors[chunk.tensor].dtype, part_size_bytes)
            seen[chunk.tensor].append(chunk)
    for index, chunks in seen.items():  # every value of every tensor in exactly one chunk, pieces in order
        assert [c.piece for c in chunks] == list(range(len(chunks)))
        assert sum(c.numel for c in chunks) == tensors[index].numel
        assert all(a.end == b.start for a, b in itertools.pairwise(chunks))
    assert plan_layout(tensors, roles, part_size_bytes).fingerprint == layout.fingerprint


def test_fingerprint_tells_layouts_apart() -> None:
    roles = [MemberRole(1.0), MemberRole(2.0)]
    base = plan_layout(specs((10,), (4, 4)), roles, 64).fingerprint
    assert plan_layout(specs((10,), (4, 4)), roles, 64).fingerprint == base
    assert plan_layout(specs((10,), (16,)), roles, 64).fingerprint != base  # shape
    assert plan_layout(specs((10,), (4, 4), dtype=F16), roles, 64).fingerprint != base  # dtype
    assert plan_layout(specs((10,), (4, 4)), roles, 32).fingerprint != base  # chunk size
    assert plan_layout(specs((10,), (4, 4)), roles[::-1], 64).fingerprint != base  # part sizes


def test_undeclared_bandwidth_is_the_mean_of_the_declared_ones() -> None:
    members = [Member("a", "x", 1.0), Member("b", "x", None), Member("c", "x", 5.0), Member("d", "x", 9.0, True)]
    assert [role.bandwidth for role in member_roles(members)] == [1.0, 3.0, 5.0, 9.0]
    assert [role.bandwidth for role in member_roles([Member("a", "x")])] == [1.0]


def members_at(*mbit: float | None) -> list[Member]:
    return [Member(f"peer{i}", "x", bandwidth) for i, bandwidth in enumerate(mbit)]


def test_huge_declared_bandwidths_still_plan_a_round() -> None:
    # four members at 1e308 Mbit/s: int(inf // quantum) raised a bare ValueError in every member's opt.step
    limit = 2 * 1024 * 1024
    assert round_chunk_bytes(members_at(1e308, 1e308, 1e308, 1e308), limit) == limit
    assert round_chunk_bytes(members_at(1e308, 100.0, 100.0, 100.0), limit) == 6 * CHUNK_QUANTUM_BYTES
    roles = member_roles(members_at(1e308, None, 1e308))  # the mean of 1e308s overflowed to inf
    assert [role.bandwidth for role in roles] == [MAX_BANDWIDTH] * 3
    layout = plan_round_layout(specs((1000,)), members_at(1e308, 1e308, 1e308, 1e308), limit)
    assert [p.size for p in layout.parts] == [250] * 4


@given(st.lists(st.none() | st.floats(0.0, 1e308) | st.sampled_from([0.0, 5e-324, 1e308]), min_size=1, max_size=8))
@settings(max_examples=200, deadline=None)
def test_any_finite_declared_bandwidths_plan_a_round(bandwidths: list[float | None]) -> None:
    limit = 2 * 1024 * 1024
    layout = plan_round_layout(specs((997,)), members_at(*bandwidths), limit)
    assert sum(p.size for p in layout.parts) == 997
    assert 0 < layout.part_size_bytes <= limit


def test_chunk_size_follows_the_slowest_declared_link() -> None:
    limit = 2 * 1024 * 1024
    # the drain, N - 1 chunks through the slowest link, fits in 0.1 s: 0.1 x 12.5e6 / 3 bytes -> 6 quanta
    assert round_chunk_bytes(members_at(100.0, 100.0, 100.0, 100.0), limit) == 6 * CHUNK_QUANTUM_BYTES
    assert round_chunk_bytes(members_at(20.0, 100.0, 100.0, 100.0), limit) == CHUNK_QUANTUM_BYTES
    assert round_chunk_bytes(members_at(200.0, 200.0, 200.0), limit) == 19 * CHUNK_QUANTUM_BYTES  # 0.1 x 25e6 / 2
    assert round_chunk_bytes(members_at(5000.0, 5000.0, 5000.0, 5000.0), limit) == limit  # fast links: the limit
    assert round_chunk_bytes(members_at(None, None, None), limit) == limit  # nobody knows yet: the limit
    assert round_chunk_bytes(members_at(100.0, None, None, None), limit) == 6 * CHUNK_QUANTUM_BYTES  # as typical
    assert round_chunk_bytes(members_at(0.0, 100.0), limit) == CHUNK_QUANTUM_BYTES  # a liar gets one quantum, not 0
    assert round_chunk_bytes(members_at(20.0), limit) == limit  # alone: nothing crosses a link
    assert round_chunk_bytes(members_at(20.0, 20.0), 4096) == 4096  # never above the configured size
    # the same on every member: the members' order does not matter, and the layout records the choice
    assert round_chunk_bytes(members_at(100.0, 300.0, 20.0)[::-1], limit) == round_chunk_bytes(
        members_at(100.0, 300.0, 20.0), limit
    )
    tensors = specs((2**20,))
    thin = plan_round_layout(tensors, members_at(20.0, 20.0, 20.0, 20.0), limit)
    unknown = plan_round_layout(tensors, members_at(None, None, None, None), limit)
    assert (thin.part_size_bytes, unknown.part_size_bytes) == (CHUNK_QUANTUM_BYTES, limit)
    assert [len(part.chunks) for part in thin.parts] == [16] * 4 and [len(p.chunks) for p in unknown.parts] == [1] * 4
    assert thin.fingerprint != unknown.fingerprint  # members that disagree refuse each other's streams


@pytest.mark.parametrize(
    "description",
    [None, [[[3], "int64"]], [[[-1], "float32"]], [[[3]]], [[3, "float32"]], [[[2**41], "float32"]], "x"],
)
def test_tensor_descriptions_from_peers_are_validated(description) -> None:
    with pytest.raises(ProtocolError):
        parse_tensor_list(description, floats_only=True)


def test_join_round_trip_and_rejections() -> None:
    tensors = specs((3, 4), (0,))
    message = join_message(b"group", b"f" * 16, 2.5, pack_gather({"batch": 7}, 1024), tensors)
    join = parse_join(message, 1024)
    assert (join.group_id, join.fingerprint, join.weight, join.tensors) == (b"group", b"f" * 16, 2.5, tensors)
    assert unpack_gather(join.gather) == {"batch": 7}
    for header_update in [{"v": PROTOCOL_VERSION + 1}, {"weight": math.inf}, {"weight": True}, {"layout": b"x"}]:
        with pytest.raises(ProtocolError):
            parse_join(Message({**message.header, **header_update}, message.payload), 1024)
    with pytest.raises(ProtocolError):
        parse_join(message, 2)  # gather larger than the receiver accepts
    with pytest.raises(ConfigurationError):
        pack_gather(object(), 1024)
    with pytest.raises(ConfigurationError):
        pack_gather("x" * 100, 10)


def test_result_head_round_trip_and_rejections() -> None:
    members = frozenset({"a", "b", "c"})
    head = parse_result_head(result_message(["a", "c"], 3, {"a": b"\x01"}), members)
    assert head.contributors == ("a", "c") and head.num_chunks == 3 and head.gathered == {"a": b"\x01"}
    bad = [
        result_message(["a", "z"], 1, {}),  # a stranger
        result_message(["a", "a"], 1, {}),  # twice
        result_message(["a"], -1, {}),
        result_message(["a"], 1, {"z": b""}),
        Message({"contributors": ["a"], "chunks": 1}, b"\xc1"),  # invalid msgpack
        Message({"refused": "no"}),
    ]
    for message in bad:
        with pytest.raises(ProtocolError):
            parse_result_head(message, members)


@given(
    header=st.dictionaries(
        st.sampled_from(["v", "group", "layout", "weight", "i", "tensor", "x"]),
        st.none() | st.integers() | st.binary(max_size=20) | st.text(max_size=5) | st.floats(),
    ),
    payload=st.binary(max_size=64),
)
@settings(max_examples=300, deadline=None)
def test_parsers_raise_only_protocol_errors(header, payload) -> None:
    message = Message(header, payload)
    for parse in (
        lambda: parse_join(message, 1024),
        lambda: parse_chunk(message),
        lambda: parse_result_head(message, frozenset({"a"})),
    ):
        try:
            parse()
        except ProtocolError:
            pass


def test_chunk_round_trip() -> None:
    values = torch.arange(5.0)
    index, message = parse_chunk(pack_tensor(NoCompression().compress(values), i=4))
    assert index == 4 and message.shape == (5,)
    with pytest.raises(ProtocolError):
        parse_chunk(Message({"i": "4", "tensor": {}}, b""))


def test_reducer_with_explicit_bounds_and_late_weights() -> None:
    codec = NoCompression()
    reducer = PartReducer(6, 1, {"a": 0.0, "b": 0.0}, bounds=[(0, 1), (1, 4), (4, 6)])
    reducer.set_weight("a", 1.0)
    reducer.set_weight("b", 3.0)
    a, b = torch.arange(6.0), torch.full((6,), 2.0)
    for sender, values in (("a", a), ("b", b)):
        for index, (start, end) in enumerate(reducer.bounds):
            reducer.accept(sender, index, codec.compress(values[start:end]))
    with pytest.raises(ProtocolError):
        reducer.set_weight("a", 5.0)  # too late: its chunks are in
    result = reducer.finalize()
    torch.testing.assert_close(result.values, (a + 3 * b) / 4)
    with pytest.raises(ProtocolError):
        PartReducer(2, 1, {"a": 0.0}).set_weight("a", -1.0)
    with pytest.raises(ConfigurationError):
        PartReducer(6, 1, {}, bounds=[(0, 2), (3, 6)])  # a gap


def test_all_finite_matches_the_exact_check() -> None:
    big = torch.full((10,), 3e38)  # a finite tensor whose sum overflows: falls back to the exact check
    cases = [torch.zeros(0), torch.randn(100), big, torch.tensor([1.0, float("nan")]), torch.tensor([float("-inf")])]
    for values in cases:
        assert all_finite(values) == bool(torch.isfinite(values).all())
    assert all_finite(torch.tensor([60000.0, 60000.0], dtype=F16))  # float16 sum overflows, values do not


def test_gather_data_round_trips_arbitrary_msgpack() -> None:
    data = {"a": [1, 2.5, None, b"raw"], 3: {"nested": True}}
    assert unpack_gather(pack_gather(data, 1024)) == data
    with pytest.raises(ProtocolError):
        unpack_gather(msgpack.packb([1])[:-1] + b"\xc1")


def test_float16_chunks_of_float32_and_float64_tensors_travel_as_float16_or_minmax16() -> None:
    """Same bytes as float16, never less precise (see test_compression_minmax16.py); float16 tensors,
    other codecs and wrappers that keep state (error feedback) are left alone."""
    f16, f32, f64 = (CompressionInfo(key=0, shape=(10,), dtype=dtype) for dtype in (F16, F32, F64))
    assert isinstance(chunk_codec(Float16Compression(), f32), Float16OrMinMax16)
    assert isinstance(chunk_codec(Float16Compression(), f64), Float16OrMinMax16)
    assert type(chunk_codec(Float16Compression(), f16)) is Float16Compression
    per_tensor = PerTensorCompression([Float16Compression(), MinMaxUInt8()])
    assert isinstance(chunk_codec(per_tensor, f32), Float16OrMinMax16)  # an adaptive wrapper's pick
    assert chunk_codec(per_tensor, CompressionInfo(key=1, shape=(10,))) is per_tensor
    by_size = SizeAdaptiveCompression(5, less=NoCompression(), greater_equal=Float16Compression())
    assert isinstance(chunk_codec(by_size, f32), Float16OrMinMax16)
    for codec in (NoCompression(), BFloat16Compression(), MinMaxUInt8(), ErrorFeedback(Float16Compression())):
        assert chunk_codec(codec, f32) is codec


def test_lead_holds_a_sender_until_the_averages_catch_up_and_gives_up_on_a_stall() -> None:
    from hivemind_ext.averaging.allreduce.sender import Lead
    from hivemind_ext.p2p import now

    async def scenario() -> None:
        lead = Lead(limit=2, give_up_after=10.0, until=now() + 10.0)
        await lead.wait_to_send(0)
        await lead.wait_to_send(1)  # two chunks ahead of no average: allowed
        held = asyncio.ensure_future(lead.wait_to_send(2))
        await asyncio.sleep(0.05)
        assert not held.done()  # a third would run ahead of the limit
        lead.averaged()
        await asyncio.wait_for(held, 1.0)
        assert lead.paced

        stalled = Lead(limit=1, give_up_after=0.1, until=now() + 10.0)
        start = now()
        await stalled.wait_to_send(1)  # no average comes: the wait ends after give_up_after
        assert 0.09 <= now() - start < 1.0 and not stalled.paced
        start = now()
        await stalled.wait_to_send(5)  # and pacing is over for good
        assert now() - start < 0.05

        late = Lead(limit=1, give_up_after=10.0, until=now() - 1.0)
        await asyncio.wait_for(late.wait_to_send(3), 0.05)  # past `until`: no pacing at all
        assert not late.paced

    asyncio.run(scenario())
