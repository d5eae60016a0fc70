"""The Algorithm API's own guarantees: the default is the standard path, one Algorithm object serves
several models, and QAdam's frozen variance cannot blow an update up."""

from __future__ import annotations

import math
import threading
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from hivemind.utils import get_dht_time
from swarm import local_swarm

import hivemind_ext
from hivemind_ext.errors import MatchmakingError
from hivemind_ext.optim.algorithms import (
    Algorithm,
    AlgorithmImpl,
    GradientAllReduce,
    LocalUpdatesImpl,
    SyncGradientsImpl,
)
from hivemind_ext.optim.algorithms.qadam import adam_update_, frozen_variance_floor
from hivemind_ext.optim.algorithms.runner import AlgorithmRunner
from hivemind_ext.optim.rounds import RoundDriver, RoundHooks

TRACKER = dict(min_refresh_period=0.05, max_refresh_period=0.5, default_refresh_period=0.2)


def solo_training(dht, algorithm) -> list[torch.Tensor]:
    """A solo peer steps on its own gradients at every epoch end: deterministic for a given data stream."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1)
    opt = hivemind_ext.Optimizer(
        dht=dht,
        run_id=f"solo_{type(algorithm).__name__}",
        target_batch_size=8,
        batch_size_per_step=4,
        optimizer=lambda params: torch.optim.Adam(params, lr=0.05),
        params=model.parameters(),
        matchmaking_time=0.5,
        averaging_timeout=5.0,
        tracker_opts=TRACKER,
        algorithm=algorithm,
    )
    generator = torch.Generator().manual_seed(1)
    try:
        while opt.local_epoch < 4:
            x = torch.randn(4, 6, generator=generator)
            torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
            opt.step()
            opt.zero_grad()
        assert opt.algorithm_impl is None  # the default runs the Optimizer's own code path
    finally:
        opt.shutdown()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(120)
def test_the_default_algorithm_reproduces_the_standard_behaviour_exactly() -> None:
    with local_swarm(1) as (dht,):
        standard = solo_training(dht, None)
        default = solo_training(dht, GradientAllReduce())
    for a, b in zip(standard, default, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class GenericSync(Algorithm):
    """Synchronous gradient averaging through the generic hooks (AlgorithmImpl's defaults)."""

    def reify(self, context):
        return AlgorithmImpl(context)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("options", "engine_class"),
    [
        (dict(), SyncGradientsImpl),
        (dict(algorithm=GradientAllReduce()), SyncGradientsImpl),
        (dict(use_local_updates=True), LocalUpdatesImpl),
        (dict(algorithm=GenericSync()), AlgorithmRunner),
    ],
)
def test_the_optimizer_always_runs_an_algorithm(options, engine_class) -> None:
    """The default reifies into a built-in implementation that runs its own steps (with local updates
    too); a custom algorithm runs under an AlgorithmRunner."""
    model = torch.nn.Linear(3, 1)
    with local_swarm(1) as (dht,):
        opt = hivemind_ext.Optimizer(
            dht=dht,
            run_id="engine",
            target_batch_size=8,
            batch_size_per_step=4,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
            params=model.parameters(),
            matchmaking_time=0.5,
            averaging_timeout=5.0,
            tracker_opts=TRACKER,
            **options,
        )
        try:
            assert isinstance(opt.engine, engine_class)
            assert (opt.grad_averager is not None) == (engine_class is SyncGradientsImpl)
            assert (opt.algorithm_runner is opt.engine) == (engine_class is AlgorithmRunner)
            model(torch.randn(4, 3)).sum().backward()
            opt.step()
        finally:
            opt.shutdown()


@pytest.mark.timeout(150)
def test_one_algorithm_object_serves_several_models() -> None:
    algorithm = GenericSync()
    with local_swarm(2) as dhts:
        models, opts = {}, {}
        for peer, dht in enumerate(dhts):
            for name, width in (("small", 3), ("wide", 5)):
                torch.manual_seed({"small": 0, "wide": 1}[name])
                model = torch.nn.Linear(width, 1)
                models[peer, name] = model
                opts[peer, name] = hivemind_ext.Optimizer(
                    dht=dht,
                    run_id=f"several_{name}",
                    target_batch_size=16,
                    batch_size_per_step=4,
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                    params=model.parameters(),
                    matchmaking_time=0.5,
                    averaging_timeout=10.0,
                    tracker_opts=TRACKER,
                    algorithm=algorithm,
                )

        def train(peer: int, name: str) -> None:
            generator = torch.Generator().manual_seed(10 * peer + len(name))
            model, opt = models[peer, name], opts[peer, name]
            while opt.local_epoch < 3:
                x = torch.randn(4, model.in_features, generator=generator)
                torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
                opt.step()
                opt.zero_grad()

        threads = [threading.Thread(target=train, args=key) for key in models]
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
            assert not any(thread.is_alive() for thread in threads)
            for name in ("small", "wide"):
                runners = [opts[peer, name].algorithm_runner for peer in range(2)]
                assert all(runner is not None and runner.rounds >= 2 for runner in runners), name
                # each model averaged with the same model on the other peer: identical parameters
                for a, b in zip(models[0, name].parameters(), models[1, name].parameters(), strict=True):
                    torch.testing.assert_close(a, b)
            keys = {opts[0, name].algorithm_impl.context.key for name in ("small", "wide")}
            assert len(keys) == 2  # one implementation per model, each with its own DHT keys
        finally:
            for opt in opts.values():
                opt.shutdown()


def test_qadam_frozen_variance_floor_keeps_updates_bounded() -> None:
    """An entry whose gradient was zero through warm-up has v = 0; a frozen v must not turn its first
    momentum into a step of m / eps."""
    v = torch.tensor([0.0, 1e-4, 4e-4])
    floor = frozen_variance_floor(v)
    assert floor == pytest.approx(1e-2 * v.mean().item())
    param, m = torch.zeros(3), torch.full((3,), 1e-3)
    adam_update_(
        param,
        m,
        v,
        step=10,
        variance_steps=10,
        lr=0.01,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        variance_floor=floor,
    )
    assert param.abs().max() < 1.0  # without the floor the first entry would move by ~1e3
    dead = torch.zeros(3)
    assert math.isinf(frozen_variance_floor(dead))  # a tensor with no gradient at all does not move
    param = torch.ones(3)
    adam_update_(
        param,
        m,
        dead,
        step=10,
        variance_steps=10,
        lr=0.01,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        variance_floor=frozen_variance_floor(dead),
    )
    torch.testing.assert_close(param, torch.ones(3))


# ---------------------------------------------------------------------------------------------
# a failed round under the runner (no network: a stand-in averager and Optimizer)


class _Control:
    cancelled = False

    def done(self) -> bool:
        return False

    def cancel(self) -> None:
        self.cancelled = True


class _Averager:
    last_round = None

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.controls: list[_Control] = []

    def step(self, **kwargs) -> _Control:
        self.calls.append(kwargs)
        self.controls.append(_Control())
        return self.controls[-1]


class _FailEveryRound(RoundHooks):
    """The round-driver seam: every round fails as if the swarm finished it without us."""

    def __init__(self) -> None:
        self.watched: list[bool] = []

    def before_round(self, control, *, watch_swarm: bool) -> None:
        self.watched.append(watch_swarm)
        raise MatchmakingError("the swarm finished this epoch's round without this peer")


class _Swarm:
    """What the runner reaches through its context (no network): 3 peers, rounds that fail."""

    def __init__(self, swarm_epoch: int = 0) -> None:
        self.hooks = _FailEveryRound()
        progress = SimpleNamespace(num_peers=3, num_trainers=3, epoch=swarm_epoch, slowest_trainer_speed=0.0)
        # the runner pauses the tracker's speed estimate while a round on its own clock waits
        self.tracker = SimpleNamespace(global_progress=progress, performance_ema=SimpleNamespace(pause=nullcontext))
        self.rounds = RoundDriver(
            tracker=self.tracker, matchmaking_time=0.5, averaging_timeout=5.0, local_epoch=lambda: 0, hooks=self.hooks
        )
        self.resyncs = 0

    def request_resync(self) -> bool:
        self.resyncs += 1
        return self.rounds.request_resync()


class _OwnSchedule(AlgorithmImpl):
    """Communicates on its own schedule and recovers from failed rounds itself (as DiLoCo does)."""

    resync_after_failed_round = False

    def should_communicate(self) -> bool:
        return True


@pytest.mark.timeout(30)
@pytest.mark.parametrize("impl_class", [AlgorithmImpl, _OwnSchedule])
def test_a_failed_round_keeps_local_values_and_asks_for_a_resync_unless_the_algorithm_recovers(impl_class) -> None:
    optimizer = _Swarm()
    params = [torch.randn(3, 2), torch.randn(4)]
    context = SimpleNamespace(
        params=params,
        grad_compression=None,
        rounds=optimizer.rounds,
        request_resync=optimizer.request_resync,
        tracker=optimizer.tracker,
    )
    impl = impl_class(context)
    results: list[bool] = []
    impl.on_average_result = lambda succeeded, report=None: results.append(succeeded)
    averager = _Averager()
    runner = AlgorithmRunner(impl, averager_factory=lambda position, buckets: averager)
    before = [bucket.flat.clone() for bucket in runner.buckets]
    started = get_dht_time()
    runner.average(runner.buckets)

    assert runner.failed_rounds == 1 and runner.rounds == 0 and results == [False]
    assert averager.controls[0].cancelled  # the abandoned search is cancelled, not left running
    for bucket, old in zip(runner.buckets, before, strict=True):
        assert torch.equal(bucket.flat, old)  # the local values stay
    # the group forms as soon as the 3 peers the tracker sees are looking, else after 2 x matchmaking_time
    assert averager.calls[0]["expected_group_size"] == 3
    assert 0.9 <= averager.calls[0]["scheduled_time"] - started <= 1.5
    default = impl_class is AlgorithmImpl
    assert optimizer.hooks.watched == [default]  # epoch-end rounds give up once the swarm moved on
    assert optimizer.resyncs == (1 if default else 0)


def _runner_in(optimizer: _Swarm, impl_class: type[AlgorithmImpl] = AlgorithmImpl):
    context = SimpleNamespace(
        params=[torch.randn(3)],
        grad_compression=None,
        rounds=optimizer.rounds,
        request_resync=optimizer.request_resync,
        tracker=optimizer.tracker,
    )
    impl = impl_class(context)
    results: list[bool] = []
    impl.on_average_result = lambda succeeded, report=None: results.append(succeeded)
    averager = _Averager()
    return AlgorithmRunner(impl, averager_factory=lambda position, buckets: averager), averager, results


@pytest.mark.timeout(30)
@pytest.mark.parametrize("impl_class", [AlgorithmImpl, _OwnSchedule])
def test_a_peer_behind_the_swarm_skips_the_round_it_missed_and_resyncs(impl_class) -> None:
    """At its epoch's end, a peer whose swarm already entered the next epoch averaged nothing with it: a
    search would join the next epoch's round with this epoch's values (a late peer did, and stayed an
    epoch behind, missing round after round). It downloads the state instead, without searching.
    Algorithms on their own schedule (DiLoCo) are not tied to the epoch and still average."""
    optimizer = _Swarm(swarm_epoch=1)
    runner, averager, results = _runner_in(optimizer, impl_class)
    runner.average(runner.buckets)
    default = impl_class is AlgorithmImpl
    assert results == [False] and runner.failed_rounds == 1
    assert len(averager.calls) == (0 if default else 1)  # no search at all for the missed epoch round
    assert optimizer.hooks.watched == ([] if default else [False])
    assert optimizer.resyncs == (1 if default else 0)


# ---------------------------------------------------------------------------------------------
# a GradScaler with a custom algorithm (it used to be validated, then ignored)


@pytest.mark.timeout(60)
def test_a_grad_scaler_works_with_a_custom_algorithm() -> None:
    """Overflowed batches are skipped and the scale is lowered; the unscaled gradients are what the
    algorithm accumulates and averages."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    scaler = hivemind_ext.GradScaler(device="cpu", init_scale=2.0**8)
    generator = torch.Generator().manual_seed(2)
    with local_swarm(1) as (dht,):
        opt = hivemind_ext.Optimizer(
            dht=dht,
            run_id="scaler_with_algorithm",
            target_batch_size=10_000,  # no epoch ends: the test reads what would be averaged
            batch_size_per_step=4,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
            params=model.parameters(),
            matchmaking_time=0.5,
            averaging_timeout=5.0,
            tracker_opts=TRACKER,
            algorithm=GenericSync(),
        )
        try:
            x = torch.randn(4, 3, generator=generator)
            loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            expected = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            impl, runner = opt.algorithm_impl, opt.algorithm_runner
            assert impl is not None and runner is not None and impl.samples == 4

            def what_is_averaged() -> list[torch.Tensor]:
                tensors = []
                for bucket in runner.buckets:
                    bucket.ops[0].run([bucket], runner)  # the Python op before the average: mean gradients
                    tensors.extend(t.clone() for t in bucket.tensors)
                return tensors

            for averaged, grad in zip(what_is_averaged(), expected, strict=True):
                torch.testing.assert_close(averaged, grad)  # unscaled (not 2**8 times larger)

            scale = scaler.get_scale()
            x = torch.randn(4, 3, generator=generator)
            scaler.scale(torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))).backward()
            model.weight.grad[0, 0] = math.inf  # an overflow
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            assert scaler.get_scale() < scale  # the scale is lowered
            assert impl.samples == 4  # the overflowed batch was skipped
            for averaged, grad in zip(what_is_averaged(), expected, strict=True):
                torch.testing.assert_close(averaged, grad)
        finally:
            opt.shutdown()
