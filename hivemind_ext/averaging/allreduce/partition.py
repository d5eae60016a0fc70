"""Who reduces what: splitting the flattened tensors into parts, one per reducing member, and parts
into chunks that are streamed and reduced one at a time.

Pure functions of the group's declared bandwidths and roles, so every member computes the same
layout from the same member list, and tests drive them directly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hivemind_ext.errors import ConfigurationError


@dataclass(frozen=True)
class MemberRole:
    """What a group member declared: its bandwidth and whether it can own (reduce) a part."""

    bandwidth: float
    client_mode: bool = False  # accepts no incoming connections: owns no part
    auxiliary: bool = False  # owns a part but contributes no tensors


def part_sizes(total: int, roles: Sequence[MemberRole]) -> list[int]:
    """Number of values each member reduces, in proportion to its bandwidth; client-mode members get 0.

    Largest-remainder rounding makes the sizes sum to ``total`` exactly; ties go to the lower index,
    so the answer is the same on every member.
    """
    if total < 0:
        raise ConfigurationError(f"total must be non-negative, got {total}")
    weights = [0.0 if role.client_mode else role.bandwidth for role in roles]
    if any(not math.isfinite(w) or w < 0 for w in weights):
        raise ConfigurationError(f"bandwidths must be finite and non-negative, got {weights}")
    if sum(weights) <= 0:
        owners = [i for i, role in enumerate(roles) if not role.client_mode]
        if not owners:
            raise ConfigurationError("a group needs at least one member that is not in client mode")
        weights = [0.0 if role.client_mode else 1.0 for role in roles]  # all declared zero: split evenly
    largest = max(weights)
    weights = [w / largest for w in weights]  # normalized, so tiny bandwidths cannot overflow the scale
    scale = total / sum(weights)
    exact = [w * scale for w in weights]
    sizes = [math.floor(x) for x in exact]
    remainder = total - sum(sizes)
    by_fraction = sorted(range(len(roles)), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in by_fraction[:remainder]:
        sizes[i] += 1
    return sizes


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
