"""Butterfly all-reduce between real peers on 127.0.0.1: weighted means, roles, codecs, gather, routing.

Faults are in test_allreduce_faults.py; the pure layout in test_allreduce_layout.py. One swarm of
daemons serves the whole module (see allreduce_swarm.py).
"""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import torch
from allreduce_swarm import Swarm, check_round, config, flat, group_of, make_tensors, run_round, swarm_fixtures

from hivemind_ext.averaging.allreduce import sender
from hivemind_ext.averaging.allreduce.service import AllreduceConfig, AllreduceResult, RoundHooks
from hivemind_ext.averaging.allreduce.wire import HANDLER_NAME, PROTOCOL_VERSION
from hivemind_ext.compression import (
    CompressionInfo,
    Float16Compression,
    MinMaxUInt8,
    NoCompression,
    PerTensorCompression,
)
from hivemind_ext.errors import AllreduceError, ConfigurationError
from hivemind_ext.p2p import Message

pytestmark = pytest.mark.timeout(60)
swarm, no_leftover_tasks = swarm_fixtures(4)

SHAPES = [(7, 13), (0,), (1000,), (3, 1, 5), (1,), (257,)]  # 1364 values; one tensor empty


def inputs_for(count: int, shapes=SHAPES, dtypes=None, seed: int = 0):
    return [make_tensors(shapes, seed + i, dtypes) for i in range(count)]


@pytest.mark.parametrize("size", [2, 3, 4])
def test_weighted_mean_with_uneven_parts_and_many_chunks(swarm: Swarm, size: int) -> None:
    peers = swarm.peers[:size]
    group = group_of([p.member() for p in peers])
    inputs, weights = inputs_for(size), [1.0, 2.5, 0.5, 4.0][:size]
    outcomes = swarm.run(run_round(peers, group, inputs, weights=weights, config=config(part_size_bytes=400)))
    check_round(peers, inputs, weights, outcomes, honest=range(size))
    total = sum(t.numel() for t in inputs[0])
    for outcome in outcomes:
        result = outcome.result
        assert result.all_averaged and not result.excluded
        assert [p.end - p.start for p in result.parts] == [total // size + (i < total % size) for i in range(size)]
        assert [part.owner for part in result.parts] == [p.peer_id for p in peers]
        assert all(part.contributors == tuple(p.peer_id for p in peers) for part in result.parts)
        assert {str(k): v["index"] for k, v in result.gathered.items()} == {p.name: i for i, p in enumerate(peers)}


class SlowLastChunk(RoundHooks):
    """Sender side: holds back the last chunk of its slice of part 0 for ``delay`` seconds."""

    def __init__(self, last: int, delay: float) -> None:
        self.last, self.delay = last, delay

    async def before_send_chunk(self, owner, part: int, index: int, message: Message) -> Message:
        if part == 0 and index == self.last:
            await asyncio.sleep(self.delay)
        return message


class Timeline(RoundHooks):
    """Owner side: when each chunk of each sender arrived and each averaged chunk went out (loop time)."""

    def __init__(self) -> None:
        self.received: dict[tuple[str, int], float] = {}
        self.sent: dict[tuple[str, int | None], float] = {}

    async def after_receive_chunk(self, sender, part: int, index: int, message: Message) -> None:
        self.received[str(sender), index] = asyncio.get_running_loop().time()

    async def before_send_result(self, sender, part: int, index: int | None, message: Message) -> Message:
        self.sent[str(sender), index] = asyncio.get_running_loop().time()
        return message


def test_owner_streams_each_averaged_chunk_back_before_its_part_is_complete(swarm: Swarm) -> None:
    # the owner returns chunk 0 of the average while the last chunk of its part is still on its way
    peers = swarm.peers[:2]
    inputs = inputs_for(2, shapes=[(1600,)])
    cfg = config(part_size_bytes=400)  # part 0: 800 values, 8 chunks
    timeline = Timeline()
    hooks = {0: timeline, 1: SlowLastChunk(last=7, delay=0.5)}
    outcomes = swarm.run(run_round(peers, group_of([p.member() for p in peers]), inputs, config=cfg, hooks=hooks))
    check_round(peers, inputs, [1.0, 1.0], outcomes, honest=range(2))
    assert outcomes[0].result.complete and outcomes[1].result.complete
    slow = str(peers[1].peer_id)
    last_in = timeline.received[slow, 7]
    assert timeline.sent[slow, 0] < last_in - 0.3  # the first averaged chunk went out well before
    assert timeline.sent[slow, 6] < last_in < timeline.sent[slow, 7]


class SendTimes(RoundHooks):
    """Sender side: when it sent each chunk of its slice of part 0, and, with ``delay``, a pause before each."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.sent: dict[int, float] = {}

    async def before_send_chunk(self, owner, part: int, index: int, message: Message) -> Message:
        if part == 0:
            await asyncio.sleep(self.delay)
            self.sent[index] = asyncio.get_running_loop().time()
        return message


def test_a_fast_sender_stays_a_few_chunks_ahead_of_the_averages(swarm: Swarm) -> None:
    # peer 2 sends its slice of part 0 slowly; peer 1 could send its own at once, but the owner
    # averages chunk i only once both have delivered it, so peer 1 runs at most MAX_LEAD_CHUNKS chunks
    # ahead of the averages it got back (on shaped links, racing ahead takes link time from the others)
    peers = swarm.peers[:3]
    inputs = inputs_for(3, shapes=[(7200,)], seed=60)
    cfg = config(part_size_bytes=400)  # parts of 2400 values: 24 chunks each
    owner, fast, slow = Timeline(), SendTimes(), SendTimes(delay=0.02)
    outcomes = swarm.run(
        run_round(peers, group_of([p.member() for p in peers]), inputs, config=cfg, hooks={0: owner, 1: fast, 2: slow})
    )
    check_round(peers, inputs, [1.0] * 3, outcomes, honest=range(3))
    assert all(o.result.complete for o in outcomes)
    name, lead = str(peers[1].peer_id), sender.MAX_LEAD_CHUNKS
    assert sorted(fast.sent) == list(range(24)) and 24 > lead + 4
    for index in range(lead, 24):  # chunk i left only after average i - lead had gone back to it
        assert fast.sent[index] >= owner.sent[name, index - lead]
    assert fast.sent[23] - fast.sent[0] > 0.02 * (23 - lead)  # so it kept to the slow sender's pace


def test_pacing_gives_way_to_a_sender_slower_than_half_the_idle_window(swarm: Swarm) -> None:
    # no average comes back for 0.8 s (half the idle window is 0.5 s): the fast sender stops pacing
    # and delivers its whole slice, as it did before pacing existed, and nobody is cut
    peers = swarm.peers[:3]
    inputs = inputs_for(3, shapes=[(7200,)], seed=61)
    cfg = config(part_size_bytes=400, next_chunk_timeout=1.0)
    owner, fast, slow = Timeline(), SendTimes(), SlowLastChunk(last=0, delay=0.8)
    outcomes = swarm.run(
        run_round(peers, group_of([p.member() for p in peers]), inputs, config=cfg, hooks={0: owner, 1: fast, 2: slow})
    )
    check_round(peers, inputs, [1.0] * 3, outcomes, honest=range(3))
    assert all(o.result.complete and not o.result.excluded for o in outcomes)
    assert fast.sent[23] - fast.sent[0] < 0.75  # after one wait given up (0.5 s), the rest went out at once
    assert fast.sent[23] < owner.received[str(peers[2].peer_id), 0]


def test_declared_thin_links_make_chunks_smaller_and_the_mean_stays_exact(swarm: Swarm) -> None:
    # 3 peers at 20 Mbit/s: the pipeline's tail, 2 chunks through a link, fits 0.1 s in one 64 KiB quantum
    # (layout.round_chunk_bytes); with nothing declared the round keeps the configured 2 MiB
    peers = swarm.peers[:3]
    inputs = inputs_for(3, shapes=[(3, 20000)], seed=90)  # parts of 20000 values: 2 chunks of <= 16384, or 1
    cfg = config(part_size_bytes=2**21)
    for bandwidth, chunk_bytes, chunks_per_part in [(20.0, 2**16, 2), (None, 2**21, 1)]:
        timelines = {i: Timeline() for i in range(3)}
        group = group_of([p.member(bandwidth=bandwidth) for p in peers])
        outcomes = swarm.run(run_round(peers, group, inputs, config=cfg, hooks=timelines))
        check_round(peers, inputs, [1.0] * 3, outcomes, honest=range(3))
        assert all(o.result.complete and o.result.chunk_bytes == chunk_bytes for o in outcomes)
        for timeline in timelines.values():  # each owner got chunks 0..k-1 from each of the two other peers
            assert sorted(index for _, index in timeline.received) == sorted(list(range(chunks_per_part)) * 2)


def test_butterfly_bytes_match_the_minimum(swarm: Swarm) -> None:
    peers = swarm.peers
    group = group_of([p.member() for p in peers])
    inputs = inputs_for(4, shapes=[(4000,)])
    outcomes = swarm.run(run_round(peers, group, inputs, config=config()))
    check_round(peers, inputs, [1.0] * 4, outcomes, honest=range(4))
    for outcome in outcomes:
        chunk_bytes = 2 * (4 - 1) / 4 * 4000 * 4  # 2 (N-1)/N x size, plus the small gather maps
        assert chunk_bytes <= outcome.result.bytes_sent <= chunk_bytes + 2000
        assert chunk_bytes <= outcome.result.bytes_received <= chunk_bytes + 2000


def test_a_round_resolves_each_member_name_once_per_member(swarm: Swarm, monkeypatch) -> None:
    """Names (base58) become PeerIDs once per member and round: the member list. PeerID.from_base58
    runs base58 in pure Python both ways, and a round used to resolve every contributor of every part
    on every stream (N (N - 1) streams of N names each) and every member's gather data again: 14% of
    a small round's CPU at 8 peers."""
    from hivemind.p2p import PeerID

    conversions = []
    original = PeerID.from_base58.__func__
    monkeypatch.setattr(
        PeerID, "from_base58", classmethod(lambda cls, name: conversions.append(name) or original(cls, name))
    )
    peers = swarm.peers
    group = group_of([p.member() for p in peers])
    inputs = inputs_for(4, shapes=[(4000,)])
    outcomes = swarm.run(run_round(peers, group, inputs, config=config()))
    check_round(peers, inputs, [1.0] * 4, outcomes, honest=range(4))
    assert all(set(o.result.gathered) == {p.peer_id for p in peers} for o in outcomes)
    assert len(conversions) <= len(peers) * len(peers), len(conversions)  # each member's group.peer_ids


def test_mixed_dtypes_keep_their_dtype(swarm: Swarm) -> None:
    peers = swarm.peers[:3]
    dtypes = [torch.float16, torch.float64, torch.float32, torch.bfloat16, torch.float32, torch.float64]
    inputs, weights = inputs_for(3, dtypes=dtypes, seed=10), [1.0, 2.0, 3.0]
    outcomes = swarm.run(
        run_round(peers, group_of([p.member() for p in peers]), inputs, weights=weights, config=config())
    )
    check_round(peers, inputs, weights, outcomes, honest=range(3), atol=1e-2, rtol=1e-2)  # half-precision outputs
    for outcome in outcomes:
        assert [t.dtype for t in outcome.result.tensors] == dtypes


@pytest.mark.parametrize(
    ("codec", "atol", "rtol"),
    [(NoCompression(), 1e-6, 1e-6), (Float16Compression(), 1e-2, 2e-3), (MinMaxUInt8(), None, 0.0)],
    ids=["none", "float16", "minmax_uint8"],
)
def test_codecs_stay_within_their_error_bound(swarm: Swarm, codec, atol, rtol) -> None:
    peers = swarm.peers
    inputs, weights = inputs_for(4, seed=20), [3.0, 1.0, 1.0, 2.0]
    if atol is None:  # 8-bit: each value is off by at most half a step of its chunk, once each way
        values = torch.cat([flat(x) for x in inputs])
        atol = float(values.max() - values.min()) / 255
    cfg = config(compression=codec)
    outcomes = swarm.run(run_round(peers, group_of([p.member() for p in peers]), inputs, weights=weights, config=cfg))
    check_round(peers, inputs, weights, outcomes, honest=range(4), atol=atol, rtol=rtol)
    for outcome in outcomes:
        assert outcome.result.all_averaged


def test_float16_rounds_are_more_precise_than_float16_and_identical_everywhere(swarm: Swarm) -> None:
    """With Float16Compression, chunks travel as Float16OrMinMax16 both ways (same bytes): every member
    gets the same values (check_round), far closer to the mean than float16 could hold it."""
    peers = swarm.peers
    inputs = [[10 + torch.rand(3000, generator=torch.Generator().manual_seed(50 + i))] for i in range(4)]
    cfg = config(compression=Float16Compression())
    outcomes = swarm.run(run_round(peers, group_of([p.member() for p in peers]), inputs, config=cfg))
    check_round(peers, inputs, [1.0] * 4, outcomes, honest=range(4), atol=1e-3, rtol=0)
    mean = sum(tensors[0] for tensors in inputs) / 4
    float16_error = torch.mean((mean.half().float() - mean) ** 2).item()
    for outcome in outcomes:
        assert outcome.result.all_averaged
        assert torch.mean((outcome.result.tensors[0] - mean) ** 2).item() < float16_error / 1000


def test_client_mode_and_auxiliary_members(swarm: Swarm) -> None:
    """A client-mode member owns no part but contributes; an auxiliary member (no tensors) reduces a part."""
    peers = swarm.peers
    members = [peers[0].member(), peers[1].member(client_mode=True), peers[2].member(auxiliary=True), peers[3].member()]
    inputs = inputs_for(4, seed=30)
    inputs[2] = []  # the auxiliary member learns the layout from the senders
    weights = [1.0, 2.0, 0.0, 3.0]
    outcomes = swarm.run(run_round(peers, group_of(members), inputs, weights=weights, config=config()))
    check_round(peers, inputs, weights, outcomes, honest=[0, 1, 3])
    owners = [peers[0].peer_id, peers[2].peer_id, peers[3].peer_id]
    for i in (0, 1, 3):
        result = outcomes[i].result
        assert [part.owner for part in result.parts] == owners  # the client-mode member owns nothing
        assert all(
            set(part.contributors) == {peers[0].peer_id, peers[1].peer_id, peers[3].peer_id} for part in result.parts
        )
        assert set(result.gathered) == {p.peer_id for p in peers}
    aux = outcomes[2].result
    assert (
        aux.tensors == [] and len(aux.parts) == 3 and aux.parts[1].averaged and aux.parts[1].owner == peers[2].peer_id
    )
    assert not aux.parts[0].averaged and aux.parts[0].contributors == ()
    assert {peers[0].peer_id, peers[1].peer_id, peers[3].peer_id} <= set(aux.gathered)


def test_a_slow_member_that_owns_nothing_holds_nobody_up(swarm: Swarm) -> None:
    # one member at 1/10 of the others' bandwidth: the optimal split gives it no part (see partition.py)
    peers = swarm.peers
    members = [peers[0].member(bandwidth=10.0)] + [p.member(bandwidth=100.0) for p in peers[1:]]
    inputs = inputs_for(4, seed=60)
    outcomes = swarm.run(run_round(peers, group_of(members), inputs, config=config(part_size_bytes=400)))
    check_round(peers, inputs, [1.0] * 4, outcomes, honest=range(4))
    for outcome in outcomes:
        result = outcome.result
        assert result.all_averaged and not result.excluded
        assert result.parts[0].end == result.parts[0].start  # its part is empty, and counts as averaged
        assert outcome.seconds < 1.5  # nobody waited for a JOIN or a chunk to it (next_chunk_timeout is 2 s)


def test_auxiliary_member_with_tensors_and_bandwidth_weighted_parts(swarm: Swarm) -> None:
    peers = swarm.peers[:3]
    members = [peers[0].member(bandwidth=1.0), peers[1].member(bandwidth=3.0, auxiliary=True), peers[2].member()]
    inputs, weights = inputs_for(3, seed=40), [1.0, 0.0, 1.0]
    outcomes = swarm.run(run_round(peers, group_of(members), inputs, weights=weights, config=config()))
    check_round(peers, inputs, weights, outcomes, honest=[0, 2])
    sizes = [part.end - part.start for part in outcomes[0].result.parts]
    assert sizes == [227, 682, 455]  # 1364 values by bandwidths 1 : 3 : (undeclared: the mean) 2
    aux = outcomes[1].result
    torch.testing.assert_close(flat(aux.tensors)[227:909], flat(outcomes[0].result.tensors)[227:909])
    torch.testing.assert_close(flat(aux.tensors)[:227], flat(inputs[1])[:227])  # the rest stays as given


def test_empty_tensors_still_gather(swarm: Swarm) -> None:
    peers = swarm.peers[:3]
    inputs = [[torch.zeros(0), torch.zeros(2, 0)] for _ in peers]
    outcomes = swarm.run(run_round(peers, group_of([p.member() for p in peers]), inputs, config=config()))
    for outcome in outcomes:
        result = outcome.result
        assert [t.shape for t in result.tensors] == [(0,), (2, 0)] and result.all_averaged
        assert {v["index"] for v in result.gathered.values()} == {0, 1, 2}


def test_single_member_group(swarm: Swarm) -> None:
    peer = swarm.peers[0]
    inputs = inputs_for(1, seed=50)
    outcomes = swarm.run(run_round([peer], group_of([peer.member()]), inputs, weights=[2.0], config=config()))
    check_round([peer], inputs, [2.0], outcomes, honest=[0], atol=0, rtol=0)


def test_per_tensor_codec_gets_tensor_keys(swarm: Swarm) -> None:
    """Chunks never span tensors, so a per-tensor codec sees each tensor's own key."""
    peers = swarm.peers[:2]
    codec = PerTensorCompression([NoCompression(), Float16Compression(), NoCompression()])
    inputs = inputs_for(2, shapes=[(300,), (300,), (300,)], seed=60)
    group = group_of([p.member() for p in peers])

    async def both() -> list[AllreduceResult]:
        infos = [CompressionInfo(key=i, shape=(300,)) for i in range(3)]
        cfg = config(compression=codec)
        return await asyncio.gather(
            *(p.service.run_round(group, x, config=cfg, tensor_infos=infos) for p, x in zip(peers, inputs, strict=True))
        )

    results = swarm.run(both())
    mean = [(a + b) / 2 for a, b in zip(*inputs, strict=True)]
    for result in results:
        torch.testing.assert_close(result.tensors[0], mean[0], atol=1e-6, rtol=0)  # exact
        torch.testing.assert_close(result.tensors[1], mean[1], atol=1e-2, rtol=1e-3)  # float16
        assert not torch.equal(result.tensors[1], mean[1])


def test_stream_before_the_round_starts_waits_for_it(swarm: Swarm) -> None:
    peers = swarm.peers[:3]
    inputs = inputs_for(3, seed=70)
    group = group_of([p.member() for p in peers])
    outcomes = swarm.run(run_round(peers, group, inputs, config=config(), delays={2: 0.5}))
    check_round(peers, inputs, [1.0] * 3, outcomes, honest=range(3))
    assert all(o.result.all_averaged for o in outcomes)


def test_mismatched_layouts_are_refused_and_keep_local_values(swarm: Swarm) -> None:
    peers = swarm.peers[:3]
    inputs = inputs_for(3, seed=80)
    inputs[2] = make_tensors([(7, 13), (1000,)], seed=1)  # a member that averages other tensors
    outcomes = swarm.run(run_round(peers, group_of([p.member() for p in peers]), inputs, config=config()))
    check_round(peers, inputs, [1.0] * 3, outcomes, honest=range(3))
    for i in (0, 1):
        result = outcomes[i].result
        assert peers[2].peer_id in result.excluded and not result.parts[2].averaged
        assert [len(p.contributors) for p in result.parts[:2]] == [2, 2]
    assert not any(part.averaged for part in outcomes[2].result.parts[:2])


def test_refusals_for_unknown_groups_and_strangers(swarm: Swarm) -> None:
    """A stream for a group that is not running, or from a peer outside the group, is refused."""
    peers = swarm.peers

    async def join_once(sender, owner, group_id: bytes) -> Message:
        header = {"v": PROTOCOL_VERSION, "group": group_id, "layout": b"x" * 16, "weight": 1.0}
        body = msgpack.packb({"gather": msgpack.packb(None), "tensors": []})
        async with await sender.service.rpc_client.open_stream(owner.peer_id, HANDLER_NAME, timeout=5) as stream:
            await stream.send(Message(header, body))
            return await stream.receive()

    unknown = swarm.run(join_once(peers[0], peers[1], b"no such group"))
    assert "refused" in unknown.header and "in time" in unknown.header["refused"]

    group = group_of([p.member() for p in peers[1:3]])
    inputs = inputs_for(2, seed=90)

    async def stranger_during_round() -> tuple[Message, list]:
        round_task = asyncio.ensure_future(run_round(peers[1:3], group, inputs, config=config(), delays={1: 0.5}))
        await asyncio.sleep(0.1)  # peers[1] runs the round, waiting for peers[2]
        refused = await join_once(peers[0], peers[1], group.group_id)
        return refused, await round_task

    refused, outcomes = swarm.run(stranger_during_round())
    assert "not a member" in refused.header["refused"]
    check_round(peers[1:3], inputs, [1.0, 1.0], outcomes, honest=[0, 1])
    finished = swarm.run(join_once(peers[2], peers[1], group.group_id))
    assert "over" in finished.header["refused"]


def test_invalid_arguments_raise_typed_errors(swarm: Swarm) -> None:
    peer, other = swarm.peers[0], swarm.peers[1]
    group = group_of([peer.member(), other.member()])
    service = peer.service
    cases = [
        (ConfigurationError, dict(tensors=[torch.zeros(3, dtype=torch.int64)])),
        (ConfigurationError, dict(weight=-1.0)),
        (ConfigurationError, dict(weight=float("nan"))),
        (ConfigurationError, dict(gather=object())),
        (ConfigurationError, dict(config=AllreduceConfig(part_size_bytes=2**27))),
        (AllreduceError, dict(group=group_of([other.member()]))),
        (AllreduceError, dict(group=group_of([peer.member(), peer.member()]))),
    ]
    for error, overrides in cases:
        arguments = dict(group=group, tensors=[torch.zeros(3)], weight=1.0, gather=None, config=config())
        arguments.update(overrides)
        group_arg, tensors = arguments.pop("group"), arguments.pop("tensors")
        with pytest.raises(error):
            swarm.run(service.run_round(group_arg, tensors, **arguments))


@pytest.mark.parametrize(
    "overrides",
    [
        dict(part_size_bytes=0),
        dict(part_size_bytes=1.5),
        dict(next_chunk_timeout=0),
        dict(allreduce_timeout=float("inf")),
        dict(allreduce_timeout=10, collect_timeout=10),
        dict(compression="none"),
        dict(offload_codecs=1),
    ],
)
def test_config_checks(overrides) -> None:
    with pytest.raises(ConfigurationError):
        AllreduceConfig(**overrides)


def test_config_defaults_resolve_none() -> None:
    cfg = AllreduceConfig(allreduce_timeout=None, next_chunk_timeout=None)
    assert cfg.allreduce_timeout == 60.0 and cfg.next_chunk_timeout == 5.0 and cfg.collect_timeout == 45.0


def test_offloaded_codec_work_gives_the_same_result(swarm: Swarm) -> None:
    peers = swarm.peers
    inputs, weights = inputs_for(4, seed=100), [1.0, 1.0, 2.0, 2.0]
    cfg = config(offload_codecs=True, compression=Float16Compression())
    outcomes = swarm.run(run_round(peers, group_of([p.member() for p in peers]), inputs, weights=weights, config=cfg))
    check_round(peers, inputs, weights, outcomes, honest=range(4), atol=1e-2, rtol=2e-3)


class _Pause(RoundHooks):
    """Holds every stream of its peer before its first chunk, so the round is surely in progress."""

    def __init__(self) -> None:
        self.paused = asyncio.Event()

    async def before_send_chunk(self, owner, part, index, message):
        self.paused.set()
        await asyncio.sleep(60)
        return message


def test_cancelling_a_round_cleans_up_and_the_others_finish(swarm: Swarm) -> None:
    peers = swarm.peers
    inputs = inputs_for(4, seed=110)
    group = group_of([p.member() for p in peers])
    cfg = config(next_chunk_timeout=1.0, allreduce_timeout=4.0)
    pause = _Pause()

    async def cancel_one() -> list:
        tasks: dict = {}
        running = asyncio.ensure_future(run_round(peers, group, inputs, config=cfg, hooks={3: pause}, tasks_out=tasks))
        await pause.paused.wait()
        tasks[3].cancel()
        return await running

    outcomes = swarm.run(cancel_one())
    assert isinstance(outcomes[3].error, asyncio.CancelledError)  # re-raised, never swallowed
    check_round(peers, inputs, [1.0] * 4, outcomes, honest=[0, 1, 2])
    for i in range(3):
        assert peers[3].peer_id in outcomes[i].result.excluded
        assert outcomes[i].seconds < cfg.next_chunk_timeout + 1.0  # its streams broke at once


def test_results_written_into_given_outputs(swarm: Swarm) -> None:
    peers = swarm.peers[:2]
    inputs = inputs_for(2, seed=120)
    outs = [[torch.full_like(t, 7.0) for t in x] for x in inputs]
    group = group_of([p.member() for p in peers])

    async def both() -> list[AllreduceResult]:
        return await asyncio.gather(
            *(
                p.service.run_round(group, x, config=config(), out=o)
                for p, x, o in zip(peers, inputs, outs, strict=True)
            )
        )

    results = swarm.run(both())
    for result, out in zip(results, outs, strict=True):
        assert all(r is o for r, o in zip(result.tensors, out, strict=True))
        for got, a, b in zip(out, *inputs, strict=True):
            torch.testing.assert_close(got, (a + b) / 2)
    bad_outputs = [
        inputs[0],  # the inputs themselves
        [t[:1] for t in outs[0]],  # wrong shapes
        [t.double() for t in outs[0]],  # wrong dtypes
        outs[0][:2],  # too few
    ]
    for bad in bad_outputs:
        with pytest.raises(ConfigurationError):
            swarm.run(peers[0].service.run_round(group, inputs[0], config=config(), out=bad))


def test_zero_weights(swarm: Swarm) -> None:
    """A zero weight contributes nothing; if every weight is zero there is no mean and values stay."""
    peers = swarm.peers[:3]
    inputs = inputs_for(3, seed=130)
    group = group_of([p.member() for p in peers])
    outcomes = swarm.run(run_round(peers, group, inputs, weights=[0.0, 1.0, 3.0], config=config()))
    check_round(peers, inputs, [0.0, 1.0, 3.0], outcomes, honest=range(3))
    assert all(o.result.all_averaged for o in outcomes)
    outcomes = swarm.run(
        run_round(peers, group_of([p.member() for p in peers]), inputs, weights=[0.0] * 3, config=config())
    )
    for i, outcome in enumerate(outcomes):
        assert not any(part.averaged for part in outcome.result.parts)
        assert torch.equal(flat(outcome.result.tensors), flat(inputs[i]))
