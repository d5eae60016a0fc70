"""QAdam's numerics without a network: a short warm-up must not make it diverge, and its update
matches a hand-written reference (floor on the bias-corrected frozen ``v``, the ``max_update`` bound).

Simulated peers run QAdamImpl's real operations; averaging is a weighted mean computed in-process,
each peer's contribution through the bucket's codec (as the all-reduce sends it).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hivemind_ext.compression import MinMaxUInt8, NoCompression, as_codec
from hivemind_ext.errors import ConfigurationError
from hivemind_ext.optim.algorithms import AverageOp, Bucket, QAdam
from hivemind_ext.optim.algorithms.qadam import QAdamImpl

Peer = tuple[QAdamImpl, list[Bucket]]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors on a shared 2-core machine
    yield
    torch.set_num_threads(threads)


def make_peer(params: Sequence[torch.Tensor], algorithm: QAdam, **adam: Any) -> Peer:
    torch_opt = torch.optim.Adam(params, **adam)
    context = SimpleNamespace(params=list(params), torch_optimizer=torch_opt, state_lock=threading.RLock())
    impl = algorithm.reify(context)  # type: ignore[arg-type]
    return impl, build_buckets(impl)


def build_buckets(impl: QAdamImpl) -> list[Bucket]:
    buckets = [Bucket(f"b{i}", group) for i, group in enumerate(impl.tensors_to_buckets(impl.init_tensors()))]
    for bucket in buckets:
        impl.init_operations(bucket)
    return buckets


def global_step(peers: Sequence[Peer]) -> list[Peer]:
    """What AlgorithmRunner.step does after every peer's on_backward, for all peers at once."""
    rebuilt = []
    for impl, buckets in peers:
        if impl.need_reset():  # a new stage: new tensors, buckets and operations
            impl.reset()
            buckets = build_buckets(impl)
        rebuilt.append((impl, buckets))
    peers = rebuilt
    depth = max(len(b.ops) for _, buckets in peers for b in buckets)
    for position in range(depth):
        columns = list(zip(*(buckets for _, buckets in peers), strict=True))
        for column in columns:
            op = column[0].ops[position]
            if isinstance(op, AverageOp):
                weights = [float(b.ops[position].weight()) for b in column]
                codec = as_codec(op.codec or NoCompression())
                for bucket in column:
                    bucket.pack()
                sent = [codec.decompress(codec.compress(b.flat)) for b in column]
                mean = sum(w * t for w, t in zip(weights, sent, strict=True)) / sum(weights)
                for bucket in column:
                    bucket.flat.copy_(mean)
                    bucket.unpack()
            else:
                for bucket in column:
                    bucket.ops[position].run([bucket], None)  # type: ignore[arg-type]
    for impl, _ in peers:
        impl.optimizer_step()
        impl.on_optimizer_step()
    return peers


# ---------------------------------------------------------------------------------------------
# a short warm-up: the benchmark's failure (benchmarks/algorithms.py, warm-up 2 of 8 steps) in miniature

CLASSES, FEATURES, HIDDEN, SAMPLES = 10, 64, 256, 1024
PEERS, BATCH, STEPS_PER_EPOCH, EPOCHS, LR = 2, 32, 4, 8, 2e-3


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy sparse class prototypes in [0, 1] (as digits' pixels: some inputs are always 0)."""
    generator = torch.Generator().manual_seed(0)
    prototypes = (torch.rand(CLASSES, FEATURES, generator=generator) < 0.4) * torch.rand(
        CLASSES, FEATURES, generator=generator
    )
    prototypes[:, :8] = 0
    labels = torch.arange(SAMPLES) % CLASSES
    noise = 0.3 * torch.randn(SAMPLES, FEATURES, generator=generator)
    return (prototypes[labels] + noise).clamp(0, 1) * (prototypes[labels] > 0), labels


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    )


def batches(x: torch.Tensor, y: torch.Tensor, index: int) -> Any:
    generator = torch.Generator().manual_seed(100 + index)
    while True:
        order = torch.randperm(len(x), generator=generator)
        for start in range(0, len(x) - BATCH + 1, BATCH):
            yield x[order[start : start + BATCH]], y[order[start : start + BATCH]]


def full_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(x), y).item()


def train_qadam(algorithm: QAdam) -> list[float]:
    """Mean training loss over the peers after each global step."""
    x, y = dataset()
    models = [make_model() for _ in range(PEERS)]
    streams = [batches(x, y, i) for i in range(PEERS)]
    peers = [make_peer(list(model.parameters()), algorithm, lr=LR) for model in models]
    losses = []
    for _ in range(EPOCHS):
        for (impl, _), model, stream in zip(peers, models, streams, strict=True):
            for _ in range(STEPS_PER_EPOCH):
                inputs, targets = next(stream)
                model.zero_grad()
                torch.nn.functional.cross_entropy(model(inputs), targets).backward()
                impl.on_backward(BATCH)
        peers = global_step(peers)
        losses.append(sum(full_loss(model, x, y) for model in models) / PEERS)
    return losses


def train_synchronous_adam() -> list[float]:
    x, y = dataset()
    model = make_model()
    adam = torch.optim.Adam(model.parameters(), lr=LR)
    streams = [batches(x, y, i) for i in range(PEERS)]
    losses = []
    for _ in range(EPOCHS):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for stream in streams:
            for _ in range(STEPS_PER_EPOCH):
                inputs, targets = next(stream)
                model.zero_grad()
                torch.nn.functional.cross_entropy(model(inputs), targets).backward()
                for total, param in zip(grads, model.parameters(), strict=True):
                    total.add_(param.grad, alpha=1 / (PEERS * STEPS_PER_EPOCH))
        for total, param in zip(grads, model.parameters(), strict=True):
            param.grad = total
        adam.step()
        losses.append(full_loss(model, x, y))
    return losses


@pytest.mark.parametrize("warmup", [2, 4])
def test_qadam_with_a_short_warmup_converges_like_synchronous_adam(warmup: int) -> None:
    """A warm-up of 2 steps froze a v that underestimates the later gradients: m_hat / sqrt(v_hat)
    reached 1e2-1e4 in places and the loss went to ~1e4 (with the floor taken on the raw, not the
    bias-corrected v, and no bound on the update). Now it follows synchronous Adam."""
    sync = train_synchronous_adam()
    qadam = train_qadam(QAdam(warmup_steps=warmup))  # MinMaxUInt8 momenta after warm-up
    assert all(math.isfinite(loss) for loss in qadam), qadam
    assert max(qadam) <= qadam[0] + 1e-3, qadam  # never worse than after the first step
    assert qadam[-1] <= 1.1 * sync[-1], (qadam, sync)


# ---------------------------------------------------------------------------------------------
# the update against a hand-written reference


def test_qadam_update_matches_a_hand_written_reference_through_the_stage_switch() -> None:
    """Two peers (3 and 1 samples), warm-up 2: entry 0 sees no gradient during warm-up (v = 0: the
    floor binds), and the gradients grow 100x after it (the max_update bound binds)."""
    lr, (beta1, beta2), eps, weight_decay, warmup, floor_fraction, bound = 0.01, (0.9, 0.999), 1e-8, 0.1, 2, 0.01, 1.0
    generator = torch.Generator().manual_seed(7)
    init = torch.randn(6, generator=generator)
    samples = (3, 1)
    peers = [
        make_peer(
            [init.clone().requires_grad_()],
            QAdam(warmup, codec=NoCompression()),
            lr=lr,
            betas=(beta1, beta2),
            eps=eps,
            weight_decay=weight_decay,
        )
        for _ in samples
    ]
    x, m, v = init.clone(), torch.zeros(6), torch.zeros(6)
    for t in range(1, 6):
        scale = 0.01 if t <= warmup else 1.0
        local = [scale * torch.randn(6, generator=generator) for _ in samples]
        if t <= warmup:
            for grad in local:
                grad[0] = 0.0
        for (impl, _), grad, n in zip(peers, local, samples, strict=True):
            impl.context.params[0].grad = grad.clone()
            impl.on_backward(n)  # grad_sums += n * grad: the peer's mean gradient is grad
        peers = global_step(peers)

        mean_grad = (samples[0] * local[0] + samples[1] * local[1]) / sum(samples)
        m = beta1 * m + (1 - beta1) * mean_grad  # = the weighted mean of the peers' local momenta
        if t <= warmup:
            v = beta2 * v + (1 - beta2) * mean_grad**2
        m_hat = m / (1 - beta1**t)
        v_hat = v / (1 - beta2 ** min(t, warmup))
        if t > warmup:
            v_hat = v_hat.clamp(min=floor_fraction * v_hat.mean().item())
        update = m_hat / (v_hat.sqrt() + eps)
        if t > warmup:
            assert update.abs().max() > bound  # the case this test is for
            update = update.clamp(-bound, bound)
        x = x - lr * (update + weight_decay * x)

        for impl, _ in peers:
            param = impl.context.params[0]
            state = impl.context.torch_optimizer.state[param]
            assert impl.compressing == (t > warmup)
            torch.testing.assert_close(param.detach(), x, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(state["exp_avg"], m, rtol=1e-5, atol=1e-8)
            torch.testing.assert_close(state["exp_avg_sq"], v, rtol=1e-5, atol=1e-12)
            assert int(state["step"]) == t


def test_after_warmup_no_entry_steps_more_than_max_update_times_lr() -> None:
    lr, bound = 0.05, 0.5
    generator = torch.Generator().manual_seed(8)
    init = torch.randn(300, generator=generator)
    peers = [make_peer([init.clone().requires_grad_()], QAdam(1, max_update=bound), lr=lr) for _ in range(2)]
    for t in range(1, 5):
        before = peers[0][0].context.params[0].detach().clone()
        for impl, _ in peers:  # after warm-up, far larger gradients with outliers (MinMaxUInt8 momenta)
            grad = torch.randn(300, generator=generator) * (1e-3 if t == 1 else 10.0)
            grad[::37] *= 100.0
            impl.context.params[0].grad = grad
            impl.on_backward(8)
        peers = global_step(peers)
        step = (peers[0][0].context.params[0].detach() - before).abs()
        assert step.max() <= lr * (1.0 if t == 1 else bound) * (1 + 1e-5)


@pytest.mark.parametrize("value", [0, -1.0, math.inf, math.nan, "1", True])
def test_qadam_refuses_an_invalid_max_update(value: Any) -> None:
    with pytest.raises(ConfigurationError):
        QAdam(2, max_update=value)


def test_qadam_max_update_none_or_positive_is_accepted() -> None:
    assert QAdam(2, max_update=None).max_update is None
    assert QAdam(2, max_update=3).max_update == 3.0
    assert QAdam(2).max_update == 1.0
    assert isinstance(QAdam(2).codec, MinMaxUInt8)
