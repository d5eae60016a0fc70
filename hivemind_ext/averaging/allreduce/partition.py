"""Who reduces what: splitting the flattened tensors into parts, one per reducing member, and parts
into chunks that are streamed and reduced one at a time.

Pure functions of the group's declared bandwidths and roles, so every member computes the same
layout from the same member list, and tests drive them directly.

**Part sizes minimize the round's predicted time** (:func:`optimal_fractions`). In a butterfly round
over a vector of S bytes (as sent: after compression), a member that owns the fraction f_i of the
vector sends its slices of the other parts, (1 - f_i) S, and the average of its own part to each
other contributor, k_i f_i S; it receives as much. With every member contributing (k_i = N - 1)
that is (1 + (N - 2) f_i) S each way, so over a link of bandwidth B_i it needs

    t_i = (1 + (N - 2) f_i) S / B_i

and the round takes max_i t_i. The fractions that minimize it (sum 1, f_i >= 0, 0 for client-mode
members) are found exactly by water-filling: members take parts until their times are equal, and a
member whose time without any part (S / B_i) already exceeds that level gets no part at all, as
in hivemind's load balancing (a linear program there). A slow peer gets a smaller part, or none: it
still sends and receives its whole vector once. Auxiliary members (no tensors of their own:
t_i = k_i f_i S / B_i) fit the same model. When two members contribute, every split costs them the
same (each sends exactly one vector), so parts are simply proportional to bandwidth; a lone
contributor owns everything (nothing needs to cross the network).

Bandwidths that peers measure are noisy (:mod:`.throughput`: a busy CPU, a late start), and on links
that are really equal a split that follows the noise only loses (water-filling is sensitive: four
peers measured within 5% of each other would get parts of 22% to 27%). So :func:`part_sizes` plans
with the bandwidths denoised - those within a factor :data:`NOISE_FACTOR` of the owners' median
count as the median, so only a clearly slower (or faster) peer gets a different part - and keeps
the even split unless the plan promises a round at least :data:`MIN_PREDICTED_GAIN` shorter under
the declared bandwidths. One peer at 20 Mbit/s with three at 100 still gets no part.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from hivemind_ext.errors import ConfigurationError

MIN_PREDICTED_GAIN = 0.1  # an uneven split must promise a round this much shorter than the even split
NOISE_FACTOR = 2.0  # bandwidths within this factor of the owners' median are planned as the median


@dataclass(frozen=True)
class MemberRole:
    """What a group member declared: its bandwidth and whether it can own (reduce) a part."""

    bandwidth: float
    client_mode: bool = False  # accepts no incoming connections: owns no part
    auxiliary: bool = False  # owns a part but contributes no tensors


def part_sizes(total: int, roles: Sequence[MemberRole]) -> list[int]:
    """Number of values each member reduces: ``total`` split by :func:`planned_fractions`.

    Largest-remainder rounding makes the sizes sum to ``total`` exactly; ties go to the lower index,
    so the answer is the same on every member.
    """
    if total < 0:
        raise ConfigurationError(f"total must be non-negative, got {total}")
    exact = [f * total for f in planned_fractions(roles)]
    sizes = [min(math.floor(x), total) for x in exact]
    remainder = total - sum(sizes)
    if remainder < 0:  # float rounding of fractions that sum to 1 + epsilon: take back from the largest
        for i in sorted(range(len(roles)), key=lambda i: (-sizes[i], i))[:-remainder]:
            sizes[i] -= 1
        return sizes
    by_fraction = sorted(range(len(roles)), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in by_fraction[:remainder]:
        sizes[i] += 1
    return sizes


def planned_fractions(roles: Sequence[MemberRole]) -> list[float]:
    """The split :func:`part_sizes` uses (see the module docstring): with three or more contributors,
    :func:`optimal_fractions` for the denoised bandwidths if they promise a round at least
    :data:`MIN_PREDICTED_GAIN` shorter than the even split among the members that can own a part,
    else that even split. (With two contributors every split costs the same: the optimum as is.)"""
    if _contributors(roles) <= 2:
        return optimal_fractions(roles)
    owners = sum(not role.client_mode for role in roles)
    even = [0.0 if role.client_mode else 1.0 / owners for role in roles]
    plan = optimal_fractions(denoised(roles))
    if predicted_time(plan, roles) < (1 - MIN_PREDICTED_GAIN) * predicted_time(even, roles):
        return plan
    return even


def denoised(roles: Sequence[MemberRole]) -> list[MemberRole]:
    """The roles with every owner's bandwidth within :data:`NOISE_FACTOR` of the owners' median set to it."""
    median = statistics.median([role.bandwidth for role in roles if not role.client_mode] or [0.0])
    return [
        dataclasses.replace(role, bandwidth=median)
        if not role.client_mode and median / NOISE_FACTOR <= role.bandwidth <= median * NOISE_FACTOR
        else role
        for role in roles
    ]


def optimal_fractions(roles: Sequence[MemberRole]) -> list[float]:
    """The fraction of the vector each member reduces, minimizing :func:`predicted_time` (see the
    module docstring); client-mode members and members of zero bandwidth get 0 (if every owner
    declared 0, the owners split evenly).

    :raises ConfigurationError: no member can own a part, or a bandwidth is negative or not finite
    """
    bandwidths = [float(role.bandwidth) for role in roles]
    if any(not math.isfinite(b) or b < 0 for b in bandwidths):
        raise ConfigurationError(f"bandwidths must be finite and non-negative, got {bandwidths}")
    owners = [i for i, role in enumerate(roles) if not role.client_mode]
    if not owners:
        raise ConfigurationError("a group needs at least one member that is not in client mode")
    largest = max(bandwidths[i] for i in owners)
    if largest <= 0:  # all declared zero: split evenly
        return [1.0 / len(owners) if i in owners else 0.0 for i in range(len(roles))]
    # normalized, so that tiny or huge bandwidths neither underflow nor overflow below
    scaled = [b / largest if not role.client_mode else 0.0 for b, role in zip(bandwidths, roles, strict=True)]
    contributors = [i for i, role in enumerate(roles) if not role.auxiliary]
    if len(contributors) == 1 and scaled[contributors[0]] > 0:
        return [1.0 if i == contributors[0] else 0.0 for i in range(len(roles))]  # nothing crosses the network
    if len(contributors) <= 2:
        return _proportional(scaled)
    return _water_filling(scaled, roles)


def predicted_time(fractions: Sequence[float], roles: Sequence[MemberRole]) -> float:
    """The round's time under the model of the module docstring, in units of S / bandwidth:
    max over members of (bytes through its link, as a multiple of S) / its bandwidth (inf if a
    member with traffic has zero bandwidth)."""
    worst, contributors = 0.0, _contributors(roles)
    for fraction, role in zip(fractions, roles, strict=True):
        base, slope = _load_terms(role, contributors)
        load = base + slope * fraction
        if load > 0:
            worst = max(worst, load / role.bandwidth if role.bandwidth > 0 else math.inf)
    return worst


def _contributors(roles: Sequence[MemberRole]) -> int:
    return sum(not role.auxiliary for role in roles)


def _load_terms(role: MemberRole, contributors: int) -> tuple[float, float]:
    """(base, slope): the member's traffic each way is base + slope x f, as a multiple of S: its own
    slices of the other parts, own x (1 - f), plus its part's average for each other contributor, k x f."""
    own = 0 if role.auxiliary else 1
    others = contributors - own
    return float(own), float(others - own)


def _proportional(scaled: Sequence[float]) -> list[float]:
    total = sum(scaled)
    return [b / total for b in scaled]


def _water_filling(scaled: Sequence[float], roles: Sequence[MemberRole]) -> list[float]:
    """Raises the common time level T until the members' parts, f_i = (T B_i - base_i) / slope_i where
    positive, add up to 1. Members join in the order of the level at which their part becomes
    positive (base_i / B_i), so the active set is a prefix of that order."""
    contributors = _contributors(roles)
    terms = [_load_terms(role, contributors) for role in roles]
    candidates = sorted(
        (i for i, b in enumerate(scaled) if b > 0 and terms[i][1] > 0),  # slope > 0 whenever 3+ contribute
        key=lambda i: (terms[i][0] / scaled[i], i),
    )
    numerator, denominator, level = 1.0, 0.0, math.inf
    active = 0
    for position, i in enumerate(candidates):
        base, slope = terms[i]
        numerator += base / slope
        denominator += scaled[i] / slope
        level, active = numerator / denominator, position + 1
        following = candidates[position + 1] if position + 1 < len(candidates) else None
        if following is None or level <= terms[following][0] / scaled[following]:
            break
    fractions = [0.0] * len(roles)
    for i in candidates[:active]:
        base, slope = terms[i]
        fractions[i] = max(0.0, (level * scaled[i] - base) / slope)
    total = sum(fractions)
    return [f / total for f in fractions]


def chunk_bounds(part_size: int, chunk_size: int) -> list[tuple[int, int]]:
    """[start, end) offsets of the chunks of one part, every chunk ``chunk_size`` long except the last."""
    if chunk_size <= 0:
        raise ConfigurationError(f"chunk_size must be positive, got {chunk_size}")
    return [(start, min(start + chunk_size, part_size)) for start in range(0, part_size, chunk_size)]


def part_bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) offsets of each member's part within the flattened tensors."""
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds
