"""The rules that decide the swarm's epoch and which sample claims count (hivemind_ext.optim.progress_rules),
driven directly: legitimate swarms (a lone peer, a peer one epoch ahead, a late joiner, peers that move
on) and any set of honest records plus hostile ones."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hivemind_ext.optim.progress import LocalTrainingProgress, aggregate_progress, is_ready_to_update_epoch
from hivemind_ext.optim.progress_rules import (
    ABSURD_TARGET_FACTOR,
    SAMPLE_FACTOR,
    accepts_epoch,
    quorum_epoch,
    screen_progress,
    swarm_epoch,
)

NOW = 1_000_000.0
TARGET = 512
SETTINGS = dict(
    min_refresh_period=0.5,
    max_refresh_period=10.0,
    default_refresh_period=3.0,
    expected_drift_peers=3.0,
    expected_drift_rate=0.2,
)


def peer(name: str, epoch: int, samples: int = 0, speed: float = 10.0, *, aux: bool = False) -> LocalTrainingProgress:
    return LocalTrainingProgress(name, epoch, samples, speed, NOW, False, None, aux)


def aggregate(records, local, target: int = TARGET):
    return aggregate_progress(records, local, target_batch_size=target, now=NOW, **SETTINGS)


# ----- legitimate swarms


def test_a_lone_peer_keeps_its_own_epoch_and_samples() -> None:
    progress = aggregate([], peer("A", 7, 300))
    assert (progress.epoch, progress.samples_accumulated, progress.num_peers) == (7, 300, 1)
    assert aggregate([], peer("A", 7, TARGET)).samples_accumulated == TARGET  # and may end its epoch alone


def test_two_peers_one_just_ahead_the_other_follows() -> None:
    behind = aggregate([peer("B", 5)], peer("A", 4, 100))
    assert behind.epoch == 5 and is_ready_to_update_epoch(behind, local_epoch=4)  # it missed the round
    ahead = aggregate([peer("A", 4, 100)], peer("B", 5, 3))
    assert (ahead.epoch, ahead.samples_accumulated) == (5, 3)  # the peer ahead keeps its epoch, A adds nothing


def test_a_late_joiner_adopts_what_most_others_agree_on() -> None:
    assert aggregate([peer("B", 12), peer("C", 12), peer("D", 11)], peer("J", 0)).epoch == 12
    # one peer that lags (or lies low) does not hold it back, one that runs ahead does not pull it
    assert aggregate([peer("B", 12), peer("C", 12), peer("D", 0)], peer("J", 0)).epoch == 12
    assert aggregate([peer("B", 12), peer("C", 12), peer("D", 10**9)], peer("J", 0)).epoch == 12


def test_a_minority_that_moved_on_is_not_followed_a_majority_is() -> None:
    records = [peer("B", 5, 200), peer("C", 6, 0), peer("D", 5, 100)]
    progress = aggregate(records, peer("A", 5, 100))
    assert progress.epoch == 5 and progress.samples_accumulated == 400  # C's epoch 6 waits for the others
    records = [peer("B", 6), peer("C", 6), peer("D", 5, 100)]
    assert aggregate(records, peer("A", 5, 100)).epoch == 6  # most others moved on: A is behind


def test_an_epoch_needs_the_target_from_peers_that_vouch_for_each_other() -> None:
    claims = [peer("B", 2, 120), peer("C", 2, 130), peer("D", 2, 140, speed=30.0)]  # D is a faster machine
    progress = aggregate(claims, peer("A", 2, 121))
    assert progress.samples_accumulated == 511 and not is_ready_to_update_epoch(progress, 2)
    assert progress.samples_per_second == pytest.approx(50.0)  # D's speed counts up to twice the others'

    assert is_ready_to_update_epoch(aggregate(claims, peer("A", 2, 122)), 2)
    assert progress.ignored == ()


def test_auxiliary_peers_vote_on_the_epoch_but_bring_no_samples() -> None:
    progress = aggregate([peer("X", 3, 400, aux=True), peer("B", 3, 50)], peer("A", 3, 40))
    assert (progress.epoch, progress.samples_accumulated, progress.num_auxiliary) == (3, 90, 1)


# ----- hostile records


def test_a_record_far_ahead_is_ignored_and_said_why() -> None:
    records = [peer("B", 4, 100), peer("C", 4, 100), peer("H", 10**9, 0)]
    progress = aggregate(records, peer("A", 4, 100))
    assert (progress.epoch, progress.samples_accumulated, progress.num_peers) == (4, 300, 3)
    assert [peer_id for peer_id, _ in progress.ignored] == ["H"]
    assert not is_ready_to_update_epoch(progress, 4)


def test_an_absurd_sample_claim_is_ignored_a_plausible_lie_is_capped() -> None:
    honest = [peer("B", 4, 100), peer("C", 4, 110)]
    absurd = aggregate([*honest, peer("H", 4, 10**12, speed=1e12)], peer("A", 4, 90))
    assert absurd.samples_accumulated == 300 and [p for p, _ in absurd.ignored] == ["H"]
    assert absurd.samples_per_second == pytest.approx(30.0)
    lie = aggregate([*honest, peer("H", 4, ABSURD_TARGET_FACTOR * TARGET, speed=1e12)], peer("A", 4, 90))
    # H counts as at most SAMPLE_FACTOR times the upper median of the others' claims (100), not more
    assert lie.samples_accumulated == 300 + SAMPLE_FACTOR * 100 and lie.ignored == ()
    assert lie.samples_per_second == pytest.approx(30.0 + SAMPLE_FACTOR * 10.0)
    assert not is_ready_to_update_epoch(lie, 4)


def test_an_old_or_backdated_report_is_not_extrapolated_past_the_target() -> None:
    backdated = LocalTrainingProgress("H", 4, 100, 10.0, NOW - 10**9, False)
    progress = aggregate([peer("B", 4, 100), peer("C", 4, 100), backdated], peer("A", 4, 100))
    assert progress.eta_next_epoch > NOW  # H's extrapolation stops at its cap (twice the others': 200) ...
    assert not is_ready_to_update_epoch(progress, 4)  # ... and readiness never extrapolates


def test_two_peers_cannot_tell_which_one_lies() -> None:
    """The documented limit: with one other peer, its record is believed (up to the target)."""
    progress = aggregate([peer("H", 10**9)], peer("A", 3))
    assert progress.epoch == 10**9


def test_quorum_epoch_and_accepts_epoch() -> None:
    assert quorum_epoch([]) is None
    assert [quorum_epoch(values) for values in ([3], [3, 9], [3, 9, 9], [1, 2, 3, 4])] == [3, 3, 9, 2]
    assert swarm_epoch(5, []) == 5 and swarm_epoch(5, [2, 2, 2]) == 5 and swarm_epoch(0, [7, 7, 0]) == 7
    assert accepts_epoch(6, 5) and not accepts_epoch(7, 5)


# ----- properties: any honest swarm plus hostile records


honest_epochs = st.integers(0, 50)
hostile_records = st.builds(
    lambda epoch, samples, speed: peer("H", epoch, samples, speed),
    st.integers(0, 2**62),
    st.integers(0, 2**62),
    st.floats(0, 1e300),
)


@given(
    local=honest_epochs,
    others=st.lists(st.integers(-1, 1), min_size=2, max_size=8),
    hostile=st.lists(st.integers(0, 2**62), max_size=8),
)
def test_fewer_hostile_peers_than_honest_ones_keep_the_epoch_in_the_honest_range(
    local: int, others: list[int], hostile: list[int]
) -> None:
    honest = [max(0, local + delta) for delta in others]  # honest peers are at most one epoch apart
    hostile = hostile[: len(honest)]  # f hostile of f + h peers, f < h (this peer is honest too)
    epoch = swarm_epoch(local, honest + hostile)
    assert min(local, *honest) <= local <= epoch <= max(local, *honest)


@given(
    target=st.integers(1, 10**6),
    local=st.integers(0, 10**6),
    honest=st.lists(st.tuples(st.integers(0, 10**6), st.floats(0, 1e6)), min_size=2, max_size=8),
    hostile=hostile_records,
)
def test_one_hostile_record_moves_nothing_outside_the_honest_range(
    target: int, local: int, honest: list[tuple[int, float]], hostile: LocalTrainingProgress
) -> None:
    epoch = 7
    honest_records = [peer(f"P{i}", epoch, min(samples, target), speed) for i, (samples, speed) in enumerate(honest)]
    own = peer("A", epoch, min(local, target), 1.0)
    clean = aggregate(honest_records, own, target=target)
    attacked = aggregate([*honest_records, hostile], own, target=target)
    assert attacked.epoch == epoch == clean.epoch
    claims = [record.samples_accumulated for record in honest_records] + [own.samples_accumulated]
    # the hostile record adds at most SAMPLE_FACTOR times the largest honest claim, and never lowers the rest
    assert clean.samples_accumulated <= attacked.samples_accumulated
    assert attacked.samples_accumulated <= clean.samples_accumulated + SAMPLE_FACTOR * max(claims)
    speeds = [record.samples_per_second for record in honest_records] + [1.0]
    assert attacked.samples_per_second <= clean.samples_per_second + SAMPLE_FACTOR * max(speeds) + 1e-9 * max(
        1.0, clean.samples_per_second
    )
    assert math.isfinite(attacked.eta_next_epoch) or not math.isfinite(clean.eta_next_epoch)


@given(
    epochs=st.lists(st.integers(0, 10**6), min_size=1, max_size=9),
    local=st.integers(0, 10**6),
    samples=st.lists(st.integers(0, 4 * TARGET), min_size=9, max_size=9),
)
def test_screening_never_counts_more_than_claimed_nor_drops_this_peer(
    epochs: list[int], local: int, samples: list[int]
) -> None:
    records = [peer(f"P{i}", epoch, samples[i]) for i, epoch in enumerate(epochs)]
    screening = screen_progress(records, peer("A", local, 5), target_batch_size=TARGET)
    assert screening.epoch >= local
    assert screening.counted[-1].is_local and screening.counted[-1].record.peer_id == "A"
    assert len(screening.counted) + len(screening.ignored) == len(records) + 1
    for entry in screening.counted:
        assert 0 <= entry.samples <= entry.record.samples_accumulated
        assert entry.samples == 0 or entry.record.epoch == screening.epoch
