"""The owner's side of butterfly all-reduce for one part: the weighted mean over the senders that
delivered the whole part.

Senders stream their slice of the part in chunks. Each chunk is decoded, validated (length, dtype,
finite values) and added to a running weighted sum at once, so reducing overlaps receiving. A
sender that fails, stalls or misbehaves mid-part is excluded and its chunks already added are
subtracted again (from the compressed messages kept until the sender is done), so the result is
exactly the weighted mean over the senders that contributed all of the part, and says who they are.

Memory: the compressed chunks of a sender are kept only until it has delivered its whole part.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

import torch

from hivemind_ext.compression import CompressedTensor, decompress
from hivemind_ext.errors import AllreduceError, CompressionError, ProtocolError

logger = logging.getLogger(__name__)

Sender = Hashable


@dataclass(frozen=True)
class ReducedPart:
    values: torch.Tensor  # float32 [part_size], weighted mean over contributors
    contributors: tuple[Sender, ...]  # senders whose whole slice is in `values`, in constructor order
    total_weight: float


class PartReducer:
    """Accumulates one part from several senders; not thread-safe (use from one event loop)."""

    def __init__(
        self,
        part_size: int,
        chunk_size: int,
        weights: Mapping[Sender, float],
        device: torch.device | str = "cpu",
    ):
        if part_size < 0 or chunk_size <= 0:
            raise ValueError(f"part_size must be >= 0 and chunk_size > 0, got {part_size}, {chunk_size}")
        self.part_size, self.chunk_size, self.device = part_size, chunk_size, torch.device(device)
        self.num_chunks = -(-part_size // chunk_size)
        self.weights = {sender: float(weight) for sender, weight in weights.items()}
        self.total = torch.zeros(part_size, dtype=torch.float32, device=self.device)
        self._received: dict[Sender, dict[int, CompressedTensor]] = {sender: {} for sender in self.weights}
        self._done: set[Sender] = set(self.weights) if self.num_chunks == 0 else set()
        self._excluded: dict[Sender, str] = {}

    def chunk_length(self, index: int) -> int:
        return min(self.chunk_size, self.part_size - index * self.chunk_size)

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
            values = self._validated(sender, index, message)
        except ProtocolError as e:
            self.exclude(sender, str(e))
            raise
        self.total[index * self.chunk_size : index * self.chunk_size + values.numel()].add_(
            values, alpha=self.weights[sender]
        )
        received = self._received[sender]
        received[index] = message
        if len(received) == self.num_chunks:
            self._done.add(sender)
            del self._received[sender]  # nothing left to retract: release the kept messages

    def _validated(self, sender: Sender, index: int, message: CompressedTensor) -> torch.Tensor:
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
        if not bool(torch.isfinite(values).all()):
            raise ProtocolError(f"{sender} sent chunk {index} with NaN or Inf values")
        return values.to(torch.float32)

    def exclude(self, sender: Sender, reason: str) -> None:
        """Removes a sender and retracts whatever it had added; idempotent. A finished sender stays in."""
        if sender in self._excluded or sender in self._done or sender not in self.weights:
            return
        for index, message in self._received.pop(sender).items():
            values = decompress(message, device=self.device).to(torch.float32)
            start = index * self.chunk_size
            self.total[start : start + values.numel()].sub_(values, alpha=self.weights[sender])
        self._excluded[sender] = reason
        logger.debug(f"excluded {sender} from a part: {reason}")

    def finalize(self) -> ReducedPart:
        """The weighted mean; every sender must be done or excluded by now."""
        pending = self.active_senders()
        if pending:
            raise AllreduceError(f"cannot finalize a part while {len(pending)} senders are still pending")
        contributors = tuple(s for s in self.weights if s in self._done)
        total_weight = sum(self.weights[s] for s in contributors)
        if not contributors or total_weight <= 0:
            raise AllreduceError(f"no sender contributed to this part (excluded: {self._excluded})")
        return ReducedPart(self.total.div_(total_weight), contributors, total_weight)
