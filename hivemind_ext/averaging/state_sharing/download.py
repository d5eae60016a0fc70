"""The newcomer: finds the donors of the newest state in the DHT and downloads it, spread over them.

How one download goes (:meth:`StateLoader.load_state`):

1. Read the donor records of the prefix (:mod:`.records`) and group the donors that accept
   downloads by version, newest first. No such donor: return ``None`` (like hivemind).
2. For the newest version, ask up to ``max_parallel_donors`` of its donors for their manifest at
   once. The first valid manifest fixes what is downloaded (version, tensors, chunk layout, metadata);
   a later donor joins if its layout matches, and is dropped otherwise.
3. Every donor that joined pulls chunks from one shared pool (:class:`ChunkPool`) and keeps
   ``inflight_bytes`` requested ahead, so a fast donor serves more chunks than a slow one. Each chunk is
   checked against the manifest of the donor that sent it (size, shape, dtype, SHA-256) and decoded
   straight into the output tensors, in a worker thread while the next chunk is being received.
4. A donor that fails (unreachable, "busy", a bad manifest or chunk, a transfer that ends early, no
   chunk for ``next_chunk_timeout``) is dropped: the chunks it delivered intact are kept, the others
   go back to the pool for the other donors, and the next donor of the version (if any) is asked in
   its place.
5. If every donor of the newest version failed, the next older version is tried the same way. If
   every donor was merely busy, the whole search starts again after ``busy_retry_delay``, while the
   deadline allows. Otherwise :class:`~hivemind_ext.errors.StateLoadError` is raised, listing why
   each donor failed.

Everything happens before one deadline (the ``timeout`` argument); past it, StateLoadError is raised
with the underlying :class:`~hivemind_ext.errors.DeadlineExceededError` as its cause.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hivemind import DHT
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time

from hivemind_ext.averaging.state_sharing.config import LOAD_STATE_HANDLER, StateSharingConfig
from hivemind_ext.averaging.state_sharing.manifest import (
    MAX_CHUNK_PAYLOAD_BYTES,
    MAX_INDICES_PER_REQUEST,
    MAX_MANIFEST_BYTES,
    CorruptStateError,
    Manifest,
    check_chunk,
    chunks_request,
    manifest_request,
    parse_manifest,
)
from hivemind_ext.averaging.state_sharing.records import DonorRecord, donor_tiers, donors_key, read_donor_records
from hivemind_ext.averaging.tensor_layout import TensorSpec
from hivemind_ext.compression import decompress
from hivemind_ext.errors import (
    ClosedError,
    CompressionError,
    DeadlineExceededError,
    DonorBusyError,
    HivemindExtError,
    PeerUnreachableError,
    RemoteError,
    RunMismatchError,
    StateLoadError,
)
from hivemind_ext.p2p import (
    ClientStream,
    Limits,
    Message,
    RPCClient,
    TaskOwner,
    now,
    remaining,
    resolve_deadline,
    wait_until,
)
from hivemind_ext.p2p.dht_calls import DHTCalls
from hivemind_ext.p2p.signing import default_signing_key, install_signing

logger = logging.getLogger(__name__)

DEFAULT_LOAD_TIMEOUT = 600.0  # hivemind.Optimizer's load_state_timeout
FINISH_GRACE = 1.0  # after the last chunk, how long donors get to close their streams cleanly
VERIFY_AHEAD = 2  # chunks of one donor being verified in threads while the next one is received


class DonorMismatchError(HivemindExtError):
    """A donor's state is older than it advertised, or laid out differently from the state being downloaded."""


@dataclass(frozen=True, eq=False)
class LoadedState:
    """A downloaded state, and how the download went."""

    metadata: Any
    tensors: list[torch.Tensor]
    version: int
    chunks_by_donor: dict[str, int]  # base58 peer id -> chunks it served
    failures: dict[str, BaseException]  # base58 peer id -> why it was dropped
    seconds: float


class ChunkPool:
    """Which chunks are left to download, and which donor downloads which.

    Donors take chunks in order; a donor that fails gives its unfinished chunks back to the front
    of the queue. :meth:`wait_changed` wakes donors that ran out of chunks when some come back (or
    when the download completes).
    """

    def __init__(self, chunk_bytes: Sequence[int]) -> None:
        self._bytes = list(chunk_bytes)
        self._pending: collections.deque[int] = collections.deque(range(len(self._bytes)))
        self._owner: dict[int, str] = {}
        self._done = 0
        self._changed = asyncio.Event()

    @property
    def finished(self) -> bool:
        return self._done == len(self._bytes)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def chunk_bytes(self, index: int) -> int:
        return self._bytes[index]

    def take(self, donor: str, budget: int, *, at_least_one: bool) -> list[int]:
        """Next chunks for ``donor`` totalling at most ``budget`` bytes (one chunk regardless of its size
        if ``at_least_one``, so that chunks larger than the budget are still downloaded)."""
        taken: list[int] = []
        while self._pending and len(taken) < MAX_INDICES_PER_REQUEST:
            size = self._bytes[self._pending[0]]
            if size > budget and not (at_least_one and not taken):
                break
            index = self._pending.popleft()
            self._owner[index] = donor
            taken.append(index)
            budget -= size
        return taken

    def complete(self, donor: str, index: int) -> None:
        if self._owner.get(index) != donor:
            raise RuntimeError(f"chunk {index} is not being downloaded from {donor}")  # a bug, not bad input
        del self._owner[index]
        self._done += 1
        if self.finished:
            self._notify()

    def release(self, donor: str) -> int:
        """Gives the unfinished chunks of ``donor`` back (in order, before the others); returns how many."""
        returned = sorted(index for index, owner in self._owner.items() if owner == donor)
        for index in returned:
            del self._owner[index]
        self._pending.extendleft(reversed(returned))
        if returned:
            self._notify()
        return len(returned)

    async def wait_changed(self, deadline: float) -> None:
        await wait_until(self._changed.wait(), deadline, "waiting for chunks")

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


class _TierFailed(Exception):
    """Internal: every donor of one version failed (or the deadline passed)."""

    def __init__(self, failures: dict[str, BaseException], timed_out: BaseException | None = None) -> None:
        super().__init__(f"{len(failures)} donors failed")
        self.failures, self.timed_out = failures, timed_out


class StateLoader:
    """Downloads the newest state of a prefix from the donors that advertise it.

    :param config: the state sharing configuration (prefix, timeouts, limits).
    :param dht: a running hivemind DHT, to find donors.
    :param p2p: the libp2p daemon to download through (``await dht.replicate_p2p()``); client mode is fine.
    :param dht_calls: the peer runtime's DHT helper (default: one of the loader's own around ``dht``).
    """

    def __init__(self, config: StateSharingConfig, *, dht: DHT, p2p: P2P, dht_calls: DHTCalls | None = None) -> None:
        self.config, self.dht, self.p2p = config, dht, p2p
        self._dht_calls = dht_calls if dht_calls is not None else DHTCalls(dht)
        self.skipped_records = 0  # donor records skipped so far: unsigned, malformed or expired
        self._validating = False  # whether the DHT validates (and strips) signed records yet
        limits = Limits(max_payload_bytes=max(MAX_MANIFEST_BYTES, MAX_CHUNK_PAYLOAD_BYTES))
        self.client = RPCClient(p2p, config.rpc_namespace, limits=limits, default_timeout=DEFAULT_LOAD_TIMEOUT)

    async def load_state_from_peers(
        self, *, timeout: float | None = None, expected_tensors: Sequence[TensorSpec] | None = None
    ) -> tuple[Any, list[torch.Tensor]] | None:
        """hivemind's ``load_state_from_peers``: ``(metadata, tensors)`` of the newest state, or None if
        no peer shares its state. Raises StateLoadError where hivemind would log and return None
        (donors exist, but none delivered a complete, valid state before the deadline)."""
        loaded = await self.load_state(timeout=timeout, expected_tensors=expected_tensors)
        return None if loaded is None else (loaded.metadata, loaded.tensors)

    async def load_state(
        self, *, timeout: float | None = None, expected_tensors: Sequence[TensorSpec] | None = None
    ) -> LoadedState | None:
        """Like :meth:`load_state_from_peers`, with the version and who served what.

        :param timeout: everything (DHT reads, connections, transfers, retries) ends within this many
          seconds; default 600 (hivemind.Optimizer's ``load_state_timeout``).
        :param expected_tensors: the shapes that the state's first tensors must have (this peer's
          model): a donor's manifest is checked against them before any chunk is pulled.
        :returns: None if no donor (other than this peer) advertises a state it shares.
        :raises RunMismatchError: a donor's state has other shapes than ``expected_tensors`` (a peer of
          another model under the same prefix: retrying cannot help, so this is not retried).
        :raises StateLoadError: donors exist but none delivered (each failure is logged, and listed
          in the message); or the DHT could not be read; or the deadline passed (the cause is then
          a DeadlineExceededError).
        """
        deadline = resolve_deadline(timeout, None, DEFAULT_LOAD_TIMEOUT)
        started = now()
        failures: dict[str, BaseException] = {}
        while True:
            tiers = donor_tiers(await self._read_donors(deadline), exclude=self.p2p.peer_id.to_base58())
            if not tiers:
                if failures:  # the donors that were there failed, then withdrew
                    raise StateLoadError(f"no donor delivered the state: {_describe(failures)}")
                logger.info("no peer shares the state of %s", self.config.prefix)
                return None
            round_failures: dict[str, BaseException] = {}
            for version, donors in tiers:
                try:
                    return await _TierDownload(self, version, donors, deadline, started, expected_tensors).run()
                except _TierFailed as failed:
                    mismatches = [e for e in failed.failures.values() if isinstance(e, RunMismatchError)]
                    if mismatches:
                        raise mismatches[0] from None
                    round_failures.update(failed.failures)
                    failures.update(failed.failures)
                    if failed.timed_out is not None:
                        raise StateLoadError(
                            f"no complete state before the deadline; {_describe(failures)}"
                        ) from failed.timed_out
                    logger.warning("every donor of version %d failed: %s", version, _describe(failed.failures))
            if not _all_busy(round_failures) or remaining(deadline) <= self.config.busy_retry_delay:
                raise StateLoadError(f"no donor delivered the state: {_describe(failures)}")
            await asyncio.sleep(self.config.busy_retry_delay)

    async def _read_donors(self, deadline: float) -> list[DonorRecord]:
        try:
            if not self._validating:
                key, timeout = default_signing_key(self.dht), min(remaining(deadline), self.config.dht_timeout)
                protected = (donors_key(self.config.prefix),)
                await install_signing(self._dht_calls, key, protected_keys=protected, timeout=timeout, verify=False)
                self._validating = True
            result = await self._dht_calls.get(
                donors_key(self.config.prefix), latest=True, deadline=min(deadline, now() + self.config.dht_timeout)
            )
        except (DeadlineExceededError, PeerUnreachableError, ClosedError) as e:
            raise StateLoadError(f"could not read the state donors from the DHT: {type(e).__name__}: {e}") from e
        value = getattr(result, "value", None)  # None: no donor ever advertised under this prefix
        entries = value.items() if isinstance(value, dict) else ()
        records, skipped = read_donor_records(
            (
                (subkey, getattr(item, "value", None), getattr(item, "expiration_time", None))
                for subkey, item in entries
            ),
            get_dht_time(),
        )
        self.skipped_records += skipped
        return records


class _TierDownload:
    """Downloads one version from its donors, spread over them (steps 2-4 of the module docstring)."""

    def __init__(
        self,
        loader: StateLoader,
        version: int,
        donors: list[str],
        deadline: float,
        started: float,
        expected_tensors: Sequence[TensorSpec] | None = None,
    ) -> None:
        self.config, self.client = loader.config, loader.client
        self.expected_tensors = expected_tensors
        self.version, self.deadline, self.started = version, deadline, started
        self.candidates = collections.deque(donors)
        self.reference: Manifest | None = None
        self.pool: ChunkPool | None = None
        self.outputs: list[torch.Tensor] = []
        self.flat_outputs: list[torch.Tensor] = []
        self.served: collections.Counter[str] = collections.Counter()
        self.failures: dict[str, BaseException] = {}
        self._owner = TaskOwner(f"state download v{version}")
        self._workers: set[asyncio.Task[None]] = set()
        self._pulling: set[asyncio.Task[Any]] = set()  # workers whose donor's manifest was adopted
        self._finished = asyncio.Event()

    async def run(self) -> LoadedState:
        async with self._owner:
            self._start_donors()
            try:
                await wait_until(self._finished.wait(), self.deadline, "downloading the state")
            except DeadlineExceededError as e:
                raise _TierFailed(self.failures, timed_out=e) from e
            pulling = self._pulling & self._workers
            if pulling and self._complete():  # let donors that served end their streams cleanly, briefly
                await asyncio.wait(pulling, timeout=max(0.0, min(FINISH_GRACE, remaining(self.deadline))))
        if not self._complete() or self.reference is None:
            raise _TierFailed(self.failures)
        return self._result(self.reference)

    def _complete(self) -> bool:
        return self.pool is not None and self.pool.finished

    def _result(self, manifest: Manifest) -> LoadedState:
        seconds = now() - self.started
        nbytes = sum(spec.nbytes for spec in manifest.tensors)
        logger.info(
            "downloaded state version %d (%.1f MB) in %.2f s from %d donors",
            manifest.version, nbytes / 1e6, seconds, len(self.served),
        )  # fmt: skip
        return LoadedState(manifest.metadata, self.outputs, manifest.version, dict(self.served), self.failures, seconds)

    def _start_donors(self) -> None:
        """Asks more donors until ``max_parallel_donors`` are at work; finishes the tier if none are left."""
        while len(self._workers) < self.config.max_parallel_donors and self.candidates and not self._complete():
            donor = self.candidates.popleft()
            task = self._owner.spawn(self._download_from(donor), name=f"state from {donor}", report_errors=False)
            self._workers.add(task)
        if not self._workers or self._complete():
            self._finished.set()

    async def _download_from(self, donor: str) -> None:
        try:
            await self._session(donor)
        except Exception as e:
            self.failures[donor] = e
            logger.info("state download from %s failed: %s: %s", donor, type(e).__name__, e)
        finally:
            if self.pool is not None:
                self.pool.release(donor)
            self._workers.discard(asyncio.current_task())  # type: ignore[arg-type]
            if not self._owner.closing:
                self._start_donors()

    async def _session(self, donor: str) -> None:
        connect_deadline = min(self.deadline, now() + self.config.manifest_timeout)
        stream = await wait_until(
            self.client.open_stream(PeerID.from_base58(donor), LOAD_STATE_HANDLER, deadline=self.deadline),
            connect_deadline,
            f"connecting to {donor}",
        )
        async with stream:
            manifest = await _fetch_manifest(stream, donor, connect_deadline, self.config.max_state_bytes)
            self._adopt(donor, manifest)
            self._pulling.add(asyncio.current_task())  # type: ignore[arg-type]  # always inside a task
            await self._pull_chunks(donor, stream, manifest)
            await _finish_stream(stream, min(self.deadline, now() + FINISH_GRACE))

    def _adopt(self, donor: str, manifest: Manifest) -> None:
        """The first valid manifest fixes what is downloaded; later donors must match its layout."""
        if self.expected_tensors is not None:
            check_expected_tensors(manifest.tensors, self.expected_tensors)
        if self.reference is None:
            if manifest.version < self.version:
                raise DonorMismatchError(f"{donor} advertised version {self.version} but serves {manifest.version}")
            self.reference = manifest
            self.outputs = [torch.empty(spec.shape, dtype=spec.dtype) for spec in manifest.tensors]
            self.flat_outputs = [output.view(-1) for output in self.outputs]
            self.pool = ChunkPool([manifest.raw_chunk_bytes(index) for index in range(len(manifest.chunks))])
            if self.pool.finished:  # a state without tensor elements
                self._finished.set()
        elif manifest.layout() != self.reference.layout():
            raise DonorMismatchError(
                f"{donor} serves version {manifest.version} laid out differently from version {self.reference.version}"
            )

    async def _pull_chunks(self, donor: str, stream: ClientStream, manifest: Manifest) -> None:
        """Requests chunks ahead (``inflight_bytes``) and receives them in request order, while the
        chunks received before are verified and decoded in worker threads (hashing and copying
        release the GIL, so the event loop keeps reading meanwhile)."""
        pool = self.pool
        if pool is None:
            raise RuntimeError("no chunk pool before a manifest was adopted")  # a bug, not bad input
        loop = asyncio.get_running_loop()
        outstanding: collections.deque[int] = collections.deque()  # requested, not received yet
        verifying: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()
        outstanding_bytes = 0
        try:
            while True:
                if outstanding_bytes < self.config.inflight_bytes:
                    budget = self.config.inflight_bytes - outstanding_bytes
                    batch = pool.take(donor, budget, at_least_one=not outstanding)
                    if batch:
                        outstanding.extend(batch)
                        outstanding_bytes += sum(pool.chunk_bytes(index) for index in batch)
                        request = Message(chunks_request(manifest.snapshot, batch))
                        await stream.send(request, deadline=min(self.deadline, now() + self.config.next_chunk_timeout))
                if outstanding and len(verifying) < VERIFY_AHEAD:
                    response = await self._receive_chunk(donor, stream, missing=len(outstanding))
                    index = outstanding.popleft()
                    outstanding_bytes -= pool.chunk_bytes(index)
                    verifying.append((index, loop.run_in_executor(None, self._store_chunk, manifest, index, response)))
                elif verifying:
                    await self._settle_oldest(pool, donor, verifying)
                elif pool.finished:
                    return
                else:
                    await pool.wait_changed(self.deadline)  # chunks may come back from a donor that fails
                while verifying and verifying[0][1].done():
                    await self._settle_oldest(pool, donor, verifying)
        finally:
            await self._keep_verified(pool, donor, verifying)

    async def _settle_oldest(
        self, pool: ChunkPool, donor: str, verifying: collections.deque[tuple[int, asyncio.Future[None]]]
    ) -> None:
        """Marks the oldest chunk done once its verification passed (raises what the verification
        raised). It leaves the queue only then, so that :meth:`_keep_verified` still waits for it if
        this wait is interrupted."""
        index, verification = verifying[0]
        await verification
        verifying.popleft()
        pool.complete(donor, index)
        self.served[donor] += 1
        if pool.finished:
            self._finished.set()

    async def _keep_verified(
        self, pool: ChunkPool, donor: str, verifying: collections.deque[tuple[int, asyncio.Future[None]]]
    ) -> None:
        """When a donor's transfer stops, waits for the verifications still running in threads and
        keeps the chunks that passed: only the rest goes back to the pool. Waiting matters: a thread
        cannot be cancelled, and one that wrote into the outputs after its chunk went to another
        donor, or after the download returned, would race with that writer (each takes milliseconds)."""
        if not verifying:
            return
        await asyncio.wait([verification for _, verification in verifying])
        for index, verification in verifying:
            if not verification.cancelled() and verification.exception() is None:
                pool.complete(donor, index)
                self.served[donor] += 1
        if pool.finished:
            self._finished.set()

    async def _receive_chunk(self, donor: str, stream: ClientStream, *, missing: int) -> Message:
        try:
            response = await stream.receive(deadline=min(self.deadline, now() + self.config.next_chunk_timeout))
        except DeadlineExceededError:
            if remaining(self.deadline) <= 0:
                raise
            raise DeadlineExceededError(f"{donor} sent no chunk for {self.config.next_chunk_timeout} s") from None
        if response is None:
            raise CorruptStateError(f"{donor} ended the transfer with {missing} requested chunks missing")
        if "status" in response.header:
            raise RemoteError(f"{donor} stopped the transfer: {_reason(response.header)}")
        return response

    def _store_chunk(self, manifest: Manifest, index: int, response: Message) -> None:
        spec = manifest.chunks[index]
        chunk = check_chunk(manifest, spec, index, response.header, response.payload)
        try:
            values = decompress(chunk)
        except CompressionError as e:
            raise CorruptStateError(f"chunk {index} cannot be decoded: {e}") from None
        self.flat_outputs[spec.tensor][spec.start : spec.end].copy_(values)


def check_expected_tensors(theirs: Sequence[TensorSpec], expected: Sequence[TensorSpec]) -> None:
    """Raises :class:`RunMismatchError` naming the first tensor whose shape differs between a donor's
    state (``theirs``) and the ``expected`` first tensors of this peer's."""
    if len(theirs) < len(expected):
        raise RunMismatchError(f"the donor's state has {len(theirs)} tensors, this peer's at least {len(expected)}")
    for index, (mine, donor) in enumerate(zip(expected, theirs, strict=False)):
        if tuple(mine.shape) != tuple(donor.shape):
            raise RunMismatchError(
                f"tensor {index}: shape {tuple(mine.shape)} here, {tuple(donor.shape)} in the donor's state"
            )


async def _fetch_manifest(stream: ClientStream, donor: str, deadline: float, max_state_bytes: int) -> Manifest:
    await stream.send(Message(manifest_request()), deadline=deadline)
    response = await stream.receive(deadline=deadline)
    if response is None:
        raise CorruptStateError(f"{donor} ended the stream without a manifest")
    status = response.header.get("status")
    if status == "busy":
        raise DonorBusyError(f"{donor} is busy: {_reason(response.header)}")
    if status != "ok":
        raise RemoteError(f"{donor} did not serve its state ({status!r:.20}): {_reason(response.header)}")
    payload = response.payload if response.payload is not None else b""
    return parse_manifest(payload, response.header.get("manifest_sha256"), max_state_bytes=max_state_bytes)


async def _finish_stream(stream: ClientStream, deadline: float) -> None:
    """Ends the call cleanly (END, then the donor's END), so the donor frees its slot at once; best effort."""
    try:
        await stream.end(deadline=deadline)
        await stream.receive(deadline=deadline)
    except HivemindExtError as e:
        logger.debug("state donor did not end the stream cleanly: %s", e)


def _reason(header: Any) -> str:
    reason = header.get("reason")
    return reason[:500] if isinstance(reason, str) else "no reason given"


def _all_busy(failures: dict[str, BaseException]) -> bool:
    return bool(failures) and all(isinstance(error, DonorBusyError) for error in failures.values())


def _describe(failures: dict[str, BaseException]) -> str:
    if not failures:
        return "no donor could be asked"
    return "; ".join(f"{donor}: {type(error).__name__}: {error}"[:300] for donor, error in failures.items())
