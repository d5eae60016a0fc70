"""Who averages with whom: the matchmaking configuration, the records peers publish, and the
grouping rule, as pure functions of what the DHT returned and the clock.

Nothing here touches the network; :mod:`hivemind_ext.averaging.matchmaking.protocol` turns these rules
into one peer's state machine and :mod:`hivemind_ext.averaging.matchmaking.matchmaker` does the I/O. Keeping
the rule pure lets tests check, over many generated boards, that every peer that sees the same
records computes the same groups.

The grouping rule (:func:`plan_groups`), applied to the peers that are looking for a group:

- Peers are ranked by seniority (when they started looking, then peer id), so a newcomer never
  changes the groups of the peers that came before it, and peers with slightly different views of
  the DHT (one saw the newcomer, one did not) still agree on the senior groups. Peers with rotation
  coordinates (large swarms, see :mod:`.rotation`) are ranked by those first, so that each group
  collects peers from different groups of the round before; given the swarm's size, peers on one
  board for the whole swarm also wait (until their scheduled time at most) for all of it before
  forming full groups.
- Before anyone's scheduled time, only *full* groups (``target_group_size`` peers) form, at once,
  from the most senior peers; the remainder keeps waiting for more peers. If that remainder would
  be too small to ever form a group (fewer than ``min_group_size``), nobody forms a group yet: more
  peers may come, and at the scheduled time everyone is split evenly instead, so no peer is left
  alone when that can be avoided.
- Once any looking peer's scheduled time has come, all looking peers are split into the fewest
  groups of at most ``target_group_size`` whose sizes differ by at most one and are all at least
  ``min_group_size``. Peers that cannot be placed are fewer than ``min_group_size``: they could
  not have formed a group by themselves.
- A group needs a member that accepts connections (not client mode) to own parts of the
  all-reduce, and a member that is not auxiliary to bring tensors; members are swapped between
  groups to satisfy this where possible, and groups that still cannot run are not formed. One
  exception, as in hivemind: once the scheduled time has come and every looking peer is auxiliary,
  they form one group with nothing to average, so that their steps finish instead of waiting out
  their deadline (:func:`all_auxiliary`); a group sealed with a trainer that then left is abandoned.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from hivemind.p2p import PeerID

from hivemind_ext.averaging.matchmaking.group_key import check_group_bits
from hivemind_ext.averaging.matchmaking.group_key import group_key as make_group_key
from hivemind_ext.averaging.matchmaking.rotation import (
    Digits,
    check_digits,
    expected_in_shard,
    in_shard,
    ranking,
    shard_depth,
    shard_key,
    split_evenly,
)
from hivemind_ext.errors import ConfigurationError

PeerKey = tuple[str, str]
"""(peer id in base58, attempt token): one peer's one try at finding a group in one round."""

MAX_BANDWIDTH = 1e9
"""The largest bandwidth a peer may declare, in the unit peers declare it in (Mbit/s by default: a
petabit per second, far above any link, and far below where the group's sums overflow). A user's
larger ``bandwidth`` is a :class:`ConfigurationError`; a larger one declared by another peer counts
as this much (:func:`capped_bandwidth`): 1e308 from one peer overflowed the part-split and chunk-size
arithmetic and failed every member's ``opt.step`` with a bare ValueError."""

SEAL_HORIZON = 3
"""A seal whose commit time lies more than this many ``request_timeout`` ahead is not joined (see
:func:`plausible`): an honest leader commits one ``request_timeout`` after sealing, and the rest
covers clock skew between peers (hivemind allows a few seconds)."""

POLLS_BEFORE_DEADLINE = 5
MAX_FINGERPRINT_CHARS = 128  # a digest; bounds what a declaration may carry
"""A peer is not put into a new group when its deadline is fewer than this many polls away: the
group would have to commit in less time than the confirmation round trip takes."""


@dataclass(frozen=True, kw_only=True)
class MatchmakingConfig:
    """How one peer looks for averaging groups; hivemind's knobs keep their names and meaning.

    :param prefix: peers average only with peers that use the same prefix (e.g. ``"run42_grads"``).
    :param target_group_size: a group forms at once when this many peers are looking; ``None`` means
        no limit: groups form only at the scheduled time, with every peer that is looking.
    :param min_group_size: never form a group smaller than this.
    :param min_matchmaking_time: default time from the start of matchmaking to the scheduled time,
        after which a group smaller than ``target_group_size`` may form.
    :param request_timeout: how long one protocol step may take: a declaration lives this long
        without refresh (so a dead peer is forgotten after it), and a leader waits this long for
        members to confirm.
    :param poll_interval: pause between two reads of the DHT while waiting.
    :param client_mode: this peer accepts no incoming connections (it owns no all-reduce part).
    :param auxiliary: this peer brings no tensors and only helps to reduce.
    :param bandwidth: declared to the group for load balancing; ``None``: the group's mean.
    :param group_bits: this peer's group bits (hivemind's ``initial_group_bits``): peers only group with
        peers of the same :attr:`group_key`, the prefix plus these bits (see :mod:`.group_key`).
    :param expected_group_size: with ``target_group_size=None``, how many contributing (not
        auxiliary) peers this one expects (e.g. the trainers of a training run): as soon as that many
        are looking, they form one group at once, with the auxiliary peers that are looking too,
        instead of waiting for the scheduled time. Auxiliary peers do not count, so a peer never waits
        for one (an auxiliary peer may decide not to join) nor forms a group without an expected
        contributor because an auxiliary peer took its place. A hint: a wrong value only delays or
        hastens the group, the leader's seal keeps members consistent. With ``target_group_size`` and
        ``digits``: the swarm's size, from which the shard and the peers it expects follow (see
        :mod:`.rotation`).
    :param digits: this peer's rotation coordinates (see :mod:`.rotation`; empty: no rotation): declared
        with every attempt, they rank the peers of a board so that groups mix across rounds.
    :param shard_depth: how many of the last ``digits`` name the shard whose board this peer uses
        (0: the board of the whole group key; see :func:`.rotation.shard_depth`).
    :param fingerprint: the run's fingerprint digest (see ``hivemind_ext.optim.fingerprint``): this
        peer only groups with peers that declare the same one (or none, as auxiliary peers do), so a
        peer of another model or other settings never joins, nor delays, a group. Empty: no check.
    """

    prefix: str
    target_group_size: int | None = None
    min_group_size: int = 2
    min_matchmaking_time: float = 5.0
    request_timeout: float = 3.0
    poll_interval: float = 0.05
    client_mode: bool = False
    auxiliary: bool = False
    bandwidth: float | None = None
    expected_group_size: int | None = None
    group_bits: str = ""
    digits: Digits = ()
    shard_depth: int = 0
    fingerprint: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not self.prefix:
            raise ConfigurationError(f"prefix must be a non-empty string, got {self.prefix!r}")
        if not isinstance(self.fingerprint, str) or len(self.fingerprint) > MAX_FINGERPRINT_CHARS:
            raise ConfigurationError(f"fingerprint must be a string of at most {MAX_FINGERPRINT_CHARS} characters")
        check_group_bits(self.group_bits)
        self._check_rotation()
        self._check_group_sizes()
        self._check_times()
        if self.client_mode and self.auxiliary:
            raise ConfigurationError("an auxiliary peer must accept connections: it cannot be in client mode")
        if self.bandwidth is not None and not (_is_number(self.bandwidth) and 0 <= self.bandwidth <= MAX_BANDWIDTH):
            raise ConfigurationError(
                f"bandwidth must be None or a number in [0, {MAX_BANDWIDTH:g}] (Mbit/s), got {self.bandwidth!r}"
            )

    @property
    def group_key(self) -> str:
        """The key peers group under: only declarations made under the same key are ever grouped
        (the prefix, the group bits if any, and the shard if any)."""
        return shard_key(make_group_key(self.prefix, self.group_bits), self.digits, self.shard_depth, self._base)

    @property
    def shard_digits(self) -> Digits:
        """The digits that name this peer's shard (empty: no shard)."""
        return self.digits[len(self.digits) - self.shard_depth :] if self.shard_depth else ()

    @property
    def _base(self) -> int:
        return self.target_group_size or 0

    def _check_rotation(self) -> None:
        if not self.digits and not self.shard_depth:
            return
        if self.target_group_size is None or self.target_group_size < 2:
            raise ConfigurationError("rotation coordinates need a target_group_size of at least 2")
        object.__setattr__(self, "digits", check_digits(self.digits, self.target_group_size))
        if not _is_int(self.shard_depth) or not 0 <= self.shard_depth <= len(self.digits):
            raise ConfigurationError(f"shard_depth must be in [0, {len(self.digits)}], got {self.shard_depth!r}")

    def _check_group_sizes(self) -> None:
        if self.expected_group_size is not None and (
            not _is_int(self.expected_group_size) or self.expected_group_size < 1
        ):
            raise ConfigurationError(
                f"expected_group_size must be None or a positive integer, got {self.expected_group_size!r}"
            )
        if not _is_int(self.min_group_size) or self.min_group_size < 1:
            raise ConfigurationError(f"min_group_size must be a positive integer, got {self.min_group_size!r}")
        if self.target_group_size is None:
            return
        if not _is_int(self.target_group_size) or self.target_group_size < 1:
            raise ConfigurationError(
                f"target_group_size must be None or a positive integer, got {self.target_group_size!r}"
            )
        if self.min_group_size > self.target_group_size:
            raise ConfigurationError(
                f"min_group_size ({self.min_group_size}) exceeds target_group_size ({self.target_group_size})"
            )

    def _check_times(self) -> None:
        for name in ("min_matchmaking_time", "request_timeout", "poll_interval"):
            value = getattr(self, name)
            if not _is_number(value) or not 0 <= value < math.inf:
                raise ConfigurationError(f"{name} must be a finite non-negative number, got {value!r}")
        if self.request_timeout <= 0 or self.poll_interval <= 0:
            raise ConfigurationError("request_timeout and poll_interval must be positive")
        # A declaration lives request_timeout and is refreshed from the polling loop once it has
        # lost a third of that: polls must come often enough for the refresh to land in time.
        if self.poll_interval > self.request_timeout / 4:
            raise ConfigurationError(
                f"poll_interval ({self.poll_interval}) must be at most request_timeout / 4 ({self.request_timeout / 4})"
            )


@dataclass(frozen=True)
class Member:
    """One peer in one attempt, as it declared itself; what the all-reduce needs to know about it."""

    peer_id: str  # base58, as PeerID.to_base58()
    attempt: str  # a token that is new for every attempt, so records of old rounds never match
    bandwidth: float | None = None
    client_mode: bool = False
    auxiliary: bool = False

    @property
    def key(self) -> PeerKey:
        return (self.peer_id, self.attempt)


@dataclass(frozen=True)
class Declaration:
    """A peer that is looking for a group: who it is, how senior it is, and how long it may wait."""

    member: Member
    prefix: str  # the group key it declared under (the prefix itself for a peer without group bits)
    declared_at: float  # when the peer started looking (kept across its retries): its seniority
    ready_at: float  # its scheduled time: from then on, a group smaller than the target is acceptable
    deadline: float  # it gives up at this time
    expiration: float = -math.inf  # when the DHT forgets the record under this attempt (latest stored)
    fingerprint: str = ""  # the run fingerprint it declared (empty: none, e.g. an auxiliary peer)
    digits: Digits = ()  # its rotation coordinates (see .rotation; empty: none)


@dataclass(frozen=True)
class SealedGroup:
    """A group proposed by its leader (``members[0]``): members are ordered by peer id."""

    group_id: str  # hex digest of the member keys, see group_id_for
    members: tuple[Member, ...]
    commit_by: float  # the leader commits at the latest at this time, with whoever confirmed
    start_at: float = -math.inf  # its all-reduce starts no earlier (a group sealed ahead, see .timing)
    direct: bool = False  # members confirm by calling the leader, not on the board (see .confirmation)

    @property
    def leader(self) -> Member:
        return self.members[0]

    @property
    def keys(self) -> frozenset[PeerKey]:
        return frozenset(member.key for member in self.members)


@dataclass(frozen=True)
class Commit:
    """The leader's final word on a sealed group: who is in it. No members: the group was abandoned."""

    group_id: str
    members: tuple[PeerKey, ...]


@dataclass(frozen=True)
class Board:
    """Everything one read of the DHT returned for one prefix, parsed and stripped of expired records."""

    declarations: Mapping[PeerKey, Declaration] = field(default_factory=dict)
    markers: Mapping[PeerKey, str | None] = field(default_factory=dict)  # attempt -> group joined, None: left
    sealed: Mapping[str, SealedGroup] = field(default_factory=dict)
    commits: Mapping[str, Commit] = field(default_factory=dict)


@dataclass(frozen=True)
class GroupInfo:
    """An averaging group: every member receives the same id and the same ordered member list."""

    group_id: bytes
    members: tuple[Member, ...]

    @property
    def peer_ids(self) -> tuple[PeerID, ...]:
        return tuple(PeerID.from_base58(member.peer_id) for member in self.members)

    @property
    def size(self) -> int:
        return len(self.members)

    def index_of(self, peer_id: PeerID | str) -> int:
        """Position of a peer in the member list; raises ValueError if it is not a member."""
        wanted = peer_id.to_base58() if isinstance(peer_id, PeerID) else peer_id
        for index, member in enumerate(self.members):
            if member.peer_id == wanted:
                return index
        raise ValueError(f"{wanted} is not a member of group {self.group_id.hex()}")


def capped_bandwidth(bandwidth: float) -> float:
    """A finite, non-negative bandwidth declared by a peer, capped at :data:`MAX_BANDWIDTH`."""
    return min(float(bandwidth), MAX_BANDWIDTH)


def group_id_for(members: Iterable[Member]) -> str:
    """A group's id is derived from its members' attempt keys: two leaders can never seal different
    member lists under one id, and the same peers in a later round get a new id."""
    text = "\n".join(f"{peer}/{attempt}" for peer, attempt in sorted(member.key for member in members))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def is_open(group: SealedGroup, now: float, board: Board) -> bool:
    """A sealed group still takes confirmations until its leader commits it or its commit time passes."""
    return group.group_id not in board.commits and now <= group.commit_by


def plausible(group: SealedGroup, member: Declaration, now: float, config: MatchmakingConfig) -> bool:
    """Whether ``group``, which lists ``member``, could have been sealed by an honest leader, as far as
    the waits it imposes on that member go: its commit time within :data:`SEAL_HORIZON` request
    timeouts and before the member's deadline (an honest leader commits one poll before the nearest
    deadline), and its start time (a group sealed ahead, see :mod:`.timing`) no later than the member's
    scheduled time (an honest leader starts the group when its first member is due). A member does not
    join any other seal, and planners do not count it as claiming the member (:func:`looking_peers`):
    a hostile seal with a commit or start time far ahead held every member it listed until its
    deadline, and took it out of every honest peer's plans until then. Nor does it list more than
    ``target_group_size`` members (:func:`plan_groups` never plans more): a hostile seal that listed
    the member among thousands of made-up ones made its round open a stream to each."""
    target = config.target_group_size
    return (
        group.commit_by <= min(member.deadline, now + SEAL_HORIZON * config.request_timeout)
        and group.start_at <= member.ready_at
        and (target is None or len(group.members) <= target)
    )


def looking_peers(now: float, board: Board, config: MatchmakingConfig) -> list[Declaration]:
    """The declarations that may be put into a new group, most senior first.

    Skipped: other group keys (and declarations whose coordinates are not of this shard), expired
    records, peers too close to their deadline, and attempts that an open sealed group (one that is
    :func:`plausible` for that attempt) or a commit already claims. A peer seen with several live
    attempts (an old one it failed to withdraw) counts once, with the attempt it refreshed last.
    """
    claimed = {
        key
        for group in board.sealed.values()
        if is_open(group, now, board)
        for key in group.keys
        if key not in board.declarations or plausible(group, board.declarations[key], now, config)
    }
    claimed.update(key for commit in board.commits.values() for key in commit.members)
    latest: dict[str, Declaration] = {}
    for declaration in board.declarations.values():
        usable = (
            declaration.prefix == config.group_key
            and in_shard(declaration.digits, config.shard_digits)
            and declaration.expiration > now
            and declaration.deadline >= now + POLLS_BEFORE_DEADLINE * config.poll_interval
            and declaration.member.key not in claimed
        )
        previous = latest.get(declaration.member.peer_id)
        if usable and (previous is None or _freshness(declaration) > _freshness(previous)):
            latest[declaration.member.peer_id] = declaration
    return sorted(latest.values(), key=_seniority)


def plan_groups(now: float, looking: Sequence[Declaration], config: MatchmakingConfig) -> list[tuple[Declaration, ...]]:
    """Split the looking peers into groups by the rule in the module docstring.

    Every group is ordered by peer id; its first member is its leader. Input order does not matter.
    """
    ranked = sorted(looking, key=_seniority)
    count = len(ranked)
    if count == 0:
        return []
    target = config.target_group_size or count
    if any(declaration.ready_at <= now for declaration in ranked):
        if count >= config.min_group_size and all_auxiliary(d.member for d in ranked):
            return [tuple(sorted(ranked[:target], key=_member_order))]  # nothing to average: let them finish
        groups = min(-(-count // target), count // config.min_group_size)
        chosen = ranked[: min(count, groups * target)]
    else:
        expected = config.expected_group_size
        contributing = sum(not d.member.auxiliary for d in ranked)
        if config.target_group_size is None and expected is not None and contributing >= expected:
            if count >= config.min_group_size:  # every expected contributor is here: one group, now
                return [tuple(sorted(ranked, key=_member_order))]
        if _waits_for_the_swarm(config) and contributing < expected_in_shard(expected, config.target_group_size, 0):
            return []  # rotating groups on the swarm's one board (see .rotation): wait for it, so that groups mix
        groups, rest = divmod(count, target)
        # (in a shard, the rest falls back to the coarser shard's board soon: see .rotation)
        stranded = 0 < rest < config.min_group_size and not config.shard_depth
        if config.target_group_size is None or stranded:
            return []  # no group is full yet, or forming the full ones would strand the rest
        chosen = ranked[: groups * target]
    split = split_evenly(chosen, groups)
    return [tuple(sorted(group, key=_member_order)) for group in _balance_roles(split)]


def _waits_for_the_swarm(config: MatchmakingConfig) -> bool:
    """Whether full groups on this board wait for the whole swarm (see :mod:`.rotation`): the prefix's
    board of a swarm small enough to have no shards. Where the swarm has shards, the prefix's board
    is only reached by falling back, by peers of different shards: the swarm never comes there, and
    waiting for it held every peer that fell back until its scheduled time (64 real peers: groups of
    2-7 formed at the scheduled time from those leftovers, where full groups of 8 were there)."""
    target, expected = config.target_group_size, config.expected_group_size
    if not config.digits or config.shard_depth or target is None or expected is None:
        return False
    return shard_depth(expected, target) == 0


def is_viable(members: Iterable[Member]) -> bool:
    """A group can run an all-reduce: someone accepts connections and someone brings tensors."""
    members = list(members)
    return any(not m.client_mode for m in members) and any(not m.auxiliary for m in members)


def all_auxiliary(members: Iterable[Member]) -> bool:
    """Every member is an auxiliary peer: a group with nothing to average. It forms only once its
    scheduled time has come and nobody else is looking (see :func:`plan_groups`), so that auxiliary
    peers' steps finish, as in hivemind, instead of waiting out their deadline (or for ever)."""
    members = list(members)
    return bool(members) and all(m.auxiliary for m in members)


def _balance_roles(groups: list[list[Declaration]]) -> list[list[Declaration]]:
    """Swap members so every group is viable where possible; drop the groups that still are not."""
    for group in groups:
        if not is_viable(d.member for d in group):
            _swap_into(group, groups)
    return [group for group in groups if is_viable(d.member for d in group)]


def _swap_into(needy: list[Declaration], groups: list[list[Declaration]]) -> None:
    """Make ``needy`` viable by exchanging one member with another group that stays viable.

    Tries the most junior members first, so the senior peers' groups change as little as possible.
    """
    for donor in groups:
        if donor is needy or not is_viable(d.member for d in donor):
            continue
        for i in reversed(range(len(donor))):
            for j in reversed(range(len(needy))):
                new_donor = [*donor[:i], needy[j], *donor[i + 1 :]]
                new_needy = [*needy[:j], donor[i], *needy[j + 1 :]]
                if is_viable(d.member for d in new_donor) and is_viable(d.member for d in new_needy):
                    donor[:], needy[:] = new_donor, new_needy
                    return


def _seniority(declaration: Declaration) -> tuple[Digits, float, str, str]:
    member = declaration.member
    return (ranking(declaration.digits), declaration.declared_at, member.peer_id, member.attempt)


def _freshness(declaration: Declaration) -> tuple[float, str]:
    return (declaration.expiration, declaration.member.attempt)


def _member_order(declaration: Declaration) -> tuple[str, str]:
    return declaration.member.key


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
