"""Many peers running the matchmaking protocol over a simulated, lagging, sharded DHT, without a
network: the pure :func:`.protocol.step` and :func:`.protocol.fall_back` driven by a discrete-event
clock, as :class:`.matchmaker.Matchmaker` drives them over the real DHT.

For property tests and ``benchmarks/scale.py`` (a thousand peers take seconds). Each DHT key keeps
every version of every record with the time it was written; a read sees the versions older than a
lag drawn for that read (replicas that apply stores in order). Peers may die after declaring
(churn: their records live on until they expire), and arbitrary records may be planted (a hostile
peer's). Records are not signed here: what signing rules out (overwriting another peer's records)
cannot happen in this simulation either, since every simulated peer writes only its own.
"""

from __future__ import annotations

import dataclasses
import random
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hivemind_ext.averaging.matchmaking.board import Write, board_key, parse_board
from hivemind_ext.averaging.matchmaking.group import Declaration, GroupInfo, MatchmakingConfig, Member
from hivemind_ext.averaging.matchmaking.pace import ReadPace
from hivemind_ext.averaging.matchmaking.protocol import URGENT_POLL_FRACTION, Looking, State, fall_back, step
from hivemind_ext.averaging.matchmaking.rotation import Digits, shard_depth

_BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"  # in ASCII order


def simulated_peer_id(index: int) -> str:
    """A valid base58 peer id whose string order is the order of ``index``."""
    digits = []
    for _ in range(6):
        index, digit = divmod(index, 58)
        digits.append(_BASE58[digit])
    return "12D3KooW" + "".join(reversed(digits))


def simulated_member(
    index: int, *, attempt: int = 0, bandwidth: float | None = None, client_mode: bool = False, auxiliary: bool = False
) -> Member:
    """Peer ``index`` in its ``attempt``-th attempt (the tests' and the simulation's members)."""
    return Member(simulated_peer_id(index), f"{index:08x}{attempt:08x}", bandwidth, client_mode, auxiliary)


@dataclass
class LaggingDHT:
    """Every key's records, each version with the time it was written; reads lag by up to ``max_lag``.

    ``per_record=False``: a read sees every version older than one lag drawn for that read (replicas
    that each apply stores in order). ``per_record=True``: every version of every record reaches every
    reader after its own lag, so a reader may see a marker before the group it refers to."""

    seed: int
    max_lag: float
    per_record: bool = False
    versions: dict[str, dict[str, list[tuple[float, dict, float]]]] = field(default_factory=dict)
    reads: int = 0
    records_read: int = 0

    def store(self, key: str, write: Write, now: float) -> None:
        history = self.versions.setdefault(key, {}).setdefault(str(write.subkey), [])
        if not history or write.expiration_time > max(e for _, _, e in history):  # the DHT keeps the latest
            history.append((now, write.value, write.expiration_time))

    def read(self, key: str, reader: str, now: float) -> list[tuple[str, dict, float]]:
        lag = self._lag(f"{reader}/{now}")
        entries = []
        for subkey, history in self.versions.get(key, {}).items():
            arrived = [
                (value, expiration)
                for i, (written, value, expiration) in enumerate(history)
                if written + (self._lag(f"{subkey}/{i}/{reader}") if self.per_record else lag) <= now
            ]
            if arrived and arrived[-1][1] > now:
                entries.append((subkey, *arrived[-1]))
        self.reads += 1
        self.records_read += len(entries)
        return entries

    def _lag(self, what: str) -> float:
        return self.max_lag * (zlib.crc32(f"{self.seed}/{what}".encode()) / 2**32)


@dataclass
class SimulatedPeer:
    """One peer's search: its configuration (which changes when it falls back) and protocol state."""

    peer_id: str
    config: MatchmakingConfig
    state: State
    next_time: float
    dies: bool = False  # stops after its first declaration, as a peer that crashed
    group: GroupInfo | None = None
    found_at: float | None = None
    reads: int = 0
    pace: ReadPace = field(default_factory=ReadPace)  # its reads' durations (see .pace)


@dataclass(frozen=True)
class SimulatedRound:
    """What a simulated round produced: each grouped peer's group, and what it cost."""

    groups: Mapping[str, GroupInfo]  # peer id -> its group (peers that found none are absent)
    found_at: Mapping[str, float]
    reads_per_peer: Mapping[str, int]
    last_declared_at: float  # when the last (live) peer started looking
    records_per_read: float
    polls_to_group: float  # max over peers: (time its group was final - the later of last_declared_at and
    # the first scheduled time) / poll_interval: how long the last group took once it could form
    ungrouped: tuple[str, ...] = ()  # live peers that found no group by ``until`` (not in polls_to_group)


def simulate_round(
    coordinates: Mapping[str, Digits],
    config: MatchmakingConfig,
    *,
    swarm_size: int | None,
    seed: int = 0,
    max_lag: float = 0.0,
    spread: float = 0.0,
    dying: Sequence[str] = (),
    planted: Sequence[tuple[str, Write] | tuple[str, Write, float]] = (),
    scheduled_time: float | None = None,
    until: float = 60.0,
    per_record: bool = False,
    read_time: float = 0.0,
    dht: LaggingDHT | None = None,
    begin: float = 0.0,
    attempt: int = 0,
) -> SimulatedRound:
    """One round of matchmaking for the peers of ``coordinates`` (peer id -> digits; empty digits
    and ``swarm_size=None``: one board, no rotation): each starts looking at a random time within
    ``spread`` seconds, with its scheduled time ``min_matchmaking_time`` later (or
    ``scheduled_time`` for all, as in synchronous training); ``dying`` peers die right after
    declaring; ``planted`` records ``(key, write)`` lie in the DHT from the start (``(key, write,
    time)``: from that time on, as a hostile peer's later writes); ``per_record``:
    see :class:`LaggingDHT`; ``read_time``: a read takes up to this long (a uniform draw), as reads
    of 64 real peers on two saturated cores took seconds; each peer steps at the pace of its own
    reads' durations (:mod:`.pace`), as the matchmaker does. Runs until every live peer has a group or
    gave up at ``until`` (a peer in a group that is being formed finishes that first). ``dht``: the DHT
    to run on (default: a new one), e.g. that of an earlier round, with peers that start looking from
    ``begin`` on (a DHT time; ``until`` is one too) under attempt tokens numbered ``attempt``."""
    rnd = random.Random(seed)
    dht = LaggingDHT(seed, max_lag, per_record) if dht is None else dht
    for key, write, *at in planted:
        dht.store(key, write, at[0] if at else 0.0)
    base = config.target_group_size
    depth = shard_depth(swarm_size, base) if base is not None else 0
    peers = []
    for index, (peer_id, digits) in enumerate(sorted(coordinates.items())):
        start = begin + rnd.uniform(0, spread)
        mine = dataclasses.replace(
            config, digits=tuple(digits), shard_depth=min(depth, len(digits)), expected_group_size=swarm_size
        )
        member = simulated_member(index, attempt=attempt, client_mode=config.client_mode, auxiliary=config.auxiliary)
        member = dataclasses.replace(member, peer_id=peer_id)
        ready_at = start + config.min_matchmaking_time if scheduled_time is None else max(start, scheduled_time)
        declaration = Declaration(member, mine.group_key, start, ready_at, until, digits=mine.digits)
        peers.append(SimulatedPeer(peer_id, mine, Looking(declaration), start, dies=peer_id in set(dying)))
    last_declared = max((p.next_time for p in peers if not p.dies), default=0.0)
    first_due = min((p.state.declaration.ready_at for p in peers), default=0.0)
    while True:
        active = [p for p in peers if p.group is None and (p.next_time < until or not isinstance(p.state, Looking))]
        if not active:
            break
        peer = min(active, key=lambda p: (p.next_time, p.peer_id))
        _poll(peer, dht, rnd, read_time)
    live = [p for p in peers if not p.dies]
    grouped = [p for p in live if p.group is not None]
    found = {p.peer_id: p.found_at for p in grouped if p.found_at is not None}
    latest = max(found.values(), default=last_declared)
    return SimulatedRound(
        groups={p.peer_id: p.group for p in grouped if p.group is not None},
        found_at=found,
        reads_per_peer={p.peer_id: p.reads for p in live},
        last_declared_at=last_declared,
        records_per_read=dht.records_read / max(dht.reads, 1),
        polls_to_group=max(0.0, latest - max(last_declared, first_due)) / config.poll_interval,
        ungrouped=tuple(p.peer_id for p in live if p.group is None),
    )


def _poll(peer: SimulatedPeer, dht: LaggingDHT, rnd: random.Random, read_time: float = 0.0) -> None:
    """One read, one step and its writes; schedules the peer's next read as the matchmaker would."""
    now, key = peer.next_time, board_key(peer.config.group_key)
    entries = dht.read(key, peer.peer_id, now)
    peer.reads += 1
    board = parse_board(peer.config.group_key, entries, now, peer.config.fingerprint)
    paced = peer.pace.paced(peer.config)  # the protocol counts in reads (see .pace)
    result = step(peer.state, now, board, paced)
    peer.state = result.state
    if result.fall_back:
        peer.config, peer.state, left = fall_back(result.state.declaration, now, peer.config, result.hop)
        dht.store(key, left, now)
        peer.next_time = now + _read_delay(rnd, read_time, peer.pace)  # declares on the coarser board at once
        return
    for write in result.writes:
        dht.store(key, write, now)
    if result.group is not None:
        peer.group, peer.found_at = result.group, now
        return
    if peer.dies and result.writes:
        peer.next_time = float("inf")  # declared, then died
        return
    pause = paced.poll_interval * (URGENT_POLL_FRACTION if result.urgent else 1.0)
    peer.next_time = now + pause * rnd.uniform(0.5, 1.5) + _read_delay(rnd, read_time, peer.pace)


def _read_delay(rnd: random.Random, read_time: float, pace: ReadPace) -> float:
    """How long one read takes beyond the poll pause, recorded in the peer's ``pace``; no draw
    without ``read_time``, so that seeded runs without it keep their results."""
    delay = rnd.uniform(0, read_time) if read_time > 0 else 0.0
    pace.record(delay)
    return delay
