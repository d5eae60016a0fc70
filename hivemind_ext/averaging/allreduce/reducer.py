"""The owner's side of butterfly all-reduce for one part: the aggregate (by default the weighted
mean) over the senders that delivered the whole part.

Senders stream their slice of the part in chunks. Each chunk is decoded, validated (length, dtype,
finite values) and, for the weighted mean, added to a running weighted sum at once, so reducing
overlaps receiving. A sender that fails, stalls or misbehaves mid-part is excluded and its chunks
already added are subtracted again (from the compressed messages it sent, kept until the part is
finalized), so the result is exactly the weighted mean over the senders that contributed all of
the part, and says who they are.

The norm bound (:func:`~hivemind_ext.averaging.allreduce.aggregators.norm_outliers`, on by default)
is checked at :meth:`PartReducer.finalize`: each sender's norm on the part is summed chunk by chunk
as chunks arrive (the same pass that checks the values are finite), and a sender whose norm is
absurd next to the group's median is excluded; the mean is then recomputed from the kept messages
of the others (subtracting a huge contribution from the sum would leave rounding errors of its
size). A robust aggregator (CenteredClip, TrimmedMean) needs every contribution of the part at
once: the chunks are only validated on arrival, and the part is aggregated at ``finalize``.

Memory: the compressed chunks of every sender are kept until the part is finalized (one copy of
the part per sender, in the codec's size); a robust aggregator also decodes them into a float32
[senders, part size] matrix at ``finalize``.
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
class ReducedPart:
    values: torch.Tensor  # float32 [part_size], the aggregate (weighted mean) over contributors
    contributors: tuple[Sender, ...]  # senders whose whole slice is in `values`, in constructor order
    total_weight: float
    # senders that delivered the whole part but were left out at finalize (norm bound), with why
    rejected: Mapping[Sender, str] = dataclasses.field(default_factory=dict)


class PartReducer:
    """Accumulates one part from several senders; not thread-safe (use from one thread at a time).

    Chunks are ``chunk_size`` values long (the last one may be shorter), unless ``bounds`` lists
    them explicitly: consecutive ``[start, end)`` offsets covering the part, as when a part is cut
    at tensor boundaries as well (see :mod:`hivemind_ext.averaging.allreduce.layout`).

    ``aggregator`` (None: the weighted mean) combines the contributions; ``norm_bound`` (None: off)
    excludes, at ``finalize``, senders whose norm on the part exceeds that many times the median.
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
        self.total = torch.zeros(part_size, dtype=torch.float32, device=self.device)
        self._received: dict[Sender, dict[int, CompressedTensor]] = {sender: {} for sender in self.weights}
        self._done: set[Sender] = set(self.weights) if self.num_chunks == 0 else set()
        self._excluded: dict[Sender, str] = {}
        self.aggregator = check_aggregator(aggregator)
        self.norm_bound = check_norm_bound(norm_bound)
        self._squares: dict[Sender, float] = dict.fromkeys(self.weights, 0.0)  # squared norm so far

    def chunk_length(self, index: int) -> int:
        start, end = self.bounds[index]
        return end - start

    def set_weight(self, sender: Sender, weight: float) -> None:
        """Sets the weight of a sender that has not sent a chunk yet (senders may announce their
        weight with their first message, after the reducer was created)."""
        if sender not in self.weights:
            raise ProtocolError(f"{sender} is not a sender of this part")
        if sender in self._excluded or (self.num_chunks and sender in self._done) or self._received[sender]:
            raise ProtocolError(f"{sender} cannot change its weight after sending chunks")
        if not isinstance(weight, int | float) or isinstance(weight, bool) or not 0 <= weight < math.inf:
            raise ProtocolError(f"{sender} declared weight {weight!r:.50}, expected a finite non-negative number")
        self.weights[sender] = float(weight)

    def active_senders(self) -> list[Sender]:
        return [s for s in self.weights if s not in self._excluded and s not in self._done]

    @property
    def excluded(self) -> Mapping[Sender, str]:
        return dict(self._excluded)

    def accept(self, sender: Sender, index: int, message: CompressedTensor) -> None:
        """Adds one chunk. Raises ProtocolError (and excludes the sender) if the chunk is invalid."""
        if sender not in self.weights:
            raise ProtocolError(f"{sender} is not a sender of this part")
        if sender in self._excluded or sender in self._done:
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
            self.total[start : start + values.numel()].add_(values, alpha=self.weights[sender])
        self._squares[sender] += norm * norm
        received = self._received[sender]
        received[index] = message
        if len(received) == self.num_chunks:
            self._done.add(sender)
            if self.norm_bound is None and self.aggregator.streaming:
                del self._received[sender]  # nothing left to retract or recompute: release them

    def _validated(self, sender: Sender, index: int, message: CompressedTensor) -> tuple[torch.Tensor, float]:
        if type(index) is not int or not 0 <= index < self.num_chunks:
            raise ProtocolError(f"{sender} sent chunk index {index!r}, expected 0..{self.num_chunks - 1}")
        if index in self._received[sender]:
            raise ProtocolError(f"{sender} sent chunk {index} twice")
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
        """Removes a sender and retracts whatever it had added; idempotent. A finished sender stays in."""
        if sender in self._excluded or sender in self._done or sender not in self.weights:
            return
        received = self._received.pop(sender)
        for index, message in received.items() if self.aggregator.streaming else ():
            values = decompress(message, device=self.device).to(torch.float32)
            start = self.bounds[index][0]
            self.total[start : start + values.numel()].sub_(values, alpha=self.weights[sender])
        self._excluded[sender] = reason
        logger.debug(f"excluded {sender} from a part: {reason}")

    def finalize(self) -> ReducedPart:
        """The weighted mean; every sender must be done or excluded by now."""
        pending = self.active_senders()
        if pending:
            raise AllreduceError(f"cannot finalize a part while {len(pending)} senders are still pending")
        contributors = tuple(s for s in self.weights if s in self._done)
        rejected = self._reject_outliers(contributors)
        contributors = tuple(s for s in contributors if s not in rejected)
        total_weight = sum(self.weights[s] for s in contributors)
        if not contributors or total_weight <= 0:
            raise AllreduceError(f"no sender contributed to this part (excluded: {self._excluded})")
        if not self.aggregator.streaming:
            values = self._aggregated(contributors)
        elif rejected:
            values = self._recomputed_sum(contributors).div_(total_weight)
        else:
            values = self.total.div_(total_weight)
        self._received.clear()
        return ReducedPart(values, contributors, total_weight, rejected)

    def _reject_outliers(self, contributors: tuple[Sender, ...]) -> dict[Sender, str]:
        """Excludes the contributors whose norm on the part is absurd next to the others' median
        (those with weight 0 take no part: their values are not averaged in)."""
        weighed = [s for s in contributors if self.weights[s] > 0]
        norms = [math.sqrt(self._squares[s]) for s in weighed]
        rejected: dict[Sender, str] = {}
        if self.num_chunks == 0:
            return rejected
        outliers = norm_outliers(norms, self.norm_bound)
        if outliers:
            median = sorted(norms)[len(norms) // 2]
            for index in outliers:
                sender = weighed[index]
                rejected[sender] = (
                    f"its contribution's norm {norms[index]:.3g} exceeds {self.norm_bound:g}x the group's "
                    f"median norm (~{median:.3g}) on this part"
                )
                logger.warning(f"excluded {sender} from a part: {rejected[sender]}")
        self._excluded.update(rejected)
        self._done.difference_update(rejected)
        return rejected

    def _decoded(self, sender: Sender) -> torch.Tensor:
        """A sender's whole slice, decoded again from the messages it sent (float32 [part_size])."""
        values = torch.empty(self.part_size, dtype=torch.float32, device=self.device)
        for index, message in self._received[sender].items():
            start, end = self.bounds[index]
            values[start:end] = decompress(message, device=self.device).to(torch.float32)
        return values

    def _recomputed_sum(self, contributors: tuple[Sender, ...]) -> torch.Tensor:
        total = self.total.zero_()
        for sender in contributors:
            total.add_(self._decoded(sender), alpha=self.weights[sender])
        return total

    def _aggregated(self, contributors: tuple[Sender, ...]) -> torch.Tensor:
        weighed = [s for s in contributors if self.weights[s] > 0]  # weight 0: not averaged in
        matrix = torch.stack([self._decoded(s) for s in weighed])  # [senders, part_size]
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
