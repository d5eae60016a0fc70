"""Overlapped (streaming) DiLoCo: the fragment schedule and the staleness bound as pure functions, the
outer-step math of one peer against a hand-written reference, and real peers on loopback: rounds
that overlap the inner steps and converge, a round that fails on one peer, a late joiner."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from diloco_peers import (
    FailOneRound,
    LateJoinSwarm,
    batch,
    linear_model,
    make_optimizer,
    run_peers,
    test_loss,
    train_step,
)
from swarm import local_swarm, new_peer, wait_for

from hivemind_ext.compression import ErrorFeedback, SparseTopK
from hivemind_ext.compression.adaptive import CodecWrapper
from hivemind_ext.compression.base import CompressionInfo
from hivemind_ext.errors import ConfigurationError, UntrustedStateError
from hivemind_ext.optim.algorithms import DiLoCo
from hivemind_ext.optim.algorithms.diloco_outer import check_count
from hivemind_ext.optim.algorithms.streaming import (
    MAX_COUNT,
    OverlappedDiLoCoImpl,
    after_download,
    check_phase,
    fragment_offset,
    fragment_tensors,
    round_is_due,
    round_window,
    rounds_due,
    sanitized_phase,
    steps_missed,
    update_is_fresh,
)
from hivemind_ext.optim.rounds import RoundHooks
from hivemind_ext.optim.state_averager import TrainingStateAverager

# ----- pure functions


def test_overlap_keywords_are_checked():
    with pytest.raises(ConfigurationError):
        DiLoCo(5, fragments=2)  # fragments need overlap=True
    with pytest.raises(ConfigurationError):
        DiLoCo(5, alpha=0.5)
    with pytest.raises(ConfigurationError):
        DiLoCo(5, overlap=True, fragments=6)  # more fragments than inner steps
    with pytest.raises(ConfigurationError):
        DiLoCo(5, overlap=True, alpha=0.0)
    with pytest.raises(ConfigurationError):
        DiLoCo(5, overlap=True, fragments=True)


def test_fragments_are_consecutive_and_about_equal():
    assert fragment_tensors([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert fragment_tensors([10, 10, 10, 10], 4) == [[0], [1], [2], [3]]
    assert fragment_tensors([100, 1, 1, 1], 2) == [[0], [1, 2, 3]]  # a tensor is never split
    assert fragment_tensors([7], 3) == [[0]]  # fewer tensors than fragments: empty ones are dropped
    sizes = [3, 50, 7, 20, 20, 1, 30]
    groups = fragment_tensors(sizes, 3)
    assert sorted(i for g in groups for i in g) == list(range(len(sizes)))
    assert all(g == list(range(g[0], g[-1] + 1)) for g in groups)


def test_fragment_rounds_are_staggered_once_per_h_steps():
    inner_steps, fragments = 12, 3
    assert [fragment_offset(f, inner_steps, fragments) for f in range(fragments)] == [0, 4, 8]
    due = {f: [s for s in range(0, 40) if round_is_due(s, f, inner_steps, fragments)] for f in range(fragments)}
    assert due == {0: [12, 24, 36], 1: [4, 16, 28], 2: [8, 20, 32]}
    # one fragment: plain DiLoCo's schedule
    assert [s for s in range(0, 25) if round_is_due(s, 0, 5, 1)] == [5, 10, 15, 20]


def test_staleness_bound_applies_at_most_one_round_old_updates():
    fresh = dict(started_step=20, inner_steps=10, started_round=3, round_index=3)
    assert update_is_fresh(now_step=20, **fresh)  # arrived at once (a solo peer)
    assert update_is_fresh(now_step=27, **fresh)
    assert update_is_fresh(now_step=30, **fresh)  # exactly one round: the next round's start waits for it
    assert not update_is_fresh(now_step=31, **fresh)  # older than one round: dropped
    assert not update_is_fresh(now_step=19, **fresh)  # the step counter went back (a download)
    # a download moved the fragment's round index since the round started: its update is stale
    assert not update_is_fresh(now_step=25, **{**fresh, "round_index": 4})


def test_after_a_download_each_fragment_keeps_the_furthest_consistent_values():
    assert after_download(mine=5, served=4, held=()) == ("mine", 0)  # the donor had not applied a round yet
    assert after_download(mine=4, served=4, held=()) == ("donor", 0)
    assert after_download(mine=3, served=4, held={4}) == ("held", 1)  # the donor's round 4 was in flight
    assert after_download(mine=3, served=4, held={4, 5, 7}) == ("held", 2)  # rounds 4 and 5, in order
    assert after_download(mine=3, served=6, held={4, 5}) == ("donor", 0)  # the donor applied them meanwhile
    assert after_download(mine=-1, served=0, held=()) == ("donor", 0)  # a first download


def test_a_joiner_skips_the_steps_the_swarm_made_during_its_download():
    assert round_window([10.0, 10.5, 11.0], 10) == pytest.approx(5.0)
    assert round_window([3.0], 10) == 0.0
    assert steps_missed(2.0, 0.5, limit=10) == 4
    assert steps_missed(2.0, 0.0, limit=10) == 0  # the donor's pace is unknown
    assert steps_missed(0.0, 0.5, limit=10) == 0


def test_a_hostile_donors_phase_cannot_stall_or_crash_a_joiner():
    # the phase [inner step, seconds per step, round indices...] comes from a donor: its bad word is
    # bounded, never an exception, a hang (skipping 1e30 steps) or a counter that float32 cannot advance
    assert steps_missed(5.0, 1e-30, limit=10) == 10
    assert steps_missed(5.0, float("nan"), limit=10) == 0
    assert steps_missed(5.0, float("-inf"), limit=10) == 0
    assert steps_missed(float("inf"), 1.0, limit=10) == 0
    nan, inf = float("nan"), float("inf")
    assert sanitized_phase([nan, -1.0, 1e30, 3.7, -inf]) == [0.0, 0.0, float(MAX_COUNT), 3.0, 0.0]
    assert sanitized_phase([12.0, 0.25, 3.0]) == [12.0, 0.25, 3.0]
    assert float(torch.tensor(float(MAX_COUNT), dtype=torch.float32) + 1) == MAX_COUNT + 1


def test_a_donors_impossible_phase_is_refused_with_a_typed_error():
    # [inner step, seconds per step, round index per fragment] with H=8, F=2: fragment 0 is due at
    # steps 8, 16, ...; fragment 1 at 4, 12, ...: at step 20, 2 and 3 rounds were due
    assert [rounds_due(20, f, 8, 2) for f in (0, 1)] == [2, 3]
    assert [rounds_due(3, f, 8, 2) for f in (0, 1)] == [0, 0]
    check_phase([20.0, 0.05, 2.0, 3.0], 8, 2)  # in step
    check_phase([20.0, 0.0, 4.0, 5.0], 8, 2)  # a fragment kept after a download may run ahead a little
    nan, inf = float("nan"), float("inf")
    for bad in (
        [nan, 0.05, 2.0, 3.0],
        [20.0, nan, 2.0, 3.0],
        [20.0, -inf, 2.0, 3.0],
        [20.0, 0.05, nan, 3.0],
        [20.0, 0.05, -1.0, 3.0],
        [20.0, 0.05, 2.5, 3.0],  # not a whole number
        [20.0, 0.05, 1e30, 3.0],  # a huge round index
        [20.0, 0.05, 2.0, 6.0],  # more rounds than were due by step 20
        [1e30, 0.05, 2.0, 3.0],  # an inner step float32 cannot count on from
        [20.0],  # too short
    ):
        with pytest.raises(UntrustedStateError):
            check_phase(bad, 8, 2)
    # plain DiLoCo's phase [inner steps in the round, outer steps]: whole counters
    assert check_count(3.0, "x") == 3
    for bad_count in (nan, -1.0, 0.5, float(MAX_COUNT + 1)):
        with pytest.raises(UntrustedStateError):
            check_count(bad_count, "x")


# ----- one peer: the math


@pytest.fixture
def solo_dht():
    dht = new_peer()
    try:
        yield dht
    finally:
        dht.shutdown()


@pytest.mark.timeout(60)
def test_solo_overlapped_fragments_match_reference(solo_dht):
    """One peer (its rounds step on its own pseudo-gradient at once): two fragments (two tensors of
    equal size) whose outer steps are staggered by H/2, mixed in with alpha."""
    inner_lr, inner_steps, steps, alpha = 0.1, 4, 15, 0.5
    x0 = [torch.tensor([1.0, -2.0]), torch.tensor([0.5, 3.0])]
    targets = torch.randn(steps, 4, generator=torch.Generator().manual_seed(0))
    params = [torch.nn.Parameter(x.clone()) for x in x0]
    algorithm = DiLoCo(inner_steps, codec=None, overlap=True, fragments=2, alpha=alpha)
    opt = make_optimizer(solo_dht, params, "overlap_math", algorithm, lr=inner_lr)
    try:
        impl = opt.algorithm_impl
        assert isinstance(impl, OverlappedDiLoCoImpl)
        for k in range(steps):
            for param, target in zip(params, targets[k].split(2), strict=True):
                param.grad = param.detach() - target
            opt.step(batch_size=1)
            opt.zero_grad()

        x = [t.clone() for t in x0]
        anchor, momentum = [t.clone() for t in x0], [torch.zeros(2), torch.zeros(2)]
        for k in range(steps):
            for f in range(2):
                x[f] = x[f] - inner_lr * (x[f] - targets[k].split(2)[f])
            for f in range(2):
                if (k + 1 - f * inner_steps // 2) % inner_steps == 0:  # fragment 1 at steps 2, 6, 10, 14
                    pseudo_grad = anchor[f] - x[f]
                    momentum[f] = 0.9 * momentum[f] + pseudo_grad
                    new_anchor = anchor[f] - 0.7 * (pseudo_grad + 0.9 * momentum[f])
                    x[f] = x[f] + alpha * (new_anchor - x[f])
                    anchor[f] = new_anchor
        for f in range(2):
            torch.testing.assert_close(params[f].detach(), x[f], atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(impl.anchor[f], anchor[f], atol=1e-6, rtol=1e-6)
        assert impl.round_indices == [3, 4] and impl.rounds == impl.solo_rounds == 7
        assert impl.step_index == steps
    finally:
        opt.shutdown()


# ----- real peers


@pytest.fixture(scope="module")
def swarm_dhts():
    """Three DHT peers shared by this module's multi-peer tests (each test trains under its own run_id):
    starting a swarm takes seconds, which the suite pays once here."""
    with local_swarm(3) as dhts:
        yield dhts


def plain_diloco_reference(peers: int, steps: int, inner_steps: int, lr: float = 0.1) -> float:
    """What plain DiLoCo computes on the same data when every round succeeds (in one process)."""
    models = [linear_model(seed=0) for _ in range(peers)]
    generators = [torch.Generator().manual_seed(index + 1) for index in range(peers)]
    anchor = [p.detach().clone() for p in models[0].parameters()]
    momentum = [torch.zeros_like(a) for a in anchor]
    for step in range(1, steps + 1):
        for model, generator in zip(models, generators, strict=True):
            x, y = batch(generator)
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= lr * p.grad
        if step % inner_steps == 0:
            with torch.no_grad():
                for i, a in enumerate(anchor):
                    pg = sum(a - list(m.parameters())[i] for m in models) / peers
                    momentum[i] = 0.9 * momentum[i] + pg
                    a -= 0.7 * (pg + 0.9 * momentum[i])
                    for m in models:
                        list(m.parameters())[i].copy_(a)
    return sum(test_loss(m) for m in models) / peers


def finish(opt, impl: OverlappedDiLoCoImpl) -> None:
    """Applies the rounds in flight, then downloads the state if a round said this peer was behind."""
    impl.settle()
    give_up = time.monotonic() + 30
    while opt.rounds.resync_pending and time.monotonic() < give_up:
        opt.load_state_from_peers()


def catch_up(opts: Sequence[Any]) -> None:
    """After the peers stopped: a peer whose very last round did not average (the others applied it)
    downloads the swarm's state, as it would at its next step."""
    furthest = max(opt.algorithm_impl.round_indices for opt in opts)
    for opt in opts:
        if opt.algorithm_impl.round_indices != furthest:
            opt.load_state_from_peers()


def anchors_agree(impls: list[OverlappedDiLoCoImpl]) -> None:
    histories = [list(impl.history) for impl in impls]
    assert all(impl.round_indices == impls[0].round_indices for impl in impls), histories
    for impl in impls[1:]:
        for mine, theirs in zip(impls[0].anchor, impl.anchor, strict=True):
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0, msg=lambda m: f"{m}\n{histories}")


@pytest.mark.timeout(120)
def test_overlapped_rounds_converge_without_stopping_the_inner_steps(swarm_dhts):
    inner_steps, steps, peers = 10, 60, 2
    dhts = swarm_dhts[:peers]
    models = [linear_model(seed=0) for _ in dhts]
    algorithm = DiLoCo(inner_steps, overlap=True, fragments=2)  # float16 pseudo-gradients
    opts = [make_optimizer(dht, m.parameters(), "overlap", algorithm) for dht, m in zip(dhts, models, strict=True)]
    impls = [opt.algorithm_impl for opt in opts]
    wait_for(lambda: all(o.tracker.global_progress.num_trainers == peers for o in opts), 30, message="peers")

    anchors: list[list[torch.Tensor]] = [[], []]
    indices: list[list[int]] = [[], []]

    def worker(index: int) -> None:
        generator = torch.Generator().manual_seed(index + 1)
        for _ in range(steps):
            train_step(models[index], opts[index], generator)
            time.sleep(0.05)  # the compute of a step
        finish(opts[index], impls[index])  # the rounds of step 60 (both peers take part)
        anchors[index] = [a.clone() for a in impls[index].anchor]
        indices[index] = impls[index].round_indices
        for _ in range(inner_steps // 2 + 1):  # start the next round, then shut down with it in flight
            train_step(models[index], opts[index], generator)

    try:
        run_peers(worker, peers, timeout=90)
        in_flight = [impl.rounds_in_flight for impl in impls]
        started = time.perf_counter()
    finally:
        for opt in opts:
            opt.shutdown()
    assert time.perf_counter() - started < 10  # rounds still in flight are cancelled, not awaited
    assert all(impl.rounds_in_flight == 0 for impl in impls), in_flight
    reference = plain_diloco_reference(peers, steps, inner_steps)
    losses = [test_loss(m) for m in models]
    histories = [list(impl.history) for impl in impls]
    assert reference < 0.05 < test_loss(linear_model(seed=0)), reference
    # within 0.02 (absolute MSE; floor 0.01, start ~3) of plain DiLoCo on the same data
    assert all(loss <= reference + 0.02 for loss in losses), (losses, reference, histories)
    for impl in impls:
        swarm = [h for h in impl.history if h[2] == "swarm"]
        assert len(swarm) >= 6, histories  # of 12 rounds (2 fragments, 60 steps); some may fail here
        assert all(0 <= age <= inner_steps for *_, age in swarm), histories
        assert any(age > 0 for *_, age in swarm), histories  # inner steps went on during a round
        assert impl.bytes_sent > 0
    # in step after the rounds of step 60: the same round indices and anchors (a peer that a failed
    # round left behind downloaded the state in finish())
    assert indices[0] == indices[1], histories
    for mine, theirs in zip(*anchors, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0, msg=lambda m: f"{m}\n{histories}")


@pytest.mark.timeout(120)
def test_overlapped_round_failed_on_one_peer_is_recovered(swarm_dhts):
    inner_steps, steps, failing_round = 10, 60, 1
    dhts = swarm_dhts[:2]
    models = [linear_model(seed=0) for _ in dhts]
    algorithm = DiLoCo(inner_steps, codec=None, overlap=True)
    hooks = [None, FailOneRound(failing_round)]  # peer 1 counts its second round as failed
    opts = [
        make_optimizer(dht, m.parameters(), "overlap_fail", algorithm, round_hooks=h)
        for dht, m, h in zip(dhts, models, hooks, strict=True)
    ]
    impls = [opt.algorithm_impl for opt in opts]
    wait_for(lambda: all(o.tracker.global_progress.num_trainers == 2 for o in opts), 30, message="both peers")

    def worker(index: int) -> None:
        generator = torch.Generator().manual_seed(index + 1)
        impl = impls[index]
        for _ in range(steps):
            train_step(models[index], opts[index], generator)
            time.sleep(0.05)
        finish(opts[index], impl)

    try:
        run_peers(worker, 2, timeout=100)
    finally:
        for opt in opts:
            opt.shutdown()
    histories = [(list(impl.history), impl.state_loads) for impl in impls]
    failed = [h for h in impls[1].history if h[2] != "swarm"]
    assert failed and failed[0][1] == failing_round, histories  # the injected failure: no outer step
    for impl in impls:  # both averaged again afterwards, with weight
        assert any(h[2] == "swarm" and h[3] > 0 and h[1] > failing_round for h in impl.history), histories
    anchors_agree(impls)
    losses = [test_loss(m) for m in models]
    assert all(loss < test_loss(linear_model(seed=0)) / 10 for loss in losses), (losses, histories)


def contributed(impl: OverlappedDiLoCoImpl, group: int) -> set[tuple[int, int]]:
    """(fragment, round index) of the rounds that ``impl`` applied in a group of ``group`` with a weight."""
    return {(h[0], h[1]) for h in impl.history if h[2] == "swarm" and h[3] > 0 and h[4] == group}


@pytest.mark.timeout(120)
def test_overlapped_late_joiner_with_fragments_gets_in_step(swarm_dhts):
    """A peer joins a swarm of two whose fragments (F=2, staggered by H/2) have rounds in flight most of
    the time, so its download is one round behind on a fragment or both: it takes part with weight 0,
    holds the others' averages, downloads again, and then averages with weight at the swarm's round
    indices. The swarm then trains two more windows; at the end every peer holds the same anchors and
    round indices, and parameters within 0.2 of each other (they differ by the up to H inner steps each
    made since its last round started, lr 0.1; 0.10 was the largest difference seen in 8 runs)."""
    inner_steps, fragments = 8, 2
    target = 2 * 16 * inner_steps  # an epoch per round: the joiner sees the swarm ahead and downloads
    algorithm = DiLoCo(inner_steps, codec=None, overlap=True, fragments=fragments)
    dhts = swarm_dhts[:3]
    with LateJoinSwarm(dhts, "overlap_late", algorithm, target_batch_size=target) as swarm:
        models, opts = swarm.models, swarm.opts
        wait_for(lambda: all(o.tracker.global_progress.num_trainers == 2 for o in opts[:2]), 30, message="peers")
        last_step = [10**6]  # the schedule is the swarm's: every peer stops at this step (set once the joiner is in)
        give_up = time.monotonic() + 70

        def worker(index: int) -> None:
            generator = torch.Generator().manual_seed(index + 1)
            if index == 2:
                swarm.join(lambda o: o.algorithm_impl.round_indices[0] >= 2, "two rounds of fragment 0")
            opt = opts[index]
            impl = opt.algorithm_impl
            while impl.step_index < last_step[0] and time.monotonic() < give_up:
                train_step(models[index], opt, generator)
                time.sleep(0.03)
                if index == 2 and last_step[0] == 10**6 and {f for f, _ in contributed(impl, 3)} == {0, 1}:
                    last_step[0] = (impl.step_index // inner_steps + 2) * inner_steps
            finish(opt, impl)

        run_peers(worker, 3, timeout=100)
        impls = [opt.algorithm_impl for opt in opts]
        histories = [(list(i.history), i.state_loads) for i in impls]
        assert last_step[0] < 10**6, histories  # the joiner contributed to rounds of both fragments
        catch_up(opts)
    joiner = impls[2]
    histories = [(list(i.history), i.state_loads) for i in impls]
    assert swarm.joined.is_set() and joiner.state_loads >= 1, histories
    assert joiner.inner_steps < impls[0].inner_steps - 2 * inner_steps, histories  # it followed the swarm's schedule
    # the rounds it contributed to were applied by the others at the same round index (the round check)
    for impl in impls[:2]:
        assert contributed(joiner, 3) & {(h[0], h[1]) for h in impl.history if h[2] == "swarm"}, histories
    anchors_agree(impls)
    for model in models[1:]:
        for mine, theirs in zip(models[0].parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(
                mine.detach(), theirs.detach(), atol=0.2, rtol=0, msg=lambda m: f"{m}\n{histories}"
            )
    assert test_loss(models[2]) < test_loss(linear_model(seed=1)) / 10, ([test_loss(m) for m in models], histories)


# ----- error feedback around a round that is not applied


class RecordingCodec(CodecWrapper):
    """Passes every compression to ``codec`` and records its input, so that a test can replay them."""

    def __init__(self, codec: ErrorFeedback) -> None:
        self.codec = codec
        self.calls: list[tuple[torch.Tensor, CompressionInfo | None]] = []
        self.lock = threading.Lock()

    def check_tensor(self, tensor: Any) -> None:
        self.codec.check_tensor(tensor)

    def encode(self, tensor: torch.Tensor, info: CompressionInfo | None = None, allow_inplace: bool = False) -> Any:
        with self.lock:
            self.calls.append((tensor.detach().clone(), info))
        return self.codec.encode(tensor, info, allow_inplace=False)

    def compress(self, tensor: torch.Tensor, info: CompressionInfo | None = None, allow_inplace: bool = False) -> Any:
        return self.encode(tensor, info).to_host()

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.codec.estimate_compression_ratio(info)


class FailAfterRound(RoundHooks):
    """This peer's ``index``-th round (from 0) arrives whole, and is then failed (a hook's fault): its
    messages were all compressed and sent, and no outer step follows."""

    def __init__(self, index: int) -> None:
        self.index, self.rounds = index, 0

    def after_round(self, control: Any, error: BaseException | None) -> None:
        self.rounds += 1
        if self.rounds == self.index + 1:
            raise TimeoutError("injected: the round is counted as failed")


def replayed(calls: list[tuple[torch.Tensor, Any]]) -> dict:
    """The residuals of a fresh ErrorFeedback after these compressions."""
    feedback = ErrorFeedback(SparseTopK(density=0.25, bits=4))
    for tensor, info in calls:
        feedback.encode(tensor, info)
    return feedback.snapshot()


def same_residuals(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k][0], b[k][0], atol=1e-7, rtol=0) for k in a)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "plain"])
def test_a_round_that_is_not_applied_leaves_no_error_feedback_residual(swarm_dhts, overlap):
    """Rounds 0 and 2 succeed, round 1 arrives and is failed by a hook on both peers. Round 2 resends
    round 1's pseudo-gradient (``anchor - params`` still holds it), so after it each peer's residuals
    must be those of its rounds 0 and 2 alone: replayed on a fresh ErrorFeedback, in this process.
    Overlapped DiLoCo and plain DiLoCo (whose rounds block the step) alike."""
    inner_steps, rounds = 4, 3
    dhts = swarm_dhts[:2]
    models = [linear_model(seed=0) for _ in dhts]
    codecs = [RecordingCodec(ErrorFeedback(SparseTopK(density=0.25, bits=4))) for _ in dhts]
    run_id = "overlap_ef" if overlap else "plain_ef"
    opts = [
        make_optimizer(d, m.parameters(), run_id, DiLoCo(inner_steps, codec=c, overlap=overlap), round_hooks=h)
        for d, m, c, h in zip(dhts, models, codecs, [FailAfterRound(1), FailAfterRound(1)], strict=True)
    ]
    impls = [opt.algorithm_impl for opt in opts]
    wait_for(lambda: all(o.tracker.global_progress.num_trainers == 2 for o in opts), 30, message="both peers")
    calls_per_round: list[list[int]] = [[], []]

    def worker(index: int) -> None:
        generator = torch.Generator().manual_seed(index + 1)
        for step in range(1, rounds * inner_steps + 1):
            train_step(models[index], opts[index], generator)
            if step % inner_steps == 0:
                if overlap:
                    impls[index].settle()  # the round started at this step: every compression of it is done
                calls_per_round[index].append(len(codecs[index].calls))

    try:
        run_peers(worker, 2, timeout=50)
    finally:
        for opt in opts:
            opt.shutdown()
    histories = [list(impl.history) for impl in impls]
    for index, impl in enumerate(impls):
        assert [h[2 if overlap else 1] for h in impl.history] == ["swarm", "retry", "swarm"], histories
        if overlap:
            assert all(age <= inner_steps for *_, age in impl.history), histories  # the staleness bound
        first, second, third = calls_per_round[index]
        calls = codecs[index].calls
        assert 0 < first < second < third == len(calls), calls_per_round
        actual = codecs[index].codec.snapshot()
        without_failed = replayed(calls[:first] + calls[second:])
        assert same_residuals(actual, without_failed), (index, histories)
        assert not same_residuals(actual, replayed(calls)), "the failed round's compressions left no residual"
    if overlap:
        anchors_agree(impls)
    else:
        for mine, theirs in zip(impls[0].anchor, impls[1].anchor, strict=True):
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)


def test_error_feedback_restores_one_fragments_residuals_only():
    # fragments' rounds overlap: restoring one fragment's residuals must leave another's round alone
    feedback = ErrorFeedback(SparseTopK(density=0.25, bits=4))
    x = torch.linspace(-1.0, 1.0, 16)
    feedback.encode(x, CompressionInfo(key="f0"))
    before = feedback.snapshot(keys={"f0"})
    assert set(key for key, _ in before) == {"f0"}
    feedback.encode(x * 3, CompressionInfo(key="f0"))  # the round that is not applied
    feedback.encode(x * 2, CompressionInfo(key="f1"))  # another fragment's round, in flight meanwhile
    f1 = feedback.residual("f1").clone()
    feedback.restore(before, keys={"f0"})
    torch.testing.assert_close(feedback.residual("f0"), before[("f0", 0)][0], rtol=0, atol=0)
    torch.testing.assert_close(feedback.residual("f1"), f1, rtol=0, atol=0)
    feedback.restore({}, keys={"f1"})  # a snapshot from before f1's first round: none
    assert feedback.residual("f1") is None and feedback.residual("f0") is not None


# ----- a hostile donor's phase


@pytest.mark.timeout(90)
def test_a_joiner_refuses_a_donors_impossible_round_index_and_loads_from_another(swarm_dhts, monkeypatch, caplog):
    """Two peers train with fragments; one of them serves joiners a phase with a huge round index (a
    finite value: only the algorithm's check can refuse it) and is asked first. The joiner refuses it
    with UntrustedStateError, bans that donor, downloads the honest peer's state, and trains in step."""
    caplog.set_level(logging.WARNING, logger="hivemind_ext")
    inner_steps, fragments = 4, 2
    honest = TrainingStateAverager.get_current_state
    hostile: set[int] = set()

    def get_current_state(self: TrainingStateAverager) -> tuple[Any, list[torch.Tensor]]:
        metadata, tensors = honest(self)
        if id(self) in hostile:  # the phase is the last extra tensor: [step, pace, round of each fragment]
            tensors = [t.clone() for t in tensors]
            tensors[metadata["num_params"] + metadata["num_extra"] - 1][2] = 1e6
        return metadata, tensors

    monkeypatch.setattr(TrainingStateAverager, "get_current_state", get_current_state)
    dhts = swarm_dhts[:3]
    algorithm = DiLoCo(inner_steps, codec=None, overlap=True, fragments=fragments)
    with LateJoinSwarm(dhts, "overlap_hostile", algorithm) as swarm:
        early = swarm.opts[:2]
        hostile.add(id(early[1].state_averager))
        early[1].state_averager.state_sharing_priority = 1  # a newer version than the honest donor's 0
        wait_for(lambda: all(o.tracker.global_progress.num_trainers == 2 for o in early), 30, message="peers")

        def train(indices: Sequence[int], steps: int) -> None:
            def worker(index: int) -> None:
                generator = torch.Generator().manual_seed(indices[index] + 1)
                for _ in range(steps):
                    train_step(swarm.models[indices[index]], swarm.opts[indices[index]], generator)
                    time.sleep(0.02)
                swarm.opts[indices[index]].algorithm_impl.settle()

            run_peers(worker, len(indices), timeout=40)

        train([0, 1], 3 * inner_steps)
        # the joiner's first round fails (a hook): it must still sit it out with weight 0 afterwards
        joiner = swarm.join(lambda o: True, "the early peers", round_hooks=FailOneRound(0))
        joiner.load_state_from_peers()
        impls = [opt.algorithm_impl for opt in swarm.opts]
        assert "UntrustedStateError" in caplog.text or "refused the state" in caplog.text, caplog.text
        assert early[1].state_averager.donor.stats.downloads >= 1  # it was asked first
        assert impls[2].state_loads == 1
        # the honest donor's phase (3 rounds per fragment were due; one may have failed on a loaded machine)
        assert impls[2].round_indices == impls[0].round_indices, [i.round_indices for i in impls]
        assert all(1 <= index <= 3 for index in impls[2].round_indices), [i.round_indices for i in impls]
        for mine, theirs in zip(impls[0].anchor, impls[2].anchor, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
        # it trains on with the others, in step
        train([0, 1, 2], 2 * inner_steps + 1)
        for opt in swarm.opts:
            finish(opt, opt.algorithm_impl)
        catch_up(swarm.opts)
    histories = [list(impl.history) for impl in impls]
    first = impls[2].history[0]
    assert first[2] == "retry" and first[3] == 0.0, histories  # the injected failure, with weight 0
    after = [h for h in impls[2].history if h[0] == first[0]][1]
    assert after[3] == 0.0, histories  # a failed round did not say it was in step: still weight 0
    anchors_agree(impls)
