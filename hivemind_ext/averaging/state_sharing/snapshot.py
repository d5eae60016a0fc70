"""The donor's snapshots: taking the state from the averager, copying it, encoding it into chunks,
and sharing one prepared snapshot between the downloads that may have it.

Every download is served a consistent copy of the state as of the request, as hivemind's
``rpc_download_state`` calls ``get_current_state`` once per request: ``get_state`` may return live
tensors that training keeps changing in place (hivemind's documented pattern), so the donor copies
them at once, under the averager's lock where it has one (``state_lock``), and encodes and hashes
the copy. That copy is the only one a download makes (``NoCompression`` chunks are views of it).

Why a snapshot never blocks the event loop: ``get_state`` (which may wait for the averager's lock),
the copy and the encoding + hashing run in one worker thread; the event loop only waits, and never
longer than ``snapshot_timeout`` for the state. Only one snapshot is taken at a time: requests that
arrive before it starts reading the state wait for the same one, and with ``snapshot_reuse_time`` >
0 a prepared snapshot of the current version is also served to requests that arrive that long after
it was taken (the averager uses 0: a fresh copy per request, like hivemind). When the state stays
locked past ``snapshot_timeout`` (an all-reduce in progress), the previous snapshot of the same
version is served if there is one, and otherwise the request is answered "busy" so that the
newcomer moves on at once; the snapshot keeps being taken in the background.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from hivemind_ext.averaging.state_sharing.manifest import (
    Manifest,
    ManifestChunk,
    chunk_digest,
    encode_manifest,
    manifest_digest,
    pack_metadata,
)
from hivemind_ext.averaging.tensor_layout import TensorSpec, chunk_tensors
from hivemind_ext.compression import Codec, CompressedTensor, CompressionInfo, NoCompression
from hivemind_ext.compression.base import NAMES_BY_DTYPE
from hivemind_ext.errors import CompressionError, DeadlineExceededError, DonorBusyError, ProtocolError
from hivemind_ext.p2p import now, wait_until

logger = logging.getLogger(__name__)

StateTuple = tuple[Any, Sequence[torch.Tensor]] | tuple[Any, Sequence[torch.Tensor], Sequence[CompressionInfo] | None]
StateGetter = Callable[[], StateTuple]
"""Returns ``(metadata, tensors)`` or, like hivemind's ``get_current_state``, ``(metadata, tensors, infos)``.

Called in a worker thread of the donor, once per snapshot, so it must be thread-safe. The tensors
may be live (changed in place by training afterwards): the donor copies them right after the call,
holding the donor's ``state_lock`` if it was given one, so they are consistent if whoever changes
them holds that lock too. The donor never writes into them. ``metadata`` must be msgpack-serializable.
"""


@dataclass(frozen=True, eq=False)
class EncodedChunk:
    tensor_header: dict[str, Any]  # the CompressedTensor header (codec, dtype, shape, params)
    payload: torch.Tensor  # uint8, 1-D, host memory

    def payload_view(self) -> memoryview:
        return memoryview(self.payload.numpy()).cast("B")


@dataclass(frozen=True, eq=False)
class PreparedState:
    """One snapshot, encoded: the manifest (and its bytes and digest) and every chunk, ready to send."""

    manifest: Manifest
    manifest_bytes: bytes
    manifest_digest: bytes
    chunks: tuple[EncodedChunk, ...]
    created_at: float  # time.monotonic()

    @property
    def version(self) -> int:
        return self.manifest.version


def prepare_state(state: StateTuple, version: int, codec: Codec, chunk_bytes: int) -> PreparedState:
    """Encodes a state into chunks and builds its manifest (blocking; runs in a worker thread)."""
    metadata, tensors, infos = _unpack_state(state)
    specs = []
    for index, tensor in enumerate(tensors):
        if tensor.dtype not in NAMES_BY_DTYPE:
            raise ProtocolError(f"state tensor {index} has unsupported dtype {tensor.dtype}")
        specs.append(TensorSpec.of(tensor))
    chunk_specs, chunks = [], []
    for index, tensor_chunks in itertools.groupby(chunk_tensors(specs, chunk_bytes), key=lambda c: c.tensor):
        tensor = tensors[index]
        info = infos[index] if infos is not None else CompressionInfo.from_tensor(tensor, key=index)
        flat = tensor.detach().reshape(-1)
        for chunk in tensor_chunks:
            encoded = encode_chunk(codec, flat[chunk.start : chunk.end], info.get_part(chunk.piece, chunk.numel))
            chunk_specs.append(ManifestChunk.of(chunk, encoded.payload.numel(), chunk_digest(encoded)))
            chunks.append(EncodedChunk(encoded.header(), encoded.payload))
    manifest = Manifest(version, secrets.token_hex(16), metadata, tuple(specs), tuple(chunk_specs))
    manifest_bytes = encode_manifest(manifest, pack_metadata(metadata))
    return PreparedState(manifest, manifest_bytes, manifest_digest(manifest_bytes), tuple(chunks), time.monotonic())


def encode_chunk(codec: Codec, part: torch.Tensor, info: CompressionInfo) -> CompressedTensor:
    """``part`` compressed with ``codec``, or sent raw if the codec cannot carry it (an integer
    dtype, NaN for a scaled codec): a newcomer must get every tensor, if not compressed."""
    try:
        # NoCompression never writes into its input: allowing "in place" makes its payload a view of
        # the snapshot instead of a second copy of the whole state (the snapshot is never modified)
        return codec.compress(part, info, allow_inplace=type(codec) is NoCompression)
    except CompressionError as e:
        if not isinstance(codec, NoCompression):
            logger.debug("state chunk of %s sent uncompressed: %s", part.dtype, e)
            return NoCompression().compress(part, info, allow_inplace=True)
        raise


def copy_state(state: StateTuple, lock: AbstractContextManager[Any] | None = None) -> StateTuple:
    """``state`` with every tensor copied (contiguous, on its own device), all under ``lock``: one
    moment's state, which nobody else writes into, so it can be encoded and hashed at leisure."""
    metadata, tensors, infos = _unpack_state(state)
    with lock if lock is not None else contextlib.nullcontext():
        copies = [tensor.detach().clone(memory_format=torch.contiguous_format) for tensor in tensors]
    return metadata, copies, infos


def _unpack_state(state: Any) -> tuple[Any, Sequence[torch.Tensor], Sequence[CompressionInfo] | None]:
    if not isinstance(state, tuple | list) or len(state) not in (2, 3):
        raise ProtocolError(f"get_state must return (metadata, tensors[, infos]), got {type(state).__name__}")
    metadata, tensors = state[0], list(state[1])
    infos = list(state[2]) if len(state) == 3 and state[2] is not None else None
    if not all(isinstance(tensor, torch.Tensor) for tensor in tensors):
        raise ProtocolError("get_state must return torch tensors")
    if infos is not None and len(infos) != len(tensors):
        raise ProtocolError(f"get_state returned {len(infos)} infos for {len(tensors)} tensors")
    return metadata, tensors, infos


@dataclass(eq=False)
class _Job:
    version: int
    taken: asyncio.Event  # set once the state is copied (the averager's lock is released)
    result: asyncio.Future[PreparedState] = field(init=False)  # set right after the job is made
    started_at: float | None = None  # time.monotonic() when get_state was called (set by the worker)

    def reads_state_after(self, moment: float) -> bool:
        """Whether this job reads the state at or after ``moment`` (so it may serve a request made then)."""
        started_at = self.started_at  # one read: the worker thread sets it
        return started_at is None or started_at >= moment


def _last_or_busy(last: PreparedState | None, version: int, snapshot_timeout: float) -> PreparedState:
    """What to serve when the state stays locked: the last snapshot of this version, else "busy"."""
    if last is not None and last.version == version:
        return last  # the averager holds its lock: serve what we have rather than nothing
    raise DonorBusyError(f"the state is locked (averaging in progress?) for more than {snapshot_timeout} s")


class SnapshotCache:
    """Prepared snapshots for the download handler: at most one being taken, the last one kept.

    :param executor: runs ``get_state``, the copy and the encoding; one worker is enough, since one
      snapshot is taken at a time. Its owner shuts it down (a thread stuck in ``get_state`` cannot be
      killed, only abandoned).
    :param reuse_time: a snapshot serves requests made up to this many seconds after it was taken
      (0: every request gets a copy taken after it arrived)
    :param state_lock: held while the tensors ``get_state`` returned are copied (the averager's lock)
    """

    def __init__(
        self,
        get_state: StateGetter,
        *,
        codec: Codec,
        chunk_bytes: int,
        reuse_time: float,
        executor: concurrent.futures.Executor,
        state_lock: AbstractContextManager[Any] | None = None,
    ) -> None:
        self._get_state, self._codec, self._chunk_bytes = get_state, codec, chunk_bytes
        self._reuse_time, self._executor, self._state_lock = reuse_time, executor, state_lock
        self._last: PreparedState | None = None
        self._job: _Job | None = None
        self.snapshots_taken = 0

    async def get(self, version: int, *, snapshot_timeout: float, deadline: float) -> PreparedState:
        """A prepared snapshot of ``version``, taken at most ``reuse_time`` before this call.

        A request that arrives while a snapshot is being taken waits for that one if it reads the
        state late enough; otherwise (or if it was started for an older version) one more is taken
        after it.

        :raises DonorBusyError: ``get_state`` did not return within ``snapshot_timeout`` and there is
          no previous snapshot of this version to serve instead.
        """
        requested_at = time.monotonic()
        snapshot_deadline = min(deadline, now() + snapshot_timeout)
        prepared: PreparedState | None = None
        for _ in range(3):  # join or wait out the job in flight, then take one's own
            self._collect_finished_job()
            last = self._last
            if last is not None and last.version == version and time.monotonic() - last.created_at <= self._reuse_time:
                return last
            job = self._job if self._job is not None else self._start(version)
            if not job.reads_state_after(requested_at - self._reuse_time):
                # it read the state before this request: let it finish, then take one of our own
                with contextlib.suppress(DeadlineExceededError):  # its failure is not this request's
                    await wait_until(asyncio.wait([job.result]), snapshot_deadline, "the previous snapshot")
                if job.result.done():
                    continue
                return _last_or_busy(last, version, snapshot_timeout)
            with contextlib.suppress(DeadlineExceededError):
                await wait_until(job.taken.wait(), snapshot_deadline, "taking a state snapshot")
            if not job.taken.is_set():
                return _last_or_busy(last, version, snapshot_timeout)
            prepared = await wait_until(asyncio.shield(job.result), deadline, "encoding the state")
            # awaiting a result that was already set does not yield, so the job's done-callback may
            # not have run: apply it now, so that the cache's books (the last snapshot, the count)
            # include what this request is served when it returns
            self._finish(job, job.result)
            if prepared.version >= version:
                return prepared
        return prepared if prepared is not None else _last_or_busy(self._last, version, snapshot_timeout)

    def _collect_finished_job(self) -> None:
        """Applies a finished job now: its done-callback may not have run yet when a waiter resumes
        (awaiting a future that is already done does not yield to the loop)."""
        if self._job is not None and self._job.result.done():
            self._finish(self._job, self._job.result)

    def _start(self, version: int) -> _Job:
        loop = asyncio.get_running_loop()
        taken = asyncio.Event()

        def take_and_prepare() -> PreparedState:
            job.started_at = time.monotonic()
            state = copy_state(self._get_state(), self._state_lock)
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(taken.set)
            return prepare_state(state, version, self._codec, self._chunk_bytes)

        job = _Job(version, taken)
        job.result = loop.run_in_executor(self._executor, take_and_prepare)
        job.result.add_done_callback(lambda future: self._finish(job, future))
        self._job = job
        return job

    def _finish(self, job: _Job, future: asyncio.Future[PreparedState]) -> None:
        """Keeps a finished job's snapshot (or logs its failure); runs once per job."""
        if self._job is not job:
            return  # applied already by _collect_finished_job
        self._job = None
        job.taken.set()  # waiters proceed to the result, or to its error
        if future.cancelled():
            return
        error = future.exception()
        if error is not None:
            logger.warning("could not take a state snapshot: %s: %s", type(error).__name__, error, exc_info=error)
            return
        self.snapshots_taken += 1
        self._last = future.result()
