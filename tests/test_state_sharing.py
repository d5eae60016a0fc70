"""State download between real hivemind DHT peers and libp2p daemons on 127.0.0.1.

One swarm of five DHTs (the last in client mode) serves the whole module; every test uses its own
prefix, so donor records and RPC handlers of one test never meet another's. All tests run in one
event loop (a background thread) on one replica of each DHT's daemon (see the ``network`` fixture
for why). Faults are injected through :class:`DonorHooks`, the donor's seam for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import hivemind
import pytest
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time
from swarm import local_swarm, new_test_loop

from hivemind_ext.averaging.state_sharing import (
    CorruptStateError,
    DonorHooks,
    LoadedState,
    StateDonor,
    StateLoader,
    StateSharingConfig,
)
from hivemind_ext.averaging.state_sharing.config import LOAD_STATE_HANDLER
from hivemind_ext.averaging.state_sharing.manifest import chunks_request, manifest_request
from hivemind_ext.averaging.state_sharing.records import donors_key, parse_donor_records
from hivemind_ext.averaging.tensor_layout import TensorSpec, chunk_tensors
from hivemind_ext.compression import Float16Compression
from hivemind_ext.errors import DeadlineExceededError, DonorBusyError, StateLoadError
from hivemind_ext.p2p import DirectClientConfig, DirectConfig, Message, RPCClient
from hivemind_ext.p2p.loop_thread import LoopThread
from hivemind_ext.p2p.signing import default_signing_key, split_signed_subkey

pytestmark = pytest.mark.slow

A, B, C, NEWCOMER, CLIENT = range(5)  # roles of the swarm's peers
CHUNK = 64 * 1024
T = TypeVar("T")


@pytest.fixture(scope="module")
def swarm() -> Iterator[list[hivemind.DHT]]:
    with local_swarm(5, client_indices=[CLIENT]) as dhts:
        yield dhts


@pytest.fixture(scope="module")
def network(swarm: list[hivemind.DHT]) -> Iterator[Network]:
    # One loop for the whole module, not one per test: with hivemind 1.1.12, once a replica
    # (``dht.replicate_p2p()``) that registered stream handlers is shut down, stream handlers that later
    # replicas register on the same daemon cannot be reached ("failed to negotiate protocol: stream
    # reset"). Replicas are bound to their loop, so they live as long as the module's swarm.
    runner = LoopThread("state-sharing-tests", loop=new_test_loop())
    for dht in swarm:  # the tests read donor records directly: the DHT must strip their signatures
        dht.add_validators([RSASignatureValidator(default_signing_key(dht))])
    try:
        p2ps = runner.run(replicate_all(swarm), timeout=120)
        yield Network(swarm, p2ps, runner)
        runner.run(shutdown_all(p2ps), timeout=120)
    finally:
        runner.stop()


async def replicate_all(dhts: Sequence[hivemind.DHT]) -> list[P2P]:
    return [await dht.replicate_p2p() for dht in dhts]


async def shutdown_all(p2ps: Sequence[P2P]) -> None:
    for p2p in p2ps:
        await p2p.shutdown()


def in_loop(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Runs an async test (whose first argument is the ``network`` fixture) in the module's loop."""

    @functools.wraps(test)
    def runner(network: Network, *args: Any, **kwargs: Any) -> None:
        network.runner.run(test(network, *args, **kwargs), timeout=120)

    return runner


# ----- states, donors, newcomers


def make_state(seed: int, float_elements: int = 300_000) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """A state with every kind of tensor a trainer holds: large and small floats, integers, flags,
    half precision, empty and scalar tensors; about 20 chunks of CHUNK bytes."""
    generator = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randn(float_elements, generator=generator),
        torch.randn(17, 33, generator=generator),
        torch.randint(-(2**40), 2**40, (1000,), generator=generator),
        torch.rand(64, generator=generator) > 0.5,
        torch.randn(5000, generator=generator).half(),
        torch.zeros(0, 5),
        torch.tensor(float(seed)),
    ]
    metadata = {"epoch": seed, "lr": 0.01, "names": ["w", "b"], "optimizer": {0: {"step": seed}}, "raw": b"\x00\xff"}
    return metadata, tensors


def num_chunks(state: tuple[dict[str, Any], list[torch.Tensor]], chunk_bytes: int = CHUNK) -> int:
    return len(chunk_tensors([TensorSpec.of(t) for t in state[1]], chunk_bytes))


def assert_same_state(loaded: LoadedState, state: tuple[dict[str, Any], list[torch.Tensor]]) -> None:
    metadata, tensors = state
    assert loaded.metadata == metadata
    assert len(loaded.tensors) == len(tensors)
    for got, expected in zip(loaded.tensors, tensors, strict=True):
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert torch.equal(got, expected)


def config(prefix: str, **overrides: Any) -> StateSharingConfig:
    values: dict[str, Any] = dict(
        prefix=prefix,
        chunk_bytes=CHUNK,
        inflight_bytes=2 * CHUNK,
        next_chunk_timeout=5.0,
        snapshot_timeout=0.5,
        manifest_timeout=5.0,
        dht_timeout=5.0,
    )
    values.update(overrides)
    return StateSharingConfig(**values)


def snapshot_of(state: tuple[dict[str, Any], list[torch.Tensor]], lock: threading.Lock | None = None) -> Callable:
    """A get_state like the averager's: copies taken under the lock that averaging holds."""
    lock = lock if lock is not None else threading.Lock()

    def get_state() -> tuple[dict[str, Any], list[torch.Tensor]]:
        with lock:
            return state[0], [tensor.clone() for tensor in state[1]]

    return get_state


@dataclasses.dataclass
class Network:
    dhts: list[hivemind.DHT]
    p2ps: list[P2P]
    runner: LoopThread

    @contextlib.asynccontextmanager
    async def view(self) -> AsyncIterator[Peers]:
        """One test's view of the swarm: its own prefix; the donors it starts are shut down at exit."""
        async with contextlib.AsyncExitStack() as stack:
            yield Peers(self.dhts, self.p2ps, stack)


class Peers:
    def __init__(self, dhts: list[hivemind.DHT], p2ps: list[P2P], stack: contextlib.AsyncExitStack) -> None:
        self.dhts, self.p2ps, self.stack = dhts, p2ps, stack
        self.prefix = f"state-{secrets.token_hex(4)}"

    def peer(self, index: int) -> str:
        return self.p2ps[index].peer_id.to_base58()

    async def donor(
        self,
        index: int,
        state: tuple[dict[str, Any], list[torch.Tensor]],
        version: int,
        *,
        hooks: DonorHooks | None = None,
        get_state: Callable | None = None,
        direct: DirectConfig | None = None,
        **overrides: Any,
    ) -> StateDonor:
        donor = StateDonor(
            config(self.prefix, **overrides),
            dht=self.dhts[index],
            p2p=self.p2ps[index],
            get_state=get_state or snapshot_of(state),
            version=version,
            hooks=hooks,
            direct=direct,
        )
        await donor.start()
        self.stack.push_async_callback(donor.shutdown)
        return donor

    def loader(self, index: int = NEWCOMER, direct: DirectClientConfig | None = None, **overrides: Any) -> StateLoader:
        return StateLoader(config(self.prefix, **overrides), dht=self.dhts[index], p2p=self.p2ps[index], direct=direct)

    async def advertised(self, count: int, *, accepting: bool = True, timeout: float = 10.0) -> None:
        """Waits until the newcomer's DHT shows ``count`` donor records (accepting or not)."""
        give_up = time.monotonic() + timeout
        while True:
            found = await self.dhts[NEWCOMER].get(donors_key(self.prefix), latest=True, return_future=True)
            entries = found.value.items() if found is not None and isinstance(found.value, dict) else ()
            records = parse_donor_records(((k, v.value, v.expiration_time) for k, v in entries), get_dht_time())
            if sum(record.accepts == accepting for record in records) >= count:
                return
            assert time.monotonic() < give_up, f"donors not advertised: {records}"
            await asyncio.sleep(0.05)


# ----- fault injection through the donor's seam


class SlowDonor(DonorHooks):
    """Sends every chunk after a pause (a donor with a slow uplink), optionally delays the manifest."""

    def __init__(self, chunk_delay: float = 0.0, manifest_delay: float = 0.0) -> None:
        self.chunk_delay, self.manifest_delay = chunk_delay, manifest_delay

    async def on_manifest(self, peer_id: PeerID, payload: bytes) -> bytes:
        await asyncio.sleep(self.manifest_delay)
        return payload

    async def on_chunk(self, peer_id: PeerID, index: int, header: dict, payload: memoryview) -> Any:
        await asyncio.sleep(self.chunk_delay)
        return header, payload


class FaultyDonor(DonorHooks):
    """Misbehaves on the ``at``-th chunk it sends (0-based): corrupts it, cuts it short, ends the
    stream before it, or stalls."""

    def __init__(self, fault: str, at: int = 0) -> None:
        self.fault, self.at, self.sent = fault, at, 0

    async def on_chunk(self, peer_id: PeerID, index: int, header: dict, payload: memoryview) -> Any:
        position, self.sent = self.sent, self.sent + 1
        if position != self.at:
            return header, payload
        if self.fault == "corrupt":
            corrupted = bytearray(payload)
            corrupted[len(corrupted) // 2] ^= 0x01
            return header, memoryview(corrupted)
        if self.fault == "short_payload":
            return header, payload[:-8]
        if self.fault == "end_stream":
            return None
        if self.fault == "stall":
            await asyncio.sleep(60)
        raise AssertionError(f"unknown fault {self.fault}")


class CorruptManifest(DonorHooks):
    async def on_manifest(self, peer_id: PeerID, payload: bytes) -> bytes:
        corrupted = bytearray(payload)
        corrupted[len(corrupted) // 3] ^= 0x01
        return bytes(corrupted)


# ----- tests


@pytest.mark.timeout(60)
@in_loop
async def test_newcomer_downloads_the_donors_exact_state_and_metadata(network: Network) -> None:
    async with network.view() as peers:
        state = make_state(5)
        donor = await peers.donor(A, state, version=5)
        await peers.advertised(1)
        loaded = await peers.loader().load_state(timeout=30)
        assert loaded is not None and loaded.version == 5
        assert_same_state(loaded, state)
        assert loaded.chunks_by_donor == {peers.peer(A): donor.stats.chunks_served} and not loaded.failures
        metadata, tensors = await peers.loader().load_state_from_peers(timeout=30)  # hivemind's shape
        assert_same_state(LoadedState(metadata, tensors, 5, {}, {}, 0.0), state)
        assert donor.snapshots_taken == 1  # the second download reused the snapshot


@pytest.mark.timeout(60)
@in_loop
async def test_a_download_goes_over_the_encrypted_direct_path_where_both_sides_use_it(network: Network) -> None:
    async with network.view() as peers:
        state = make_state(8)
        await peers.donor(A, state, version=1, direct=DirectConfig(host="127.0.0.1"))
        await peers.advertised(1)
        loader = peers.loader(direct=DirectClientConfig())
        assert_same_state(await loader.load_state(timeout=30), state)
        assert loader.client.transports_since(0.0) == {peers.p2ps[A].peer_id: "direct"}


@pytest.mark.timeout(60)
@in_loop
async def test_float16_download_is_within_the_codecs_bound(network: Network) -> None:
    async with network.view() as peers:
        state = make_state(6)
        await peers.donor(A, state, version=1, load_state_compression=Float16Compression())
        await peers.advertised(1)
        loaded = await peers.loader().load_state(timeout=30)
        assert loaded is not None and loaded.metadata == state[0]
        for got, expected in zip(loaded.tensors, state[1], strict=True):
            assert got.dtype == expected.dtype and got.shape == expected.shape
            if expected.dtype == torch.float32:  # exactly what a cast to float16 and back gives
                assert torch.equal(got, expected.half().float())
            else:  # integers and flags are sent raw, float16 is already float16
                assert torch.equal(got, expected)


@pytest.mark.timeout(60)
@in_loop
async def test_the_newest_version_wins_over_an_older_donor(network: Network) -> None:
    async with network.view() as peers:
        old, new = make_state(3), make_state(7)
        await peers.donor(A, old, version=3)
        await peers.donor(B, new, version=7)
        await peers.advertised(2)
        loaded = await peers.loader().load_state(timeout=30)
        assert loaded is not None and loaded.version == 7
        assert_same_state(loaded, new)
        assert set(loaded.chunks_by_donor) == {peers.peer(B)}


@pytest.mark.timeout(60)
@in_loop
async def test_download_is_spread_over_donors_of_the_same_version(network: Network) -> None:
    async with network.view() as peers:
        state = make_state(4)
        slow = SlowDonor(chunk_delay=0.01)  # so that neither donor is done before the other starts
        donors = [await peers.donor(i, state, version=4, hooks=slow) for i in (A, B)]
        await peers.advertised(2)
        loaded = await peers.loader().load_state(timeout=30)
        assert loaded is not None
        assert_same_state(loaded, state)
        assert set(loaded.chunks_by_donor) == {peers.peer(A), peers.peer(B)}
        assert all(count > 0 for count in loaded.chunks_by_donor.values())
        assert all(donor.stats.chunks_served > 0 for donor in donors)
        assert sum(loaded.chunks_by_donor.values()) == sum(donor.stats.chunks_served for donor in donors)


@pytest.mark.timeout(60)
@in_loop
async def test_a_donor_slower_to_answer_than_the_transfer_takes_still_serves_its_share(network: Network) -> None:
    async with network.view() as peers:
        state = make_state(24)
        fast = await peers.donor(A, state, version=4)
        slow = await peers.donor(B, state, version=4, hooks=SlowDonor(manifest_delay=0.3))  # a donor busy a moment
        await peers.advertised(2)
        loaded = await peers.loader().load_state(timeout=30)
        assert loaded is not None
        assert_same_state(loaded, state)
        # the manifests are gathered before the transfer starts: A alone would have sent every chunk by 0.3 s
        assert fast.stats.chunks_served > 0 and slow.stats.chunks_served > 0, (fast.stats, slow.stats)
        assert loaded.chunks_by_donor == {
            peers.peer(A): fast.stats.chunks_served,
            peers.peer(B): slow.stats.chunks_served,
        }


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("fault", "message"),
    [("corrupt", "digest mismatch"), ("short_payload", "payload bytes"), ("end_stream", "chunks missing")],
)
@in_loop
async def test_corrupted_or_truncated_transfer_is_detected_and_retried_from_another_donor(
    network: Network, fault: str, message: str
) -> None:
    async with network.view() as peers:
        state = make_state(8)
        await peers.donor(A, state, version=2, hooks=FaultyDonor(fault, at=2))
        await peers.donor(B, state, version=2, hooks=SlowDonor(manifest_delay=0.3))  # A gets to serve first
        await peers.advertised(2)
        loaded = await peers.loader().load_state(timeout=30)
        assert loaded is not None
        assert_same_state(loaded, state)
        failure = loaded.failures[peers.peer(A)]
        assert isinstance(failure, CorruptStateError) and message in str(failure)
        assert loaded.chunks_by_donor[peers.peer(A)] >= 2  # the chunks verified before the fault were kept
        assert loaded.chunks_by_donor[peers.peer(B)] > 0
        assert sum(loaded.chunks_by_donor.values()) == num_chunks(state)  # each chunk was kept once


@pytest.mark.timeout(60)
@in_loop
async def test_corrupted_manifest_is_detected(network: Network) -> None:
    async with network.view() as peers:
        state = make_state(9)
        await peers.donor(A, state, version=2, hooks=CorruptManifest())
        await peers.donor(B, state, version=2)
        await peers.advertised(2)
        loaded = await peers.loader().load_state(timeout=30)
        assert loaded is not None
        assert_same_state(loaded, state)
        assert set(loaded.chunks_by_donor) == {peers.peer(B)}
        if peers.peer(A) in loaded.failures:  # unless B finished before A's manifest came
            assert "manifest digest mismatch" in str(loaded.failures[peers.peer(A)])


@pytest.mark.timeout(60)
@in_loop
async def test_a_donor_slow_to_answer_does_not_delay_a_finished_download(network: Network) -> None:
    async with network.view() as peers:
        state = make_state(21)
        await peers.donor(A, state, version=2)
        await peers.donor(B, state, version=2, hooks=SlowDonor(manifest_delay=10.0))
        await peers.advertised(2)
        started = time.monotonic()
        loaded = await peers.loader().load_state(timeout=30)
        assert time.monotonic() - started < 2.0
        assert_same_state(loaded, state)
        assert set(loaded.chunks_by_donor) == {peers.peer(A)} and not loaded.failures


@pytest.mark.timeout(60)
@in_loop
async def test_a_peer_never_downloads_from_itself(network: Network) -> None:
    async with network.view() as peers:
        state = make_state(22)
        await peers.donor(NEWCOMER, make_state(23), version=9)  # the newcomer shares a newer state itself
        await peers.donor(A, state, version=1)
        await peers.advertised(2)
        loaded = await peers.loader().load_state(timeout=30)
        assert loaded is not None and loaded.version == 1
        assert_same_state(loaded, state)


@pytest.mark.timeout(60)
@in_loop
async def test_a_stalled_donor_is_abandoned_within_the_chunk_timeout(network: Network) -> None:
    async with network.view() as peers:
        state = make_state(10)
        await peers.donor(A, state, version=2, hooks=FaultyDonor("stall", at=1))
        await peers.donor(B, state, version=2, hooks=SlowDonor(manifest_delay=0.3))
        await peers.advertised(2)
        started = time.monotonic()
        loaded = await peers.loader(next_chunk_timeout=1.0).load_state(timeout=30)
        elapsed = time.monotonic() - started
        assert loaded is not None
        assert_same_state(loaded, state)
        assert isinstance(loaded.failures[peers.peer(A)], DeadlineExceededError)
        assert 1.0 <= elapsed < 4.0, f"took {elapsed:.2f} s with a 1 s chunk timeout"


@pytest.mark.timeout(60)
@in_loop
async def test_a_donor_with_all_slots_taken_sends_the_newcomer_elsewhere(network: Network) -> None:
    async with network.view() as peers:
        state = make_state(11)
        busy = await peers.donor(A, state, version=3, max_concurrent_downloads=1)
        await peers.donor(B, state, version=3, hooks=SlowDonor(chunk_delay=0.01))
        await peers.advertised(2)
        # another newcomer holds A's only slot: it took the manifest and keeps the stream open
        client = RPCClient(peers.p2ps[C], config(peers.prefix).rpc_namespace)
        async with await client.open_stream(PeerID.from_base58(peers.peer(A)), LOAD_STATE_HANDLER, timeout=30) as held:
            await held.send(Message(manifest_request()))
            assert (await held.receive()).header["status"] == "ok"
            started = time.monotonic()
            loaded = await peers.loader().load_state(timeout=30)
            elapsed = time.monotonic() - started
            await held.send(Message(chunks_request("00" * 16, [0])))  # not the snapshot it was offered
            assert (await held.receive()).header["status"] == "rejected"
            assert await held.receive() is None  # and the donor ends the stream
        assert loaded is not None
        assert_same_state(loaded, state)
        assert isinstance(loaded.failures[peers.peer(A)], DonorBusyError) and busy.stats.busy_answers == 1
        assert set(loaded.chunks_by_donor) == {peers.peer(B)}
        assert elapsed < 3.0


@pytest.mark.timeout(60)
@in_loop
async def test_a_donor_busy_averaging_does_not_stall_the_newcomer(network: Network) -> None:
    async with network.view() as peers:
        state = make_state(12)
        averaging = threading.Lock()
        averaging.acquire()  # A's averager holds its state lock (a long all-reduce)
        try:
            locked = await peers.donor(A, state, version=3, get_state=snapshot_of(state, averaging))
            # B's transfer (~1 s) outlasts A's snapshot_timeout, so A's "busy" answer is seen
            await peers.donor(B, state, version=3, hooks=SlowDonor(chunk_delay=0.05))
            await peers.advertised(2)
            started = time.monotonic()
            loaded = await peers.loader().load_state(timeout=30)
            elapsed = time.monotonic() - started
            assert loaded is not None
            assert_same_state(loaded, state)
            assert isinstance(loaded.failures[peers.peer(A)], DonorBusyError)
            assert "locked" in str(loaded.failures[peers.peer(A)]) and locked.stats.busy_answers == 1
            assert elapsed < 5.0  # A's snapshot_timeout (0.5 s) in parallel with B's transfer, never A's lock
        finally:
            averaging.release()


@pytest.mark.timeout(60)
@in_loop
async def test_a_locked_donor_serves_its_last_snapshot_then_says_busy_for_a_newer_version(network: Network) -> None:
    async with network.view() as peers:
        old, new = make_state(13), make_state(14)
        current = [old]
        averaging = threading.Lock()

        def get_state() -> tuple[dict[str, Any], list[torch.Tensor]]:
            with averaging:
                return current[0][0], [tensor.clone() for tensor in current[0][1]]

        donor = await peers.donor(A, old, version=1, get_state=get_state, snapshot_reuse_time=0.0)
        await peers.advertised(1)
        assert_same_state(await peers.loader().load_state(timeout=30), old)
        with averaging:  # averaging in progress: get_state blocks
            loaded = await peers.loader().load_state(timeout=30)
            assert_same_state(loaded, old)  # served from the last snapshot of version 1
            current[0] = new
            donor.set_version(2)  # the averager moved on, but the lock is still held
            await peers.advertised(1)
            started = time.monotonic()
            with pytest.raises(StateLoadError, match="DonorBusyError") as error:
                await peers.loader(busy_retry_delay=0.2).load_state(timeout=1.5)
            assert time.monotonic() - started < 2.5
            assert "locked" in str(error.value)
        loaded = await peers.loader().load_state(timeout=30)  # the lock is free: version 2 is served
        assert loaded is not None and loaded.version == 2
        assert_same_state(loaded, new)


@pytest.mark.timeout(60)
@in_loop
async def test_no_donors_means_none_quickly(network: Network) -> None:
    async with network.view() as peers:
        started = time.monotonic()
        assert await peers.loader().load_state_from_peers(timeout=30) is None
        assert time.monotonic() - started < 3.0


@pytest.mark.timeout(60)
@in_loop
async def test_client_mode_peers_do_not_advertise_but_can_download(network: Network) -> None:
    async with network.view() as peers:
        state = make_state(15)
        client_donor = await peers.donor(CLIENT, make_state(99), version=100)  # client_mode=None: asks the DHT
        assert not client_donor.serving
        await peers.donor(A, state, version=1)
        await peers.advertised(1)
        await asyncio.sleep(0.3)  # time for a (wrong) advertisement of the client-mode peer to land
        loaded = await peers.loader(CLIENT).load_state(timeout=30)  # the newest version would be 100
        assert loaded is not None and loaded.version == 1
        assert_same_state(loaded, state)
        found = await network.dhts[NEWCOMER].get(donors_key(peers.prefix), latest=True, return_future=True)
        assert {split_signed_subkey(subkey).peer_id for subkey in found.value} == {peers.peer(A)}


@pytest.mark.timeout(60)
@in_loop
async def test_switching_sharing_off_withdraws_the_donor(network: Network) -> None:
    async with network.view() as peers:
        state = make_state(16)
        donor = await peers.donor(A, state, version=1)
        await peers.advertised(1)
        donor.allow_state_sharing = False
        await peers.advertised(1, accepting=False)
        assert await peers.loader().load_state(timeout=30) is None
        client = RPCClient(peers.p2ps[NEWCOMER], config(peers.prefix).rpc_namespace)
        async with await client.open_stream(PeerID.from_base58(peers.peer(A)), LOAD_STATE_HANDLER, timeout=30) as call:
            await call.send(Message(manifest_request()))  # a newcomer with an old record is told so
            assert (await call.receive()).header["status"] == "refused"
        donor.allow_state_sharing = True
        await peers.advertised(1)
        assert_same_state(await peers.loader().load_state(timeout=30), state)


@pytest.mark.timeout(60)
@in_loop
async def test_an_older_version_is_used_when_every_newest_donor_fails(network: Network) -> None:
    async with network.view() as peers:
        older = make_state(17)
        await peers.donor(A, make_state(18), version=9, hooks=FaultyDonor("corrupt", at=0))
        await peers.donor(B, older, version=8)
        await peers.advertised(2)
        loaded = await peers.loader().load_state(timeout=30)
        assert loaded is not None and loaded.version == 8
        assert_same_state(loaded, older)


@pytest.mark.timeout(60)
@in_loop
async def test_the_deadline_bounds_a_download_from_a_stalled_donor(network: Network) -> None:
    async with network.view() as peers:
        await peers.donor(A, make_state(19), version=1, hooks=FaultyDonor("stall", at=0))
        await peers.advertised(1)
        started = time.monotonic()
        with pytest.raises(StateLoadError, match="deadline") as error:
            await peers.loader(next_chunk_timeout=30.0).load_state(timeout=1.5)
        assert 1.4 <= time.monotonic() - started < 2.5
        assert isinstance(error.value.__cause__, DeadlineExceededError)


@pytest.mark.timeout(90)
@in_loop
async def test_throughput_of_a_64_mb_download(network: Network) -> None:
    async with network.view() as peers:
        state = make_state(20, float_elements=16 * 2**20)  # 64 MiB of float32, plus the small tensors
        nbytes = sum(tensor.nbytes for tensor in state[1])
        await peers.donor(A, state, version=1, chunk_bytes=4 * 2**20, inflight_bytes=16 * 2**20)
        await peers.advertised(1)
        loader = peers.loader(inflight_bytes=16 * 2**20)
        first = await loader.load_state(timeout=60)  # includes the donor's snapshot and encoding
        assert_same_state(first, state)
        again = await loader.load_state(timeout=60)  # served from the donor's prepared snapshot
        print(
            f"64 MB state download: first {nbytes / first.seconds / 1e6:.0f} MB/s ({first.seconds:.2f} s), "
            f"again {nbytes / again.seconds / 1e6:.0f} MB/s ({again.seconds:.2f} s)"
        )
        assert nbytes / again.seconds > 50e6
