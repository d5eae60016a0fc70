"""What an all-reduce round takes and returns: its config, its fault-injection hooks, its result.

Kept apart from the round's machinery so that the sender and owner modules, the service and the
averager all share these definitions without importing each other.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import torch
from hivemind.p2p import PeerID

from hivemind_ext.averaging.allreduce.aggregators import (
    DEFAULT_NORM_BOUND,
    Aggregator,
    WeightedMean,
    check_aggregator,
    check_norm_bound,
)
from hivemind_ext.compression import Codec, NoCompression
from hivemind_ext.compression.resolve import as_codec
from hivemind_ext.errors import ConfigurationError
from hivemind_ext.p2p import Message

# Measured with 4 peers x 16M float32 values on 2 cores (benchmarks/allreduce.py, one process): rounds
# with 256 KiB / 512 KiB / 1 MiB / 2 MiB / 4 MiB chunks took 1.28 / 1.14 / 1.02 / 0.96 / 0.91 s with
# no compression and 0.86 / 0.61 / 0.48 / 0.47 / 0.44 s with MinMaxUInt8 (per-chunk overhead); 2 MiB
# keeps most of the gain (next_chunk_timeout is an idle window, so a chunk may take any time to cross a thin link).
DEFAULT_PART_SIZE_BYTES = 2**21
DEFAULT_NEXT_CHUNK_TIMEOUT = 5.0
DEFAULT_ALLREDUCE_TIMEOUT = 60.0
DEFAULT_COLLECT_FRACTION = 0.75
MAX_PART_SIZE_BYTES = 2**28


@dataclasses.dataclass(frozen=True, kw_only=True)
class AllreduceConfig:
    """How one all-reduce round runs; every member of a group should use the same values.

    :param compression: the codec for chunks in both directions (ours, or a hivemind codec object)
    :param part_size_bytes: chunks hold at most this many bytes of uncompressed values (members
      that disagree cannot average with each other: their layouts differ)
    :param next_chunk_timeout: the idle window. A stream of the round on which no byte moves for
      this long while one is due (a sender's next chunk, an owner's next averaged chunk, our own
      write that the peer stops taking) is cut and its peer excluded from that part; a sender must
      also JOIN within this long of the owner's start. A transfer that keeps moving is never cut,
      however slow the link: a chunk may take far longer than this to cross a thin link (hivemind's
      keyword, which there bounds each chunk's whole transfer, has this meaning here); the round's
      ``allreduce_timeout`` bounds everything. ``None``: the default (5 s)
    :param allreduce_timeout: the whole round ends within this many seconds (plus a small margin)
      of its start, whatever other peers do; ``None``: the default (60 s). With ``adaptive_deadline``
      this is the floor: a round predicted to take longer gets a multiple of its prediction
    :param adaptive_deadline: lengthen the round's deadline (and ``collect_timeout`` in proportion)
      to 3x its duration predicted from the members' declared throughputs where that exceeds
      ``allreduce_timeout``, up to an hour (see :mod:`.round_time`); stalls are still cut by
      ``next_chunk_timeout``. ``False``: ``allreduce_timeout`` is a fixed bound
    :param collect_timeout: owners stop waiting for slow senders this many seconds after the start
      and average what arrived, leaving the rest of ``allreduce_timeout`` to send the results back;
      ``None``: 3/4 of ``allreduce_timeout``
    :param offload_codecs: compress, decode and reduce in the service's thread pool, so that codec
      work overlaps with network I/O on the event loop (torch releases the GIL inside its kernels).
      Off by default: measured on 2 cores with 4 peers, handing every chunk to a thread costs more
      (GIL hand-offs stall the event loop, buffers cross malloc arenas) than the overlap gains; it
      can pay off on machines with cores to spare and expensive codecs.
    :param aggregator: how each owner combines the contributions to its part: ``None`` or
      ``WeightedMean()`` (plain averaging, streamed), ``CenteredClip()`` / ``CenteredClip(tau=...)`` or
      ``TrimmedMean(trim=...)`` (robust to hostile contributions; see :mod:`.aggregators`)
    :param norm_bound: a contribution whose norm on a part exceeds this many times the median norm
      of the part's contributions is excluded from it (and reported in the round's result), with
      any aggregator; ``None`` turns the bound off
    """

    compression: Any = dataclasses.field(default_factory=NoCompression)
    part_size_bytes: int = DEFAULT_PART_SIZE_BYTES
    next_chunk_timeout: float | None = None
    allreduce_timeout: float | None = None
    collect_timeout: float | None = None
    adaptive_deadline: bool = True
    offload_codecs: bool = False
    aggregator: Aggregator = dataclasses.field(default_factory=WeightedMean)
    norm_bound: float | None = DEFAULT_NORM_BOUND

    def __post_init__(self) -> None:
        object.__setattr__(self, "compression", _codec(self.compression))
        if type(self.part_size_bytes) is not int or not 1 <= self.part_size_bytes <= MAX_PART_SIZE_BYTES:
            raise ConfigurationError(
                f"part_size_bytes must be an int in [1, {MAX_PART_SIZE_BYTES}], got {self.part_size_bytes!r}"
            )
        self._resolve("next_chunk_timeout", DEFAULT_NEXT_CHUNK_TIMEOUT)
        self._resolve("allreduce_timeout", DEFAULT_ALLREDUCE_TIMEOUT)
        self._resolve("collect_timeout", DEFAULT_COLLECT_FRACTION * self.allreduce_timeout)
        if self.collect_timeout >= self.allreduce_timeout:
            raise ConfigurationError(
                f"collect_timeout ({self.collect_timeout}) must be shorter than allreduce_timeout "
                f"({self.allreduce_timeout}): owners need time to send the results back"
            )
        if not isinstance(self.adaptive_deadline, bool):
            raise ConfigurationError(f"adaptive_deadline must be a bool, got {self.adaptive_deadline!r}")
        if not isinstance(self.offload_codecs, bool):
            raise ConfigurationError(f"offload_codecs must be a bool, got {self.offload_codecs!r}")
        object.__setattr__(self, "aggregator", check_aggregator(self.aggregator))
        object.__setattr__(self, "norm_bound", check_norm_bound(self.norm_bound))

    def _resolve(self, name: str, default: float) -> None:
        value = getattr(self, name)
        if value is None:
            value = default
        if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < math.inf:
            raise ConfigurationError(f"{name} must be None or a positive finite number of seconds, got {value!r}")
        object.__setattr__(self, name, float(value))


def _codec(compression: Any) -> Codec:
    try:
        return as_codec(compression)
    except ConfigurationError as e:
        raise ConfigurationError(f"AllreduceConfig(compression=...): {e}") from None


class RoundHooks:
    """The fault-injection seam of a round: override the methods to delay, corrupt, fail or crash.

    Each method is awaited on the event loop at the point its name says, with the message about to
    be sent (return it, or a replacement) or just received. The defaults do nothing. An exception
    raised by a hook fails that one stream as a network failure at that point would (the peer on
    the other side excludes this one, or this one gives up on it); to simulate a crash of the whole
    peer, cancel its ``run_round`` task from a hook.

    ``part`` is the part's index (= its owner's index in the group), ``index`` the chunk's index
    within the part.
    """

    async def before_join(self, owner: PeerID, part: int, message: Message) -> Message:
        """Sender side: the JOIN message that opens the stream to ``owner``."""
        return message

    async def before_send_chunk(self, owner: PeerID, part: int, index: int, message: Message) -> Message:
        """Sender side: a chunk of this peer's slice of ``part`` about to go to its owner."""
        return message

    async def after_receive_chunk(self, sender: PeerID, part: int, index: int, message: Message) -> None:
        """Owner side: a chunk from ``sender`` has arrived and is about to be reduced."""

    async def before_send_result(self, sender: PeerID, part: int, index: int | None, message: Message) -> Message:
        """Owner side: the RESULT head (``index`` None) or a chunk of the averaged part for ``sender``."""
        return message


class ContributorRun(NamedTuple):
    """A range ``[start, end)`` of the flattened tensors (consecutive chunks of one part) and the
    peers whose values its average holds."""

    start: int
    end: int
    contributors: tuple[PeerID, ...]


@dataclasses.dataclass(frozen=True)
class PartOutcome:
    """What became of one part, from this peer's point of view.

    ``averaged`` parts hold the weighted mean over ``contributors`` everywhere, except where
    ``runs`` says otherwise: owners average and return each chunk as soon as it is complete, so a
    sender that drops out mid-part is in the chunks averaged before and missing from the rest, and
    ``runs`` then lists every range with its own contributors (``contributors`` are the peers in
    all of them). A part that was not averaged (its owner failed, refused or was too slow) holds
    this peer's own values, and ``contributors`` is just this peer (or empty on an auxiliary peer,
    which has no values of its own).
    """

    owner: PeerID
    start: int  # [start, end) of the flattened, concatenated tensors
    end: int
    averaged: bool
    contributors: tuple[PeerID, ...]
    reason: str | None = None  # why the part was not averaged
    runs: tuple[ContributorRun, ...] = ()  # empty: ``contributors`` everywhere in the part

    @property
    def segments(self) -> tuple[ContributorRun, ...]:
        """The part as ranges, each with the peers whose values it holds (one range unless a
        contributor dropped out mid-part)."""
        return self.runs or (ContributorRun(self.start, self.end, self.contributors),)


@dataclasses.dataclass(frozen=True)
class AllreduceResult:
    """The outcome of one round.

    :param tensors: new tensors with the inputs' shapes, dtypes and devices: the average where a
      part was averaged, this peer's own values elsewhere (empty for an auxiliary peer that passed
      no tensors)
    :param parts: one per member that owns a part (client-mode members own none), in member order
    :param excluded: peers this peer saw fail, with the reason: senders excluded from the part it
      owns, and owners whose part it could not get averaged
    :param gathered: every member's ``gather`` data that reached this peer, by peer id
    :param bytes_sent / bytes_received: message payload bytes this peer put on / took off the
      network (chunks both ways, gather data; not frame headers)
    :param members: the group's contributing members (all but auxiliary ones), in member order:
      whose values a complete round averages (see :attr:`missing`)
    :param receive_rate: bytes/s at which this peer received during the round, what its
      throughput estimate learns from (see :mod:`.throughput`); None if the round moved too little
    :param predicted_seconds: the round's duration predicted from the members' declared throughputs
      (see :mod:`.round_time`); None where nobody declared one
    :param timeout_seconds: how long the round was allowed to take (``allreduce_timeout``, or the
      longer deadline the prediction set)
    :param chunk_bytes: the chunk size (uncompressed bytes) the round's layout used: the configured
      ``part_size_bytes`` or less on thin links (see :mod:`.layout`); None where this peer had no layout
    """

    tensors: list[torch.Tensor]
    parts: tuple[PartOutcome, ...]
    excluded: dict[PeerID, str]
    gathered: dict[PeerID, Any]
    bytes_sent: int
    bytes_received: int
    members: tuple[PeerID, ...] = ()
    receive_rate: float | None = None
    predicted_seconds: float | None = None
    timeout_seconds: float | None = None
    chunk_bytes: int | None = None

    @property
    def contributors(self) -> tuple[tuple[PeerID, ...], ...]:
        """Per part (as ``parts``), the peers whose values are in it."""
        return tuple(part.contributors for part in self.parts)

    @property
    def all_averaged(self) -> bool:
        return all(part.averaged for part in self.parts)

    @property
    def missing(self) -> dict[PeerID, str]:
        """Contributing members whose values are missing from some part of this peer's result, with
        why (the first reason found): empty when the result is the weighted mean over the whole group
        everywhere. A round with anyone missing still succeeds (faults are tolerated), but its result
        is not the group's mean: callers that need the full mean must check this (or :attr:`complete`).
        An auxiliary peer without tensors only judges the part it reduced."""
        missing: dict[PeerID, str] = {}
        for part in self.parts:
            if not part.averaged and not part.contributors:
                continue  # an auxiliary peer's view of another owner's part: it holds nothing there
            for member in self.members:
                if member in part.contributors or member in missing:
                    continue
                if member in self.excluded:
                    missing[member] = self.excluded[member]
                elif any(member in run.contributors for run in part.runs):
                    missing[member] = f"its values are in only some chunks of part {part.start}:{part.end}"
                elif not part.averaged:
                    missing[member] = f"part {part.start}:{part.end} kept local values: {part.reason or 'not averaged'}"
                else:
                    missing[member] = f"left out of the average of part {part.start}:{part.end}"
        return missing

    @property
    def complete(self) -> bool:
        """Whether every part holds the weighted mean over every contributing member (see :attr:`missing`)."""
        return not self.missing
