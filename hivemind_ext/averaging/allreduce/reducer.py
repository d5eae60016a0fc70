"""The owner's side of butterfly all-reduce for one part: the aggregate (by default the weighted
mean) of each chunk over the senders that delivered it, chunk by chunk.

Senders stream their slice of the part in chunks. Each chunk is decoded, validated (length, dtype,
finite values) and, for the weighted mean, added to a running weighted sum at once, so reducing
overlaps receiving. A chunk is *ready* once every sender that is not excluded has delivered it;
:meth:`PartReducer.finalize_chunk` then turns it into its aggregate, which the owner streams back
while the next chunks are still arriving (so its uplink works while its downlink does). A finalized
chunk is final: a sender that is excluded later (it fails, stalls or misbehaves mid-part) stays in
the chunks already finalized and is retracted from the others (they are recomputed from the
other senders' compressed messages, kept until their chunk is finalized). Each
:class:`ReducedChunk` says exactly whose values are in it.

The norm bound (:func:`~hivemind_ext.averaging.allreduce.aggregators.norm_outliers`, on by default)
and the robust aggregators (CenteredClip, TrimmedMean) work per chunk: each sender's norm on the
chunk is computed on arrival (the same pass that checks the values are finite); at
:meth:`PartReducer.finalize_chunk` a sender whose norm is absurd next to the chunk's median is
excluded from the rest of the part (the chunk is recomputed without it, as above). A
robust aggregator decodes the chunk's contributions into a float32 [senders, chunk] matrix then.

Memory: the compressed chunks of every sender are kept until their chunk is finalized.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch

from hivemind_ext.averaging.allreduce.aggregators import (
    DEFAULT_NORM_BOUND,
    Aggregator,
    check_aggregator,
    check_norm_bound,
    norm_outliers,
)
from hivemind_ext.averaging.allreduce.partition import chunk_bounds
from hivemind_ext.compression import CompressedTensor, decompress
from hivemind_ext.errors import AllreduceError, CompressionError, ConfigurationError, ProtocolError

logger = logging.getLogger(__name__)

Sender = Hashable


@dataclass(frozen=True)
class ReducedChunk:
    """One finalized chunk of a part."""

    index: int
    values: torch.Tensor  # float32 [chunk length], the aggregate over `contributors`
    contributors: tuple[Sender, ...]  # senders whose values are in `values`, in constructor order
    total_weight: float
    # senders that delivered this chunk but were left out of it (norm bound), with why
    rejected: Mapping[Sender, str] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class ReducedPart:
    values: torch.Tensor  # float32 [part_size], the aggregate (weighted mean), chunk by chunk
    contributors: tuple[Sender, ...]  # senders whose values are in every chunk, in constructor order
    total_weight: float  # the contributors' total weight
    # senders left out of some chunk they delivered (norm bound), with why
    rejected: Mapping[Sender, str] = dataclasses.field(default_factory=dict)


class PartReducer:
    """Accumulates one part from several senders; not thread-safe (use from one thread at a time).

    Chunks are ``chunk_size`` values long (the last one may be shorter), unless ``bounds`` lists
    them explicitly: consecutive ``[start, end)`` offsets covering the part, as when a part is cut
    at tensor boundaries as well (see :mod:`hivemind_ext.averaging.allreduce.layout`).

    ``aggregator`` (None: the weighted mean) combines the contributions; ``norm_bound`` (None: off)
    excludes, when a chunk is finalized, senders whose norm on it exceeds that many times the median.
    """

    def __init__(
        self,
        part_size: int,
        chunk_size: int,
        weights: Mapping[Sender, float],
        device: torch.device | str = "cpu",
        *,
        bounds: Sequence[tuple[int, int]] | None = None,
        aggregator: Aggregator | None = None,
        norm_bound: float | None = DEFAULT_NORM_BOUND,
    ):
        if part_size < 0 or chunk_size <= 0:
            raise ValueError(f"part_size must be >= 0 and chunk_size > 0, got {part_size}, {chunk_size}")
        self.part_size, self.chunk_size, self.device = part_size, chunk_size, torch.device(device)
        self.bounds = chunk_bounds(part_size, chunk_size) if bounds is None else _checked_bounds(bounds, part_size)
        self.num_chunks = len(self.bounds)
        self.weights = {sender: float(weight) for sender, weight in weights.items()}
        # not zero-filled: each chunk's first accepted contribution is written, the others added
        # (zeroing a part every round was 4% of a peer's event-loop time in benchmarks/averaging.py)
        self.total = torch.empty(part_size, dtype=torch.float32, device=self.device)
        self._summed: set[int] = set()  # chunks of the running sum that hold a contribution
        # per sender: the messages of chunks not finalized yet (to retract or recompute them)
        self._received: dict[Sender, dict[int, CompressedTensor]] = {sender: {} for sender in self.weights}
        self._delivered: dict[Sender, set[int]] = {sender: set() for sender in self.weights}
        self._norms: dict[Sender, dict[int, float]] = {sender: {} for sender in self.weights}
        self._excluded: dict[Sender, str] = {}
        self._final: dict[int, ReducedChunk] = {}
        self._dirty: set[int] = set()  # chunks in the running sum that hold values of an excluded sender
        self.aggregator = check_aggregator(aggregator)
        self.norm_bound = check_norm_bound(norm_bound)

    def chunk_length(self, index: int) -> int:
        start, end = self.bounds[index]
        return end - start

    def set_weight(self, sender: Sender, weight: float) -> None:
        """Sets the weight of a sender that has not sent a chunk yet (senders may announce their
        weight with their first message, after the reducer was created)."""
        if sender not in self.weights:
            raise ProtocolError(f"{sender} is not a sender of this part")
        if sender in self._excluded or self._delivered[sender]:
            raise ProtocolError(f"{sender} cannot change its weight after sending chunks")
        if not isinstance(weight, int | float) or isinstance(weight, bool) or not 0 <= weight < math.inf:
            raise ProtocolError(f"{sender} declared weight {weight!r:.50}, expected a finite non-negative number")
        self.weights[sender] = float(weight)

    def done(self, sender: Sender) -> bool:
        """Whether ``sender`` delivered every chunk and was not excluded."""
        return sender not in self._excluded and len(self._delivered[sender]) == self.num_chunks

    def active_senders(self) -> list[Sender]:
        """Senders neither excluded nor done."""
        return [s for s in self.weights if s not in self._excluded and not self.done(s)]

    @property
    def excluded(self) -> Mapping[Sender, str]:
        return dict(self._excluded)

    @property
    def finalized(self) -> int:
        """How many chunks are finalized."""
        return len(self._final)

    def accept(self, sender: Sender, index: int, message: CompressedTensor) -> None:
        """Adds one chunk. Raises ProtocolError (and excludes the sender) if the chunk is invalid."""
        if sender not in self.weights:
            raise ProtocolError(f"{sender} is not a sender of this part")
        if sender in self._excluded or self.done(sender):
            raise ProtocolError(
                f"{sender} sent a chunk after it was {'excluded' if sender in self._excluded else 'done'}"
            )
        try:
            values, norm = self._validated(sender, index, message)
        except ProtocolError as e:
            self.exclude(sender, str(e))
            raise
        if self.aggregator.streaming:
            start = self.bounds[index][0]
            segment = self.total[start : start + values.numel()]
            if index in self._summed:
                segment.add_(values, alpha=self.weights[sender])
            else:  # bit-identical to adding it to zeros
                torch.mul(values, self.weights[sender], out=segment)
                self._summed.add(index)
        self._norms[sender][index] = norm
        self._received[sender][index] = message
        self._delivered[sender].add(index)

    def _validated(self, sender: Sender, index: int, message: CompressedTensor) -> tuple[torch.Tensor, float]:
        if type(index) is not int or not 0 <= index < self.num_chunks:
            raise ProtocolError(f"{sender} sent chunk index {index!r}, expected 0..{self.num_chunks - 1}")
        if index in self._delivered[sender]:
            raise ProtocolError(f"{sender} sent chunk {index} twice")
        if index in self._final:  # cannot happen to a sender that is not excluded; kept as a guard
            raise ProtocolError(f"{sender} sent chunk {index} after it was averaged without it")
        expected = self.chunk_length(index)
        if not isinstance(message, CompressedTensor) or message.shape != (expected,):
            shape = getattr(message, "shape", None)
            raise ProtocolError(f"{sender} sent chunk {index} of shape {shape}, expected ({expected},)")
        if not message.dtype.is_floating_point:
            raise ProtocolError(f"{sender} sent chunk {index} of dtype {message.dtype}, expected a float dtype")
        try:
            values = decompress(message, device=self.device)
        except CompressionError as e:
            raise ProtocolError(f"{sender} sent an undecodable chunk {index}: {e}") from e
        values = values.to(torch.float32)
        norm = finite_norm(values)
        if norm is None:
            raise ProtocolError(f"{sender} sent chunk {index} with NaN or Inf values")
        return values, norm

    def exclude(self, sender: Sender, reason: str) -> None:
        """Removes a sender from the chunks not finalized yet, retracting what it added there;
        idempotent. A sender that has delivered every chunk stays in."""
        if sender in self._excluded or sender not in self.weights or self.done(sender):
            return
        self._retract(sender, reason)

    def _retract(self, sender: Sender, reason: str) -> None:
        # its chunks are recomputed from the others' kept messages when finalized: subtracting them
        # would leave rounding errors of their size (or NaN, for a sum that overflowed)
        self._dirty.update(self._received.pop(sender, {}))
        self._excluded[sender] = reason
        logger.debug(f"excluded {sender} from a part: {reason}")

    def chunk_ready(self, index: int) -> bool:
        """Whether chunk ``index`` can be finalized: not yet, and every sender not excluded delivered it."""
        return index not in self._final and all(
            index in delivered for sender, delivered in self._delivered.items() if sender not in self._excluded
        )

    def finalize_chunk(self, index: int) -> ReducedChunk:
        """The aggregate of chunk ``index`` over the senders not excluded (all of which delivered it),
        less those the norm bound rejects, who are excluded from the rest of the part. Raises
        AllreduceError if the chunk is not ready or nobody with a positive weight is left in it."""
        if not self.chunk_ready(index):
            raise AllreduceError(f"chunk {index} cannot be finalized: already done, or senders are still pending")
        start, end = self.bounds[index]
        contributors = tuple(s for s in self.weights if s not in self._excluded)
        rejected = self._reject_outliers(index, contributors)
        contributors = tuple(s for s in contributors if s not in rejected)
        total_weight = sum(self.weights[s] for s in contributors)
        if not contributors or total_weight <= 0:
            raise AllreduceError(f"no sender contributed to chunk {index} (excluded: {self._excluded})")
        segment = self.total[start:end]
        if not self.aggregator.streaming:
            segment.copy_(self._aggregated(index, contributors))
        else:
            if index in self._dirty:
                self._recompute(index, contributors)
            segment.div_(total_weight)
        for received in self._received.values():
            received.pop(index, None)  # final: nothing left to retract or recompute
        reduced = ReducedChunk(index, segment, contributors, total_weight, rejected)
        self._final[index] = reduced
        return reduced

    def finalize(self) -> ReducedPart:
        """Finalizes every chunk not finalized yet; every sender must be done or excluded by now.
        The part's contributors are the senders in every chunk."""
        pending = self.active_senders()
        if pending:
            raise AllreduceError(f"cannot finalize a part while {len(pending)} senders are still pending")
        if self.num_chunks == 0:
            contributors = tuple(s for s in self.weights if s not in self._excluded)
            total_weight = sum(self.weights[s] for s in contributors)
            if not contributors or total_weight <= 0:
                raise AllreduceError(f"no sender contributed to this part (excluded: {self._excluded})")
            return ReducedPart(self.total, contributors, total_weight)
        chunks = [self._final.get(index) or self.finalize_chunk(index) for index in range(self.num_chunks)]
        common = set.intersection(*(set(chunk.contributors) for chunk in chunks))
        contributors = tuple(s for s in self.weights if s in common)
        rejected = {sender: reason for chunk in chunks for sender, reason in chunk.rejected.items()}
        return ReducedPart(self.total, contributors, sum(self.weights[s] for s in contributors), rejected)

    def _reject_outliers(self, index: int, contributors: tuple[Sender, ...]) -> dict[Sender, str]:
        """Excludes the contributors whose norm on the chunk is absurd next to the others' median
        (those with weight 0 take no part: their values are not averaged in)."""
        weighed = [s for s in contributors if self.weights[s] > 0]
        norms = [self._norms[s][index] for s in weighed]
        rejected: dict[Sender, str] = {}
        outliers = norm_outliers(norms, self.norm_bound)
        if outliers:
            median = sorted(norms)[len(norms) // 2]
            for position in outliers:
                sender = weighed[position]
                rejected[sender] = (
                    f"its contribution's norm {norms[position]:.3g} exceeds {self.norm_bound:g}x the group's "
                    f"median norm (~{median:.3g}) on chunk {index} of this part"
                )
                logger.warning(f"excluded {sender} from a part: {rejected[sender]}")
        for sender, reason in rejected.items():
            self._retract(sender, reason)
        return rejected

    def _decoded(self, sender_messages: Mapping[int, CompressedTensor], index: int) -> torch.Tensor:
        return decompress(sender_messages[index], device=self.device).to(torch.float32)

    def _recompute(self, index: int, contributors: tuple[Sender, ...]) -> None:
        start, end = self.bounds[index]
        segment = self.total[start:end].zero_()
        for sender in contributors:
            segment.add_(self._decoded(self._received[sender], index), alpha=self.weights[sender])

    def _aggregated(self, index: int, contributors: tuple[Sender, ...]) -> torch.Tensor:
        weighed = [s for s in contributors if self.weights[s] > 0]  # weight 0: not averaged in
        matrix = torch.stack([self._decoded(self._received[s], index) for s in weighed])  # [senders, chunk]
        weights = torch.tensor([self.weights[s] for s in weighed], dtype=torch.float32, device=self.device)
        return self.aggregator.aggregate(matrix, weights)


def finite_norm(values: torch.Tensor) -> float | None:
    """The L2 norm of a float32 tensor, or None if it holds NaN or Inf (one pass, like
    :func:`all_finite`; a norm that overflows float32 for finite values is returned as inf)."""
    if values.numel() == 0:
        return 0.0
    norm = float(torch.linalg.vector_norm(values))
    if math.isfinite(norm):
        return norm
    return math.inf if bool(torch.isfinite(values).all()) else None


def all_finite(values: torch.Tensor) -> bool:
    """Whether a float tensor holds no NaN or Inf.

    One sum instead of ``isfinite(values).all()``, which builds a bool tensor and is ~25x slower on
    CPU: NaN and Inf always make the sum non-finite, and a finite sum proves them absent. Only a
    sum that overflows (values near the dtype's limit) needs the exact check.
    """
    if values.numel() == 0 or bool(torch.isfinite(values.sum())):
        return True
    return bool(torch.isfinite(values).all())


def _checked_bounds(bounds: Sequence[tuple[int, int]], part_size: int) -> list[tuple[int, int]]:
    """Explicit chunk bounds must be non-empty, consecutive and cover exactly ``[0, part_size)``."""
    checked, position = [], 0
    for start, end in bounds:
        if start != position or end <= start:
            raise ConfigurationError(
                f"chunk bounds must be consecutive non-empty ranges from 0, got {list(bounds)[:8]}"
            )
        checked.append((int(start), int(end)))
        position = end
    if position != part_size:
        raise ConfigurationError(f"chunk bounds cover {position} values, the part has {part_size}")
    return checked
