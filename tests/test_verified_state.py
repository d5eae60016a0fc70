"""Verified state (issue 12, item 3): a joiner does not trust one donor, refuses out-of-range states,
falls back to other donors without downloading a bad state again, and peers whose state silently
diverged from the group's resync. Real Optimizers on 127.0.0.1.

The hostile donor is a peer that trains honestly but serves a poisoned copy of its state to
newcomers (with valid digests: it poisons what ``get_current_state`` returns, before the manifest is
built), as a modified client would.
"""

from __future__ import annotations

import copy
import logging
import math
import threading
from collections.abc import Callable
from typing import Any

import hivemind
import pytest
import torch
from faulty_dht import FaultyDHT
from peer_trainers import (
    LR,
    Trainer,
    make_model,
    make_optimizer,
    make_trainers,
    params_of,
    same_params,
    shutting_down,
    train_together,
)
from swarm import local_swarm, wait_for

from hivemind_ext.errors import ConfigurationError, UntrustedStateError
from hivemind_ext.optim.state_averager import TrainingStateAverager
from hivemind_ext.optim.state_checks import StateBounds, check_state_values
from hivemind_ext.optim.state_digests import DigestBoard, majority_digest, state_digest
from hivemind_ext.p2p.signing import default_signing_key

pytestmark = pytest.mark.slow


# ----- a hostile donor


def poisoned(mode: str, metadata: dict[str, Any], tensors: list[torch.Tensor]) -> tuple[dict, list[torch.Tensor]]:
    """What the hostile donor serves instead of its state."""
    metadata, tensors = copy.deepcopy(metadata), [t.clone() for t in tensors]
    params = tensors[: metadata["num_params"]]
    if mode == "scale":
        for tensor in params:
            tensor.mul_(57)
    elif mode in ("inf", "nan"):
        params[0].fill_(math.inf if mode == "inf" else math.nan)
    elif mode == "lr":
        for group in metadata["param_groups"]:
            group["lr"] = 10000.0
    elif mode == "epoch":
        metadata["epoch"] = 10**9
    else:
        raise AssertionError(mode)
    return metadata, tensors


@pytest.fixture
def hostile_donors(monkeypatch: pytest.MonkeyPatch) -> dict[int, str]:
    """id(state averager) -> poisoning mode: those averagers serve a poisoned state."""
    modes: dict[int, str] = {}
    honest = TrainingStateAverager.get_current_state

    def get_current_state(self: TrainingStateAverager) -> tuple[Any, list[torch.Tensor]]:
        metadata, tensors = honest(self)
        mode = modes.get(id(self))
        return poisoned(mode, metadata, tensors) if mode else (metadata, tensors)

    monkeypatch.setattr(TrainingStateAverager, "get_current_state", get_current_state)
    return modes


# ----- peers


def join(dht: hivemind.DHT, optimizers: list, run_id: str, swarm_epoch: int, **kwargs: Any) -> Trainer:
    """A newcomer with other initial parameters, once it sees the swarm's epoch."""
    model = make_model(seed=1)
    optimizers.append(make_optimizer(dht, model, run_id, **kwargs))
    newcomer = Trainer(optimizers[-1], model, seed=7)
    wait_for(
        lambda: newcomer.opt.tracker.global_progress.epoch >= swarm_epoch, 15, message="the newcomer to see the swarm"
    )
    return newcomer


def assert_honest(trainer: Trainer, reference: Trainer) -> None:
    """``trainer`` holds the honest state of ``reference``: same parameters, learning rate and epoch."""
    assert trainer.opt.local_epoch == reference.opt.local_epoch
    assert same_params(params_of(trainer.model), params_of(reference.model)), (
        "the newcomer did not adopt the honest state"
    )
    assert all(group["lr"] == pytest.approx(LR) for group in trainer.opt.param_groups)


# ----- a joiner with two honest donors and a hostile one


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["scale", "inf", "lr", "epoch", "nan"])
def test_a_joiner_refuses_a_hostile_donors_state_and_never_spreads_it(
    mode: str, hostile_donors: dict[int, str]
) -> None:
    run_id = f"hostile_{mode}"
    with local_swarm(4) as dhts, shutting_down() as optimizers:
        *honest, hostile = make_trainers(dhts, optimizers, 3, run_id)
        train_together([*honest, hostile], until_epoch=2)
        hostile_donors[id(hostile.opt.state_averager)] = mode
        swarm_epoch = max(t.opt.local_epoch for t in (*honest, hostile))
        if mode in ("epoch", "nan"):  # it also advertises a newer version than anyone: asked first
            hostile.opt.state_averager.state_sharing_priority = 10**9 if mode == "epoch" else swarm_epoch + 1
        newcomer = join(dhts[3], optimizers, run_id, swarm_epoch)
        newcomer.step_once(torch.Generator().manual_seed(3))  # the first step downloads the state
        assert_honest(newcomer, honest[0])
        hostile_stats = hostile.opt.state_averager.donor.stats
        assert hostile_stats.chunks_served == 0, f"the newcomer downloaded from the hostile donor: {hostile_stats}"

        # training on: nobody's parameters take the poisoned values (x57, inf, NaN) through averaging
        everyone = [*honest, hostile, newcomer]
        train_together(everyone, until_epoch=swarm_epoch + 2)
        scale = max(p.abs().max().item() for p in params_of(honest[0].model))
        for trainer in everyone:
            assert all(torch.isfinite(p).all() for p in params_of(trainer.model))
            assert max(p.abs().max().item() for p in params_of(trainer.model)) < 2 * scale
            assert trainer.opt.local_epoch < swarm_epoch + 10
            assert all(group["lr"] == pytest.approx(LR) for group in trainer.opt.param_groups)


@pytest.mark.timeout(150)
def test_without_agreement_a_nan_donor_is_dropped_and_the_joiner_reaches_the_swarm_epoch(
    hostile_donors: dict[int, str],
) -> None:
    """Where donors need not agree (as in modes whose peers differ), a donor whose chunks hold NaN is
    dropped, banned and replaced by the others; it is never asked again."""
    run_id = "hostile_nan_fallback"
    options = dict(averager_opts={"require_agreement": False})
    with local_swarm(4) as dhts, shutting_down() as optimizers:
        *honest, hostile = make_trainers(dhts, optimizers, 3, run_id, **options)
        train_together([*honest, hostile], until_epoch=2)
        hostile_donors[id(hostile.opt.state_averager)] = "nan"
        swarm_epoch = max(t.opt.local_epoch for t in (*honest, hostile))
        hostile.opt.state_averager.state_sharing_priority = swarm_epoch + 1  # asked first, alone
        newcomer = join(dhts[3], optimizers, run_id, swarm_epoch, **options)
        newcomer.step_once(torch.Generator().manual_seed(3))
        assert_honest(newcomer, honest[0])
        everyone = [*honest, hostile, newcomer]
        train_together(everyone, until_epoch=swarm_epoch + 3)
        assert newcomer.opt.local_epoch >= swarm_epoch + 3 and newcomer.steps > 10
        assert all(torch.isfinite(p).all() for t in everyone for p in params_of(t.model))
        # the bad state was served at most once to each other peer, however many steps they took
        assert hostile.opt.state_averager.donor.stats.downloads <= 3, hostile.opt.state_averager.donor.stats


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["lr", "inf"])
def test_a_lone_hostile_donor_is_refused_by_the_range_checks_and_not_asked_again(
    mode: str, hostile_donors: dict[int, str], caplog: pytest.LogCaptureFixture
) -> None:
    """A swarm with a single donor: its state is believed only if its values are in range."""
    caplog.set_level(logging.WARNING, logger="hivemind_ext")
    run_id = f"lone_{mode}"
    with local_swarm(2) as dhts, shutting_down() as optimizers:
        (hostile,) = make_trainers(dhts, optimizers, 1, run_id)
        train_together([hostile], until_epoch=2)
        hostile_donors[id(hostile.opt.state_averager)] = mode
        newcomer = join(dhts[1], optimizers, run_id, hostile.opt.local_epoch)
        before = params_of(newcomer.model)
        generator = torch.Generator().manual_seed(3)
        newcomer.step_once(generator)
        assert newcomer.opt.local_epoch == 0 and same_params(params_of(newcomer.model), before, atol=0)
        for _ in range(15):  # every step still finds the newcomer behind the swarm
            newcomer.step_once(generator)
        assert hostile.opt.state_averager.donor.stats.downloads == 1, "the refused state was downloaded again"
        assert "is skipped for" in caplog.text  # the donor is banned for a cool-down
        assert all(torch.isfinite(p).all() for p in params_of(newcomer.model))
        assert all(group["lr"] == pytest.approx(LR) for group in newcomer.opt.param_groups)


# ----- silent divergence


@pytest.mark.timeout(150)
def test_a_peer_whose_parameters_silently_diverge_resyncs() -> None:
    run_id = "diverge"
    with local_swarm(3) as dhts, shutting_down() as optimizers:
        # no state averaging: nothing but the digest comparison brings a diverged peer back
        trainers = make_trainers(dhts, optimizers, 3, run_id, average_state_every=1000)
        train_together(trainers, until_epoch=2)
        victim = trainers[2]
        with victim.opt.state_lock, torch.no_grad():  # a bit flip, a bad kernel, a half-applied round
            victim.opt.opt.param_groups[0]["params"][0].add_(0.05)
            victim.opt.state_manager.copy_to_model()
        diverged_at = victim.opt.local_epoch
        assert not same_params(params_of(victim.model), params_of(trainers[0].model))
        train_together(trainers, until_epoch=diverged_at + 5, seconds=100)
        # back in line with an honest peer at some later epoch: compared after the epoch's last step, since
        # the resync's download lands within an epoch that the peer entered out of line (under load, a round
        # the downloading peer misses puts it out of line again for an epoch or two: not every epoch matches)
        later = sorted(set(victim.latest) - set(range(diverged_at + 2)))
        in_line = [
            e for e in later if any(e in t.latest and same_params(victim.latest[e], t.latest[e]) for t in trainers[:2])
        ]
        assert in_line, f"the diverged peer never came back in line (epochs {later})"
        assert victim.opt.state_digests is not None and victim.opt.state_digests.divergences >= 1
        assert trainers[0].opt.state_digests.divergences == 0


@pytest.mark.timeout(150)
def test_a_fake_digest_majority_only_makes_honest_peers_resync_from_honest_donors() -> None:
    """Three Sybil keys (each on a DHT of its own, so each signs its own records) publish one fake
    state digest for every epoch the two honest peers reach: they outvote them, and the honest
    peers resync. That is all they can do: the resync downloads from a donor (the other honest
    peer; the Sybils serve no state), so nobody's parameters leave the honest trajectory."""
    run_id = "fake_digests"
    with local_swarm(5) as dhts, shutting_down() as optimizers:
        honest = make_trainers(dhts[:2], optimizers, 2, run_id, average_state_every=1000)
        prefix = honest[0].opt.state_averager.prefix
        fake = ({"epoch": -1}, [torch.zeros(1)])
        sybils = [
            DigestBoard(dht, prefix, dht.peer_id.to_base58(), take_state=lambda: fake, on_diverged=lambda _: None)
            for dht in dhts[2:]
        ]
        stop, published = threading.Event(), set()

        def publish_fake_digests() -> None:
            while not stop.is_set():
                epoch = max(t.opt.local_epoch for t in honest)
                for e in sorted({max(epoch - 1, 0), epoch, epoch + 1} - published):
                    for board in sybils:
                        board.after_epoch(e)
                    published.add(e)
                stop.wait(0.05)

        publisher = threading.Thread(target=publish_fake_digests, daemon=True)
        publisher.start()
        try:
            train_together(honest, until_epoch=4, seconds=100)
        finally:
            stop.set()
            publisher.join(10)
            for board in sybils:
                board.shutdown()
        assert all(t.opt.state_digests is not None and t.opt.state_digests.divergences >= 1 for t in honest)
        downloads = sum(t.opt.state_averager.donor.stats.downloads for t in honest)
        assert downloads >= 1, "the outvoted peers never resynced"
        # still one honest trajectory: the two peers match at some epoch after the resyncs began
        common = sorted(set(honest[0].history) & set(honest[1].history) - {0, 1})
        assert any(same_params(honest[0].history[e], honest[1].history[e]) for e in common), common
        for trainer in honest:
            assert all(torch.isfinite(p).all() for p in params_of(trainer.model))
            assert all(group["lr"] == pytest.approx(LR) for group in trainer.opt.param_groups)


# ----- the pure parts


def test_range_checks_refuse_each_out_of_range_value() -> None:
    model = make_model(0)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    from hivemind_ext.optim.training_state import TrainingState

    state = TrainingState(optimizer=opt)
    metadata, tensors = state.snapshot()
    groups = [dict(group) for group in opt.param_groups]
    check = dict(bounds=StateBounds(), local_groups=groups, max_epoch=10)
    check_state_values(metadata, tensors, **check)  # the honest state passes
    for mode in ("inf", "nan", "lr", "epoch"):
        with pytest.raises(UntrustedStateError):
            check_state_values(*poisoned(mode, metadata, tensors), **check)
    for step in (-1, 1.5, 2**50, math.inf):
        bad = copy.deepcopy(metadata)
        bad["state"] = [[0, {"step": {"__scalar__": step, "dtype": "float32", "device": "cpu"}}]]
        with pytest.raises(UntrustedStateError):
            check_state_values(bad, tensors, **check)
    check_state_values(*poisoned("scale", metadata, tensors), **check)  # in range: only agreement catches it
    with pytest.raises(ConfigurationError):
        StateBounds(max_lr_ratio=0)


def test_state_digest_and_majority() -> None:
    metadata = {"epoch": 3, "state": [[0, {"step": {"__scalar__": 3.0, "dtype": "float32", "device": "cuda:0"}}]]}
    tensors = [torch.arange(6.0).reshape(2, 3)]
    on_cpu = copy.deepcopy(metadata)
    on_cpu["state"][0][1]["step"]["device"] = "cpu"
    assert state_digest(metadata, tensors) == state_digest(on_cpu, [t.clone() for t in tensors])
    assert state_digest(metadata, tensors) != state_digest(metadata, [tensors[0] * 57])
    assert state_digest(metadata, tensors) != state_digest({**metadata, "epoch": 4}, tensors)
    a, b = b"a" * 32, b"b" * 32
    assert majority_digest({"p1": a, "p2": a, "p3": b}) == a
    assert majority_digest({"p1": a, "p2": b}) is None  # one each: nobody is outvoted
    assert majority_digest({"p1": a}) is None  # a lone peer is no majority
    assert majority_digest({"p1": a, "p2": a, "p3": b, "p4": b}) is None


class LoadDuringRead(FaultyDHT):
    """The victim's DHT: ``on_get`` runs as a digest check's read starts (a state download landing
    while the check is in flight)."""

    on_get: Callable[[], Any] | None = None

    def get(self, *args: Any, **kwargs: Any) -> Any:
        if self.on_get is not None:
            self.on_get()
        return super().get(*args, **kwargs)


@pytest.mark.timeout(60)
def test_a_check_of_a_state_taken_before_a_load_does_not_resync_again() -> None:
    """Once the diverged peer loaded the swarm's state, a check still running on a digest of its old
    state must not request another resync (it did: a second download, then a missed round)."""
    honest_state = ({"epoch": 1}, [torch.zeros(4)])
    held = [({"epoch": 1}, [torch.ones(4)])]  # the victim's state: diverged until it "loads"
    resyncs: list[int] = []
    with local_swarm(3) as dhts:
        prefix = "stale_digest_check"
        boards = [
            DigestBoard(
                dht, prefix, dht.peer_id.to_base58(), take_state=lambda: honest_state, on_diverged=lambda _: None
            )
            for dht in dhts[:2]
        ]
        victim_dht = LoadDuringRead(dhts[2])
        victim = DigestBoard(
            victim_dht,
            prefix,
            dhts[2].peer_id.to_base58(),
            take_state=lambda: held[0],
            on_diverged=resyncs.append,
            signing_key=default_signing_key(dhts[2]),
        )
        try:
            for epoch in (0, 1):
                for board in [*boards, victim]:
                    board.after_epoch(epoch).result(30)
            assert resyncs == [0] and victim.divergences == 1  # the check of epoch 0 found the divergence

            def load() -> None:
                held[0] = honest_state
                victim.forget()

            victim_dht.on_get = load  # the download lands while the check of epoch 1 reads the digests
            victim.after_epoch(2).result(30)
            assert resyncs == [0] and victim.divergences == 1, "a check of the old state resynced the peer again"
        finally:
            for board in [*boards, victim]:
                board.shutdown()
