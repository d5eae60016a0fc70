"""A hostile peer with its own valid key cannot move the swarm's epoch nor end epochs early.

Three honest Optimizers train a small model on loopback (threads of one process, see optim_swarm); a
fourth DHT plays a volunteer that publishes validly signed progress records, exactly as a
ProgressTracker would (its own RSA key through the DHT's RSASignatureValidator, under its
``[owner:...]`` subkey, with the run's fingerprint copied from the honest records): epoch 10**9, or
10**12 samples at the honest epoch, a plausible lie (the whole target at the honest epoch), or always
one epoch past the honest peers. Before hivemind_ext.optim.progress_rules, a far-future epoch left
every honest peer stuck (or moved it there, with a donor to download from), and the other attacks
ended epochs after a step or two.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import hivemind
import pytest
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from optim_swarm import FAST_TRACKER, SwarmRun, quiet_hivemind, regression_model, run_swarm, signing_key
from swarm import local_swarm, wait_for

from hivemind_ext import Optimizer
from hivemind_ext.optim.progress import LocalTrainingProgress, parse_progress_records
from hivemind_ext.optim.progress_rules import SAMPLE_FACTOR

NUM_HONEST, TARGET, BATCH, TARGET_EPOCH = 3, 96, 4, 3
HOSTILE_KEY = RSAPrivateKey()


@pytest.fixture(scope="module")
def dhts() -> Iterator[list[hivemind.DHT]]:
    with quiet_hivemind(), local_swarm(NUM_HONEST + 1) as swarm:
        # the hostile node signs with its own key, like a tracker's DHT (the first validator given is kept)
        swarm[-1].add_validators([RSASignatureValidator(HOSTILE_KEY)])
        yield swarm


class HostilePeer:
    """Keeps one validly signed progress record in the run's key, rewritten every 0.1 s from what the
    honest records say (their fingerprint, their highest epoch): ``make_value(peer_id, honest)``."""

    def __init__(self, dht: hivemind.DHT, run_id: str, make_value: Callable[[str, list[Any]], list[Any]]):
        self.dht, self.key, self.make_value = dht, f"{run_id}_progress", make_value
        self.subkey = RSASignatureValidator(HOSTILE_KEY).local_public_key
        self.stored = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def honest_records(self) -> list[LocalTrainingProgress]:
        found = self.dht.get(self.key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return []
        entries = [(subkey, item.value, item.expiration_time) for subkey, item in found.value.items()]
        return parse_progress_records(entries, now=get_dht_time(), exclude_subkey=self.subkey)

    def run(self) -> None:
        while not self.stop.is_set():
            value = self.make_value(str(self.dht.peer_id), self.honest_records())
            if self.dht.store(self.key, value, get_dht_time() + 10, subkey=self.subkey):
                self.stored += 1
            self.stop.wait(0.1)

    def __enter__(self) -> HostilePeer:
        self.thread.start()
        wait_for(lambda: self.stored > 0, 20.0, message="the hostile record to be stored")
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop.set()
        self.thread.join(10)


def record(
    peer_id: str, honest: list[LocalTrainingProgress], *, epoch: int | None, samples: int, ahead: int = 0
) -> list[Any]:
    """A well-formed record with the honest peers' fingerprint; ``ahead`` of their highest epoch unless ``epoch``."""
    fingerprint = next((r.fingerprint for r in honest if r.fingerprint is not None), None)
    at = epoch if epoch is not None else max((r.epoch for r in honest), default=0) + ahead
    wire = [fingerprint.to_wire()] if fingerprint is not None else []
    return [peer_id, at, samples, 1e9, get_dht_time(), False, *wire]


ATTACKS = {
    "far_future_epoch": dict(epoch=10**9, samples=0),
    "absurd_samples": dict(epoch=None, samples=10**12),
    "plausible_lie": dict(epoch=None, samples=TARGET),
    "one_epoch_ahead": dict(epoch=None, samples=0, ahead=1),  # always just past the others: a creep
}


def train_under_attack(dhts: list[hivemind.DHT], name: str) -> tuple[SwarmRun, HostilePeer]:
    run_id = f"hostile_{name}"
    attack = ATTACKS[name]
    with HostilePeer(dhts[-1], run_id, lambda peer_id, honest: record(peer_id, honest, **attack)) as hostile:
        run = run_swarm(
            dhts[:NUM_HONEST],
            run_id=run_id,
            target_epoch=TARGET_EPOCH,
            optimizer_kwargs=dict(
                target_batch_size=TARGET,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
                scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (1 + epoch)),
                matchmaking_time=1.0,
                averaging_timeout=10.0,
                tracker_opts=dict(FAST_TRACKER),
                shutdown_timeout=2.0,
            ),
            batch_sizes=(BATCH,),
            sleep=0.02,
            max_seconds=90.0,
            drain=False,
        )
    return run, hostile


def samples_per_epoch(run: SwarmRun) -> dict[int, int]:
    return {
        epoch: sum(step.batch_size for log in run.logs for step in log.batches_in_epoch(epoch))
        for epoch in range(TARGET_EPOCH)
    }


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_a_hostile_record_neither_moves_the_epoch_nor_ends_epochs_early(dhts: list[hivemind.DHT], name: str) -> None:
    run, hostile = train_under_attack(dhts, name)
    assert hostile.stored > 5  # the record was there the whole run
    errors = [f"peer {log.index}: {log.error!r}" for log in run.logs if log.error is not None]
    assert not errors, errors

    # the epoch: every honest peer ends where the honest peers stop, one epoch at a time, the LR with it
    epochs = [opt.local_epoch for opt in run.optimizers]
    assert all(TARGET_EPOCH <= epoch <= TARGET_EPOCH + 1 for epoch in epochs), epochs
    jumps = [(log.index, s.epoch_before, s.epoch_after) for log in run.logs for s in log.steps]
    assert all(after <= before + 1 for _, before, after in jumps), [j for j in jumps if j[2] > j[1] + 1]
    for log in run.logs:
        for epoch, lr in log.lr_at_epoch.items():
            assert lr == pytest.approx(0.05 / (1 + epoch)) and epoch <= TARGET_EPOCH + 1

    # the samples: an absurd claim counts nothing, a plausible lie at most SAMPLE_FACTOR typical peers
    fraction = 1.0 if name != "plausible_lie" else NUM_HONEST / (NUM_HONEST + SAMPLE_FACTOR)
    counts = samples_per_epoch(run)
    print(f"{name}: samples per epoch {counts} (target {TARGET}), {run.seconds:.1f} s")  # shown with -s
    assert all(count >= fraction * TARGET for count in counts.values()), (counts, fraction * TARGET)

    if name in ("far_future_epoch", "absurd_samples"):  # out of range: ignored, counted, logged once per peer
        assert all(opt.tracker.ignored_records > 0 for opt in run.optimizers)
        ignoring = [message for message in run.warnings if "ignoring the progress record" in message]
        assert len(ignoring) == NUM_HONEST, run.warnings
    else:
        assert all(opt.tracker.ignored_records == 0 for opt in run.optimizers)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("require_agreement", [True, False], ids=["donors_must_agree", "range_checks_only"])
def test_a_joiner_refuses_a_donor_state_far_above_the_agreed_epoch(
    dhts: list[hivemind.DHT], caplog: pytest.LogCaptureFixture, require_agreement: bool
) -> None:
    """The hostile peer runs an Optimizer too, at epoch 10**9, and shares that state as the newest: a
    joiner's catch-up neither follows its record nor adopts its state, whether the two honest donors
    outvote it (``require_agreement``) or only the joiner's epoch checks stand in the way."""
    caplog.set_level(logging.WARNING, logger="hivemind_ext")
    run_id, optimizers = f"hostile_donor_{require_agreement}", []

    def make(dht: hivemind.DHT, key: RSAPrivateKey) -> Optimizer:
        optimizers.append(
            Optimizer(
                dht=dht,
                run_id=run_id,
                params=regression_model().parameters(),
                optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
                target_batch_size=TARGET,
                batch_size_per_step=BATCH,
                load_state_timeout=10.0,
                tracker_opts=dict(FAST_TRACKER, private_key=key),
                averager_opts=dict(require_agreement=require_agreement),
                shutdown_timeout=2.0,
            )
        )
        return optimizers[-1]

    try:
        honest = [make(dht, signing_key(dht)) for dht in dhts[:2]]
        for opt in honest:
            opt.load_state_dict({**opt.state_dict(), "local_epoch": 3})
        hostile = make(dhts[-1], HOSTILE_KEY)
        hostile.load_state_dict({**hostile.state_dict(), "local_epoch": 10**9})
        joiner = make(dhts[2], signing_key(dhts[2]))
        wait_for(lambda: joiner.tracker.global_progress.num_peers >= 3, 20.0, message="the joiner to see the swarm")
        assert joiner.tracker.global_progress.epoch == 3  # the two honest peers agree; 10**9 is ignored

        refusals = (f"refusing a state of epoch {10**9}", f"the downloaded state is of epoch {10**9}")

        def loaded_honest_state() -> bool:
            joiner.load_state_from_peers()
            assert joiner.local_epoch != 10**9, "the joiner adopted the hostile state"
            refused = any(refusal in caplog.text for refusal in refusals)
            return joiner.local_epoch == 3 and (require_agreement or refused)

        wait_for(loaded_honest_state, 30.0, message="the joiner to adopt the honest state (and refuse the hostile one)")
        assert joiner.local_epoch <= 4 and joiner.tracker.local_progress.epoch <= 4
        assert all(opt.tracker.global_progress.epoch == 3 for opt in honest)
    finally:
        for opt in optimizers:
            opt.shutdown()
