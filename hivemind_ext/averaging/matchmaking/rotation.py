"""Rotating groups and sharded boards for large swarms (Moshpit averaging), as pure functions.

When the swarm is larger than ``target_group_size`` (``M``), one round averages only within groups.
Which peers meet in the next round decides whether the averages mix across the swarm or drift apart
in cliques. The rule here makes them mix, and it also cuts the matchmaking board into shards so
that a poll reads O(M) records instead of the whole swarm's.

The rule
--------
Every peer carries *coordinates*: ``DIGITS`` digits in base ``M``, the most recent last. A newcomer
draws them from a hash of its peer id (:func:`initial_digits`). After every group it averages in,
each member drops its oldest digit and appends a new one, dealt by the group: the members get
*distinct* digits, drawn from the group id so that every member computes the same deal
(:func:`next_digits`, with :func:`.group_key.deal_buckets`).

- **Ranking.** Within a board, the grouping rule of :mod:`.group` ranks peers by their coordinates
  read from the most recent digit backwards (then by seniority), and groups are consecutive runs of
  that ranking. Peers that share their last ``k`` digits are therefore contiguous, for every ``k``.
- **Shards.** A peer reads and writes only the board of its shard: the prefix plus its last
  ``depth`` digits (:func:`shard_key`), ``depth = floor(log_M(N)) - 1`` for a swarm of ``N`` peers
  (:func:`shard_depth`), so a shard expects between ``M`` and ``M**2`` peers (exactly ``M`` when
  ``N = M**d``). ``N`` is a hint from the caller (the Optimizer passes the number of trainers its
  progress tracker sees); without one, ``depth = 0``: one board per prefix, still ranked as above.
- **Waiting for the swarm.** Given ``N``, peers on one board for the whole swarm (``depth = 0``)
  form groups before their scheduled time only once the ``N`` peers are looking
  (:func:`expected_in_shard`), not as soon as ``M`` are: peers that finished the last round
  together also start looking together, and would otherwise form the same group again. In a shard
  that cannot happen: the members of one group were dealt different last digits. Nor on the
  prefix's board of a swarm that has shards: only peers that fell back from different shards come
  there, so full groups form there at once too (waiting for a swarm that never comes held them
  until their scheduled time, and the leftovers then split into small groups).
- **Falling back.** In a shard, full groups form as soon as their peers are looking, whatever is
  left over. A peer that is in no full group ``SHARD_WAIT_POLLS`` poll intervals after it came to
  its shard's board (hashed coordinates fill shards unevenly), or at its scheduled time (a stray
  goes round the sibling shards until then, see below), moves to the coarser shard,
  one digit shorter (:func:`coarser`), with a fresh attempt and its seniority, down to the prefix's
  own board, where it waits for a full group or its scheduled time. Peers
  with different estimates of ``N`` thus still meet: the finer ones fall back.
- **Strays.** A shard forms what groups it can on its own board: full ones at once, and the rest as
  one group sealed ahead of the scheduled time (:mod:`.timing`), which holds its commit until just
  before it starts (``protocol.HOLD_POLLS``) and takes in a stray that comes to its board meanwhile
  (``protocol._take_in``). A *stray* is a peer its shard cannot place: the one peer over a multiple of
  ``M`` (fewer than ``min_group_size`` left), or a shard of one. At the latest when it would be
  planned ahead, it visits the next sibling shard (:func:`sibling`: the same coarser shard, the
  shard's oldest digit moved on by one), a board of about one group, where a group with room takes it
  in or it joins that shard's plan; it goes on round the siblings, then round the next coarser
  shard's (an odometer over the shard's digits: one coarser shard's rests need not add up to groups),
  until its scheduled time, then falls back as above.
  Falling back at once left it alone on the prefix's board after the other shards had committed (64
  peers in groups of 8: one peer in no group in 14 of 20 seeds), and sending every shard's rest
  there instead put half of the swarm on that board (64 peers read 961 records per round each,
  against 185 for 8 peers).
- **No group.** A peer that found no group in a round (left over on the prefix's board) moves as if it
  had formed a group of one (:func:`digits_without_group`). Otherwise, where the other peers all form
  full groups (``N = k * M + 1``), the same peer comes last in the same ranking every round and its
  value never mixes.

One rotation per peer
--------------------
A peer whose averagers take turns (the Optimizer's gradient round, then its parameter round, every
epoch) shares one :class:`Coordinates` between them, so that every round it takes part in, of
whichever averager, moves the same coordinates. The parameter round then ranks peers by the digits
that the gradient round just dealt, which are distinct within each gradient group: its groups take
one member from each of the gradient round's groups instead of meeting again. With separate
coordinates both averagers started from the same digits (:func:`initial_digits` of the same peer
id), so the first parameter round repeated the gradient round's groups, and later ones met the
gradient round's members by chance, and groups drifted apart: across 16 peers in groups of 4 after 12
epochs (``benchmarks/scale.py --digits 16``), a spread of 0.17 of the parameters' scale with separate
coordinates, 0.08 with one rotation per peer (one group of 16 had 0.08-0.09 in the same runs).

Why it mixes: with ``N = M**d`` peers on a grid (peer ``i`` starting with the base-``M`` digits of
``i // M`` as its last ``d - 1`` digits), every shard of round 1 holds exactly one group of ``M``.
The deal sends the ``M`` members of each group to ``M`` different shards, and a shard of the next
round collects exactly one peer from each of the ``M`` groups that shared its remaining digits. By
induction, after round ``r`` each peer holds the mean of ``M**r`` distinct initial values, and
after ``d`` rounds every peer holds the global mean (the Moshpit SGD grid: each round averages
along one axis, and the rounds cycle through the axes). With hashed coordinates, uneven ``N`` or
churn the shards hold unequal numbers of peers; groups still collect peers from different groups of
the round before, and the spread of the values falls geometrically (tested and measured in
``benchmarks/scale.py``). :func:`rotation_groups` is the rule applied to a whole swarm at once (the
model that the tests and the benchmark simulate); the network reaches the same groups where every
peer of a shard is looking when its scheduled time comes.

Hostile peers: coordinates are self-declared. A declaration on a shard's board whose digits do not
name that shard is ignored (:func:`in_shard`); a peer that lies about its digits only changes its
own place in the ranking, and one that declares on many boards is sealed into several groups but
can join one at most: the others commit without it, as they would without a dead peer.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence

from hivemind_ext.averaging.matchmaking.group_key import deal_buckets
from hivemind_ext.errors import ConfigurationError

DIGITS = 8
"""Coordinates kept per peer: M**8 cells is beyond any swarm, and bounds what a declaration carries."""

MAX_BASE = 4096  # a digit is below the group size, which matchmaking bounds (board.MAX_GROUP_MEMBERS)

Digits = tuple[int, ...]


@dataclasses.dataclass
class Coordinates:
    """A peer's rotation coordinates, which the averagers sharing this object all move (see "One
    rotation per peer" above); ``base`` is their target_group_size (0 until the first averager sets
    them, from its peer id). Only the peer's event loop reads and moves them."""

    digits: Digits = ()
    base: int = 0

    def start(self, peer_id: str, base: int) -> None:
        """Sets the newcomer's coordinates, unless another averager of this peer did (in the same base)."""
        _check_base(base)
        if not self.digits:
            self.digits, self.base = initial_digits(peer_id, base), base
        elif self.base != base:
            raise ConfigurationError(
                f"averagers that share rotation coordinates need one target_group_size: {self.base} and {base}"
            )


def check_digits(digits: object, base: int = MAX_BASE) -> Digits:
    """``digits`` as a tuple if it is at most ``DIGITS`` integers in ``range(base)``, else ConfigurationError."""
    if not isinstance(digits, (tuple, list)) or len(digits) > DIGITS:
        raise ConfigurationError(f"coordinates must be at most {DIGITS} digits, got {digits!r:.80}")
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < base for d in digits):
        raise ConfigurationError(f"coordinates must be integers in [0, {base}), got {digits!r:.80}")
    return tuple(digits)


def initial_digits(peer_id: str, base: int) -> Digits:
    """A newcomer's coordinates: ``DIGITS`` base-``base`` digits of a hash of its peer id, so that
    newcomers spread evenly over the shards without agreeing on anything."""
    _check_base(base)
    value = int.from_bytes(hashlib.sha256(f"rotation/{peer_id}".encode()).digest(), "big")
    digits = []
    for _ in range(DIGITS):
        value, digit = divmod(value, base)
        digits.append(digit)
    return tuple(digits)


def grid_digits(index: int, base: int, dims: int) -> Digits:
    """The coordinates of peer ``index`` of a perfect grid of ``base ** dims`` peers: the base-``base``
    digits of ``index // base`` as its last ``dims - 1`` digits (zeros before them). Round 1 then
    groups peers ``k * base .. k * base + base - 1``."""
    _check_base(base)
    if not 1 <= dims <= DIGITS or not 0 <= index < base**dims:
        raise ConfigurationError(f"peer {index} is not on a grid of {base}**{dims}")
    cell, digits = index // base, []
    for _ in range(dims - 1):
        cell, digit = divmod(cell, base)
        digits.append(digit)
    return (0,) * (DIGITS - dims + 1) + tuple(reversed(digits))


def shard_depth(swarm_size: int | None, base: int) -> int:
    """How many trailing digits name a shard in a swarm of ``swarm_size`` peers and groups of
    ``base``: the largest ``k`` with ``base ** (k + 1) <= swarm_size`` (a shard then expects at least
    one full group), 0 without an estimate or for groups of one."""
    if swarm_size is None or base < 2:
        return 0
    depth = 0
    while depth < DIGITS and base ** (depth + 2) <= swarm_size:
        depth += 1
    return depth


def expected_in_shard(swarm_size: int, base: int, depth: int) -> int:
    """How many peers a shard of ``depth`` digits expects in a swarm of ``swarm_size``: exactly this
    many on a grid, and once every peer has been dealt ``depth`` digits by full groups."""
    return max(1, swarm_size // base**depth)


def shard_key(group_key: str, digits: Digits, depth: int, base: int) -> str:
    """The key of the board a peer with these coordinates uses: ``group_key`` itself at depth 0,
    else ``<group_key>.m<base>.<d1>-<d2>-...`` with the last ``depth`` digits."""
    if depth <= 0:
        return group_key
    return f"{group_key}.m{base}." + "-".join(str(d) for d in digits[-depth:])


def in_shard(digits: Digits, shard_digits: Digits) -> bool:
    """Whether a declaration with ``digits`` belongs on the board of the shard named by ``shard_digits``."""
    return not shard_digits or digits[-len(shard_digits) :] == shard_digits


def coarser(depth: int) -> int:
    """The depth of the board to fall back to when a shard is too empty."""
    return max(0, depth - 1)


def sibling(digits: Digits, depth: int, base: int, hop: int = 1) -> Digits:
    """The coordinates a stray declares with to visit the next sibling shard (see "Strays" above): the
    shard's oldest digit (``digits[-depth]``) moved on by one, modulo ``base``; the shards of one
    coarser shard are visited in turn. On its ``hop``-th visit, a multiple of ``base``, the stray has
    been round its coarser shard's ring, and the next digit moves on by one too (and so on, an
    odometer over the shard's digits): it goes on round the ring of a cousin shard. Within one coarser
    shard the rests need not add up to groups (200 peers in groups of 4: 5 peers over in one coarser
    shard, groups of 3 with room in the others; one peer in no group in 25 of 40 seeds). Only the
    declaration changes: the peer's own coordinates, which its groups move, stay as they were."""
    if depth <= 0 or depth > len(digits):
        return tuple(digits)
    moved, index = list(digits), len(digits) - depth
    for level in range(depth):
        moved[index + level] = (moved[index + level] + 1) % base
        if base < 2 or hop % base ** (level + 1):
            break
    return tuple(moved)


def ranking(digits: Digits) -> Digits:
    """The rotation's part of a declaration's rank: its coordinates from the most recent digit back."""
    return tuple(reversed(digits))


def next_digits(digits: Digits, group_id: bytes, member_index: int, group_size: int, base: int) -> Digits:
    """The coordinates of the member at ``member_index`` (in the group's agreed member order) after
    the group ``group_id`` of ``group_size`` assembled: the oldest digit dropped, its dealt digit
    appended. Members of one group get distinct digits; a group larger than ``base`` (a group that
    formed without a target) deals ``member_index mod base`` in the drawn order."""
    _check_base(base)
    if not 0 <= member_index < group_size:
        raise ConfigurationError(f"member index {member_index} is outside a group of {group_size}")
    dealt = deal_buckets(group_id, min(group_size, base), base)[member_index % base]
    return (*digits[1:], dealt) if digits else ()


def digits_without_group(digits: Digits, peer_id: str, base: int) -> Digits:
    """The coordinates of a peer that looked for a group and found none: as if it had formed a group of
    one (its oldest digit dropped, a digit dealt from a hash of its peer id and coordinates appended).

    Without this a peer left over stays where it is, and in a swarm whose other peers all form full
    groups (``N = k * M + 1``) the same peer comes last in the same shard's ranking round after round
    and never averages (the spread of 129 peers in groups of 4 stopped at 0.039 of its start); moved, it
    lands elsewhere in some shard's ranking and displaces a peer whose value is already mixed."""
    _check_base(base)
    group_id = hashlib.sha256(f"rotation/alone/{peer_id}/{'-'.join(map(str, digits))}".encode()).digest()
    return next_digits(digits, group_id, 0, 1, base)


def rotation_groups(
    coordinates: Mapping[str, Digits], *, base: int, depth: int, min_group_size: int = 2
) -> list[list[str]]:
    """One round of the rule for a whole swarm that is looking at once (the model the tests and the
    benchmark simulate): shards by the last ``depth`` digits; in each shard, full groups of ``base``
    as consecutive runs of the ranking (as :func:`.group.plan_groups` forms them in a shard before
    the scheduled time); the others fall back one level at a time. On the prefix's board: where the
    swarm has shards (``depth`` > 0), full groups at once and the rest as one group at the scheduled
    time (unless that would be smaller than ``min_group_size``); otherwise (and then) the fewest
    groups of at most ``base`` with sizes differing by at most one and at least ``min_group_size``
    (the split at the scheduled time); peers left over there (fewer than ``min_group_size``) are in
    no group."""
    groups: list[list[str]] = []
    waiting = sorted(coordinates, key=lambda peer: (ranking(coordinates[peer]), peer))
    for level in range(depth, -1, -1):
        shards: dict[Digits, list[str]] = {}
        for peer in waiting:
            shards.setdefault(coordinates[peer][len(coordinates[peer]) - level :] if level else (), []).append(peer)
        waiting = []
        for members in shards.values():
            full, rest = divmod(len(members), base)
            if level:  # full groups only; the rest falls back
                count = full
                size = count * base
            elif depth and (rest == 0 or rest >= min_group_size):  # fell back: full groups at once, then the rest
                groups.extend(split_evenly(members[: full * base], full))
                members, rest = members[full * base :], 0
                count, size = (1, len(members)) if members else (0, 0)
            else:  # as .group.plan_groups splits at the scheduled time
                count = min(-(-len(members) // base), len(members) // min_group_size)
                size = min(len(members), count * base)
            groups.extend(split_evenly(members[:size], count))
            waiting.extend(members[size:])
        waiting.sort(key=lambda peer: (ranking(coordinates[peer]), peer))
    return groups


def split_evenly(ranked: Sequence, groups: int) -> list[list]:
    """Consecutive runs of ``ranked``, ``groups`` of them, sizes differing by at most one (larger first)."""
    if groups <= 0:
        return []
    base, extra = divmod(len(ranked), groups)
    runs, start = [], 0
    for index in range(groups):
        size = base + (1 if index < extra else 0)
        runs.append(list(ranked[start : start + size]))
        start += size
    return runs


def _check_base(base: int) -> None:
    if not isinstance(base, int) or not 1 <= base <= MAX_BASE:
        raise ConfigurationError(f"the rotation's base (target_group_size) must be in [1, {MAX_BASE}], got {base!r}")
