"""Swarm-wide training progress: how many samples the peers have accumulated toward the next epoch.

Every peer publishes one record under the DHT key ``f"{prefix}_progress"``, in its own subkey
``[owner:<RSA public key>]``. hivemind's :class:`RSASignatureValidator` signs a record whose subkey
holds the writer's public key and makes every DHT node that runs it (on store, and on reading a
value from another node) reject a record under such a subkey unless it carries a valid signature
by that key. The validator leaves records under any other subkey unprotected, so readers here
accept only owner subkeys; and :class:`ProgressRecordValidator` makes the nodes that run a tracker
refuse such unprotected or malformed entries at store time too.

A record's value is the list ``[peer_id, epoch, samples_accumulated, samples_per_second, time,
client_mode]``, then the peer's run fingerprint (:mod:`.fingerprint`) as a seventh item if it has
one (``None`` if not), and ``True`` as an eighth item from an auxiliary peer (it brings no samples and no
gradients, see :attr:`GlobalTrainingProgress.num_trainers`); or ``None`` once its owner has left. The
tracker counts only the peers whose fingerprint is compatible with the swarm's
(:func:`~.fingerprint.swarm_fingerprint`): a peer of another model or other settings under the same
run_id neither adds to the swarm's progress nor to the group size that peers expect
(:attr:`ProgressTracker.foreign_peers` lists it). The DHT is open to anyone: every record is
parsed strictly and a malformed one is skipped, never trusted.

:func:`aggregate_progress` turns the records into a :class:`GlobalTrainingProgress`; it is a pure
function of the records, this peer's own progress and the clock, so tests drive it directly. A valid
signature does not make a record true: the swarm's epoch and the sample claims that count are decided
by :mod:`.progress_rules` so that no single peer (nor a minority) can move the epoch or end an epoch
early; implausible records are ignored and counted (:attr:`ProgressTracker.ignored_records`).
:class:`ProgressTracker` is the thin I/O around it: a background thread that publishes this peer's
record and fetches everyone's, every DHT call made through the peer runtime's DHT helper
(:class:`~hivemind_ext.p2p.dht_calls.DHTCalls`) and bounded by a deadline.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import operator
import re
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from hivemind_ext.errors import (
    ClosedError,
    ConfigurationError,
    DeadlineExceededError,
    HivemindExtError,
    PeerUnreachableError,
    ProtocolError,
)
from hivemind_ext.optim.fingerprint import RunFingerprint, swarm_fingerprint
from hivemind_ext.optim.progress_rules import Counted, accepts_epoch, screen_progress
from hivemind_ext.p2p.dht_calls import add_validators
from hivemind_ext.p2p.runtime import PeerRuntime
from hivemind_ext.p2p.signing import CachingSignatureValidator, default_signing_key, signs_with_key

logger = logging.getLogger(__name__)

MAX_COUNT = 2**62  # epochs and sample counts above this are absurd: such a record is malformed
RECORD_FIELDS = 6
AUXILIARY_RECORD_FIELDS = 8  # the record of an auxiliary peer: a fingerprint (or None), then True
_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{1,128}")  # base58
_OWNER_SUBKEY = re.compile(rb"\[owner:(.+)\]", re.DOTALL)  # RSASignatureValidator.PUBLIC_KEY_FORMAT, whole subkey
_POLL_SECONDS = 0.1  # how often a wait on the DHT checks whether the tracker is shutting down
_MAX_WARNED_PEERS = 1024  # past this many offending peers, new ones are counted, not logged
_REMOVAL_WAIT_SECONDS = 1.0  # how long shutdown waits for the store that withdraws this peer's record


@dataclass(frozen=True)
class LocalTrainingProgress:
    """One peer's progress, as it publishes it."""

    peer_id: str  # base58 libp2p peer id
    epoch: int
    samples_accumulated: int
    samples_per_second: float
    time: float  # DHT time of the report
    client_mode: bool
    fingerprint: RunFingerprint | None = None  # the peer's run settings (None: an older peer, unchecked)
    auxiliary: bool = False  # an auxiliary peer: it helps average but brings no gradients


@dataclass(frozen=True)
class GlobalTrainingProgress:
    """The swarm's progress toward the next epoch, as this peer sees it."""

    epoch: int  # this peer's epoch, or the highest that most other peers reached (see progress_rules)
    samples_accumulated: int  # samples reported by the peers at that epoch (implausible claims capped)
    target_batch_size: int
    num_peers: int  # live peers, this one included
    num_clients: int
    eta_next_epoch: float  # DHT time at which the swarm is expected to reach target_batch_size
    next_fetch_time: float  # DHT time at which the tracker reads the records again
    samples_per_second: float = 0.0  # the live peers' speeds, summed (not in hivemind's record of this name)
    #: the slowest live trainer's speed (capped like the others; 0 while one has measured none yet): how
    #: long the swarm's straggler needs for a round's samples (see ``rounds.straggler_patience``)
    slowest_trainer_speed: float = 0.0
    num_auxiliary: int = 0  # auxiliary peers among num_peers
    ignored: tuple[tuple[str, str], ...] = ()  # (peer id, why) of the records left out as implausible

    @property
    def num_trainers(self) -> int:
        """The peers that bring gradients (client-mode ones included, auxiliary ones not): the ones a
        trainer averages with, and what decides whether a round can average anything at all."""
        return self.num_peers - self.num_auxiliary


@dataclass(frozen=True, kw_only=True)
class ProgressTrackerConfig:
    """Settings of a :class:`ProgressTracker`; the keyword arguments of its constructor, checked together."""

    prefix: str
    target_batch_size: int
    min_refresh_period: float = 0.5
    max_refresh_period: float = 10.0
    default_refresh_period: float = 3.0
    expected_drift_peers: float = 3.0
    expected_drift_rate: float = 0.2
    performance_ema_alpha: float = 0.1
    metadata_expiration: float = 60.0
    status_loglevel: int = logging.DEBUG

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not self.prefix:
            raise ConfigurationError("prefix must be a non-empty string")
        if type(self.target_batch_size) is not int or not 0 < self.target_batch_size <= MAX_COUNT:
            raise ConfigurationError(f"target_batch_size must be a positive integer, got {self.target_batch_size!r}")
        for name in _PERIODS:
            value = getattr(self, name)
            if not _is_real(value) or not 0 < value < math.inf:
                raise ConfigurationError(f"{name} must be a positive finite number, got {value!r}")
        if not self.min_refresh_period <= self.default_refresh_period <= self.max_refresh_period:
            raise ConfigurationError("refresh periods must satisfy min <= default <= max")
        if self.metadata_expiration <= self.max_refresh_period:
            # a record must outlive the longest gap between two fetches, or peers would flicker in and out
            raise ConfigurationError("metadata_expiration must exceed max_refresh_period")
        for name in ("expected_drift_peers", "expected_drift_rate"):
            value = getattr(self, name)
            if not _is_real(value) or not 0 <= value < math.inf:
                raise ConfigurationError(f"{name} must be a non-negative finite number, got {value!r}")
        if not _is_real(self.performance_ema_alpha) or not 0 < self.performance_ema_alpha <= 1:
            raise ConfigurationError(f"performance_ema_alpha must be in (0, 1], got {self.performance_ema_alpha!r}")

    @classmethod
    def resolve(cls, **kwargs: Any) -> ProgressTrackerConfig:
        """The config for hivemind's constructor arguments: where hivemind accepts periods that break
        the rules above, the dependent ones are clamped (and a warning says so, once per process)
        instead of refused. ``max_refresh_period`` stays below ``metadata_expiration`` (clamped to half
        of it, the keepalive period); ``min_refresh_period`` at most ``max_refresh_period`` (hivemind's
        clip then waits ``max_refresh_period``, as here); ``default_refresh_period`` within the two (the
        fetch period is clamped to them anyway). A period that is not a positive finite number is still
        refused: it means nothing (zero would fetch in a busy loop)."""
        fields = {field.name: field.default for field in dataclasses.fields(cls)}
        values = {name: kwargs.get(name, fields[name]) for name in _PERIODS}
        if all(_is_real(value) and 0 < value < math.inf for value in values.values()):
            changed = _clamp_periods(values)
            if changed:
                _warn_once_about_periods(changed)
            kwargs.update(values)
        return cls(**kwargs)

    @property
    def training_progress_key(self) -> str:
        return f"{self.prefix}_progress"

    @property
    def request_timeout(self) -> float:
        """Deadline of one background DHT call: long enough for a slow swarm, short enough that a
        dead one cannot make the record expire before the tracker notices."""
        return min(max(5.0, 2 * self.max_refresh_period), self.metadata_expiration / 2)


_PERIODS = ("min_refresh_period", "default_refresh_period", "max_refresh_period", "metadata_expiration")
_periods_warning = threading.Lock()  # taken for good by the first warning: at most one per process


def _clamp_periods(values: dict[str, float]) -> list[str]:
    """Makes ``values`` (the periods in ``_PERIODS``) satisfy ProgressTrackerConfig's rules by moving
    the dependent ones; returns what changed, as ``name: old -> new``."""
    before = dict(values)
    if values["max_refresh_period"] >= values["metadata_expiration"]:
        values["max_refresh_period"] = values["metadata_expiration"] / 2
    values["min_refresh_period"] = min(values["min_refresh_period"], values["max_refresh_period"])
    values["default_refresh_period"] = min(
        max(values["default_refresh_period"], values["min_refresh_period"]), values["max_refresh_period"]
    )
    return [f"{name}: {before[name]} -> {values[name]}" for name in _PERIODS if values[name] != before[name]]


def _warn_once_about_periods(changed: list[str]) -> None:
    if _periods_warning.acquire(blocking=False):
        logger.warning(
            "ProgressTracker: the refresh periods given need min <= default <= max < metadata_expiration; "
            "using %s (this warning is shown once)",
            ", ".join(changed),
        )


# ----------------------------------------------------------------------------------------------
# Records on the wire


def progress_value(progress: LocalTrainingProgress) -> list[Any]:
    """The DHT value that publishes ``progress``."""
    return [
        progress.peer_id,
        progress.epoch,
        progress.samples_accumulated,
        float(progress.samples_per_second),
        float(progress.time),
        progress.client_mode,
        *([_fingerprint_wire(progress.fingerprint)] if progress.fingerprint is not None or progress.auxiliary else []),
        *([True] if progress.auxiliary else []),
    ]


def _fingerprint_wire(fingerprint: RunFingerprint | None) -> Any:
    return fingerprint.to_wire() if fingerprint is not None else None


def parse_progress_value(value: Any) -> LocalTrainingProgress:
    """One record's value; raises :class:`ProtocolError` if anything in it is malformed."""
    if not isinstance(value, list | tuple) or not RECORD_FIELDS <= len(value) <= AUXILIARY_RECORD_FIELDS:
        raise ProtocolError(f"a progress record must be a list of {RECORD_FIELDS} to {AUXILIARY_RECORD_FIELDS} fields")
    peer_id, epoch, samples, speed, report_time, client_mode = value[:RECORD_FIELDS]
    auxiliary = len(value) == AUXILIARY_RECORD_FIELDS
    if auxiliary and value[RECORD_FIELDS + 1] is not True:
        raise ProtocolError("the 8th field of a progress record, if present, must be True (an auxiliary peer)")
    if not isinstance(peer_id, str) or not _PEER_ID.fullmatch(peer_id):
        raise ProtocolError("peer_id must be a base58 string")
    if type(epoch) is not int or not 0 <= epoch <= MAX_COUNT:
        raise ProtocolError(f"epoch must be an integer in [0, 2**62], got {epoch!r:.40}")
    if type(samples) is not int or not 0 <= samples <= MAX_COUNT:
        raise ProtocolError(f"samples_accumulated must be an integer in [0, 2**62], got {samples!r:.40}")
    if not _is_real(speed) or not 0 <= speed < math.inf:
        raise ProtocolError(f"samples_per_second must be a non-negative finite number, got {speed!r:.40}")
    if not _is_real(report_time) or not math.isfinite(report_time):
        raise ProtocolError("time must be a finite number")
    if not isinstance(client_mode, bool):
        raise ProtocolError("client_mode must be a bool")
    wired = value[RECORD_FIELDS] if len(value) > RECORD_FIELDS else None
    fingerprint = RunFingerprint.from_wire(wired) if wired is not None else None
    return LocalTrainingProgress(
        peer_id, epoch, samples, float(speed), float(report_time), client_mode, fingerprint, auxiliary
    )


def split_by_fingerprint(
    records: Sequence[LocalTrainingProgress], local: LocalTrainingProgress
) -> tuple[RunFingerprint | None, list[LocalTrainingProgress], list[LocalTrainingProgress]]:
    """The swarm's fingerprint among ``records`` and this peer's ``local`` progress, the records
    compatible with it (or with no fingerprint: unchecked), and the others (foreign peers)."""
    swarm = swarm_fingerprint([(r.fingerprint, r.epoch) for r in (*records, local)])
    if swarm is None:
        return None, list(records), []
    kept, foreign = [], []
    for record in records:
        ok = record.fingerprint is None or record.fingerprint.compatible(swarm)
        (kept if ok else foreign).append(record)
    return swarm, kept, foreign


def is_owner_subkey(subkey: Any) -> bool:
    """Whether ``subkey`` names an RSA owner, the only kind of subkey whose record the DHT makes
    its writer sign; a record under any other subkey could have been written by anyone."""
    return isinstance(subkey, bytes) and _OWNER_SUBKEY.fullmatch(subkey) is not None


def parse_progress_records(
    entries: Iterable[tuple[Any, Any, Any]], *, now: float, exclude_subkey: bytes | None = None
) -> list[LocalTrainingProgress]:
    """Records from ``(subkey, value, expiration)`` triples, skipping withdrawn (``None``), expired,
    unprotected and malformed ones, and the one under ``exclude_subkey`` (this peer's own)."""
    records = []
    for subkey, value, expiration in entries:
        if value is None or subkey == exclude_subkey:
            continue
        try:
            if not _is_real(expiration) or not expiration > now:
                raise ProtocolError("expired or malformed expiration")
            if not is_owner_subkey(subkey):
                raise ProtocolError("the subkey is not an [owner:<public key>] marker, so nothing signed the record")
            records.append(parse_progress_value(value))
        except ProtocolError as e:
            logger.debug("skipping a progress record under %.60r: %s", subkey, e)
    return records


class ProgressRecordValidator(RecordValidatorBase):
    """Makes a DHT node refuse, under one progress key, anything but owner-subkey entries holding a
    well-formed record or ``None``. It runs after :class:`RSASignatureValidator` (lower priority), so
    it sees values already checked and stripped of their signature."""

    def __init__(self, training_progress_key: str):
        self.key_bytes = DHTID.generate(source=training_progress_key).to_bytes()

    def validate(self, record: DHTRecord) -> bool:
        if record.key != self.key_bytes:
            return True
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
            value = MSGPackSerializer.loads(record.value)
            if not is_owner_subkey(subkey):
                return False
            if value is not None:
                parse_progress_value(value)
            return True
        except Exception as e:  # anything a hostile byte string makes msgpack or the parser raise
            logger.debug("refusing a progress record: %r", e)
            return False

    def merge_with(self, other: RecordValidatorBase) -> bool:
        # a second tracker for the same prefix on one DHT needs no second copy
        return isinstance(other, ProgressRecordValidator) and other.key_bytes == self.key_bytes


# ----------------------------------------------------------------------------------------------
# Decisions


def aggregate_progress(
    records: Sequence[LocalTrainingProgress],
    local: LocalTrainingProgress,
    *,
    target_batch_size: int,
    now: float,
    min_refresh_period: float,
    max_refresh_period: float,
    default_refresh_period: float,
    expected_drift_peers: float,
    expected_drift_rate: float,
) -> GlobalTrainingProgress:
    """The swarm's progress from the live peers' ``records`` and this peer's own latest ``local``
    progress (which replaces any record with its peer id). The epoch and the sample claims that count
    are decided by :func:`~.progress_rules.screen_progress`, so that no single peer (nor a minority)
    can move them; the records it ignores are listed in the result's ``ignored``."""
    screening = screen_progress(records, local, target_batch_size=target_batch_size)
    epoch = screening.epoch
    peers = [entry.record for entry in screening.counted]
    current = [entry for entry in screening.counted if entry.record.epoch == epoch]
    samples = sum(entry.samples for entry in current)

    # Every live peer's speed counts, also those still at an older epoch: they are about to catch up
    # and contribute. Samples count only at the current epoch; each is extrapolated from its report
    # time, since a record is only republished every so often.
    total_speed = sum(entry.speed for entry in screening.counted)
    expected_samples = sum(_extrapolated(entry, now) for entry in current)
    remaining = max(0.0, target_batch_size - expected_samples)
    if remaining == 0:
        seconds_to_epoch = 0.0
    elif total_speed > 0:
        seconds_to_epoch = remaining / total_speed
    else:
        seconds_to_epoch = math.inf

    if len(peers) == 1:
        # alone, this peer knows its own progress without asking; it reads the DHT only to find newcomers
        seconds_to_fetch = default_refresh_period
    else:
        # Peers may join before the epoch ends and speed it up: with up to `expected_max_peers`, the
        # epoch could end after only `num_peers / expected_max_peers` of the estimate. Reading again
        # by then means this peer does not miss the moment the others move on.
        num_peers = len(peers)
        expected_max_peers = max(num_peers + expected_drift_peers, num_peers * (1 + expected_drift_rate))
        seconds_to_fetch = seconds_to_epoch * num_peers / expected_max_peers
    seconds_to_fetch = min(max(seconds_to_fetch, min_refresh_period), max_refresh_period)

    return GlobalTrainingProgress(
        epoch=epoch,
        samples_accumulated=samples,
        target_batch_size=target_batch_size,
        num_peers=len(peers),
        num_clients=sum(1 for peer in peers if peer.client_mode),
        eta_next_epoch=now + seconds_to_epoch,
        next_fetch_time=now + seconds_to_fetch,
        samples_per_second=total_speed,
        slowest_trainer_speed=min((e.speed for e in screening.counted if not e.record.auxiliary), default=0.0),
        num_auxiliary=sum(1 for peer in peers if peer.auxiliary),
        ignored=screening.ignored,
    )


def _extrapolated(entry: Counted, now: float) -> float:
    """A peer's samples at ``now``, from its report at ``entry.record.time`` and its speed, never past
    what its claim may count for (the time in another peer's record is that peer's own word)."""
    return min(entry.samples + entry.speed * max(0.0, now - entry.record.time), entry.limit)


def is_ready_to_update_epoch(global_progress: GlobalTrainingProgress, local_epoch: int) -> bool:
    """Whether a peer at ``local_epoch`` may end its epoch now: the swarm has moved on already, or its
    reported samples reach the target. A passed ETA is not enough: it is only an extrapolation."""
    return (
        global_progress.epoch > local_epoch or global_progress.samples_accumulated >= global_progress.target_batch_size
    )


class SpeedEstimate:
    """Samples per second as an exponential moving average of the seconds per sample (so that a
    report of many samples weighs as much as several small ones), corrected for its zero start.
    Time spent paused does not count.

    It is the tracker's :attr:`ProgressTracker.performance_ema`, with the observable interface of
    hivemind's ``PerformanceEMA``: ``samples_per_second``, ``alpha``, ``num_updates``,
    ``update(task_size, interval=None)``, ``reset_timer()``, ``pause()`` (a context manager) and
    ``update_threadsafe(task_size)``. One difference: leaving ``pause()`` resumes the clock where it
    stopped (hivemind restarts it), so the samples of a step that was interrupted by a pause are
    timed by the time spent on them outside it."""

    def __init__(self, alpha: float = 0.1):
        self.alpha = alpha
        self._lock = threading.RLock()
        self._seconds_per_sample = 0.0
        self._num_updates = 0
        self._since = time.monotonic()
        self._paused_at: float | None = None
        self._paused_seconds = 0.0
        self._holds = 0  # nested pauses (the tracker's pause_updates and the user's pause())

    @property
    def samples_per_second(self) -> float:
        with self._lock:
            if self._num_updates == 0:
                return 0.0
            debiased = self._seconds_per_sample / (1 - (1 - self.alpha) ** self._num_updates)
            return 1.0 / debiased if debiased > 0 else 0.0

    @property
    def num_updates(self) -> int:
        return self._num_updates

    @property
    def paused(self) -> bool:
        return self._holds > 0

    def update(self, task_size: float, interval: float | None = None) -> float:
        """Counts ``task_size`` samples done in ``interval`` seconds (default: the unpaused time since
        the last update or timer reset); returns the new :attr:`samples_per_second`.

        :raises ValueError: ``task_size`` is not positive, or ``interval`` is negative
        """
        if not _is_real(task_size) or not 0 < task_size < math.inf:
            raise ValueError(f"task_size must be a positive number, got {task_size!r}")
        if interval is not None and (not _is_real(interval) or not 0 <= interval < math.inf):
            raise ValueError(f"interval must be a non-negative number of seconds, got {interval!r}")
        with self._lock:
            now = time.monotonic()
            if interval is None:
                paused = self._paused_seconds + (now - self._paused_at if self._paused_at is not None else 0.0)
                interval = max(0.0, now - self._since - paused)
            self._restart(now)
            if interval > 0:
                self._seconds_per_sample = (
                    self.alpha * interval / task_size + (1 - self.alpha) * self._seconds_per_sample
                )
                self._num_updates += 1
            return self.samples_per_second

    def reset_timer(self) -> None:
        """The next update counts from now."""
        with self._lock:
            self._restart(time.monotonic())

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Inside the block, time does not count toward the estimate (blocks may nest)."""
        self.hold()
        try:
            yield
        finally:
            self.release()

    @contextlib.contextmanager
    def update_threadsafe(self, task_size: float) -> Iterator[None]:
        """Counts ``task_size`` samples done by the block, timed from its start (or from the last
        update, if a concurrent block updated since)."""
        started = time.monotonic()
        yield
        with self._lock:
            self.update(task_size, interval=time.monotonic() - max(started, self._since))

    def hold(self) -> None:
        """Stops the clock until the matching :meth:`release`."""
        with self._lock:
            self._holds += 1
            if self._paused_at is None:
                self._paused_at = time.monotonic()

    def release(self) -> None:
        with self._lock:
            if self._holds == 0:
                return
            self._holds -= 1
            if self._holds == 0 and self._paused_at is not None:
                self._paused_seconds += time.monotonic() - self._paused_at
                self._paused_at = None

    def _restart(self, now: float) -> None:
        self._since, self._paused_seconds = now, 0.0
        if self._paused_at is not None:
            self._paused_at = now

    def __repr__(self) -> str:
        return f"{type(self).__name__}(ema={self.samples_per_second:.5f}, num_updates={self._num_updates})"


# ----------------------------------------------------------------------------------------------
# The tracker


class ProgressTracker:
    """Publishes this peer's training progress and keeps an up-to-date view of the swarm's.

    Drop-in for ``hivemind.optim.progress_tracker.ProgressTracker``: same constructor arguments and
    attributes. A background daemon thread publishes the local record (when a report or a new epoch
    asks for it, at most every ``min_refresh_period`` otherwise, and at least every
    ``metadata_expiration / 2``) and reads everyone's at ``global_progress.next_fetch_time``. Every
    DHT call has a deadline, so a dead or unreachable DHT slows nothing down; :meth:`shutdown`
    returns promptly. With ``start=True`` the constructor reads the swarm's progress once (waiting
    at most the request timeout), so :attr:`global_progress` is meaningful from the start;
    :meth:`start` alone does not wait.

    Beyond hivemind's arguments: ``auxiliary=True`` marks this peer's record as an auxiliary peer's
    (see :attr:`GlobalTrainingProgress.num_trainers`).
    """

    def __init__(
        self,
        dht: DHT,
        prefix: str,
        target_batch_size: int,
        *,
        client_mode: bool | None = None,
        auxiliary: bool = False,
        min_refresh_period: float = 0.5,
        max_refresh_period: float = 10.0,
        default_refresh_period: float = 3.0,
        expected_drift_peers: float = 3.0,
        expected_drift_rate: float = 0.2,
        performance_ema_alpha: float = 0.1,
        metadata_expiration: float = 60.0,
        status_loglevel: int = logging.DEBUG,
        private_key: RSAPrivateKey | None = None,
        daemon: bool = True,
        fingerprint: RunFingerprint | None = None,
        start: bool,
    ):
        self.config = ProgressTrackerConfig.resolve(
            prefix=prefix,
            target_batch_size=target_batch_size,
            min_refresh_period=min_refresh_period,
            max_refresh_period=max_refresh_period,
            default_refresh_period=default_refresh_period,
            expected_drift_peers=expected_drift_peers,
            expected_drift_rate=expected_drift_rate,
            performance_ema_alpha=performance_ema_alpha,
            metadata_expiration=metadata_expiration,
            status_loglevel=status_loglevel,
        )
        self.dht, self.prefix, self.target_batch_size = dht, prefix, target_batch_size
        self.client_mode = dht.client_mode if client_mode is None else client_mode
        self.auxiliary = bool(auxiliary)  # published with the record: trainers do not count it as one of them
        self.training_progress_key = self.config.training_progress_key
        self.fingerprint = fingerprint  # this peer's run settings, published with its record
        self._runtime = PeerRuntime.acquire(dht)  # released by shutdown(), or below if construction fails
        try:
            self._setup(private_key, performance_ema_alpha, daemon, start)
        except BaseException:
            self._runtime.release()
            raise

    def _setup(
        self, private_key: RSAPrivateKey | None, performance_ema_alpha: float, daemon: bool, start: bool
    ) -> None:
        """The rest of the constructor, once the runtime is acquired (so that a failure can release it)."""
        dht, prefix = self.dht, self.prefix
        registered = default_signing_key(dht, private_key)  # the averagers on this DHT sign with it too
        signature_validator = CachingSignatureValidator(private_key if private_key is not None else registered)
        self._own_subkey = signature_validator.local_public_key
        add_validators(dht, [signature_validator, ProgressRecordValidator(self.training_progress_key)])
        self._check_signing_key(signature_validator)

        self._lock = threading.Lock()  # guards every field below that the thread and the callers share
        self._speed = SpeedEstimate(performance_ema_alpha)
        self._local = LocalTrainingProgress(
            dht.peer_id.to_base58(), 0, 0, 0.0, get_dht_time(), self.client_mode, self.fingerprint, self.auxiliary
        )
        self._records: list[LocalTrainingProgress] = []  # the other peers' records of this run, as last fetched
        self._foreign: list[LocalTrainingProgress] = []  # those whose fingerprint differs from the swarm's
        self._swarm_fingerprint = swarm_fingerprint([(self.fingerprint, 0)])
        now = get_dht_time()
        self._global = dataclasses.replace(self._aggregate(now), next_fetch_time=now)
        self._publish_pending = self._fetch_pending = True
        self._last_publish_time = -math.inf
        self._paused = 0
        self._last_logged: tuple[int, int, int] | None = None  # the figures of the last status line
        self._ignored_records = 0
        self._warned_peers: set[str] = set()  # peers whose implausible records were logged once already

        self._wake, self._stopping = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{type(self).__name__}({prefix})", daemon=daemon)
        if start:
            # like hivemind's tracker, know the swarm's progress once constructed (here with a deadline)
            try:
                self._fetch(deadline=time.monotonic() + self.config.request_timeout)
                self._fetch_pending = False
            except (DeadlineExceededError, PeerUnreachableError) as e:
                logger.debug("no first view of the progress of %s: %r", prefix, e)
            self.start()

    # -- what callers read ------------------------------------------------------------------------

    @property
    def runtime(self) -> PeerRuntime:
        """The peer runtime whose DHT helper this tracker calls (shared with the peer's averagers)."""
        return self._runtime

    @property
    def owner_subkey(self) -> bytes:
        """The ``[owner:<public key>]`` subkey this peer's records go under; the DHT signs every
        record stored under it with this peer's key (other signed records of the peer can use it too)."""
        return self._own_subkey

    @property
    def performance_ema(self) -> SpeedEstimate:
        """This peer's measured speed (samples per second), with the interface of hivemind's
        ``PerformanceEMA`` (see :class:`SpeedEstimate`); it is what the tracker publishes."""
        return self._speed

    @property
    def local_progress(self) -> LocalTrainingProgress:
        return self._local

    @property
    def global_progress(self) -> GlobalTrainingProgress:
        return self._global

    @property
    def swarm_fingerprint(self) -> RunFingerprint | None:
        """The run's fingerprint as of the last fetch (see :func:`~.fingerprint.swarm_fingerprint`)."""
        return self._swarm_fingerprint

    @property
    def foreign_peers(self) -> list[LocalTrainingProgress]:
        """The records, as of the last fetch, of peers whose fingerprint differs from the swarm's;
        they count nowhere in :attr:`global_progress`."""
        return list(self._foreign)

    @property
    def ignored_records(self) -> int:
        """How many records the fetches so far left out as implausible (an epoch far above the one the
        other peers agree on, absurd sample counts; see :mod:`.progress_rules`): each fetch counts
        the ones it ignores. Each offending peer is logged once at WARNING."""
        return self._ignored_records

    def accepts_epoch(self, epoch: int, timeout: float | None = None) -> bool:
        """Whether ``epoch`` (a donor's, for instance) is at most one above the swarm's epoch as this
        peer sees it, which no minority of peers can raise (:func:`.progress_rules.accepts_epoch`).
        If not, the records are read once more (for up to ``timeout`` seconds, default the request
        timeout) before saying no: the view may just be old."""
        if accepts_epoch(epoch, self._global.epoch):
            return True
        with contextlib.suppress(DeadlineExceededError, PeerUnreachableError, ClosedError):
            self.fetch_now(timeout)
        return accepts_epoch(epoch, self._global.epoch)

    @property
    def global_epoch(self) -> int:
        return self._global.epoch

    @property
    def ready_to_update_epoch(self) -> bool:
        """Whether this peer may end its epoch now (see :func:`is_ready_to_update_epoch`)."""
        with self._lock:
            return is_ready_to_update_epoch(self._global, self._local.epoch)

    @property
    def estimated_next_update_time(self) -> float:
        """DHT time at which this peer is expected to end its epoch: now if it may already."""
        with self._lock:
            if is_ready_to_update_epoch(self._global, self._local.epoch):
                return get_dht_time()
            return self._global.eta_next_epoch

    # -- what callers do ----------------------------------------------------------------------------

    def report_local_progress(self, local_epoch: int, samples_accumulated: int, update_global_samples: bool = True):
        """Record this peer's progress and have it published soon; returns without touching the network.
        With ``update_global_samples``, :attr:`global_progress` counts the new samples right away."""
        local_epoch, samples_accumulated = _count(local_epoch, "local_epoch"), _count(samples_accumulated, "samples")
        with self._lock:
            extra_samples = samples_accumulated - self._local.samples_accumulated
            if local_epoch == self._local.epoch and extra_samples > 0:
                self._speed.update(extra_samples)
            else:  # a new epoch or a reset: the time since the last report measured nothing
                self._speed.reset_timer()
            self._set_local(local_epoch, samples_accumulated, update_global_samples)
            self._publish_pending = True
        self._wake.set()

    def update_epoch(self, new_epoch: int | None = None) -> int:
        """Move this peer to ``max(new_epoch, local epoch)`` (default: the next epoch) with no samples
        accumulated; publish and fetch promptly (once any :meth:`pause_updates` block ends).
        Returns the local epoch."""
        with self._lock:
            new_epoch = self._local.epoch + 1 if new_epoch is None else _count(new_epoch, "new_epoch")
            epoch = max(new_epoch, self._local.epoch)
            self._speed.reset_timer()
            self._set_local(epoch, 0, update_global_samples=True)
            self._publish_pending = self._fetch_pending = True
        self._wake.set()
        return epoch

    def fetch_now(self, timeout: float | None = None) -> GlobalTrainingProgress:
        """Read every peer's record from the DHT now and return the refreshed :attr:`global_progress`
        (also inside :meth:`pause_updates`: this is an explicit request).

        :raises DeadlineExceededError: the DHT did not answer within ``timeout`` seconds (default:
          the tracker's request timeout)
        :raises PeerUnreachableError: the DHT failed (for instance, it was shut down)
        :raises ClosedError: the tracker was shut down
        """
        if self._stopping.is_set():
            raise ClosedError("the progress tracker was shut down")
        timeout = self.config.request_timeout if timeout is None else timeout
        self._fetch(deadline=time.monotonic() + timeout)
        return self._global

    @contextlib.contextmanager
    def pause_updates(self) -> Iterator[None]:
        """Inside the block, the background thread neither publishes nor replaces :attr:`global_progress`
        (a background fetch that completes inside the block is discarded and repeated after it), and
        the time spent does not count against this peer's measured speed. Blocks may nest and come
        from several threads."""
        with self._lock:
            self._paused += 1
            self._speed.hold()
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
                self._speed.release()
            self._wake.set()

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the background thread, withdraw this peer's record (best effort, without waiting
        more than about a second for the DHT) and release the peer runtime. Idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._wake.set()
        try:
            self._stop(timeout)
        finally:
            self._runtime.release()

    def _stop(self, timeout: float | None) -> None:
        give_up = time.monotonic() + (timeout if timeout is not None else math.inf)
        if self._thread.is_alive():
            self._thread.join(max(0.0, give_up - time.monotonic()) if timeout is not None else None)
        if self._thread.ident is None:  # never started: nothing was published
            return
        # A withdrawal needs a later expiration than the last record to replace it in the DHT.
        wait = max(0.0, min(_REMOVAL_WAIT_SECONDS, give_up - time.monotonic()))
        try:
            withdrawal = self._runtime.dht_calls.store(
                self.training_progress_key,
                None,
                get_dht_time() + self.config.metadata_expiration,
                subkey=self._own_subkey,
                timeout=wait,
            )
            self._runtime.run(withdrawal, timeout=wait + _POLL_SECONDS)
        except HivemindExtError as e:  # the DHT may be gone already; the record then simply expires
            logger.debug("could not withdraw the progress record of %s: %r", self.prefix, e)

    # -- the background thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                publish, fetch, wait = self._due(get_dht_time())
                if not (publish or fetch):
                    self._wake.wait(wait)
                    self._wake.clear()
                    continue
                deadline = time.monotonic() + self.config.request_timeout
                store_future = self._start_publish(deadline) if publish else None
                if fetch:
                    with contextlib.suppress(DeadlineExceededError, PeerUnreachableError, ClosedError):
                        self._fetch(deadline=deadline, background=True)
                if store_future is not None:
                    self._finish_publish(store_future, deadline)
        except Exception:  # a bug: say so, and let is_alive() tell the owner
            logger.exception("the progress tracker of %s failed", self.prefix)
        finally:
            logger.log(self.config.status_loglevel, "no longer tracking progress of %s", self.prefix)

    def _due(self, now: float) -> tuple[bool, bool, float]:
        """Whether to publish and to fetch now; if neither, how long to sleep before checking again."""
        with self._lock:
            if self._paused:
                return False, False, self.config.max_refresh_period
            keepalive_at = self._last_publish_time + self.config.metadata_expiration / 2
            publish_at = keepalive_at
            if self._publish_pending:
                publish_at = min(keepalive_at, self._last_publish_time + self.config.min_refresh_period)
            fetch_at = now if self._fetch_pending else self._global.next_fetch_time
            publish, fetch = now >= publish_at, now >= fetch_at
            return publish, fetch, max(0.0, min(publish_at, fetch_at) - now)

    def _start_publish(self, deadline: float) -> concurrent.futures.Future[bool] | None:
        """Starts storing this peer's record on the runtime's loop; finish with :meth:`_finish_publish`."""
        with self._lock:
            local = self._local
            self._publish_pending = False
            self._last_publish_time = get_dht_time()
        try:
            store = self._runtime.dht_calls.store(
                self.training_progress_key,
                progress_value(local),
                self._last_publish_time + self.config.metadata_expiration,
                subkey=self._own_subkey,
                timeout=max(0.0, deadline - time.monotonic()),
            )
            return self._runtime.submit(store)
        except ClosedError as e:
            logger.debug("could not publish the progress of %s: %r", self.prefix, e)
            return None

    def _finish_publish(self, future: Any, deadline: float) -> None:
        try:
            if not self._wait(future, deadline):
                logger.debug("the DHT refused the progress record of %s", self.prefix)
        except (DeadlineExceededError, PeerUnreachableError, ClosedError) as e:
            logger.debug("publishing the progress of %s failed: %r", self.prefix, e)

    def _fetch(self, *, deadline: float, background: bool = False) -> None:
        """Read the records and replace the cached global progress (unless paused, when the thread
        keeps the fetch pending and repeats it after the pause)."""
        if background:
            with self._lock:
                self._fetch_pending = False
        try:
            read = self._runtime.dht_calls.get(
                self.training_progress_key, latest=True, timeout=max(0.0, deadline - time.monotonic())
            )
            found = self._wait(self._runtime.submit(read), deadline)
        except BaseException:
            self._after_failed_fetch(background)
            raise
        entries: list[tuple[Any, Any, Any]] = []
        if found is not None and isinstance(found.value, dict):
            entries = [(subkey, item.value, item.expiration_time) for subkey, item in found.value.items()]
        now = get_dht_time()
        records = parse_progress_records(entries, now=now, exclude_subkey=self._own_subkey)
        with self._lock:
            if background and self._paused:
                self._fetch_pending = True
                return
            self._swarm_fingerprint, self._records, self._foreign = split_by_fingerprint(records, self._local)
            self._global = self._aggregate(now)
            progress = self._global
            seen = (progress.epoch, progress.samples_accumulated, progress.num_peers)
            changed, self._last_logged = seen != self._last_logged, seen
            self._ignored_records += len(progress.ignored)
            first_offences = [
                (peer, why)
                for peer, why in dict(progress.ignored).items()
                if peer not in self._warned_peers and len(self._warned_peers) < _MAX_WARNED_PEERS
            ]
            self._warned_peers.update(peer for peer, _ in first_offences)
        for peer, why in first_offences:
            logger.warning("%s: ignoring the progress record of peer %s: %s", self.prefix, peer, why)
        if not changed:  # a fetch every half second would repeat the same line
            return
        logger.log(
            self.config.status_loglevel,
            "%s epoch %d: %d/%d samples from %d peers, ETA %.2f s",
            self.prefix,
            progress.epoch,
            progress.samples_accumulated,
            progress.target_batch_size,
            progress.num_peers,
            max(0.0, progress.eta_next_epoch - now),
        )

    def _after_failed_fetch(self, background: bool) -> None:
        """After a failed background fetch, try again after the usual refresh period, not in a tight loop."""
        if background:
            with self._lock:
                retry_at = get_dht_time() + self.config.default_refresh_period
                self._global = dataclasses.replace(self._global, next_fetch_time=retry_at)

    def _wait(self, future: concurrent.futures.Future[Any], deadline: float) -> Any:
        """The result of a DHT call running on the runtime's loop (which bounds it by the same
        deadline), checking every ``_POLL_SECONDS`` whether the tracker shuts down; the call is
        cancelled when abandoned.

        :raises DeadlineExceededError: no answer by ``deadline`` (monotonic)
        :raises PeerUnreachableError: the DHT failed the call, or is not running
        :raises ClosedError: the tracker is shutting down
        """
        while True:
            try:
                return future.result(timeout=max(0.0, min(_POLL_SECONDS, deadline - time.monotonic())))
            except (DeadlineExceededError, PeerUnreachableError):  # before TimeoutError: one is a subclass
                raise
            except ClosedError as e:  # the DHT refused the request: its process is gone
                raise PeerUnreachableError(f"the DHT did not take the request: {e}") from e
            except concurrent.futures.CancelledError as e:  # the runtime's loop stopped under the call
                raise ClosedError("the peer runtime stopped during a DHT call") from e
            except concurrent.futures.TimeoutError:  # not answered yet (TimeoutError itself from 3.11 on)
                pass
            if self._stopping.is_set():
                future.cancel()  # cancels the call on the loop; it never waits on the DHT
                raise ClosedError("the progress tracker is shutting down")
            if time.monotonic() >= deadline + _POLL_SECONDS:  # the helper should have given up by now
                future.cancel()
                raise DeadlineExceededError(f"the DHT did not answer {self.training_progress_key!r} in time")

    # -- state updates (callers hold self._lock) ---------------------------------------------------

    def _set_local(self, epoch: int, samples: int, update_global_samples: bool) -> None:
        now = get_dht_time()
        self._local = LocalTrainingProgress(
            self._local.peer_id,
            epoch,
            samples,
            self._speed.samples_per_second,
            now,
            self.client_mode,
            self.fingerprint,
            self.auxiliary,
        )
        if update_global_samples:
            fresh = self._aggregate(now)
            # Only a fetch moves the next fetch later: reports come every step and would postpone it forever.
            next_fetch_time = min(self._global.next_fetch_time, fresh.next_fetch_time)
            self._global = dataclasses.replace(fresh, next_fetch_time=next_fetch_time)

    def _aggregate(self, now: float) -> GlobalTrainingProgress:
        config = self.config
        return aggregate_progress(
            self._records,
            self._local,
            target_batch_size=config.target_batch_size,
            now=now,
            min_refresh_period=config.min_refresh_period,
            max_refresh_period=config.max_refresh_period,
            default_refresh_period=config.default_refresh_period,
            expected_drift_peers=config.expected_drift_peers,
            expected_drift_rate=config.expected_drift_rate,
        )

    def _check_signing_key(self, validator: RSASignatureValidator) -> None:
        """hivemind's DHT keeps the first RSASignatureValidator it is given and drops later ones (their
        ``merge_with``), signing with the first one's key only. A record under a subkey with another
        key would then go unsigned and every node would refuse it, silently: fail loudly instead."""
        check = partial(_signs_with_key, owner_subkey=validator.local_public_key, checker=validator)
        timeout = self.config.request_timeout
        try:
            signs = self._runtime.run(
                self._runtime.dht_calls.run_coroutine(check, timeout=timeout), timeout=timeout + _POLL_SECONDS
            )
        except DeadlineExceededError as e:
            raise DeadlineExceededError("the DHT did not answer while checking its signing key") from e
        if not signs:
            raise ConfigurationError(
                "this DHT already signs records with another RSA key (a previous RSASignatureValidator); "
                "pass that key as private_key, or leave both at the process-wide default"
            )


async def _signs_with_key(_dht: DHT, node: Any, *, owner_subkey: bytes, checker: RSASignatureValidator) -> bool:
    """Runs inside the DHT process: whether the node's validators sign a record under ``owner_subkey``."""
    return signs_with_key(node.protocol.record_validator, owner_subkey, checker=checker)


def _count(value: Any, name: str) -> int:
    """An epoch or sample count from a caller: any integer type (numpy's too), never a bool or a float."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got a bool")
    value = operator.index(value)
    if not 0 <= value <= MAX_COUNT:
        raise ValueError(f"{name} must be in [0, 2**62], got {value}")
    return value


def _is_real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


__all__ = [
    "GlobalTrainingProgress",
    "LocalTrainingProgress",
    "ProgressRecordValidator",
    "ProgressTracker",
    "ProgressTrackerConfig",
    "SpeedEstimate",
    "aggregate_progress",
    "default_signing_key",
    "is_ready_to_update_epoch",
    "parse_progress_records",
    "parse_progress_value",
    "split_by_fingerprint",
]
