"""State sharing without a network: configuration, DHT records, the manifest and chunk checks, the
chunk pool and the donor's snapshot cache.

Whatever a donor or a DHT writer sends, parsing raises a typed error (CorruptStateError,
ProtocolError) or returns something valid; never anything else. Multi-peer behaviour is in
test_state_sharing.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hivemind_ext.averaging.state_sharing.config import StateSharingConfig
from hivemind_ext.averaging.state_sharing.download import ChunkPool, agreed_content, agreeing_reference
from hivemind_ext.averaging.state_sharing.manifest import (
    FORMAT,
    CorruptStateError,
    Manifest,
    check_chunk,
    chunks_request,
    manifest_digest,
    parse_chunks_request,
    parse_manifest,
)
from hivemind_ext.averaging.state_sharing.records import (
    donor_subkey,
    donor_tiers,
    parse_donor_record,
    parse_donor_records,
    read_donor_records,
)
from hivemind_ext.averaging.state_sharing.snapshot import PreparedState, SnapshotCache, prepare_state
from hivemind_ext.averaging.tensor_layout import TensorSpec, chunk_tensors
from hivemind_ext.compression import (
    Float16Compression,
    NoCompression,
    ScaledFloat16Compression,
    decompress,
)
from hivemind_ext.errors import ConfigurationError, DonorBusyError, ProtocolError
from hivemind_ext.p2p.signing import signed_subkey

PEER = "12D3KooWAjvWiHM4xCJJHfShepw9DdnsihV9DbxXmGsgTdnkS5EX"
OTHER = "12D3KooWCHaHYzbaa2zuEpyho56ws1cp6NLoYunt2UG9k5NL15iu"
MAX_STATE = 1 << 30
FUZZ = settings(
    max_examples=200,
    deadline=2000,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def sample_state() -> tuple[Any, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(1000, generator=generator),
        torch.randn(7, 3, generator=generator).double(),
        torch.arange(50, dtype=torch.int64),
        torch.tensor([True, False, True]),
        torch.zeros(0, 4),
        torch.tensor(2.5),
        torch.randn(33, generator=generator).half(),
    ]
    return {"epoch": 3, "optimizer": {0: {"step": 7}}, "blob": b"\x00\x01"}, tensors


def prepared(codec: Any = None, chunk_bytes: int = 512, version: int = 3) -> PreparedState:
    return prepare_state(sample_state(), version, codec or NoCompression(), chunk_bytes)


def reassemble(state: PreparedState) -> list[torch.Tensor]:
    """What a newcomer builds from a donor's manifest and chunks (the production checks included)."""
    manifest = parse_manifest(state.manifest_bytes, state.manifest_digest, max_state_bytes=MAX_STATE)
    outputs = [torch.empty(spec.shape, dtype=spec.dtype) for spec in manifest.tensors]
    for index, (spec, chunk) in enumerate(zip(manifest.chunks, state.chunks, strict=True)):
        header = {"chunk": index, "tensor": chunk.tensor_header}
        received = check_chunk(manifest, spec, index, header, bytearray(chunk.payload_view()))
        outputs[spec.tensor].view(-1)[spec.start : spec.end].copy_(decompress(received))
    return outputs


def repacked(state: PreparedState, mutate: Callable[[dict], None]) -> tuple[bytes, bytes]:
    """The state's manifest with ``mutate`` applied to its decoded map, re-encoded with a valid digest,
    so that only the mutated field can be what parsing rejects."""
    raw = msgpack.unpackb(state.manifest_bytes, raw=False)
    mutate(raw)
    payload = msgpack.packb(raw, use_bin_type=True)
    return payload, manifest_digest(payload)


# ----- configuration


def test_config_defaults_and_codec_conversion() -> None:
    import hivemind.compression as hc

    config = StateSharingConfig(prefix="run", load_state_compression=hc.Float16Compression())
    assert isinstance(config.load_state_compression, Float16Compression)
    assert config.rpc_namespace == "run.state"
    assert isinstance(StateSharingConfig(prefix="run").load_state_compression, NoCompression)


@pytest.mark.parametrize(
    "overrides",
    [
        {"prefix": ""},
        {"prefix": "has space"},
        {"allow_state_sharing": 1},
        {"client_mode": "no"},
        {"chunk_bytes": 0},
        {"chunk_bytes": 1 << 30},
        {"max_concurrent_downloads": 0},
        {"max_parallel_donors": True},
        {"next_chunk_timeout": 0},
        {"snapshot_timeout": float("nan")},
        {"declare_state_period": float("inf")},
        {"manifest_timeout": 1.0, "snapshot_timeout": 2.0},
        {"busy_retry_delay": -1},
        {"load_state_compression": "float16"},
    ],
)
def test_config_rejects_bad_values(overrides: dict) -> None:
    with pytest.raises(ConfigurationError):
        StateSharingConfig(**{"prefix": "run", **overrides})


# ----- DHT records


def _signed(peer: str, owner: bytes = b"[owner:key-a]") -> bytes:
    return donor_subkey(peer, owner)


def test_donor_records_are_parsed_strictly() -> None:
    now = 1000.0
    good = (_signed(PEER), {"version": 5, "accepts": True}, now + 10)
    entries = [
        good,
        (_signed(OTHER), {"version": 4, "accepts": False}, now + 10),
        (PEER, {"version": 1, "accepts": True}, now + 10),  # unsigned: anyone could have written it
        (_signed(PEER), {"version": True, "accepts": True}, now + 10),  # bool is not a version
        (_signed(PEER), {"version": -1, "accepts": True}, now + 10),
        (_signed(PEER), {"version": 2**63, "accepts": True}, now + 10),
        (_signed(PEER), {"version": 1.0, "accepts": True}, now + 10),
        (_signed(PEER), {"version": 1, "accepts": 1}, now + 10),
        (_signed(PEER), {"version": 1, "accepts": True, "extra": 0}, now + 10),
        (_signed(PEER), [1, True], now + 10),
        (_signed(PEER), {"version": 1, "accepts": True}, now - 1),  # expired
        (_signed(PEER), {"version": 1, "accepts": True}, float("nan")),
        (b"bytes-subkey", {"version": 1, "accepts": True}, now + 10),
        (b"not base58 0OIl" + b"[owner:key-a]", {"version": 1, "accepts": True}, now + 10),
        (signed_subkey("other", PEER, b"[owner:key-a]"), {"version": 1, "accepts": True}, now + 10),
        (_signed(PEER), None, now + 10),
    ]
    records, skipped = read_donor_records(entries, now)
    assert [(r.peer_id, r.version, r.accepts) for r in records] == [(PEER, 5, True), (OTHER, 4, False)]
    assert skipped == len(entries) - 2
    with pytest.raises(ProtocolError):
        parse_donor_record(*entries[3], now)


def test_a_claim_under_another_key_never_hides_a_donor() -> None:
    """A key that claims an honest donor's peer id cannot say it does not accept: an accepting
    claim wins, whichever key made it (readers cannot tell which key is the donor's)."""
    honest, forged = (_signed(PEER, b"[owner:honest]"), _signed(PEER, b"[owner:forger]"))
    for order in ((0, 1), (1, 0)):
        entries = [
            (honest, {"version": 7, "accepts": True}, 5000.0),
            (forged, {"version": 0, "accepts": False}, 5000.0),
        ]
        records = parse_donor_records([entries[i] for i in order], 1000.0)
        assert [(r.peer_id, r.version, r.accepts, r.owner) for r in records] == [(PEER, 7, True, b"[owner:honest]")]
    only_refusals = [
        (honest, {"version": 7, "accepts": False}, 5000.0),
        (forged, {"version": 9, "accepts": False}, 5000.0),
    ]
    assert [r.accepts for r in parse_donor_records(only_refusals, 1000.0)] == [False]


def test_donor_tiers_rank_newest_first_and_skip_self_and_refusers() -> None:
    records = parse_donor_records(
        [
            (_signed(PEER), {"version": 3, "accepts": True}, 10.0),
            (_signed(OTHER), {"version": 7, "accepts": True}, 10.0),
            (_signed("12D3KooWself"), {"version": 9, "accepts": True}, 10.0),
            (_signed("12D3KooWoff"), {"version": 8, "accepts": False}, 10.0),
            (_signed("12D3KooWsame"), {"version": 7, "accepts": True}, 10.0),
        ],
        0.0,
    )
    tiers = donor_tiers(records, exclude="12D3KooWself", rng=random.Random(0))
    assert [version for version, _ in tiers] == [7, 3]
    assert sorted(tiers[0][1]) == sorted([OTHER, "12D3KooWsame"]) and tiers[1][1] == [PEER]
    assert donor_tiers([], exclude=None) == []


# ----- manifest and chunks


@pytest.mark.parametrize("chunk_bytes", [1, 64, 512, 1 << 20])
def test_prepared_state_round_trips_bitwise(chunk_bytes: int) -> None:
    metadata, tensors = sample_state()
    state = prepared(chunk_bytes=chunk_bytes)
    manifest = parse_manifest(state.manifest_bytes, state.manifest_digest, max_state_bytes=MAX_STATE)
    assert manifest.metadata == metadata and manifest.version == 3
    assert [(s.dtype, s.shape) for s in manifest.tensors] == [(t.dtype, tuple(t.shape)) for t in tensors]
    for got, expected in zip(reassemble(state), tensors, strict=True):
        assert got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected)


def test_lossy_codec_compresses_floats_and_sends_other_dtypes_raw() -> None:
    _, tensors = sample_state()
    tensors[0][5] = float("nan")  # the scaled codec cannot carry NaN: that chunk goes raw
    originals = [tensor.clone() for tensor in tensors]
    for codec in (Float16Compression(), ScaledFloat16Compression(), NoCompression()):
        state = prepare_state(({}, tensors), 1, codec, 512)
        assert all(
            torch.equal(
                a,
                b,
            )
            for a, b in zip(tensors[1:], originals[1:], strict=True)
        )
        assert torch.equal(tensors[0].isnan(), originals[0].isnan())  # the donor never writes into the snapshot
        if isinstance(codec, NoCompression):
            continue
        codecs = {chunk.tensor_header["codec"] for chunk in state.chunks}
        assert "none" in codecs and len(codecs) == 2
        for got, expected in zip(reassemble(state), tensors, strict=True):
            assert got.dtype == expected.dtype and got.shape == expected.shape
            if expected.dtype in (torch.float32, torch.float64) and isinstance(codec, Float16Compression):
                torch.testing.assert_close(got, expected.half().to(expected.dtype), rtol=0, atol=0, equal_nan=True)
            elif not expected.is_floating_point() or expected.dtype == torch.float16:
                assert torch.equal(got, expected)


def chunk_ranges(numel: int, dtype: torch.dtype, chunk_bytes: int) -> list[tuple[int, int]]:
    return [(c.start, c.end) for c in chunk_tensors([TensorSpec((numel,), dtype)], chunk_bytes)]


def test_chunk_ranges_tile_the_tensor() -> None:
    assert chunk_ranges(10, torch.float32, 8) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    assert chunk_ranges(0, torch.float32, 8) == []
    assert chunk_ranges(3, torch.float64, 1) == [(0, 1), (1, 2), (2, 3)]  # at least one element per chunk


def _set(path: tuple, value: Any) -> Callable[[dict], None]:
    def mutate(raw: dict) -> None:
        target = raw
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return mutate


@pytest.mark.parametrize(
    "mutate",
    [
        _set(("format",), FORMAT + 1),
        _set(("version",), -1),
        _set(("version",), True),
        _set(("snapshot",), "xyz"),
        _set(("metadata",), "not bytes"),
        _set(("metadata",), b"\xc1"),  # never-used msgpack byte
        _set(("tensors", 0, 1), "complex64"),
        _set(("tensors", 0, 0), [-1]),
        _set(("tensors", 0, 0), [2**41]),
        _set(("tensors", 0), ["float32"]),
        _set(("chunks", 1, 1), 3),  # a gap in the tiling
        _set(("chunks", 0, 2), 0),  # an empty chunk
        _set(("chunks", 0, 0), True),
        _set(("chunks", 0, 3), -5),
        _set(("chunks", 0, 4), b"short"),
        lambda raw: raw["chunks"].pop(),  # the last tensor is not covered
        lambda raw: raw["chunks"].append(raw["chunks"][-1]),  # a chunk past the end
        lambda raw: raw.pop("metadata"),
        lambda raw: raw.update(extra=1),
        lambda raw: raw["tensors"].append([[1 << 31], "float32"]),  # over max_state_bytes
    ],
)
def test_malformed_manifests_are_rejected(mutate: Callable[[dict], None]) -> None:
    payload, digest = repacked(prepared(), mutate)
    with pytest.raises(CorruptStateError):
        parse_manifest(payload, digest, max_state_bytes=MAX_STATE)


def test_manifest_digest_and_encoding_are_checked() -> None:
    state = prepared()
    corrupted = bytearray(state.manifest_bytes)
    corrupted[len(corrupted) // 2] ^= 1
    for payload, digest in [
        (bytes(corrupted), state.manifest_digest),
        (state.manifest_bytes, b"x" * 32),
        (state.manifest_bytes, None),
        (b"\xc1", hashlib.sha256(b"\xc1").digest()),
        (msgpack.packb([1, 2]), hashlib.sha256(msgpack.packb([1, 2])).digest()),
    ]:
        with pytest.raises(CorruptStateError):
            parse_manifest(payload, digest, max_state_bytes=MAX_STATE)


def test_chunk_checks_catch_every_kind_of_corruption() -> None:
    state = prepared(codec=Float16Compression())
    manifest = parse_manifest(state.manifest_bytes, state.manifest_digest, max_state_bytes=MAX_STATE)
    index, chunk = 1, state.chunks[1]
    spec = manifest.chunks[index]
    payload = bytes(chunk.payload_view())
    flipped = bytearray(payload)
    flipped[0] ^= 0x40
    header = chunk.tensor_header
    bad_inputs = [
        ({"chunk": 2, "tensor": header}, payload),  # another chunk than asked for
        ({"chunk": index}, payload),  # no tensor header
        ({"chunk": index, "tensor": {**header, "codec": "nope"}}, payload),
        ({"chunk": index, "tensor": {**header, "dtype": "float64"}}, payload),
        ({"chunk": index, "tensor": {**header, "shape": [spec.numel - 1]}}, payload),
        ({"chunk": index, "tensor": header}, payload[:-2]),  # truncated
        ({"chunk": index, "tensor": header}, bytes(flipped)),  # corrupted
    ]
    for bad_header, bad_payload in bad_inputs:
        with pytest.raises(CorruptStateError):
            check_chunk(manifest, spec, index, bad_header, bad_payload)
    check_chunk(manifest, spec, index, {"chunk": index, "tensor": header}, payload)  # the original passes


@FUZZ
@given(st.binary(max_size=300), st.integers(min_value=0, max_value=10_000))
def test_manifest_parser_fuzz(garbage: bytes, position: int) -> None:
    """Random bytes, and a valid manifest with bytes overwritten, only ever raise CorruptStateError."""
    valid = bytearray(prepared().manifest_bytes)
    position %= len(valid)
    valid[position : position + len(garbage)] = garbage
    for payload in (garbage, bytes(valid)):
        try:
            manifest = parse_manifest(payload, manifest_digest(payload), max_state_bytes=MAX_STATE)
        except CorruptStateError:
            continue
        assert isinstance(manifest, Manifest)
        assert sum(c.numel for c in manifest.chunks) == sum(t.numel for t in manifest.tensors)


def test_chunk_requests_are_validated() -> None:
    snapshot = "ab" * 16
    assert parse_chunks_request(chunks_request(snapshot, [0, 3]), snapshot, 4) == [0, 3]
    for header in [
        chunks_request("cd" * 16, [0]),
        chunks_request(snapshot, []),
        chunks_request(snapshot, [4]),
        chunks_request(snapshot, [-1]),
        chunks_request(snapshot, [True]),
        chunks_request(snapshot, list(range(5000))),
        {"op": "manifest"},
        {"op": "chunks", "snapshot": snapshot, "indices": "0"},
    ]:
        with pytest.raises(ProtocolError):
            parse_chunks_request(header, snapshot, 4)


# ----- the chunk pool


def test_chunk_pool_hands_out_by_budget_and_takes_back_in_order() -> None:
    pool = ChunkPool([100, 100, 300, 50, 50])
    assert pool.take("a", 250, at_least_one=True) == [0, 1]
    assert pool.take("b", 250, at_least_one=False) == []  # chunk 2 exceeds the budget
    assert pool.take("b", 250, at_least_one=True) == [2]  # ...unless the donor has nothing in flight
    assert pool.take("a", 1000, at_least_one=False) == [3, 4]
    pool.complete("a", 0)
    with pytest.raises(RuntimeError):
        pool.complete("b", 1)  # chunk 1 belongs to a
    assert pool.release("a") == 3  # chunks 1, 3, 4 come back, before anything else
    assert pool.take("b", 10_000, at_least_one=True) == [1, 3, 4]
    for index in (1, 2, 3, 4):
        assert not pool.finished
        pool.complete("b", index)
    assert pool.finished and pool.pending == 0 and pool.release("b") == 0


def test_the_largest_group_of_agreeing_manifests_fixes_the_download() -> None:
    def manifest(version: int, chunk_bytes: int = 256) -> Manifest:
        return prepare_state(sample_state(), version, NoCompression(), chunk_bytes).manifest

    a5, b6, c6, d5 = manifest(5), manifest(6), manifest(6), manifest(5, chunk_bytes=128)
    assert agreeing_reference([a5]) is a5
    assert agreeing_reference([a5, b6, c6]) is b6  # two donors agree on version 6
    assert agreeing_reference([a5, b6]) is b6  # one each: the newer version
    assert agreeing_reference([a5, d5, manifest(5)]) is a5  # same version, another chunk layout: outvoted
    assert agreeing_reference([d5, a5]) is d5  # a tie of one layout each within a version: the first


def test_with_agreement_a_state_needs_two_donors_and_a_majority_by_content() -> None:
    """The content digest ignores the snapshot id (a random label) and covers the metadata and every
    chunk digest: two honest donors agree, a donor serving other values or metadata does not."""

    def parsed(state: tuple[Any, list[torch.Tensor]], version: int = 5) -> Manifest:
        prepared = prepare_state(state, version, NoCompression(), 256)
        return parse_manifest(prepared.manifest_bytes, prepared.manifest_digest, max_state_bytes=1 << 30)

    metadata, tensors = sample_state()
    honest = [parsed((metadata, tensors)) for _ in range(3)]
    scaled = parsed((metadata, [t * 57 if t.is_floating_point() else t for t in tensors]))
    other_lr = parsed(({**metadata, "lr": 10000.0}, tensors))
    assert honest[0].snapshot != honest[1].snapshot and honest[0].content_digest == honest[1].content_digest
    assert scaled.content_digest != honest[0].content_digest != other_lr.content_digest
    assert agreed_content([scaled, honest[0], honest[1]]) is honest[0]
    assert agreed_content([honest[0], scaled]) is None  # one each: nobody is believed
    assert agreed_content([honest[0]]) is None  # one donor is no agreement (the loader allows a lone donor)
    assert agreed_content([honest[0], honest[1], scaled, other_lr]) is None  # 2 of 4 is no majority
    assert agreed_content([honest[0], honest[1], honest[2], scaled, other_lr]) is honest[0]


# ----- the donor's snapshot cache


class Getter:
    """A get_state that counts its calls and can be blocked like an averager holding its lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls = 0
        self.fail = False

    def __call__(self) -> tuple[Any, list[torch.Tensor]]:
        with self.lock:
            self.calls += 1
            if self.fail:
                raise ValueError("the averager has no state yet")
            return sample_state()


def run_with_cache(test: Callable[[SnapshotCache, Getter], Any], reuse_time: float = 60.0) -> None:
    getter = Getter()
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        cache = SnapshotCache(getter, codec=NoCompression(), chunk_bytes=256, reuse_time=reuse_time, executor=executor)
        asyncio.run(test(cache, getter))
    finally:
        if getter.lock.locked():
            getter.lock.release()
        executor.shutdown(wait=True)


@pytest.mark.timeout(30)
def test_snapshot_cache_takes_one_snapshot_for_concurrent_requests_and_reuses_it() -> None:
    async def test(cache: SnapshotCache, getter: Getter) -> None:
        loop = asyncio.get_running_loop()
        first = await asyncio.gather(*(cache.get(1, snapshot_timeout=5, deadline=loop.time() + 10) for _ in range(4)))
        assert getter.calls == 1 and all(state is first[0] for state in first)
        assert await cache.get(1, snapshot_timeout=5, deadline=loop.time() + 10) is first[0]
        newer = await cache.get(2, snapshot_timeout=5, deadline=loop.time() + 10)
        assert getter.calls == 2 and newer.version == 2 and cache.snapshots_taken == 2

    run_with_cache(test)


class InlineExecutor(concurrent.futures.Executor):
    """Runs each job at once in the submitting thread, so a snapshot is finished before the request
    that started it waits for it: what a fast snapshot on a loaded machine does now and then."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as e:
            future.set_exception(e)
        return future


@pytest.mark.timeout(30)
def test_snapshot_cache_counts_a_snapshot_before_serving_it_even_when_it_finished_first() -> None:
    async def test() -> None:
        cache = SnapshotCache(
            Getter(), codec=NoCompression(), chunk_bytes=256, reuse_time=60.0, executor=InlineExecutor()
        )
        deadline = asyncio.get_running_loop().time() + 10
        first = await cache.get(1, snapshot_timeout=5, deadline=deadline)
        assert cache.snapshots_taken == 1  # counted when served, not one loop iteration later
        assert await cache.get(1, snapshot_timeout=5, deadline=deadline) is first
        newer = await cache.get(2, snapshot_timeout=5, deadline=deadline)
        assert newer.version == 2 and cache.snapshots_taken == 2

    asyncio.run(test())


@pytest.mark.timeout(30)
def test_snapshot_cache_never_serves_an_older_version_than_asked_for() -> None:
    async def test(cache: SnapshotCache, getter: Getter) -> None:
        deadline = asyncio.get_running_loop().time() + 10
        for version in range(1, 6):  # each request right after the previous one finished
            assert (await cache.get(version, snapshot_timeout=5, deadline=deadline)).version == version
        old, new = await asyncio.gather(  # a request for 7 joins the snapshot in flight for 6, then takes its own
            cache.get(6, snapshot_timeout=5, deadline=deadline), cache.get(7, snapshot_timeout=5, deadline=deadline)
        )
        assert (old.version, new.version) == (6, 7) and getter.calls == 7

    run_with_cache(test)


@pytest.mark.timeout(30)
def test_snapshot_cache_answers_busy_or_serves_the_last_snapshot_while_the_state_is_locked() -> None:
    async def test(cache: SnapshotCache, getter: Getter) -> None:
        loop = asyncio.get_running_loop()
        last = await cache.get(1, snapshot_timeout=5, deadline=loop.time() + 10)
        getter.lock.acquire()  # "averaging" holds the lock
        started = time.monotonic()
        assert await cache.get(1, snapshot_timeout=0.2, deadline=loop.time() + 10) is last  # same version
        with pytest.raises(DonorBusyError):
            await cache.get(2, snapshot_timeout=0.2, deadline=loop.time() + 10)  # a newer version: nothing to serve
        assert time.monotonic() - started < 2.0
        getter.lock.release()  # the snapshot taken meanwhile finishes in the background and is kept
        for _ in range(250):
            if cache.snapshots_taken == 2:
                break
            await asyncio.sleep(0.02)
        assert cache.snapshots_taken == 2 and getter.calls == 2

    run_with_cache(test, reuse_time=0.0)


@pytest.mark.timeout(30)
def test_snapshot_cache_reports_a_failing_getter() -> None:
    async def test(cache: SnapshotCache, getter: Getter) -> None:
        getter.fail = True
        with pytest.raises(ValueError, match="no state yet"):
            await cache.get(1, snapshot_timeout=5, deadline=asyncio.get_running_loop().time() + 10)
        getter.fail = False
        assert (await cache.get(1, snapshot_timeout=5, deadline=asyncio.get_running_loop().time() + 10)).version == 1

    run_with_cache(test)


def test_prepare_state_rejects_bad_getter_output() -> None:
    for state in [None, ({},), ({}, [1, 2]), ({}, [torch.zeros(1)], [None, None]), ({"x": object()}, [])]:
        with pytest.raises(ProtocolError):
            prepare_state(state, 0, NoCompression(), 64)
    assert dataclasses.is_dataclass(prepare_state(({}, []), 0, NoCompression(), 64))
