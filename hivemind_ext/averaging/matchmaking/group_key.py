"""Group keys: which peers may meet at all, as pure functions (hivemind's ``initial_group_bits``).

A peer's *group key* is its prefix plus its current *group bits*, a string of ``0`` and ``1``
(hivemind: ``DecentralizedAverager(initial_group_bits=...)``, ``get_group_bits`` and
``set_group_bits``). Peers only ever group with peers whose group key is the same: each group key
has its own board in the DHT (:func:`.board.board_key` of the group key), and within one key the
grouping rule of :mod:`.group` applies unchanged. Empty bits (the default) keep the prefix as the
key, so peers without bits use the same board as before group bits existed.

After every group it joins, a peer with group bits moves to a new key (:func:`next_group_bits`),
the way hivemind does (Moshpit averaging): the group's members are dealt distinct buckets, derived
from the group id so that every member computes the same deal, and each member appends its
bucket's bits to its group bits and drops as many from the front. Members of one group therefore
land on different keys in the next round, and every key of the next round collects peers from
different groups of this round. With ``N = M ** d`` peers, groups of ``M`` (a power of two) and
``d * log2(M)`` group bits laid out as a grid (peer ``i`` starts with the bits of ``i // M``), every
peer holds the global mean after ``d`` rounds.

Rotating groups without explicit bits (:mod:`.rotation`, for large swarms) use the same deal
(:func:`deal_buckets`) with base-``target_group_size`` digits instead of bits, and shards chosen
from the swarm's size.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

from hivemind_ext.errors import ConfigurationError

MAX_GROUP_BITS = 64  # 2**64 keys is far beyond any swarm; bounds the key length that peers write


def check_group_bits(bits: object) -> str:
    """``bits`` if it is a valid group-bits string (only ``0`` and ``1``), else ConfigurationError."""
    if not isinstance(bits, str) or any(bit not in "01" for bit in bits) or len(bits) > MAX_GROUP_BITS:
        raise ConfigurationError(f"group bits must be a string of at most {MAX_GROUP_BITS} '0'/'1', got {bits!r:.80}")
    return bits


def group_key(prefix: str, bits: str) -> str:
    """The key under which a peer looks for a group: its prefix, plus ``.0b<bits>`` if it has bits
    (``"run42_grads.0b0110"``, as hivemind names its keys)."""
    return f"{prefix}.0b{check_group_bits(bits)}" if bits else prefix


def bucket_count(group_size: int, target_group_size: int | None) -> int:
    """How many buckets a group's members are dealt into: ``target_group_size``, or for an
    unlimited target the group size rounded up to a power of two."""
    if target_group_size is not None:
        return max(target_group_size, group_size)  # a group never exceeds its target; be safe anyway
    return 1 << max(group_size - 1, 0).bit_length()


def deal_buckets(group_id: bytes, group_size: int, buckets: int) -> list[int]:
    """A distinct bucket in ``range(buckets)`` for each member position ``0 .. group_size - 1``:
    the first ``group_size`` buckets of a permutation drawn from the group id, so that every member
    computes the same deal. Needs ``group_size <= buckets``."""
    if not 0 <= group_size <= buckets:
        raise ConfigurationError(f"cannot deal {group_size} members into {buckets} distinct buckets")
    order = sorted(range(buckets), key=lambda b: hashlib.sha256(group_id + b.to_bytes(8, "big")).digest())
    return order[:group_size]


def next_group_bits(bits: str, group_id: bytes, member_index: int, group_size: int, target: int | None) -> str:
    """The group bits of the member at ``member_index`` (in the group's agreed member order) after
    the group ``group_id`` of ``group_size`` members assembled: its bucket's bits appended, as many
    dropped from the front. Empty bits stay empty."""
    check_group_bits(bits)
    if not bits:
        return bits
    if not 0 <= member_index < group_size:
        raise ConfigurationError(f"member index {member_index} is outside a group of {group_size}")
    buckets = bucket_count(group_size, target)
    width = math.ceil(math.log2(buckets)) if buckets > 1 else 0
    if width == 0:
        return bits
    bucket = deal_buckets(group_id, group_size, buckets)[member_index]
    return (bits + format(bucket, f"0{width}b"))[-len(bits) :]


def next_group_bits_of(bits: str, group_id: bytes, member_ids: Sequence[str], me: str, target: int | None) -> str:
    """:func:`next_group_bits` for the member ``me`` of a group given as its ordered member ids."""
    return next_group_bits(bits, group_id, list(member_ids).index(me), len(member_ids), target)
