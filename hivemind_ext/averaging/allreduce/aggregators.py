"""How a part's owner combines the contributions it received: robust aggregators and the norm bound.

Each owner of the butterfly reduces only its own part of the flattened vector, and returns each
chunk of it as soon as the chunk is complete, so every rule here works per chunk (as BTARD clips
per part, not over the whole model; a chunk is at most ``part_size_bytes``).

- :class:`WeightedMean`: the plain weighted mean (the default; the reducer streams it chunk by chunk
  and never builds the matrix of contributions);
- :class:`CenteredClip` (Karimireddy, He and Jaggi 2021, "Learning from history for Byzantine robust
  optimization"; used by BTARD): from the coordinate-wise median, repeat
  ``v <- v + sum_i w_i * clip(x_i - v, tau) / sum_i w_i``, where ``clip(u, tau)`` scales ``u`` down
  to norm ``tau`` if it is longer. A contribution moves ``v`` by at most ``tau * w_i / sum w`` per
  iteration, whatever its values. ``tau`` is fixed, or (the default) twice the median distance of
  the chunk's contributions to their coordinate-wise median, recomputed for every chunk of every round;
- :class:`TrimmedMean`: per coordinate, drop the ``trim`` fraction of smallest and largest values
  and take the weighted mean of the rest (cheap; tolerates ``floor(trim * n)`` arbitrary inputs);
- :func:`norm_outliers`: the sanity bound that is on even with plain averaging: a contribution
  whose norm exceeds ``ratio`` times the median norm of the group's contributions is excluded.

Weights are the senders' sample counts (what they announce when they join the part).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

import torch

from hivemind_ext.errors import ConfigurationError

# An honest contribution 100x longer than the group's median needs e.g. a peer that averaged its
# gradient over 10^4 times fewer samples than the median peer (noise shrinks as 1/sqrt(samples));
# a scaled-gradient attack worth worrying about is far beyond that.
DEFAULT_NORM_BOUND = 100.0


class Aggregator:
    """Combines contributions ``values`` [n, d] with ``weights`` [n] (positive) into one vector [d].

    Subclasses are frozen dataclasses (hashable, comparable, safe to share between rounds).
    ``streaming`` aggregators are reduced on the fly by the reducer (a running weighted sum); the
    others get the whole matrix of a part once every sender has delivered.
    """

    streaming: bool = False

    def aggregate(self, values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class WeightedMean(Aggregator):
    """The weighted mean (plain averaging)."""

    streaming = True

    def aggregate(self, values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        _check_inputs(values, weights)
        return weights.to(values.dtype) @ values / weights.sum().to(values.dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CenteredClip(Aggregator):
    """CenteredClip from the coordinate-wise median, ``iterations`` steps, with a clip radius that is
    either fixed (``tau``, in the units of the averaged values, per chunk) or, by default, taken from
    each chunk's own spread: ``spread * median_i ||x_i - m||``, where ``m`` is the coordinate-wise
    median of the contributions (:meth:`radius`).

    Why adaptive: honest gradients shrink and their spread changes by orders of magnitude over a run
    and between parts of one model, so one fixed ``tau`` either clips honest peers (a bias that
    costs loss without any attacker) or lets an attacker pull ``tau * w / sum w`` per iteration
    long after the gradients have become small. The median distance to the median is a robust
    scale: fewer than half the contributions cannot make it larger than the largest honest
    distance. With ``spread`` 2, honest contributions of a normal round are rarely clipped, so
    without an attacker the result is the weighted mean; an outlier is pulled in to ``tau`` from
    the centre, so its influence is at most ``tau * w / sum w`` per iteration, whatever its scale.
    """

    tau: float | None = None
    spread: float = 2.0
    iterations: int = 20

    def __post_init__(self) -> None:
        if self.tau is not None and not _positive_finite(self.tau):
            raise ConfigurationError(
                f"CenteredClip(tau=...) must be None or a positive finite number, got {self.tau!r}"
            )
        if not _positive_finite(self.spread):
            raise ConfigurationError(f"CenteredClip(spread=...) must be a positive finite number, got {self.spread!r}")
        if isinstance(self.iterations, bool) or not isinstance(self.iterations, int) or self.iterations < 1:
            raise ConfigurationError(f"CenteredClip(iterations=...) must be a positive int, got {self.iterations!r}")

    def aggregate(self, values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        _check_inputs(values, weights)
        start = _start(values)
        tau = self.radius(values, start)
        if tau == 0:  # most contributions equal the median: nothing to move toward
            return start
        return centered_clip(values, weights, tau, self.iterations, start)

    def radius(self, values: torch.Tensor, start: torch.Tensor | None = None) -> float:
        """The clip radius for ``values`` [n, d]: ``tau`` if fixed, else ``spread`` times the median
        distance of the contributions to ``start`` (default: their coordinate-wise median); 0 when
        that distance is 0 or not finite (a part whose values overflow float32 is left at the median)."""
        if self.tau is not None:
            return float(self.tau)
        start = _start(values) if start is None else start
        distances = torch.linalg.vector_norm(values - start, dim=1)  # [n]
        scale = float(distances.median()) * self.spread
        return scale if math.isfinite(scale) else 0.0


def _start(values: torch.Tensor) -> torch.Tensor:
    """Where CenteredClip starts: the coordinate-wise median (the mean of 2 contributions)."""
    return values.median(dim=0).values if values.shape[0] > 2 else values.mean(dim=0)


def _positive_finite(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and 0 < value < math.inf


def centered_clip(
    values: torch.Tensor, weights: torch.Tensor, tau: float, iterations: int, start: torch.Tensor
) -> torch.Tensor:
    """``iterations`` steps of CenteredClip from ``start`` [d]; ``values`` [n, d], ``weights`` [n].

    A contribution whose distance to the centre is not finite (it overflows float32) gets scale 0,
    and ``torch.where`` keeps its infinite offsets out of the sum (``inf * 0`` would be NaN).

    An iteration that clips nobody moves the centre to the weighted mean; if the next one clips
    nobody either, the mean is the fixed point and the remaining iterations are skipped (a round
    without outliers costs 2 iterations, not ``iterations``)."""
    fractions = (weights / weights.sum()).to(values.dtype)  # [n]
    center = start.clone()
    unclipped_before = False
    for _ in range(iterations):
        offsets = values - center  # [n, d]
        norms = torch.linalg.vector_norm(offsets, dim=1)  # [n]
        scales = torch.clamp(tau / torch.clamp(norms, min=torch.finfo(values.dtype).tiny), max=1.0)
        scales = torch.where(torch.isfinite(norms), scales, 0.0)
        unclipped = bool((scales == 1.0).all())
        if unclipped and unclipped_before:
            break
        offsets = torch.where(scales[:, None] > 0, offsets, 0.0)
        center += (fractions * scales) @ offsets
        unclipped_before = unclipped
    return center


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrimmedMean(Aggregator):
    """Coordinate-wise trimmed mean: per coordinate, the ``floor(trim * n)`` smallest and largest
    values are dropped (at most ``(n - 1) // 2`` each, so one always remains) and the rest averaged
    with their senders' weights."""

    trim: float = 0.2

    def __post_init__(self) -> None:
        if isinstance(self.trim, bool) or not isinstance(self.trim, int | float) or not 0 <= self.trim < 0.5:
            raise ConfigurationError(f"TrimmedMean(trim=...) must be in [0, 0.5), got {self.trim!r}")

    def aggregate(self, values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        _check_inputs(values, weights)
        n = values.shape[0]
        cut = min(math.floor(self.trim * n), (n - 1) // 2)
        if cut == 0:
            return WeightedMean().aggregate(values, weights)
        ordered, order = values.sort(dim=0)  # [n, d] each
        kept = ordered[cut : n - cut]  # [n - 2 cut, d]
        kept_weights = weights.to(values.dtype)[order[cut : n - cut]]  # [n - 2 cut, d]
        return (kept * kept_weights).sum(dim=0) / kept_weights.sum(dim=0)


def norm_outliers(norms: Sequence[float], ratio: float | None) -> list[int]:
    """Indices of the contributions whose norm exceeds ``ratio`` times the median norm.

    The median is taken over the contributions given (unweighted: a sender's weight is its own
    claim). Nothing is excluded when ``ratio`` is None, with fewer than 3 contributions (2 cannot
    tell which one is absurd), or when the median is zero (no scale to judge by: e.g. most senders
    have no gradient for this part). Since ``ratio`` >= 1, at most a minority is ever excluded.
    """
    if ratio is None or len(norms) < 3:
        return []
    finite = [norm if math.isfinite(norm) else math.inf for norm in norms]
    median = statistics.median(finite)
    if not median > 0 or not math.isfinite(median):
        return []
    return [index for index, norm in enumerate(finite) if norm > ratio * median]


def check_norm_bound(ratio: float | None) -> float | None:
    if ratio is None:
        return None
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 1 <= ratio < math.inf:
        raise ConfigurationError(f"norm_bound must be None or a finite number >= 1, got {ratio!r}")
    return float(ratio)


def check_aggregator(aggregator: object) -> Aggregator:
    if aggregator is None:
        return WeightedMean()
    if not isinstance(aggregator, Aggregator):
        raise ConfigurationError(
            f"aggregator must be None, WeightedMean(), CenteredClip() or TrimmedMean(trim=...), got {aggregator!r:.80}"
        )
    return aggregator


def _check_inputs(values: torch.Tensor, weights: torch.Tensor) -> None:
    if values.dim() != 2 or weights.shape != (values.shape[0],) or values.shape[0] == 0:
        raise ValueError(f"expected values [n, d] and weights [n] with n > 0, got {values.shape}, {weights.shape}")
