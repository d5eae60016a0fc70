"""TrainingState and GradientAccumulator without a network: snapshots for newcomers, offload copies,
the scheduler on the epoch, functional steps equal to torch's, and local gradient accumulation."""

from __future__ import annotations

import copy

import pytest
import torch
from hivemind.utils.serializer import MSGPackSerializer

from hivemind_ext.errors import NonFiniteTensorError, StateLoadError
from hivemind_ext.optim.grad_accumulator import GradientAccumulator
from hivemind_ext.optim.training_state import TrainingState


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def random_grads(params: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=generator) for p in params]


def adam_state(model: torch.nn.Module, *, offload: bool = False, scheduler: bool = True) -> TrainingState:
    return TrainingState(
        optimizer=lambda params: torch.optim.Adam(params, lr=0.1),
        params=model.parameters(),
        scheduler=(lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)) if scheduler else None,
        offload=offload,
    )


def trained_state(steps: int = 3, epoch: int = 2) -> tuple[torch.nn.Module, TrainingState]:
    model = make_model(0)
    state = adam_state(model)
    for i in range(steps):
        state.apply_gradients(random_grads(state.opt_params, seed=i))
    state.set_epoch(epoch)
    return model, state


def frozen(state: TrainingState) -> tuple:
    """Everything load() could change, as plain values."""
    return (
        [p.detach().clone() for p in state.opt_params],
        copy.deepcopy(state.optimizer.state_dict()),
        state.epoch,
        state.optimizer.param_groups[0]["lr"],
    )


def assert_unchanged(before: tuple, state: TrainingState) -> None:
    params, opt_state, epoch, lr = before
    for old, new in zip(params, state.opt_params, strict=True):
        assert torch.equal(old, new)
    now = state.optimizer.state_dict()
    assert len(now["state"]) == len(opt_state["state"])
    for key, old in opt_state["state"].items():
        for name, value in old.items():
            assert torch.equal(now["state"][key][name], value), (key, name)
    assert state.epoch == epoch
    assert state.optimizer.param_groups[0]["lr"] == lr


# ----- snapshot / load


def test_snapshot_round_trip_through_lossy_codec_keeps_step_counters_exact() -> None:
    _, source = trained_state(steps=3, epoch=2)
    metadata, tensors = source.snapshot()
    # what the wire does: metadata through msgpack, tensors through a lossy 16-bit codec
    metadata = MSGPackSerializer.loads(MSGPackSerializer.dumps(metadata))
    lossy = [t.half().float() for t in tensors]

    target_model = make_model(seed=1)
    target = adam_state(target_model)
    assert not torch.allclose(target.opt_params[0], source.opt_params[0])
    target.load(metadata, lossy)

    assert target.epoch == 2
    assert target.scheduler.last_epoch == 2
    assert target.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)
    for mine, theirs in zip(target.opt_params, source.opt_params, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-2, rtol=1e-2)
    for mine, theirs in zip(target_model.parameters(), source.opt_params, strict=True):
        torch.testing.assert_close(mine.detach(), theirs, atol=1e-2, rtol=1e-2)
    src_state, dst_state = source.optimizer.state_dict()["state"], target.optimizer.state_dict()["state"]
    assert set(src_state) == set(dst_state)
    for key in src_state:
        step = dst_state[key]["step"]
        assert isinstance(step, torch.Tensor) and step.dim() == 0
        assert step.dtype == src_state[key]["step"].dtype
        assert step.item() == src_state[key]["step"].item() == 3.0  # exact, not 16-bit rounded
        torch.testing.assert_close(dst_state[key]["exp_avg"], src_state[key]["exp_avg"], atol=1e-3, rtol=1e-2)
    # the loaded optimizer keeps stepping from the downloaded state: step counter 4 next
    target.apply_gradients(random_grads(target.opt_params, seed=10))
    assert all(s["step"].item() == 4.0 for s in target.optimizer.state.values())


def test_snapshot_is_a_copy() -> None:
    _, state = trained_state()
    _, tensors = state.snapshot()
    before = tensors[0].clone()
    with torch.no_grad():
        state.opt_params[0].add_(1.0)
    assert torch.equal(tensors[0], before)


def test_load_before_any_step_gets_state_from_a_trained_peer() -> None:
    _, source = trained_state(steps=2, epoch=5)
    fresh = adam_state(make_model(3))
    assert not fresh.optimizer.state
    fresh.load(*source.snapshot())
    assert fresh.epoch == 5
    assert all(s["step"].item() == 2.0 for s in fresh.optimizer.state.values())


@pytest.mark.parametrize(
    "corrupt",
    ["wrong_shape", "missing_tensor", "nan", "inf", "num_params", "group_sizes", "epoch", "format", "int_tensor"],
)
def test_load_rejects_a_bad_snapshot_and_changes_nothing(corrupt: str) -> None:
    _, source = trained_state(steps=2, epoch=3)
    metadata, tensors = source.snapshot()
    _, target = trained_state(steps=1, epoch=1)
    with torch.no_grad():
        target.opt_params[0].add_(5.0)  # differ from the source in every way load() would change
    before = frozen(target)
    if corrupt == "wrong_shape":
        tensors[0] = torch.zeros(tensors[0].shape[0] + 1, *tensors[0].shape[1:])
    elif corrupt == "missing_tensor":
        tensors = tensors[: len(target.opt_params) - 1]
    elif corrupt == "nan":
        tensors[1] = tensors[1].clone()
        tensors[1].view(-1)[0] = float("nan")
    elif corrupt == "inf":
        tensors[-1] = tensors[-1].clone()
        tensors[-1].view(-1)[-1] = float("inf")
    elif corrupt == "num_params":
        metadata["num_params"] += 1
    elif corrupt == "group_sizes":
        metadata["group_sizes"] = [1, len(target.opt_params) - 1]
    elif corrupt == "epoch":
        metadata["epoch"] = -1
    elif corrupt == "format":
        metadata["format"] = 999
    elif corrupt == "int_tensor":
        tensors[0] = tensors[0].to(torch.int64)
    with pytest.raises(StateLoadError):
        target.load(metadata, tensors)
    assert_unchanged(before, target)


def test_load_rejects_a_snapshot_of_a_different_model() -> None:
    _, source = trained_state()
    other = TrainingState(optimizer=lambda p: torch.optim.Adam(p), params=torch.nn.Linear(4, 2).parameters())
    before = frozen(other)
    with pytest.raises(StateLoadError):
        other.load(*source.snapshot())
    assert_unchanged(before, other)


# ----- offload


def test_offload_keeps_host_copies_and_copies_both_ways() -> None:
    model = make_model()
    state = adam_state(model, offload=True)
    main = list(model.parameters())
    assert state.offload
    assert all(a is b for a, b in zip(state.main_params, main, strict=True))
    assert all(o is not m and o.data_ptr() != m.data_ptr() for o, m in zip(state.opt_params, main, strict=True))
    assert all(torch.equal(o, m) for o, m in zip(state.opt_params, main, strict=True))
    optimizer_params = [p for g in state.optimizer.param_groups for p in g["params"]]
    assert all(a is b for a, b in zip(optimizer_params, state.opt_params, strict=True))

    before = [m.detach().clone() for m in main]
    state.apply_gradients(random_grads(main, seed=0))
    assert all(torch.equal(b, m) for b, m in zip(before, main, strict=True)), "the model changes only on copy_to_model"
    assert not torch.equal(state.opt_params[0], main[0])
    state.copy_to_model()
    assert all(torch.equal(o, m) for o, m in zip(state.opt_params, main, strict=True))

    with torch.no_grad():
        for m in main:
            m.mul_(3.0)
    assert not torch.equal(state.opt_params[0], main[0])
    state.copy_from_model()
    assert all(torch.equal(o, m) for o, m in zip(state.opt_params, main, strict=True))


def test_without_offload_the_optimizer_steps_the_model_itself() -> None:
    model = make_model()
    state = adam_state(model, offload=False)
    assert not state.offload
    assert all(a is b for a, b in zip(state.opt_params, model.parameters(), strict=True))


# ----- the scheduler follows the epoch


def test_set_epoch_steps_the_scheduler_to_the_epoch() -> None:
    model = make_model()
    state = adam_state(model)
    assert state.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    state.set_epoch(3)
    assert state.epoch == 3 and state.scheduler.last_epoch == 3
    assert state.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    state.set_epoch(3)  # the same epoch again: no further step
    assert state.scheduler.last_epoch == 3
    assert state.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    state.set_epoch(4)
    assert state.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**4)


def test_scheduler_may_be_a_prebuilt_instance() -> None:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.1)
    state = TrainingState(optimizer=optimizer, scheduler=scheduler)
    assert state.scheduler is scheduler
    state.set_epoch(4)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01)


# ----- functional steps equal torch's


@pytest.mark.parametrize(
    "factory",
    [
        lambda p: torch.optim.Adam(p, lr=0.05, weight_decay=0.01),
        lambda p: torch.optim.AdamW(p, lr=0.05),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    ],
    ids=["adam", "adamw", "sgd_nesterov"],
)
@pytest.mark.parametrize("offload", [False, True])
def test_apply_gradients_equals_the_torch_optimizer_step(factory, offload: bool) -> None:
    ours_model, ref_model = make_model(0), make_model(0)
    state = TrainingState(optimizer=factory, params=ours_model.parameters(), offload=offload)
    reference = factory(ref_model.parameters())
    for i in range(4):
        grads = random_grads(list(ref_model.parameters()), seed=i)
        if i == 2:
            grads[1] = None  # a parameter without a gradient is left alone, as torch does
        for p, g in zip(ref_model.parameters(), grads, strict=True):
            p.grad = None if g is None else g.clone()
        reference.step()
        state.apply_gradients(grads)
        state.copy_to_model()
    for ours, ref in zip(ours_model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)
    assert all(p.grad is None for p in ours_model.parameters()), "apply_gradients must not touch .grad"
    ours_state, ref_state = state.optimizer.state_dict()["state"], reference.state_dict()["state"]
    assert set(ours_state) == set(ref_state)
    for key in ref_state:
        for name, value in ref_state[key].items():
            torch.testing.assert_close(ours_state[key][name], value, rtol=1e-6, atol=1e-7)


# ----- GradientAccumulator


def set_grads(params: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
    for p, g in zip(params, grads, strict=True):
        p.grad = None if g is None else g.clone()


def mean_of(accumulator: GradientAccumulator) -> list[torch.Tensor]:
    out = [torch.full_like(p, 123.0) for p in accumulator.params]
    accumulator.mean_gradients(out)
    return out


@pytest.fixture
def params() -> list[torch.Tensor]:
    return [torch.zeros(3, 2, requires_grad=True), torch.zeros(5, requires_grad=True)]


def test_accumulator_takes_the_sample_weighted_mean(params) -> None:
    acc = GradientAccumulator(params)
    assert all(torch.equal(m, torch.zeros_like(m)) for m in mean_of(acc)), "nothing accumulated: zeros"
    g1, g2 = random_grads(params, 1), random_grads(params, 2)
    set_grads(params, g1)
    acc.accumulate(2)
    set_grads(params, g2)
    acc.accumulate(6)
    assert acc.samples == 8 and acc.micro_steps == 2
    for mean, a, b in zip(mean_of(acc), g1, g2, strict=True):
        torch.testing.assert_close(mean, (2 * a + 6 * b) / 8)


def test_accumulator_reuse_mode_mean_is_grad_over_micro_steps(params) -> None:
    acc = GradientAccumulator(params, reuse_grad_buffers=True)
    g1, g2 = random_grads(params, 1), random_grads(params, 2)
    set_grads(params, g1)
    acc.accumulate(2)
    for p, g in zip(params, g2, strict=True):  # what autograd does when .grad is not zeroed
        p.grad.add_(g)
    acc.accumulate(6)
    for mean, a, b in zip(mean_of(acc), g1, g2, strict=True):
        torch.testing.assert_close(mean, (a + b) / 2)  # each micro-step counts equally, whatever its size
    acc.reset()
    assert acc.samples == 0 and acc.micro_steps == 0
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in params), "reuse mode: reset zeroes .grad"


def test_accumulator_reset_starts_over(params) -> None:
    acc = GradientAccumulator(params)
    set_grads(params, random_grads(params, 1))
    acc.accumulate(4)
    acc.reset()
    assert acc.samples == 0 and acc.micro_steps == 0
    assert all(torch.equal(m, torch.zeros_like(m)) for m in mean_of(acc))
    g = random_grads(params, 2)
    set_grads(params, g)
    acc.accumulate(3)
    for mean, expected in zip(mean_of(acc), g, strict=True):
        torch.testing.assert_close(mean, expected)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("reuse", [False, True])
def test_accumulator_refuses_non_finite_gradients_and_keeps_earlier_samples(params, bad: float, reuse: bool) -> None:
    acc = GradientAccumulator(params, reuse_grad_buffers=reuse)
    g1 = random_grads(params, 1)
    set_grads(params, g1)
    acc.accumulate(4)
    expected = mean_of(acc)
    poisoned = random_grads(params, 2)
    poisoned[1][2] = bad
    if reuse:
        set_grads(params, g1)  # reuse mode: the check sees .grad as it stands; keep the earlier sum there
        params[1].grad[2] = bad
    else:
        set_grads(params, poisoned)
    with pytest.raises(NonFiniteTensorError):
        acc.accumulate(4)
    assert acc.samples == 4 and acc.micro_steps == 1
    if not reuse:
        for mean, exp in zip(mean_of(acc), expected, strict=True):
            torch.testing.assert_close(mean, exp)


def test_accumulator_treats_missing_gradients_as_zero(params) -> None:
    acc = GradientAccumulator(params)
    g1, g2 = random_grads(params, 1), random_grads(params, 2)
    set_grads(params, [g1[0], None])  # the second parameter took no part in this micro-batch
    acc.accumulate(2)
    set_grads(params, g2)
    acc.accumulate(6)
    means = mean_of(acc)
    torch.testing.assert_close(means[0], (2 * g1[0] + 6 * g2[0]) / 8)
    torch.testing.assert_close(means[1], 6 * g2[1] / 8)


def test_accumulator_with_no_gradients_at_all_counts_samples(params) -> None:
    acc = GradientAccumulator(params)
    acc.accumulate(5)  # e.g. a frozen model part: no .grad anywhere
    assert acc.samples == 5
    assert all(torch.equal(m, torch.zeros_like(m)) for m in mean_of(acc))
