"""The state one member keeps for one all-reduce round, shared by its sending and owning sides.

:class:`RoundContext` holds who is who in the group, the deadlines, the layout, the traffic counters
and what this member learned (exclusions, gathered data), and which codec each chunk travels with
(:func:`chunk_codec`). :class:`RoundTensors` reads chunks of the inputs and writes chunks of the
outputs. :class:`CodecRunner` runs codec work off the event loop and remembers what is still
running, so that a round never returns while a worker thread may still write into its outputs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from hivemind.p2p import PeerID

from hivemind_ext.averaging.allreduce.api import AllreduceConfig, ContributorRun, PartOutcome, RoundHooks
from hivemind_ext.averaging.allreduce.layout import PartSpec, RoundLayout
from hivemind_ext.averaging.allreduce.throughput import ReceiveLog, receive_rate
from hivemind_ext.averaging.matchmaking.group import Member
from hivemind_ext.averaging.tensor_layout import ChunkSpec
from hivemind_ext.compression import (
    AdaptiveCompressionBase,
    Codec,
    CompressionInfo,
    Float16Compression,
    Float16OrMinMax16,
)
from hivemind_ext.errors import AllreduceError, ClosedError, ConfigurationError
from hivemind_ext.p2p import Limits

T = TypeVar("T")

_FLOAT16_OR_MINMAX16 = Float16OrMinMax16()


def chunk_codec(codec: Codec, info: CompressionInfo) -> Codec:
    """The codec a chunk described by ``info`` travels with, both ways: ``codec`` (or the one an
    adaptive wrapper picks for the chunk), except that Float16Compression of a float32 or float64
    tensor becomes Float16OrMinMax16: the same 2 bytes per value, as precise as float16 or more (it
    sends uint16 codes over the chunk's [min, max] where they are more precise). The owner's one
    message per chunk of the average then carries it far more precisely than float16 (every member
    still decodes the same message to the same values), and so do the senders' slices, which the
    average is computed from. Float16 tensors keep float16 (exact for their values)."""
    chosen = codec
    while isinstance(chosen, AdaptiveCompressionBase):
        chosen = chosen.choose_compression(info)
    if type(chosen) is Float16Compression and info.dtype in (torch.float32, torch.float64):
        return _FLOAT16_OR_MINMAX16
    return codec


class RoundTensors:
    """The caller's tensors as flat inputs, and the new output tensors the round fills chunk by chunk.

    Every value of every output is written before the round returns: with the average where its
    part was averaged, else with the input value (:meth:`keep_local`, which also overwrites an
    average that was written only in part).
    """

    def __init__(self, tensors: Sequence[torch.Tensor], out: Sequence[torch.Tensor] | None = None) -> None:
        # reshape is a view for contiguous tensors; a strided input is copied once here
        self.inputs = [tensor.detach().reshape(-1) for tensor in tensors]
        if out is None:
            self.outputs = [torch.empty(t.numel(), dtype=t.dtype, device=t.device) for t in tensors]
        else:
            self.outputs = [output.view(-1) for output in _checked_outputs(tensors, out)]
        self._out = list(out) if out is not None else None
        self.shapes = [tensor.shape for tensor in tensors]

    @property
    def present(self) -> bool:
        """False for an auxiliary peer that passed no tensors (it only reduces)."""
        return bool(self.inputs)

    @property
    def device(self) -> torch.device:
        return self.inputs[0].device if self.inputs else torch.device("cpu")

    def input_chunk(self, chunk: ChunkSpec) -> torch.Tensor:
        return self.inputs[chunk.tensor][chunk.start : chunk.end]

    def output_chunk(self, chunk: ChunkSpec) -> torch.Tensor | None:
        """Where the round's result for ``chunk`` goes (None for a member without tensors)."""
        return self.outputs[chunk.tensor][chunk.start : chunk.end] if self.outputs else None

    def write(self, chunk: ChunkSpec, values: torch.Tensor) -> None:
        if self.outputs:
            self.outputs[chunk.tensor][chunk.start : chunk.end].copy_(values)

    def keep_local(self, part: PartSpec) -> None:
        for chunk in part.chunks:
            if self.outputs:
                self.write(chunk, self.input_chunk(chunk))

    def results(self) -> list[torch.Tensor]:
        if self._out is not None:
            return self._out
        return [output.view(shape) for output, shape in zip(self.outputs, self.shapes, strict=True)]


def _checked_outputs(tensors: Sequence[torch.Tensor], out: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """Caller-provided outputs must match the inputs and must not overlap them: a part that fails
    after some of its average was written is restored from the inputs."""
    if len(out) != len(tensors):
        raise ConfigurationError(f"{len(out)} output tensors for {len(tensors)} inputs")
    for index, (given, output) in enumerate(zip(tensors, out, strict=True)):
        if not isinstance(output, torch.Tensor) or (output.shape, output.dtype, output.device) != (
            given.shape,
            given.dtype,
            given.device,
        ):
            raise ConfigurationError(f"output {index} must have the shape, dtype and device of input {index}")
        if not output.is_contiguous() or output.requires_grad:
            raise ConfigurationError(f"output {index} must be contiguous and not require grad")
    for index, output in enumerate(out):
        if output.numel() and any(_overlap(output, t) for t in (*tensors, *out[:index])):
            raise ConfigurationError(f"output {index} shares memory with an input or another output")
    return out


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or not b.numel():
        return False
    a_start, b_start = a.data_ptr(), b.data_ptr()
    a_end = a_start + a.numel() * a.element_size()
    b_end = b_start + (b.untyped_storage().nbytes() if not b.is_contiguous() else b.numel() * b.element_size())
    return a_start < b_end and b_start < a_end


class CodecRunner:
    """Runs codec work in ``executor`` (or inline if None) and tracks the jobs still running.

    A job cannot be stopped once a worker thread has started it, even if the task awaiting it is
    cancelled; :meth:`drain` waits for such jobs, so the round can safely write its outputs after.
    """

    def __init__(self, executor: concurrent.futures.Executor | None) -> None:
        self.executor = executor
        self._jobs: set[concurrent.futures.Future[object]] = set()

    def submit(self, function: Callable[..., T], *args: object) -> asyncio.Future[T]:
        """Starts ``function(*args)`` and returns a future of its result (already done when run inline).

        The future is a plain future, not a task: several coroutines may await it, and one that
        is cancelled while awaiting it does not cancel the job.
        """
        if self.executor is None:
            future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
            try:
                future.set_result(function(*args))
            except Exception as e:
                future.set_exception(e)
            return future
        try:
            job = self.executor.submit(function, *args)
        except RuntimeError as e:  # the service shut its thread pool down
            raise ClosedError(f"the all-reduce service is shut down: {e}") from e
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)
        return asyncio.wrap_future(job)

    async def run(self, function: Callable[..., T], *args: object) -> T:
        return await self.submit(function, *args)

    async def drain(self) -> None:
        """Waits until no job started by this runner is running (jobs are short: one chunk each)."""
        while self._jobs:
            await asyncio.wait([asyncio.wrap_future(job) for job in list(self._jobs)])


class Traffic:
    """Payload bytes this member put on / took off the network in one round. Each increment of
    ``received`` is logged with its time (see :class:`.throughput.ReceiveLog`), from which the
    round's download rate is read (:meth:`receive_rate`)."""

    def __init__(self) -> None:
        self.sent = 0
        self.log = ReceiveLog()

    @property
    def received(self) -> int:
        return self.log.total

    @received.setter
    def received(self, value: int) -> None:
        self.log.add(value - self.log.total)

    def receive_rate(self, started: float) -> float | None:
        """Bytes/s this member received at, in a round that started at ``started`` (loop time); None
        if the round moved too little to tell (see :func:`.throughput.receive_rate`)."""
        return receive_rate(self.log.arrivals, started)


@dataclasses.dataclass(eq=False)
class RoundContext:
    """Everything one member knows about its round; mutated only from the event loop thread."""

    group_id: bytes
    members: tuple[Member, ...]
    peers: tuple[PeerID, ...]
    me: int
    config: AllreduceConfig
    hooks: RoundHooks
    weight: float
    gather: bytes  # packed
    started: float
    deadline: float
    tensors: RoundTensors
    tensor_infos: Sequence[CompressionInfo] | None
    layout: RoundLayout | None  # None only on an auxiliary peer without tensors, until a sender tells it
    runner: CodecRunner
    limits: Limits
    traffic: Traffic = dataclasses.field(default_factory=Traffic)
    excluded: dict[PeerID, str] = dataclasses.field(default_factory=dict)
    gathered: dict[str, bytes] = dataclasses.field(default_factory=dict)  # from each author directly
    relayed: dict[str, bytes] = dataclasses.field(default_factory=dict)  # echoed by owners

    def __post_init__(self) -> None:
        self.names = tuple(member.peer_id for member in self.members)
        self.name_set = frozenset(self.names)
        # members' names (base58) to their PeerIDs, made once: PeerID.from_base58 decodes and
        # re-encodes base58 in pure Python, and a round named every contributor of every part
        # that way (N * (N - 1) streams x N names: 14% of a small round's CPU at 8 peers)
        self.peer_by_name = dict(zip(self.names, self.peers, strict=True))
        self.gathered[self.names[self.me]] = self.gather

    @property
    def my_peer(self) -> PeerID:
        return self.peers[self.me]

    @property
    def join_deadline(self) -> float:
        """Owners exclude senders that have not joined by then."""
        return min(self.started + self.config.next_chunk_timeout, self.deadline)

    @property
    def collect_deadline(self) -> float:
        """Owners stop waiting for senders then, and average what arrived."""
        return min(self.started + self.config.collect_timeout, self.deadline)

    @property
    def idle_timeout(self) -> float:
        """A stream of the round that moves no byte for this long while one is due is cut
        (``next_chunk_timeout``). A transfer that keeps moving, at whatever rate the link allows,
        is waited for until the round's deadline: a fixed time per chunk would cut healthy peers on
        thin links (a 2 MiB chunk takes 2.5 s at 20 Mbit/s shared by three streams, and more
        when the link is thinner or busier)."""
        return self.config.next_chunk_timeout

    def is_sender(self, index: int) -> bool:
        return not self.members[index].auxiliary

    def is_owner(self, index: int) -> bool:
        return not self.members[index].client_mode

    @property
    def sends(self) -> bool:
        """Whether this member contributes values (auxiliary members do not)."""
        return self.is_sender(self.me) and self.tensors.present

    def senders(self) -> list[PeerID]:
        return [peer for index, peer in enumerate(self.peers) if self.is_sender(index)]

    def owners(self) -> list[int]:
        return [index for index in range(len(self.peers)) if self.is_owner(index)]

    def exclude(self, peer: PeerID, reason: str) -> None:
        self.excluded.setdefault(peer, reason)

    def learn_gathered(self, gathered: dict[str, bytes]) -> None:
        for name, data in gathered.items():
            self.relayed.setdefault(name, data)

    def all_gathered(self) -> dict[str, bytes]:
        """What this member can tell others: direct data first, relayed data for the rest."""
        return {**self.relayed, **self.gathered}

    def compression_info(self, chunk: ChunkSpec, *, aggregate: bool = False) -> CompressionInfo:
        """The chunk's tensor's info (key, role, shape), located as part ``piece`` of that tensor at
        its offset; ``aggregate`` for the owner's average (see CompressionInfo)."""
        if self.tensor_infos is not None:
            base = self.tensor_infos[chunk.tensor]
        elif self.layout is None:
            raise AllreduceError("a chunk was compressed before the round's layout was known")
        else:
            spec = self.layout.tensors[chunk.tensor]
            base = CompressionInfo(key=chunk.tensor, shape=spec.shape, dtype=spec.dtype)
        info = base.get_part(chunk.piece, chunk.numel, chunk.start)
        return dataclasses.replace(info, aggregate=True) if aggregate else info

    def codec_for(self, chunk: ChunkSpec, *, aggregate: bool = False) -> tuple[Codec, CompressionInfo]:
        """The codec ``chunk`` travels with (see :func:`chunk_codec`) and the chunk's info."""
        info = self.compression_info(chunk, aggregate=aggregate)
        return chunk_codec(self.config.compression, info), info

    def averaged(self, part: PartSpec, first: Sequence[PeerID], chunks: Sequence[Sequence[PeerID]]) -> PartOutcome:
        """The outcome of an averaged part: ``first`` the peers in RESULT, ``chunks`` those in each
        averaged chunk; a part whose chunks differ (a sender dropped out mid-part) lists its runs."""
        everywhere = tuple(peer for peer in first if all(peer in chunk for chunk in chunks))
        runs: list[ContributorRun] = []
        for spec, contributors in zip(part.chunks, chunks, strict=True):
            start = part.start + spec.offset
            if runs and runs[-1].contributors == tuple(contributors):
                runs[-1] = runs[-1]._replace(end=start + spec.numel)
            else:
                runs.append(ContributorRun(start, start + spec.numel, tuple(contributors)))
        owner = self.peers[part.owner]
        return PartOutcome(owner, part.start, part.end, True, everywhere, None, tuple(runs) if len(runs) > 1 else ())

    def not_averaged(self, part: PartSpec, reason: str) -> PartOutcome:
        """The outcome of a part that keeps this member's own values."""
        mine = (self.my_peer,) if self.sends else ()
        return PartOutcome(self.peers[part.owner], part.start, part.end, False, mine, reason)
