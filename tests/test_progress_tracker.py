"""ProgressTracker: the pure aggregation and parsing rules, then real trackers on a local DHT swarm.

One swarm of four DHTs serves the multi-peer tests: peers 0-2 are honest (peer 2 in client mode),
peer 3 never runs a tracker and plays the forger. Each test uses its own prefix. A DHT signs with
the key of the first RSASignatureValidator it is given, so every tracker on peer i uses KEYS[i].
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import math
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.performance_ema import PerformanceEMA
from hypothesis import given
from hypothesis import strategies as st
from swarm import local_swarm, new_peer, wait_for

from hivemind_ext.errors import ClosedError, ConfigurationError, DeadlineExceededError, PeerUnreachableError
from hivemind_ext.optim.progress import (
    MAX_COUNT,
    GlobalTrainingProgress,
    LocalTrainingProgress,
    ProgressRecordValidator,
    ProgressTracker,
    ProgressTrackerConfig,
    SpeedEstimate,
    aggregate_progress,
    is_ready_to_update_epoch,
    parse_progress_records,
    progress_value,
)

NOW = 1_000_000.0
PERIODS = dict(min_refresh_period=0.5, max_refresh_period=10.0, default_refresh_period=3.0)
DRIFT = dict(expected_drift_peers=3.0, expected_drift_rate=0.2)
FAST = dict(min_refresh_period=0.05, max_refresh_period=0.5, default_refresh_period=0.2, metadata_expiration=30.0)
SWARM_SIZE, CLIENT, FORGER = 4, 2, 3
KEYS = [RSAPrivateKey() for _ in range(SWARM_SIZE)]


def peer(name: str, epoch: int = 0, samples: int = 0, speed: float = 0.0, at: float = NOW, client: bool = False):
    return LocalTrainingProgress(name, epoch, samples, speed, at, client)


def aggregate(records: Sequence[LocalTrainingProgress], local: LocalTrainingProgress, **overrides: Any):
    values: dict[str, Any] = dict(target_batch_size=100, now=NOW, **PERIODS, **DRIFT)
    values.update(overrides)
    return aggregate_progress(records, local, **values)


# ---------------------------------------------------------------------------------------------
# aggregate_progress


def test_global_epoch_is_the_highest_and_samples_count_only_at_it() -> None:
    records = [peer("B", 3, 10), peer("C", 3, 20, client=True), peer("D", 2, 99)]
    progress = aggregate(records, peer("A", 3, 5))
    assert progress.epoch == 3
    assert progress.samples_accumulated == 35  # D, still at epoch 2, adds nothing ...
    assert progress.num_peers == 4  # ... but is a live peer
    assert progress.num_clients == 1
    assert progress.target_batch_size == 100


def test_the_slowest_trainer_speed_leaves_auxiliary_peers_out() -> None:
    # what a round on each peer's own clock waits for (rounds.straggler_patience); an auxiliary peer
    # trains nothing, so its speed (whatever its record says) is never the straggler's
    aux = LocalTrainingProgress("X", 0, 0, 0.5, NOW, False, auxiliary=True)
    progress = aggregate([peer("B", speed=40.0), peer("C", speed=25.0), aux], peer("A", speed=60.0))
    assert progress.slowest_trainer_speed == 25.0
    assert aggregate([peer("B", speed=40.0)], peer("A")).slowest_trainer_speed == 0.0  # A measured none yet


def test_own_record_is_replaced_by_the_local_progress() -> None:
    stale_own = peer("A", 0, 90)
    progress = aggregate([stale_own, peer("B", 0, 10)], peer("A", 0, 3))
    assert progress.samples_accumulated == 13
    assert progress.num_peers == 2


def test_a_peer_behind_the_swarm_counts_no_samples_and_is_ready() -> None:
    progress = aggregate([peer("B", 5, 10)], peer("A", 4, 60))
    assert (progress.epoch, progress.samples_accumulated) == (5, 10)
    assert is_ready_to_update_epoch(progress, local_epoch=4)


def test_eta_is_monotone_in_speed() -> None:
    etas = [aggregate([peer("B", 0, 10, speed)], peer("A", 0, 10, speed)).eta_next_epoch for speed in (1, 2, 5, 50)]
    assert all(later < earlier for earlier, later in itertools.pairwise(etas))
    assert etas[0] == pytest.approx(NOW + 80 / 2)
    assert aggregate([peer("B", 0, 10)], peer("A", 0, 10)).eta_next_epoch == math.inf  # nobody is making progress


def test_eta_extrapolates_each_peer_since_its_report_and_counts_lagging_peers_speed() -> None:
    fresh = aggregate([peer("B", 1, 10, 2.0)], peer("A", 1, 10, 2.0))
    assert fresh.eta_next_epoch == pytest.approx(NOW + 80 / 4)
    reported_earlier = aggregate([peer("B", 1, 10, 2.0, at=NOW - 10)], peer("A", 1, 10, 2.0))
    assert reported_earlier.eta_next_epoch == pytest.approx(NOW + (80 - 20) / 4)  # B made ~20 more since
    with_lagging_peer = aggregate([peer("B", 1, 10, 2.0), peer("C", 0, 50, 4.0)], peer("A", 1, 10, 2.0))
    assert with_lagging_peer.samples_accumulated == 20  # C's 50 belong to epoch 0 ...
    assert with_lagging_peer.eta_next_epoch == pytest.approx(NOW + 80 / 8)  # ... but its speed will soon count
    assert aggregate([peer("B", 0, 60)], peer("A", 0, 40)).eta_next_epoch == NOW  # already there


@given(
    samples=st.lists(st.integers(0, 10**6), min_size=0, max_size=8),
    speeds=st.lists(st.floats(0, 1e6), min_size=8, max_size=8),
    local_samples=st.integers(0, 10**6),
    target=st.integers(1, 10**6),
)
def test_next_fetch_time_stays_within_the_refresh_bounds(
    samples: list[int], speeds: list[float], local_samples: int, target: int
) -> None:
    records = [peer(f"P{i}", 0, count, speed) for i, (count, speed) in enumerate(zip(samples, speeds, strict=False))]
    progress = aggregate(records, peer("A", 0, local_samples, speeds[0]), target_batch_size=target)
    assert NOW + PERIODS["min_refresh_period"] <= progress.next_fetch_time <= NOW + PERIODS["max_refresh_period"]
    assert progress.eta_next_epoch >= NOW
    # a claim may be capped (at the target, or next to the others' claims), never inflated
    assert local_samples <= progress.samples_accumulated <= sum(samples) + local_samples


def test_fetches_come_sooner_as_the_epoch_end_approaches_and_alone_at_the_default_period() -> None:
    waits = [
        aggregate([peer("B", 0, samples, 1.0)], peer("A", 0, 0, 1.0), target_batch_size=100).next_fetch_time - NOW
        for samples in (0, 60, 90, 99)
    ]
    assert waits == sorted(waits, reverse=True) and waits[0] > waits[-1]
    assert waits[0] == PERIODS["max_refresh_period"] and waits[-1] == PERIODS["min_refresh_period"]
    # 2 peers, up to 2 + 3 expected: the fetch comes at 2/5 of the 90 s ETA, capped by max_refresh_period
    assert waits[1] == pytest.approx(min(40 / 2 * 2 / 5, 10.0))
    alone = aggregate([], peer("A", 0, 99, 1.0))
    assert alone.next_fetch_time - NOW == PERIODS["default_refresh_period"]
    assert alone.num_peers == 1 and alone.samples_accumulated == 99


def test_ready_needs_the_samples_or_a_newer_epoch_not_a_passed_eta() -> None:
    progress = GlobalTrainingProgress(
        epoch=2,
        samples_accumulated=99,
        target_batch_size=100,
        num_peers=3,
        num_clients=0,
        eta_next_epoch=NOW - 100,
        next_fetch_time=NOW,
    )
    assert not is_ready_to_update_epoch(progress, local_epoch=2)  # the ETA is long past, but only 99 samples
    assert is_ready_to_update_epoch(dataclasses.replace(progress, samples_accumulated=100), local_epoch=2)
    assert is_ready_to_update_epoch(progress, local_epoch=1)


# ---------------------------------------------------------------------------------------------
# records on the wire

OWNER = RSASignatureValidator(KEYS[0]).local_public_key
GOOD = ["QmPeer", 1, 5, 2.5, NOW, False]


def with_field(index: int, value: Any) -> list[Any]:
    return [*GOOD[:index], value, *GOOD[index + 1 :]]


MALFORMED_VALUES = [
    with_field(0, b"QmPeer"),  # peer id of the wrong type
    with_field(0, "not/base58!"),
    with_field(1, -1),  # negative epoch
    with_field(1, MAX_COUNT + 1),  # absurd epoch
    with_field(1, 1.0),  # float epoch
    with_field(1, True),  # a bool is not an epoch
    with_field(2, -5),  # negative samples
    with_field(2, 2**63),
    with_field(3, math.nan),
    with_field(3, math.inf),
    with_field(3, -1.0),
    with_field(3, "fast"),
    with_field(4, math.nan),
    with_field(5, 1),  # client_mode must be a bool
    GOOD[:5],  # wrong field count
    [*GOOD, 0],
    [*GOOD, False],  # the auxiliary flag is present only as True
    {"epoch": 1},
    "garbage",
    42,
]


def test_records_are_parsed_strictly_and_bad_ones_skipped() -> None:
    other_owner = RSASignatureValidator(KEYS[1]).local_public_key
    entries = [(OWNER, value, NOW + 10) for value in MALFORMED_VALUES]
    entries += [
        (b"unsigned", GOOD, NOW + 10),  # not an owner subkey: anyone could have written it
        ("[owner:text]", GOOD, NOW + 10),
        (OWNER, GOOD, NOW - 1),  # expired
        (OWNER, None, NOW + 10),  # withdrawn
        (other_owner, GOOD, NOW + 10),  # this peer's own record
        (OWNER, GOOD, NOW + 10),
    ]
    records = parse_progress_records(entries, now=NOW, exclude_subkey=other_owner)
    assert records == [LocalTrainingProgress("QmPeer", 1, 5, 2.5, NOW, False)]
    assert parse_progress_records([(OWNER, progress_value(records[0]), NOW + 1)], now=NOW) == records


def test_auxiliary_peers_are_marked_in_their_record_and_not_counted_as_trainers() -> None:
    """Issue 11 item 4: trainers must count only each other, or a lone trainer averages with an
    auxiliary peer (nothing to average) instead of stepping alone."""
    aux = LocalTrainingProgress("QmAux", 1, 0, 0.0, NOW, False, auxiliary=True)
    assert progress_value(aux) == ["QmAux", 1, 0, 0.0, NOW, False, None, True]  # no fingerprint, then the mark
    assert parse_progress_records([(OWNER, progress_value(aux), NOW + 1)], now=NOW) == [aux]
    progress = aggregate([aux, peer("B", 1, 10)], peer("A", 1, 5))
    assert (progress.num_peers, progress.num_auxiliary, progress.num_trainers) == (3, 1, 2)
    alone_with_aux = aggregate([aux], peer("A", 1, 5))
    assert (alone_with_aux.num_peers, alone_with_aux.num_trainers) == (2, 1)


def test_record_validator_refuses_unprotected_and_malformed_entries_under_its_key_only() -> None:
    key = "run_progress"
    validator = ProgressRecordValidator(key)

    def record(subkey: Any, value: Any, key_name: str = key) -> DHTRecord:
        return DHTRecord(
            DHTID.generate(source=key_name).to_bytes(),
            MSGPackSerializer.dumps(subkey),
            MSGPackSerializer.dumps(value),
            NOW,
        )

    assert validator.validate(record(OWNER, GOOD))
    assert validator.validate(record(OWNER, None))
    assert not validator.validate(record(b"unsigned", GOOD))
    assert not validator.validate(record(None, GOOD))  # a regular value would replace the whole dictionary
    assert not validator.validate(dataclasses.replace(record(OWNER, GOOD), value=b"\xc1"))  # not msgpack
    for value in MALFORMED_VALUES:
        assert not validator.validate(record(OWNER, value)), value
    assert validator.validate(record(None, "anything", key_name="another_key"))


@pytest.mark.parametrize(
    "bad",
    [
        dict(min_refresh_period=2.0, default_refresh_period=1.0),
        dict(max_refresh_period=100.0),  # not below metadata_expiration
        dict(min_refresh_period=0.0, default_refresh_period=0.0),
        dict(performance_ema_alpha=0.0),
        dict(expected_drift_rate=-1),
        dict(metadata_expiration=math.inf),
        dict(target_batch_size=0),
        dict(prefix=""),
    ],
)
def test_config_is_checked(bad: dict[str, Any]) -> None:
    ProgressTrackerConfig(prefix="run", target_batch_size=100)
    with pytest.raises(ConfigurationError):
        ProgressTrackerConfig(**{"prefix": "run", "target_batch_size": 100, **bad})


@pytest.mark.parametrize(
    ("given", "used"),
    [
        # hivemind's tests/test_optimizer.py: max below the 3 s default period (default follows it)
        (dict(max_refresh_period=1.0), (0.5, 1.0, 1.0, 60.0)),
        (dict(min_refresh_period=0.1, default_refresh_period=0.2, max_refresh_period=0.5), (0.1, 0.2, 0.5, 60.0)),
        (dict(min_refresh_period=2.0, default_refresh_period=1.0), (2.0, 2.0, 10.0, 60.0)),
        (dict(min_refresh_period=2.0, max_refresh_period=1.0), (1.0, 1.0, 1.0, 60.0)),  # hivemind's clip: max
        (dict(max_refresh_period=100.0), (0.5, 3.0, 30.0, 60.0)),  # below the records' lifetime
        (dict(metadata_expiration=4.0), (0.5, 2.0, 2.0, 4.0)),
    ],
)
def test_periods_that_hivemind_accepts_are_clamped_not_refused(given: dict[str, float], used: tuple) -> None:
    config = ProgressTrackerConfig.resolve(prefix="run", target_batch_size=100, **given)
    periods = ("min_refresh_period", "default_refresh_period", "max_refresh_period", "metadata_expiration")
    assert tuple(getattr(config, name) for name in periods) == used


@pytest.mark.parametrize("bad", [dict(min_refresh_period=0.0), dict(max_refresh_period=-1.0), dict(prefix="")])
def test_meaningless_periods_are_still_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        ProgressTrackerConfig.resolve(**{"prefix": "run", "target_batch_size": 100, **bad})


def test_speed_estimate_has_hivemind_performance_ema_interface_and_numbers() -> None:
    ours, theirs = SpeedEstimate(alpha=0.3), PerformanceEMA(alpha=0.3)
    assert ours.alpha == theirs.alpha and ours.num_updates == theirs.num_updates == 0
    assert ours.samples_per_second < 1e-9 and theirs.samples_per_second < 1e-9  # nothing measured yet
    for task_size, interval in [(10, 1.0), (5, 2.0), (40, 0.5), (1, 3.0)]:
        assert ours.update(task_size, interval) == pytest.approx(theirs.update(task_size, interval), rel=1e-9)
        assert ours.samples_per_second == pytest.approx(theirs.samples_per_second, rel=1e-9)
    assert ours.num_updates == theirs.num_updates == 4
    assert "num_updates=4" in repr(ours)
    with pytest.raises(ValueError):
        ours.update(0)

    timed = SpeedEstimate(alpha=1.0)
    timed.reset_timer()
    time.sleep(0.1)
    assert 40 < timed.update(10) <= 100  # 10 samples in 0.1 s (or more time, if the host is busy)
    with timed.pause():
        assert timed.paused
        time.sleep(0.3)  # paused: does not count
    assert not timed.paused
    time.sleep(0.1)
    assert timed.update(10) > 40
    with timed.update_threadsafe(10):
        time.sleep(0.1)
    assert 40 < timed.samples_per_second <= 100


# ---------------------------------------------------------------------------------------------
# real trackers on a local swarm


@pytest.fixture(scope="module")
def swarm() -> Iterator[list[hivemind.DHT]]:
    with local_swarm(SWARM_SIZE, client_indices=[CLIENT]) as dhts:
        yield dhts


@pytest.fixture
def trackers(swarm: list[hivemind.DHT]) -> Iterator[Callable[..., ProgressTracker]]:
    """A factory of started trackers on the swarm's peers; all of them are shut down after the test."""
    made: list[ProgressTracker] = []

    def make(index: int, prefix: str, target: int = 100, **overrides: Any) -> ProgressTracker:
        options = dict(FAST, private_key=KEYS[index], start=True)
        options.update(overrides)
        made.append(ProgressTracker(swarm[index], prefix, target, **options))
        return made[-1]

    yield make
    for tracker in made:
        tracker.shutdown()


def new_prefix() -> str:
    return f"test_{secrets.token_hex(4)}"


def seen(tracker: ProgressTracker) -> tuple[int, int, int]:
    progress = tracker.global_progress
    return progress.epoch, progress.samples_accumulated, progress.num_peers


@pytest.mark.timeout(60)
def test_three_peers_agree_on_the_sum_become_ready_and_move_to_the_next_epoch(trackers) -> None:
    prefix = new_prefix()
    peers = [trackers(index, prefix) for index in range(3)]
    assert [tracker.client_mode for tracker in peers] == [False, False, True]  # the DHT's mode by default
    for tracker in peers:
        tracker.report_local_progress(0, 10)
    time.sleep(0.1)
    for tracker in peers:
        tracker.report_local_progress(0, 30)  # 20 samples in 0.1 s: every peer now has a measured speed
    for tracker in peers:
        wait_for(
            lambda tracker=tracker: seen(tracker) == (0, 90, 3), 10.0, message="every peer sees 90 samples from 3 peers"
        )
        assert tracker.global_progress.num_clients == 1
    for tracker in peers:  # the extrapolation of everyone's speed soon passes the target of 100 ...
        wait_for(lambda tracker=tracker: tracker.global_progress.eta_next_epoch <= get_dht_time(), 10.0, message="ETA")
    for tracker in peers:
        assert not tracker.ready_to_update_epoch  # ... yet only 90 samples were reported: not ready
        assert tracker.estimated_next_update_time == tracker.global_progress.eta_next_epoch

    peers[0].report_local_progress(0, 45)
    assert peers[0].global_progress.samples_accumulated == 105  # counted locally at once
    for tracker in peers:
        wait_for(
            lambda tracker=tracker: tracker.ready_to_update_epoch, 10.0, message="every peer ready with 105 samples"
        )
        assert tracker.estimated_next_update_time <= get_dht_time()

    assert peers[0].update_epoch(1) == 1
    assert peers[0].local_progress.epoch == 1 and peers[0].local_progress.samples_accumulated == 0
    assert seen(peers[0])[:2] == (1, 0) and not peers[0].ready_to_update_epoch
    # One peer of three is a minority: the others stay at epoch 0, where its samples no longer count.
    for tracker in peers[1:]:
        wait_for(lambda tracker=tracker: seen(tracker) == (0, 60, 3), 10.0, message="peer 0's record of epoch 1")
        assert not tracker.ready_to_update_epoch
    peers[1].update_epoch(1)  # a second one: for peer 2, most others have moved on
    wait_for(lambda: peers[2].global_progress.epoch == 1, 10.0, message="peer 2 sees epoch 1")
    assert peers[2].global_progress.samples_accumulated == 0  # its own 30 samples belong to epoch 0
    assert peers[2].ready_to_update_epoch  # the swarm moved on: it is behind
    assert peers[0].update_epoch(0) == 1  # never back
    assert peers[0].update_epoch() == 2  # hivemind's default: the next epoch


class ForgingValidator(RecordValidatorBase):
    """What a dishonest node runs: it accepts any record, and signs a record under an owner subkey
    with the owner's key when it has it, else with its own (a forgery)."""

    def __init__(self, keys: Sequence[RSAPrivateKey], forging_key: RSAPrivateKey):
        self.keys = {RSASignatureValidator(key).local_public_key: key for key in keys}
        self.forging_key = forging_key

    def validate(self, record: DHTRecord) -> bool:
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        if b"[owner:ssh-rsa" not in record.subkey:
            return record.value  # leave it unsigned
        key = next((key for owner, key in self.keys.items() if owner in record.subkey), self.forging_key)
        signature = key.sign(MSGPackSerializer.dumps(dataclasses.astuple(record)))
        return record.value + b"[signature:" + signature + b"]"


@pytest.mark.timeout(60)
def test_forged_unsigned_and_malformed_records_are_not_counted(swarm, trackers) -> None:
    prefix = new_prefix()
    honest = [trackers(0, prefix), trackers(1, prefix)]
    honest[0].report_local_progress(0, 11)
    honest[1].report_local_progress(0, 13)
    for tracker in honest:
        wait_for(lambda tracker=tracker: seen(tracker) == (0, 24, 2), 10.0, message="the honest peers see each other")

    forger = swarm[FORGER]
    forger_id = forger.peer_id.to_base58()
    malformed = [
        [forger_id, 0, -5, 1.0, get_dht_time(), False],
        [forger_id, 2**62 + 1, 5, 1.0, get_dht_time(), False],
        [forger_id, 0, 5, math.nan, get_dht_time(), False],
        [forger_id, 0, 5],
        {"samples_accumulated": 10**9},
    ]
    forger_keys = [RSAPrivateKey() for _ in range(len(malformed) + 1)]
    forger.add_validators([ForgingValidator(forger_keys, forging_key=RSAPrivateKey())])

    def store(subkey: bytes, value: Any) -> None:
        forger.store(f"{prefix}_progress", value, get_dht_time() + 30, subkey=subkey)

    # First a well-formed record that the forger may publish under its own key: proof that its stores reach
    # the swarm. (Later, the nodes that validate drop every answer from the forger's node, which holds the
    # forgeries; and after the last store below, the forger stops sending to them: hivemind's validator
    # raises on a malformed owner key, which fails the store call.)
    store(RSASignatureValidator(forger_keys[-1]).local_public_key, [forger_id, 0, 7, 0.0, get_dht_time(), False])
    for tracker in honest:
        wait_for(
            lambda tracker=tracker: seen(tracker) == (0, 31, 3), 10.0, message="the forger's honest record arrives"
        )

    for key, value in zip(forger_keys[:-1], malformed, strict=True):
        store(RSASignatureValidator(key).local_public_key, value)  # validly signed, malformed content
    victim = RSASignatureValidator(KEYS[0]).local_public_key
    huge = [honest[0].local_progress.peer_id, 0, 10**9, 1e6, get_dht_time(), False]
    store(victim, huge)  # signed, but with the forger's key
    store(b"sybil", [forger_id, 0, 10**9, 1e6, get_dht_time(), False])  # unsigned, no owner at all
    store(b"[owner:forged]", huge)  # unsigned, under a subkey that merely looks like an owner's

    watch_until = time.monotonic() + 1.5
    while time.monotonic() < watch_until:
        for tracker in honest:
            assert seen(tracker) == (0, 31, 3)  # 11 + 13 + 7, at epoch 0, from 3 peers: nothing forged
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_hivemind_tracker_settings_are_accepted_with_one_warning(
    swarm: list[hivemind.DHT], caplog: pytest.LogCaptureFixture
) -> None:
    made = []
    with caplog.at_level(logging.WARNING, logger="hivemind_ext.optim.progress"):
        for _ in range(2):  # what hivemind's tests/test_optimizer.py passes through tracker_opts
            made.append(
                ProgressTracker(swarm[0], new_prefix(), 32, private_key=KEYS[0], max_refresh_period=1.0, start=True)
            )
    try:
        for tracker in made:
            assert tracker.config.max_refresh_period == 1.0 and tracker.config.default_refresh_period == 1.0
            assert tracker.global_progress.next_fetch_time <= get_dht_time() + 1.0
        assert len([r for r in caplog.records if "refresh periods" in r.getMessage()]) <= 1
    finally:
        for tracker in made:
            tracker.shutdown()


@pytest.mark.timeout(60)
def test_pause_updates_holds_publishing_and_the_global_view(trackers) -> None:
    prefix = new_prefix()
    first, second = trackers(0, prefix), trackers(1, prefix)
    first.report_local_progress(0, 5)
    second.report_local_progress(0, 5)
    for tracker in (first, second):
        wait_for(lambda tracker=tracker: seen(tracker) == (0, 10, 2), 10.0, message="both see 10 samples")

    with first.pause_updates():
        first.report_local_progress(0, 50)
        assert first.global_progress.samples_accumulated == 55  # its own samples count at once
        second.report_local_progress(0, 20)
        time.sleep(1.5)  # three max_refresh_periods
        assert seen(first) == (0, 55, 2)  # did not take in the second's 20
        assert seen(second) == (0, 25, 2)  # never heard of the first's 50
    for tracker in (first, second):
        wait_for(
            lambda tracker=tracker: seen(tracker) == (0, 70, 2), 10.0, message="both see 70 samples after the pause"
        )


@pytest.mark.timeout(60)
def test_report_without_updating_global_samples_and_speed_estimate(trackers) -> None:
    tracker = trackers(0, new_prefix(), start=False)
    tracker.report_local_progress(0, 0)  # no new samples: only restarts the clock
    assert tracker.local_progress.samples_per_second == 0
    time.sleep(0.2)
    tracker.report_local_progress(0, 10)
    assert tracker.global_progress.samples_accumulated == 10
    assert 5 < tracker.local_progress.samples_per_second <= 50  # 10 samples in 0.2 s (or more, if the host is busy)

    tracker.report_local_progress(1, 0)  # a new epoch restarts the clock
    with tracker.pause_updates():
        time.sleep(1.0)  # e.g. averaging: not time spent computing samples
    time.sleep(0.1)
    tracker.report_local_progress(1, 10)
    # the moving average of 0.02 and 0.01 s/sample gives ~70 samples/s; had the pause counted, 0.11 s/sample: ~15
    assert tracker.local_progress.samples_per_second > 30

    # hivemind's name for the estimate the tracker publishes
    assert tracker.performance_ema.samples_per_second == tracker.local_progress.samples_per_second
    assert tracker.performance_ema.alpha == 0.1 and tracker.performance_ema.num_updates == 2
    with tracker.pause_updates():
        assert tracker.performance_ema.paused
    assert not tracker.performance_ema.paused

    tracker.report_local_progress(1, 30, update_global_samples=False)
    assert tracker.global_progress.samples_accumulated == 10
    assert tracker.local_progress.samples_accumulated == 30
    with pytest.raises(ValueError):
        tracker.report_local_progress(0, -1)
    assert not tracker.is_alive()


@pytest.mark.timeout(60)
def test_shutdown_is_prompt_idempotent_and_withdraws_the_record(trackers) -> None:
    prefix = new_prefix()
    peers = [trackers(index, prefix) for index in range(3)]
    for tracker in peers:
        tracker.report_local_progress(0, 1)
    wait_for(lambda: seen(peers[1])[2] == 3, 10.0, message="3 peers")
    started = time.monotonic()
    peers[0].shutdown()
    assert time.monotonic() - started < 3.0
    assert not peers[0].is_alive()
    started = time.monotonic()
    peers[0].shutdown()
    assert time.monotonic() - started < 0.1
    with pytest.raises(ClosedError):
        peers[0].fetch_now()
    # gone long before its record would have expired (metadata_expiration=30)
    wait_for(lambda: seen(peers[1])[2] == 2, timeout=5.0, message="the others stop counting it")
    assert peers[1].fetch_now(timeout=5.0).num_peers == 2
    rejoined = trackers(0, prefix)  # a new tracker knows the swarm as soon as it is constructed
    assert seen(rejoined) == (0, 2, 3)


def test_a_second_signing_key_on_one_dht_is_refused(swarm, trackers) -> None:
    trackers(0, new_prefix())  # the DHT now signs with KEYS[0]
    with pytest.raises(ConfigurationError, match="another RSA key"):
        ProgressTracker(swarm[0], new_prefix(), 100, private_key=RSAPrivateKey(), start=False)


class StallingDHT:
    """A DHT that accepts reads and writes and never answers them: a hung DHT process, as the tracker
    sees it. Set-up calls go to a real DHT."""

    def __init__(self, dht: hivemind.DHT):
        self.real, self.peer_id, self.client_mode = dht, dht.peer_id, False

    def add_validators(self, validators: Any) -> None:
        self.real.add_validators(validators)

    def run_coroutine(self, coroutine: Any, return_future: bool = False) -> Any:
        return self.real.run_coroutine(coroutine, return_future=return_future)

    def get(self, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        return concurrent.futures.Future()

    def store(self, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        return concurrent.futures.Future()


@pytest.mark.timeout(60)
def test_a_hung_dht_delays_nothing(swarm) -> None:
    tracker = ProgressTracker(StallingDHT(swarm[1]), new_prefix(), 100, private_key=KEYS[1], start=False, **FAST)
    tracker.start()  # start() alone never waits on the DHT
    try:
        tracker.report_local_progress(0, 7)
        assert tracker.global_progress.samples_accumulated == 7
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            tracker.fetch_now(timeout=0.3)
        assert time.monotonic() - started < 2.0
        assert tracker.update_epoch(1) == 1 and tracker.global_progress.epoch == 1
        time.sleep(0.3)  # a window in which the tracker must not die
        assert tracker.is_alive()
    finally:
        started = time.monotonic()
        tracker.shutdown()
        assert time.monotonic() - started < 3.0
    assert not tracker.is_alive()


@pytest.mark.timeout(60)
def test_a_dead_dht_delays_nothing(caplog: pytest.LogCaptureFixture) -> None:
    dht = new_peer()
    tracker = ProgressTracker(dht, new_prefix(), 100, private_key=RSAPrivateKey(), start=True, **FAST)
    tracker.report_local_progress(0, 3)
    dht.shutdown()
    started = time.monotonic()
    tracker.report_local_progress(0, 5)
    assert tracker.update_epoch(2) == 2
    with pytest.raises((PeerUnreachableError, DeadlineExceededError)):
        tracker.fetch_now(timeout=1.0)
    with caplog.at_level(logging.ERROR, logger="hivemind_ext.optim.progress"):
        time.sleep(0.5)  # a window in which the tracker must neither die nor log an error
        assert tracker.is_alive()
        tracker.shutdown()
        tracker.shutdown()
    assert time.monotonic() - started < 3.0
    assert not tracker.is_alive()
    assert not caplog.records  # failures of a dead DHT are expected, not reported as errors
