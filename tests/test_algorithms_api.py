"""The Algorithm API's own guarantees: the default is the standard path, one Algorithm object serves
several models, and QAdam's frozen variance cannot blow an update up."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from swarm import local_swarm

import hivemind_ext
from hivemind_ext.optim.algorithms import Algorithm, AlgorithmImpl, GradientAllReduce
from hivemind_ext.optim.algorithms.qadam import adam_update_, frozen_variance_floor

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
                runners = [opts[peer, name]._runner for peer in range(2)]
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
