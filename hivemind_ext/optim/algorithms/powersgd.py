"""PowerSGD: gradients averaged as rank-r factors (Vogels et al., 2019), with error feedback and warm start.

Per global step (end of a swarm epoch), for every parameter compressed as a matrix ``M`` (its mean
gradient, reshaped to ``[rows, cols]``, plus the error carried from the last step)::

    position 0  Python   P = M Q                       P: [rows, r], Q: [cols, r]
    position 1  Average  P (and the uncompressed gradients), weighted by samples
    position 2  Python   P = orthonormal(P); Q = M^T P
    position 3  Average  Q, weighted by samples
    position 4  Python   M_hat = P Q^T; error = M - M_hat; the mean gradient = M_hat

Averaging is linear, so the result is ``P P^T mean(M)``: the swarm's mean gradient projected on a
rank-r basis that every peer shares. The wrapped optimizer then steps on it (the default
``optimizer_step``). P and Q are fixed-shape buffers, so each round averages the same tensors.

Not compressed (averaged as they are, in the round of position 1): tensors of fewer than two
dimensions (biases, norms) and matrices whose compression rate ``rows * cols / (r * (rows + cols))``
is below ``min_compression_rate``. Q starts from a normal sample seeded by the parameter's index and
shape (all peers share it); with ``warm_start`` each step starts from the last averaged Q, else from
a new sample seeded by the epoch as well.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence
from typing import Any

import torch

from hivemind_ext.errors import ConfigurationError
from hivemind_ext.optim.algorithms.base import Algorithm, AlgorithmContext, AlgorithmImpl, Bucket, NamedTensor


def compression_rate(shape: Sequence[int], rank: int) -> float:
    """How many times fewer values a rank-``rank`` factorisation of a tensor of ``shape`` sends
    (``0`` for tensors of fewer than two dimensions, which are never compressed)."""
    if len(shape) < 2:
        return 0.0
    rows, cols = matrix_shape(shape)
    rank = min(rank, rows, cols)
    return rows * cols / (rank * (rows + cols))


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The 2-d view of a gradient: the first dimension by the product of the others."""
    rows = int(shape[0])
    cols = 1
    for size in shape[1:]:
        cols *= int(size)
    return rows, cols


def is_compressed(shape: Sequence[int], rank: int, min_compression_rate: float) -> bool:
    """Whether a tensor of ``shape`` is sent as rank-``rank`` factors (else it is averaged as it is)."""
    return len(shape) >= 2 and min(matrix_shape(shape)) > 0 and compression_rate(shape, rank) >= min_compression_rate


def initial_q(name: str, cols: int, rank: int, epoch: int | None = None) -> torch.Tensor:
    """A [cols, rank] normal sample that every peer draws alike: seeded by ``name`` (and ``epoch``)."""
    seed = zlib.crc32(name.encode()) if epoch is None else zlib.crc32(f"{name}@{epoch}".encode())
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(cols, rank, generator=generator, dtype=torch.float32)


def orthonormalize_(matrix: torch.Tensor) -> torch.Tensor:
    """Replaces the columns of ``matrix`` [rows, r] by an orthonormal basis of their span (QR, so
    stable for nearly dependent columns); returns ``matrix``."""
    basis, _ = torch.linalg.qr(matrix, mode="reduced")
    return matrix.copy_(basis)


@dataclasses.dataclass
class LowRankCompressor:
    """One matrix's PowerSGD state: the Q factor (kept for warm start) and the error-feedback term.

    The three calls of one step, with the swarm's averaging in between (a lone peer skips it)::

        p = c.begin(grad)           # P = M Q (M = grad + error)            -> average P
        q = c.after_p()             # P orthonormalised; Q = M^T P          -> average Q
        approx = c.finish()         # M_hat = P Q^T; error = M - M_hat
    """

    name: str
    shape: torch.Size
    rank: int
    error_feedback: bool = True
    warm_start: bool = True

    def __post_init__(self) -> None:
        rows, cols = matrix_shape(self.shape)
        self.rank = min(self.rank, rows, cols)
        if self.rank < 1:
            raise ConfigurationError(f"PowerSGD: rank must be >= 1, got {self.rank}")
        self.p = torch.zeros(rows, self.rank)  # averaged at position 1
        self.q = initial_q(self.name, cols, self.rank)  # averaged at position 3
        self.matrix = torch.zeros(rows, cols)  # M of the current step
        self.error = torch.zeros(rows, cols)

    def begin(self, grad: torch.Tensor, epoch: int = 0) -> torch.Tensor:
        """M = grad (+ error); returns P = M Q (in the buffer ``self.p``)."""
        self.matrix.copy_(grad.detach().reshape(self.matrix.shape))
        if self.error_feedback:
            self.matrix.add_(self.error)
        if not self.warm_start:
            self.q.copy_(initial_q(self.name, self.q.shape[0], self.rank, epoch))
        return torch.matmul(self.matrix, self.q, out=self.p)

    def after_p(self) -> torch.Tensor:
        """P (averaged) orthonormalised; returns Q = M^T P (in ``self.q``)."""
        orthonormalize_(self.p)
        return torch.matmul(self.matrix.t(), self.p, out=self.q)

    def finish(self) -> torch.Tensor:
        """M_hat = P Q^T (Q averaged), shaped as the gradient; the error keeps M - M_hat."""
        approx = self.p @ self.q.t()
        if self.error_feedback:
            torch.sub(self.matrix, approx, out=self.error)
        return approx.reshape(self.shape)


class PowerSGD(Algorithm):
    """Hyperparameters of PowerSGD.

    :param rank: rank of the factors (capped at each matrix's smaller side)
    :param error_feedback: carry each step's compression error into the next step's gradient
    :param warm_start: start each step's power iteration from the last averaged Q
    :param min_compression_rate: matrices that would shrink by less than this go uncompressed
    :param codec: codec of every averaging round (P, Q and uncompressed tensors); default none (float32)
    """

    def __init__(
        self,
        rank: int = 4,
        *,
        error_feedback: bool = True,
        warm_start: bool = True,
        min_compression_rate: float = 2.0,
        codec: Any = None,
    ) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ConfigurationError(f"PowerSGD: rank must be an integer >= 1, got {rank!r}")
        if not min_compression_rate >= 0:
            raise ConfigurationError(f"PowerSGD: min_compression_rate must be >= 0, got {min_compression_rate!r}")
        self.rank = rank
        self.error_feedback = bool(error_feedback)
        self.warm_start = bool(warm_start)
        self.min_compression_rate = float(min_compression_rate)
        self.codec = codec

    def reify(self, context: AlgorithmContext) -> PowerSGDImpl:
        return PowerSGDImpl(context, self)


class PowerSGDImpl(AlgorithmImpl):
    P_POSITION, Q_POSITION = 1, 3

    def __init__(self, context: AlgorithmContext, algorithm: PowerSGD) -> None:
        super().__init__(context)
        self.codec = algorithm.codec
        self.compressors: dict[int, LowRankCompressor] = {}
        self.uncompressed: list[int] = []
        for index, grad in enumerate(self.mean_grads):
            if is_compressed(grad.shape, algorithm.rank, algorithm.min_compression_rate):
                self.compressors[index] = LowRankCompressor(
                    name=f"param{index}:{list(grad.shape)}",
                    shape=grad.shape,
                    rank=algorithm.rank,
                    error_feedback=algorithm.error_feedback,
                    warm_start=algorithm.warm_start,
                )
            else:
                self.uncompressed.append(index)
        # the factors live on the host with the error (CPU torch); move the buffers if the model is on a device
        device = self.mean_grads[0].device
        for compressor in self.compressors.values():
            for attr in ("p", "q", "matrix", "error"):
                setattr(compressor, attr, getattr(compressor, attr).to(device))

    # ----- what and how

    def init_tensors(self) -> list[NamedTensor]:
        tensors: list[NamedTensor] = [(f"p{i}", c.p) for i, c in self.compressors.items()]
        tensors += [(f"q{i}", c.q) for i, c in self.compressors.items()]
        tensors += [(f"grad{i}", self.mean_grads[i]) for i in self.uncompressed]
        return tensors

    def tensors_to_buckets(self, tensors: Sequence[NamedTensor]) -> list[list[NamedTensor]]:
        """P factors, Q factors and uncompressed gradients never share a bucket (they are averaged at
        different positions, or follow different Python steps)."""
        buckets: list[list[NamedTensor]] = []
        for kind in ("p", "q", "grad"):
            group = [(name, tensor) for name, tensor in tensors if name.rstrip("0123456789") == kind]
            buckets += super().tensors_to_buckets(group)
        return buckets

    def init_operations(self, bucket: Bucket) -> None:
        weight = lambda: float(self.samples)  # noqa: E731
        kind = bucket.names[0].rstrip("0123456789")
        if kind == "p":
            bucket.append_python(self.compute_p)
            bucket.append_average(self.codec, weight=weight)
            bucket.append_python(self.compute_q)
        elif kind == "q":
            for _ in range(self.Q_POSITION):
                bucket.append_python(_nothing)
            bucket.append_average(self.codec, weight=weight)
            bucket.append_python(self.reconstruct)
        else:
            bucket.append_python(self.load_mean_gradients)
            bucket.append_average(self.codec, weight=weight)

    def _compressors_of(self, bucket: Bucket) -> list[tuple[int, LowRankCompressor]]:
        indices = [int(name.lstrip("pq")) for name in bucket.names]
        return [(i, self.compressors[i]) for i in indices]

    def compute_p(self, bucket: Bucket) -> None:
        epoch = self.context.local_epoch
        for index, compressor in self._compressors_of(bucket):
            compressor.begin(self.accumulator.mean(index), epoch)

    def compute_q(self, bucket: Bucket) -> None:
        for _, compressor in self._compressors_of(bucket):
            compressor.after_p()

    def reconstruct(self, bucket: Bucket) -> None:
        for index, compressor in self._compressors_of(bucket):
            self.mean_grads[index].copy_(compressor.finish())


def _nothing(bucket: Bucket) -> None:
    """A placeholder operation: keeps a bucket's average at its position in the pipeline."""
