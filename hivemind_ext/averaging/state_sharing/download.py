"""The newcomer: finds the donors of the newest state in the DHT and downloads it, spread over them.

How one download goes (:meth:`StateLoader.load_state`):

1. Read the donor records of the prefix (:mod:`.records`) and group the donors that accept
   downloads by version, newest first. No such donor: return ``None`` (like hivemind).
2. For the newest version, ask up to ``max_parallel_donors`` of its donors for their manifest at
   once, and gather their answers before any chunk is requested: until every donor asked has
   answered (a manifest or a failure), or for ``manifest_gather_time`` after the first manifest
   (longer if that first one took longer to come: a loaded swarm answers slowly all round). The
   largest group of gathered manifests that agree (same version, tensors and chunk ranges) fixes
   what is downloaded, and every donor of that group takes part from the first chunk; the others
   are dropped. Without the gathering, the first donor to answer would take every chunk of a small
   state before a slower donor's manifest arrives. A donor that answers after the gathering joins
   the transfer if its layout matches, and is dropped otherwise.
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

Trust (see also the package docstring). With ``require_agreement`` (synchronous training, where
honest peers hold bitwise identical states), step 2 groups the manifests by their content digest
instead of their layout, and a version is downloaded only if its largest group holds at least 2
donors and more than half of those that answered (unless the swarm lists a single donor). When no
version has such a majority on any of ``disagreement_retries`` tries (the other donors busy, or
honest peers that differ after a failed round), the last try takes the largest group (a warning
says so): only its donors serve, and its state is still validated. A
downloaded state is then passed to the caller's ``validate`` (range checks of the values); a state
it refuses, a corrupt manifest or chunk and a lie about the version put the donors responsible on
a cool-down list (``bad_donor_cooldown``) that every later search of this loader skips, and the
search starts again without them: a bad state is never downloaded twice in a row.

Everything happens before one deadline (the ``timeout`` argument); past it, StateLoadError is raised
with the underlying :class:`~hivemind_ext.errors.DeadlineExceededError` as its cause.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
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
    UntrustedStateError,
)
from hivemind_ext.p2p import (
    ClientStream,
    DirectClientConfig,
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


class DisagreeingDonorError(DonorMismatchError):
    """With ``require_agreement``: a donor's state differs from the one most donors serve, or no state
    is served by enough donors (it is not banned: it may merely lag the others for a moment)."""


StateValidator = Callable[[Any, list[torch.Tensor]], None]
"""Checks a downloaded ``(metadata, tensors)`` before it is returned; raises StateLoadError (e.g.
UntrustedStateError) to refuse it. Runs in a worker thread."""

BANNED_ERRORS: tuple[type[BaseException], ...] = (CorruptStateError, UntrustedStateError)


@dataclass(frozen=True, eq=False)
class LoadedState:
    """A downloaded state, and how the download went."""

    metadata: Any
    tensors: list[torch.Tensor]
    version: int
    chunks_by_donor: dict[str, int]  # base58 peer id -> chunks it served
    failures: dict[str, BaseException]  # base58 peer id -> why it was dropped
    seconds: float
    # the donors that vouched for this very state: with agreement, every donor whose manifest had its
    # content digest; without, the donor whose manifest (and so metadata) was taken
    agreeing: tuple[str, ...] = ()


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

    def __init__(
        self, failures: dict[str, BaseException], timed_out: BaseException | None = None, disagreement: bool = False
    ) -> None:
        super().__init__(f"{len(failures)} donors failed")
        self.failures, self.timed_out, self.disagreement = failures, timed_out, disagreement


class StateLoader:
    """Downloads the newest state of a prefix from the donors that advertise it.

    :param config: the state sharing configuration (prefix, timeouts, limits).
    :param dht: a running hivemind DHT, to find donors.
    :param p2p: the libp2p daemon to download through (``await dht.replicate_p2p()``); client mode is fine.
    :param dht_calls: the peer runtime's DHT helper (default: one of the loader's own around ``dht``).
    :param direct: download over donors' direct data path where they offer one, with these
      settings (falling back to libp2p); None: over libp2p only.
    """

    def __init__(
        self,
        config: StateSharingConfig,
        *,
        dht: DHT,
        p2p: P2P,
        dht_calls: DHTCalls | None = None,
        direct: DirectClientConfig | None = None,
    ) -> None:
        self.config, self.dht, self.p2p = config, dht, p2p
        self._dht_calls = dht_calls if dht_calls is not None else DHTCalls(dht)
        self.skipped_records = 0  # donor records skipped so far: unsigned, malformed or expired
        self._validating = False  # whether the DHT validates (and strips) signed records yet
        limits = Limits(max_payload_bytes=max(MAX_MANIFEST_BYTES, MAX_CHUNK_PAYLOAD_BYTES))
        self.client = RPCClient(
            p2p,
            config.rpc_namespace,
            limits=limits,
            default_timeout=DEFAULT_LOAD_TIMEOUT,
            prefer_direct=direct is not None,
            direct_config=direct,
        )
        self._banned: dict[str, float] = {}  # base58 peer id -> time.monotonic() until which it is skipped

    @property
    def banned_donors(self) -> dict[str, float]:
        """Donors skipped for now (base58 peer id -> seconds left), after a bad state or corrupt data."""
        moment = time.monotonic()
        return {peer: until - moment for peer, until in self._banned.items() if until > moment}

    def ban(self, donor: str, reason: BaseException) -> None:
        """Skips ``donor`` for ``bad_donor_cooldown`` seconds."""
        if self.config.bad_donor_cooldown > 0:
            self._banned[donor] = time.monotonic() + self.config.bad_donor_cooldown
            logger.warning("state donor %s is skipped for %.0f s: %s", donor, self.config.bad_donor_cooldown, reason)

    async def load_state_from_peers(
        self,
        *,
        timeout: float | None = None,
        expected_tensors: Sequence[TensorSpec] | None = None,
        validate: StateValidator | None = None,
    ) -> tuple[Any, list[torch.Tensor]] | None:
        """hivemind's ``load_state_from_peers``: ``(metadata, tensors)`` of the newest state, or None if
        no peer shares its state. Raises StateLoadError where hivemind would log and return None
        (donors exist, but none delivered a complete, valid state before the deadline)."""
        loaded = await self.load_state(timeout=timeout, expected_tensors=expected_tensors, validate=validate)
        return None if loaded is None else (loaded.metadata, loaded.tensors)

    async def load_state(
        self,
        *,
        timeout: float | None = None,
        expected_tensors: Sequence[TensorSpec] | None = None,
        validate: StateValidator | None = None,
    ) -> LoadedState | None:
        """Like :meth:`load_state_from_peers`, with the version and who served what.

        :param timeout: everything (DHT reads, connections, transfers, retries) ends within this many
          seconds; default 600 (hivemind.Optimizer's ``load_state_timeout``).
        :param expected_tensors: the shapes that the state's first tensors must have (this peer's
          model): a donor's manifest is checked against them before any chunk is pulled.
        :param validate: checks a downloaded state (see :data:`StateValidator`); a state it refuses
          bans the donors that served it, and the search goes on without them.
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
        disagreements = 0
        while True:
            records = [r for r in await self._read_donors(deadline) if r.peer_id not in self.banned_donors]
            tiers = donor_tiers(records, exclude=self.p2p.peer_id.to_base58())
            if not tiers:
                if failures:  # the donors that were there failed (or were refused), then withdrew
                    raise StateLoadError(f"no donor delivered the state: {_describe(failures)}")
                logger.info("no peer shares the state of %s", self.config.prefix)
                return None
            quorum = self.config.require_agreement and sum(len(donors) for _, donors in tiers) >= 2
            last_try = disagreements >= self.config.disagreement_retries  # see _TierDownload._choose_reference
            round_failures: dict[str, BaseException] = {}
            refused = False
            for version, donors in tiers:
                try:
                    tier = _TierDownload(self, version, donors, deadline, started, expected_tensors, quorum, last_try)
                    loaded = await tier.run()
                except _TierFailed as failed:
                    mismatches = [e for e in failed.failures.values() if isinstance(e, RunMismatchError)]
                    if mismatches:
                        raise mismatches[0] from None
                    self._ban_offenders(failed.failures)
                    round_failures.update(failed.failures)
                    failures.update(failed.failures)
                    if failed.timed_out is not None:
                        raise StateLoadError(
                            f"no complete state before the deadline; {_describe(failures)}"
                        ) from failed.timed_out
                    logger.warning("every donor of version %d failed: %s", version, _describe(failed.failures))
                    continue
                rejection = await self._validate(loaded, validate, deadline)
                if rejection is None:
                    return loaded
                # those who vouched for the content (with agreement: all its donors; without: the donor whose
                # manifest, and so metadata, was taken; a bad chunk already dropped its donor)
                for donor in loaded.agreeing or tuple(loaded.chunks_by_donor):
                    self.ban(donor, rejection)
                    failures[donor] = rejection
                refused = True
                break  # search again without the donors of the refused state
            if refused:
                continue
            if _any_disagreement(round_failures) and disagreements < self.config.disagreement_retries:
                disagreements += 1
            elif not _all_busy(round_failures):
                raise StateLoadError(f"no donor delivered the state: {_describe(failures)}")
            if remaining(deadline) <= self.config.busy_retry_delay:
                raise StateLoadError(f"no donor delivered the state: {_describe(failures)}")
            await asyncio.sleep(self.config.busy_retry_delay)

    async def _validate(
        self, loaded: LoadedState, validate: StateValidator | None, deadline: float
    ) -> UntrustedStateError | None:
        """None if ``validate`` accepts the state, else why it was refused."""
        if validate is None:
            return None
        try:
            await wait_until(
                asyncio.to_thread(validate, loaded.metadata, loaded.tensors), deadline, "validating the state"
            )
        except StateLoadError as e:
            served = ", ".join(sorted(loaded.chunks_by_donor)) or "no donor"
            logger.warning("refused the state of version %d served by %s: %s", loaded.version, served, e)
            return e if isinstance(e, UntrustedStateError) else UntrustedStateError(str(e))
        return None

    def _ban_offenders(self, failures: dict[str, BaseException]) -> None:
        """Bans the donors that sent corrupt data or lied about their version (not the slow or busy ones)."""
        for donor, error in failures.items():
            if isinstance(error, BANNED_ERRORS) or type(error) is DonorMismatchError:
                self.ban(donor, error)

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
        quorum: bool = False,
        last_try: bool = False,
    ) -> None:
        self.config, self.client = loader.config, loader.client
        self.expected_tensors, self.quorum, self.last_try = expected_tensors, quorum, last_try
        self.version, self.deadline, self.started = version, deadline, started
        self.tier_started = now()
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
        self._gathered_manifests: list[Manifest] = []  # valid manifests received before the transfer starts
        self._gathered_donors: list[str] = []  # who sent them
        self.agreeing: list[str] = []  # donors whose manifest matches the reference's content (with quorum)
        self._disagreement: DisagreeingDonorError | None = None  # with quorum: no state had enough donors
        self._gather_deadline: float | None = None  # set by the first manifest
        self._gathered = asyncio.Event()  # set once the reference is chosen

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
        if self._disagreement is not None:
            disagreeing = dict.fromkeys(self._gathered_donors, self._disagreement)
            raise _TierFailed({**self.failures, **disagreeing}, disagreement=True)
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
        return LoadedState(
            manifest.metadata,
            self.outputs,
            manifest.version,
            dict(self.served),
            self.failures,
            seconds,
            tuple(self.agreeing),
        )

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
                self._check_gathered()  # the failed donor no longer keeps the others waiting

    async def _session(self, donor: str) -> None:
        connect_deadline = min(self.deadline, now() + self.config.manifest_timeout)
        stream = await wait_until(
            self.client.open_stream(PeerID.from_base58(donor), LOAD_STATE_HANDLER, deadline=self.deadline),
            connect_deadline,
            f"connecting to {donor}",
        )
        async with stream:
            manifest = await _fetch_manifest(stream, donor, connect_deadline, self.config.max_state_bytes)
            if manifest.version < self.version:
                raise DonorMismatchError(f"{donor} advertised version {self.version} but serves {manifest.version}")
            if self.expected_tensors is not None:  # another model: an error of this peer's, before any chunk
                check_expected_tensors(manifest.tensors, self.expected_tensors)
            if not self._gathered.is_set():
                await self._gather(donor, manifest)
            self._adopt(donor, manifest)
            self._pulling.add(asyncio.current_task())  # type: ignore[arg-type]  # always inside a task
            await self._pull_chunks(donor, stream, manifest)
            await _finish_stream(stream, min(self.deadline, now() + FINISH_GRACE))

    async def _gather(self, donor: str, manifest: Manifest) -> None:
        """Waits (bounded) for the other donors asked to answer too, so that the transfer starts with
        every agreeing donor at once (step 2 of the module docstring)."""
        self._gathered_manifests.append(manifest)
        self._gathered_donors.append(donor)
        if self._gather_deadline is None:
            waited = now() - self.tier_started
            self._gather_deadline = now() + max(self.config.manifest_gather_time, waited)
        self._check_gathered()
        with contextlib.suppress(DeadlineExceededError):
            await wait_until(self._gathered.wait(), min(self.deadline, self._gather_deadline), "gathering manifests")
        self._choose_reference()

    def _check_gathered(self) -> None:
        """Ends the gathering once every donor at work has sent its manifest (the others failed)."""
        if self._gathered_manifests and not self._gathered.is_set():
            if len(self._gathered_manifests) >= len(self._workers):
                self._choose_reference()

    def _choose_reference(self) -> None:
        if self._gathered.is_set():
            return
        self._gathered.set()
        if self.quorum:
            agreed = agreed_content(self._gathered_manifests)
            if agreed is None and self.last_try:
                # no majority on any try: the other donors were busy (hivemind issues 169, 445), or
                # honest peers themselves differ (a round that some missed). Take the largest group
                # (the first to answer if all differ): only its donors serve, and its state is validated
                agreed = largest_content_group(self._gathered_manifests)
                logger.warning(
                    "no majority of donors agrees on the state of version %d (%d answered): trusting the "
                    "largest group (%d), range checks only",
                    self.version, len(self._gathered_manifests),
                    sum(m.content_digest == agreed.content_digest for m in self._gathered_manifests),
                )  # fmt: skip
            if agreed is None:
                digests = collections.Counter(m.content_digest.hex()[:12] for m in self._gathered_manifests)
                self._disagreement = DisagreeingDonorError(
                    f"no state of version {self.version} is served by enough donors (states by digest: {dict(digests)})"
                )
                self._finished.set()
                return
            manifest = agreed
        else:
            manifest = agreeing_reference(self._gathered_manifests)
            self.agreeing.append(self._gathered_donors[self._gathered_manifests.index(manifest)])
        self.reference = manifest
        self.outputs = [torch.empty(spec.shape, dtype=spec.dtype) for spec in manifest.tensors]
        self.flat_outputs = [output.view(-1) for output in self.outputs]
        self.pool = ChunkPool([manifest.raw_chunk_bytes(index) for index in range(len(manifest.chunks))])
        if self.pool.finished:  # a state without tensor elements
            self._finished.set()

    def _adopt(self, donor: str, manifest: Manifest) -> None:
        """A donor takes part if its manifest matches the layout of the chosen reference."""
        if self._disagreement is not None:
            raise self._disagreement
        if self.reference is None:
            raise RuntimeError("no reference manifest after the gathering")  # a bug, not bad input
        if self.quorum:
            if manifest.content_digest != self.reference.content_digest:
                raise DisagreeingDonorError(f"{donor} serves another state than most donors of version {self.version}")
            self.agreeing.append(donor)
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
        if self.config.reject_non_finite and values.is_floating_point() and not bool(torch.isfinite(values).all()):
            raise CorruptStateError(f"chunk {index} holds NaN or Inf")
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


def agreeing_reference(manifests: Sequence[Manifest]) -> Manifest:
    """The manifest that fixes a download: one of the largest group of ``manifests`` that agree on
    their layout (version, tensors, chunk ranges), the newer version between groups of one size,
    and the first to arrive within a group."""
    groups: dict[tuple[Any, ...], list[Manifest]] = {}
    for manifest in manifests:
        groups.setdefault(manifest.layout(), []).append(manifest)
    return max(groups.values(), key=lambda group: (len(group), group[0].version))[0]


def agreed_content(manifests: Sequence[Manifest]) -> Manifest | None:
    """With ``require_agreement``: the first manifest of the largest group of ``manifests`` with one
    content digest, if that group holds at least 2 of them and more than half; else None."""
    if not manifests:
        return None
    best = largest_content_group(manifests)
    count = sum(manifest.content_digest == best.content_digest for manifest in manifests)
    return best if count >= 2 and 2 * count > len(manifests) else None


def largest_content_group(manifests: Sequence[Manifest]) -> Manifest:
    """The first manifest of the largest group of ``manifests`` with one content digest (the newer
    version between groups of one size, the first to arrive within)."""
    groups: dict[bytes, list[Manifest]] = {}
    for manifest in manifests:
        groups.setdefault(manifest.content_digest, []).append(manifest)
    return max(groups.values(), key=lambda group: (len(group), group[0].version))[0]


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


def _any_disagreement(failures: dict[str, BaseException]) -> bool:
    return any(isinstance(error, DisagreeingDonorError) for error in failures.values())


def _all_busy(failures: dict[str, BaseException]) -> bool:
    return bool(failures) and all(isinstance(error, DonorBusyError) for error in failures.values())


def _describe(failures: dict[str, BaseException]) -> str:
    if not failures:
        return "no donor could be asked"
    return "; ".join(f"{donor}: {type(error).__name__}: {error}"[:300] for donor, error in failures.items())
