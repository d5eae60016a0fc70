"""Functional optimizer steps give the torch optimizer's numbers and state, with gradients passed explicitly."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import Tensor

from hivemind_ext.errors import ConfigurationError
from hivemind_ext.optim.functional import (
    FunctionalFormMissingWarning,
    FunctionalOptimizer,
    functional_form,
    register_functional,
)

SHAPES = [(7, 5), (5,), (3, 4, 2), (6,)]
STEPS = 5
TIGHT = {"rtol": 1e-6, "atol": 1e-7}

CASES: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd-plain": (torch.optim.SGD, {"lr": 0.1}),
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.1}),
    "sgd-nesterov-wd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    "sgd-maximize-wd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.5, "weight_decay": 0.1, "maximize": True}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adam-amsgrad-wd": (torch.optim.Adam, {"lr": 0.01, "amsgrad": True, "weight_decay": 0.1}),
    "adam-maximize": (torch.optim.Adam, {"lr": 0.01, "betas": (0.8, 0.99), "maximize": True, "weight_decay": 0.1}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "adamw-amsgrad-maximize": (torch.optim.AdamW, {"lr": 0.01, "amsgrad": True, "maximize": True}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
    "adagrad-decay-wd": (
        torch.optim.Adagrad,
        {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.1, "initial_accumulator_value": 0.2, "maximize": True},
    ),
    "rmsprop": (torch.optim.RMSprop, {"lr": 0.01}),
    "rmsprop-centered-momentum-wd": (
        torch.optim.RMSprop,
        {"lr": 0.01, "momentum": 0.9, "centered": True, "weight_decay": 0.1, "maximize": True},
    ),
    # explicit kernel choices in the param_groups are respected
    "sgd-foreach-off": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "foreach": False}),
    "adam-foreach-on": (torch.optim.Adam, {"lr": 0.01, "foreach": True}),
    "adamw-fused": (torch.optim.AdamW, {"lr": 0.01, "amsgrad": True, "fused": True}),
    "sgd-fused": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "fused": True}),
}


def make_params(dtype: torch.dtype = torch.float32, device: str = "cpu") -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(1)
    return [
        torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype=dtype, device=device)) for shape in SHAPES
    ]


def two_groups(params: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
    # the second group gets its own lr, so a step that mixed groups up would show
    return [{"params": params[:2]}, {"params": params[2:], "lr": 0.003}]


def make_grads(params: list[Tensor], seed: int, n_steps: int = STEPS) -> list[list[Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(p.shape, generator=generator).to(dtype=p.dtype, device=p.device) for p in params]
        for _ in range(n_steps)
    ]


def skip_if_unsupported(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], device: str = "cpu") -> None:
    """Skip kernel choices that the installed torch does not offer on this device (fused on CPU is recent)."""
    probe = torch.nn.Parameter(torch.zeros(2, device=device))
    try:
        optimizer = cls([probe], **kwargs)
        probe.grad = torch.ones_like(probe)
        optimizer.step()
    except (RuntimeError, ValueError) as error:
        pytest.skip(f"torch does not support {cls.__name__}({kwargs}) here: {error}")


def torch_step(optimizer: torch.optim.Optimizer, params: list[Tensor], grads: list[Tensor | None]) -> None:
    for param, grad in zip(params, grads, strict=True):
        param.grad = None if grad is None else grad.clone()
    optimizer.step()


def assert_state_dicts_equal(actual: dict, expected: dict) -> None:
    assert actual["param_groups"] == expected["param_groups"]
    assert actual["state"].keys() == expected["state"].keys()
    for index, expected_state in expected["state"].items():
        actual_state = actual["state"][index]
        assert actual_state.keys() == expected_state.keys(), f"state keys of param {index}"
        for key, value in expected_state.items():
            if isinstance(value, Tensor):
                # checks dtype and device too: 'step' must stay e.g. a float32 CPU tensor as torch keeps it
                torch.testing.assert_close(actual_state[key], value, **TIGHT, msg=f"state[{index}][{key!r}]")
            else:
                assert actual_state[key] == value


def assert_params_equal(actual: list[Tensor], expected: list[Tensor], **tolerance: float) -> None:
    for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
        torch.testing.assert_close(a, e, **(tolerance or TIGHT), msg=lambda m, i=index: f"param {i}: {m}")


@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch_optimizer(case: str) -> None:
    cls, kwargs = CASES[case]
    skip_if_unsupported(cls, kwargs)
    reference_params, functional_params = make_params(), make_params()
    reference = cls(two_groups(reference_params), **kwargs)
    functional = FunctionalOptimizer(cls(two_groups(functional_params), **kwargs))
    assert functional.is_functional

    for grads in make_grads(reference_params, seed=2):
        grads_before = [g.clone() for g in grads]
        torch_step(reference, reference_params, grads)
        functional.step(grads)
        assert_params_equal(functional_params, reference_params)
        assert all(p.grad is None for p in functional_params), "the functional step must not touch .grad"
        for grad, before in zip(grads, grads_before, strict=True):
            torch.testing.assert_close(grad, before, rtol=0, atol=0, msg="the step must not modify the gradients")

    assert_state_dicts_equal(functional.optimizer.state_dict(), reference.state_dict())


@pytest.mark.parametrize("case", ["sgd-nesterov-wd", "adam-amsgrad-wd", "adamw", "adagrad-decay-wd", "rmsprop"])
def test_state_dict_is_interchangeable_with_torch(case: str) -> None:
    cls, kwargs = CASES[case]
    grads = make_grads(make_params(), seed=3)

    # functional steps first, then a plain torch optimizer continues from the functional state
    functional_params = make_params()
    functional = FunctionalOptimizer(cls(two_groups(functional_params), **kwargs))
    for step_grads in grads[:3]:
        functional.step(step_grads)
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in functional_params]
    resumed = cls(two_groups(resumed_params), **kwargs)
    resumed.load_state_dict(copy.deepcopy(functional.optimizer.state_dict()))
    for step_grads in grads[3:]:
        functional.step(step_grads)
        torch_step(resumed, resumed_params, step_grads)
    assert_params_equal(functional_params, resumed_params)
    assert_state_dicts_equal(functional.optimizer.state_dict(), resumed.state_dict())

    # and the other way: torch steps first, then a functional optimizer continues from the torch state
    reference_params = make_params()
    reference = cls(two_groups(reference_params), **kwargs)
    for step_grads in grads[:3]:
        torch_step(reference, reference_params, step_grads)
    continued_params = [torch.nn.Parameter(p.detach().clone()) for p in reference_params]
    continued = FunctionalOptimizer(cls(two_groups(continued_params), **kwargs))
    continued.optimizer.load_state_dict(copy.deepcopy(reference.state_dict()))
    for step_grads in grads[3:]:
        torch_step(reference, reference_params, step_grads)
        continued.step(step_grads)
    assert_params_equal(continued_params, reference_params)
    assert_state_dicts_equal(continued.optimizer.state_dict(), reference.state_dict())


@pytest.mark.parametrize("case", ["sgd-momentum", "adam-amsgrad-wd", "adagrad", "rmsprop-centered-momentum-wd"])
def test_none_gradients_are_skipped(case: str) -> None:
    cls, kwargs = CASES[case]
    reference_params, functional_params = make_params(), make_params()
    reference = cls(two_groups(reference_params), **kwargs)
    functional = FunctionalOptimizer(cls(two_groups(functional_params), **kwargs))
    grads = make_grads(reference_params, seed=4, n_steps=3)

    # step 1: param 1 has no gradient yet; step 2: everyone; step 3: param 3 (second group) has none
    grads[0][1] = None
    grads[2][3] = None
    for step, step_grads in enumerate(grads):
        before = [p.detach().clone() for p in functional_params]
        state_before = copy.deepcopy(functional.optimizer.state_dict()["state"])
        torch_step(reference, reference_params, step_grads)
        functional.step(step_grads)
        for index, grad in enumerate(step_grads):
            if grad is None:
                torch.testing.assert_close(functional_params[index], before[index], rtol=0, atol=0)
                after = functional.optimizer.state_dict()["state"].get(index)
                assert after is None or index in state_before, f"step {step}: state created for param {index}"
                if index in state_before:
                    assert_state_dicts_equal(
                        {"param_groups": [], "state": {index: after}},
                        {"param_groups": [], "state": {index: state_before[index]}},
                    )
        assert_params_equal(functional_params, reference_params)
        assert_state_dicts_equal(functional.optimizer.state_dict(), reference.state_dict())


def test_all_gradients_none_is_a_no_op() -> None:
    params = make_params()
    functional = FunctionalOptimizer(torch.optim.Adam(params, lr=0.1))
    before = [p.detach().clone() for p in params]
    functional.step([None] * len(params))
    assert_params_equal(params, before)
    assert functional.optimizer.state_dict()["state"] == {}


def test_sgd_without_momentum_keeps_no_state() -> None:
    # torch's SGD without momentum never creates state entries; neither may the functional step
    params = make_params()
    functional = FunctionalOptimizer(torch.optim.SGD(params, lr=0.1))
    functional.step(make_grads(params, seed=5, n_steps=1)[0])
    assert functional.optimizer.state_dict()["state"] == {}


def test_existing_grad_attribute_is_ignored_and_kept() -> None:
    params = make_params()
    stale = [torch.full_like(p, 1e6) for p in params]
    for param, grad in zip(params, stale, strict=True):
        param.grad = grad
    reference_params = make_params()
    reference = torch.optim.SGD(reference_params, lr=0.1, momentum=0.9)
    functional = FunctionalOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9))
    for grads in make_grads(params, seed=6, n_steps=2):
        torch_step(reference, reference_params, grads)
        functional.step(grads)
    assert_params_equal(params, reference_params)
    assert all(p.grad is g for p, g in zip(params, stale, strict=True))


def test_param_group_added_later_is_stepped() -> None:
    reference_params, functional_params = make_params(), make_params()
    reference = torch.optim.Adam(reference_params[:2], lr=0.01)
    functional = FunctionalOptimizer(torch.optim.Adam(functional_params[:2], lr=0.01))
    grads = make_grads(reference_params, seed=7, n_steps=3)
    for step_grads in grads[:1]:
        torch_step(reference, reference_params[:2], step_grads[:2])
        functional.step(step_grads[:2])
    reference.add_param_group({"params": reference_params[2:], "lr": 0.05})
    functional.optimizer.add_param_group({"params": functional_params[2:], "lr": 0.05})
    for step_grads in grads[1:]:
        torch_step(reference, reference_params, step_grads)
        functional.step(step_grads)
    assert_params_equal(functional_params, reference_params)
    assert_state_dicts_equal(functional.optimizer.state_dict(), reference.state_dict())


def test_wrong_number_of_gradients_raises() -> None:
    params = make_params()
    functional = FunctionalOptimizer(torch.optim.Adam(two_groups(params), lr=0.1))
    grads = make_grads(params, seed=8, n_steps=1)[0]
    before = [p.detach().clone() for p in params]
    with pytest.raises(ConfigurationError, match="expected 4 gradients"):
        functional.step(grads[:-1])
    with pytest.raises(ConfigurationError, match="expected 4 gradients"):
        functional.step([*grads, grads[0]])
    assert_params_equal(params, before)
    assert functional.optimizer.state_dict()["state"] == {}


@pytest.mark.parametrize(
    ("bad_grad", "message"),
    [
        (torch.zeros(5, 7), "shape"),
        (torch.zeros(35), "shape"),
        (torch.zeros(7, 5, dtype=torch.float64), "dtype"),
        (torch.zeros(7, 5, dtype=torch.int64), "dtype"),
        ([[0.0] * 5] * 7, "Tensor or None"),
    ],
)
def test_mismatched_gradient_raises(bad_grad: Any, message: str) -> None:
    params = make_params()
    functional = FunctionalOptimizer(torch.optim.SGD(two_groups(params), lr=0.1, momentum=0.9))
    grads: list[Any] = make_grads(params, seed=9, n_steps=1)[0]
    grads[0] = bad_grad
    before = [p.detach().clone() for p in params]
    with pytest.raises(ConfigurationError, match=message):
        functional.step(grads)
    # validation happens before any parameter is touched
    assert_params_equal(params, before)
    assert functional.optimizer.state_dict()["state"] == {}


def test_gradient_on_another_device_is_moved() -> None:
    # 'meta' stands in for a second device, so this runs without a GPU (the CUDA test below does it for real)
    sign_sgd = make_sign_sgd_class()
    seen: list[Tensor] = []

    def recording_step(group: dict, params: list[Tensor], grads: list[Tensor], states: list[dict]) -> None:
        seen.extend(grads)

    register_functional(sign_sgd, recording_step)
    params = [torch.nn.Parameter(torch.zeros(3, 2, device="meta")), torch.nn.Parameter(torch.zeros(4))]
    FunctionalOptimizer(sign_sgd(params)).step([torch.ones(3, 2), torch.ones(4)])
    assert [g.device.type for g in seen] == ["meta", "cpu"]


def test_sparse_gradient_for_adam_raises() -> None:
    params = [torch.nn.Parameter(torch.zeros(4, 3))]
    functional = FunctionalOptimizer(torch.optim.Adam(params, lr=0.1))
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2, 3), (4, 3), check_invariants=True)
    with pytest.raises(ConfigurationError, match="sparse"):
        functional.step([sparse])


def test_differentiable_group_is_rejected() -> None:
    params = make_params()
    with pytest.raises(ConfigurationError, match="differentiable"):
        FunctionalOptimizer(torch.optim.Adam(params, lr=0.1, differentiable=True))


def test_not_an_optimizer_is_rejected() -> None:
    with pytest.raises(ConfigurationError):
        FunctionalOptimizer(object())  # type: ignore[arg-type]


# ------------------------------------------------------------------------ registry and fallback


def make_sign_sgd_class() -> type[torch.optim.Optimizer]:
    """A fresh optimizer class per test, so registrations made by one test cannot leak into another."""

    class SignSGD(torch.optim.Optimizer):
        def __init__(self, params: Any, lr: float = 0.01, momentum: float = 0.5) -> None:
            super().__init__(params, {"lr": lr, "momentum": momentum})

        @torch.no_grad()
        def step(self, closure: Any = None) -> None:
            for group in self.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    state = self.state[param]
                    buffer = state.setdefault("momentum_buffer", torch.zeros_like(param))
                    buffer.mul_(group["momentum"]).add_(param.grad)
                    param.add_(buffer.sign(), alpha=-group["lr"])

    return SignSGD


def sign_sgd_step(group: dict[str, Any], params: list[Tensor], grads: list[Tensor], states: list[dict]) -> None:
    for state, param in zip(states, params, strict=True):
        state.setdefault("momentum_buffer", torch.zeros_like(param))
    buffers = [state["momentum_buffer"] for state in states]
    torch._foreach_mul_(buffers, group["momentum"])
    torch._foreach_add_(buffers, grads)
    torch._foreach_add_(params, torch._foreach_sign(buffers), alpha=-group["lr"])


def test_optimizer_without_functional_form_warns_and_falls_back() -> None:
    sign_sgd = make_sign_sgd_class()
    reference_params, fallback_params = make_params(), make_params()
    reference = sign_sgd(two_groups(reference_params), lr=0.05)
    with pytest.warns(FunctionalFormMissingWarning, match="SignSGD.*register_functional"):
        fallback = FunctionalOptimizer(sign_sgd(two_groups(fallback_params), lr=0.05))
    assert issubclass(FunctionalFormMissingWarning, UserWarning)
    assert not fallback.is_functional

    previous = [None, torch.ones(SHAPES[1]), None, torch.ones(SHAPES[3])]
    for param, grad in zip(fallback_params, previous, strict=True):
        param.grad = grad
    for grads in make_grads(reference_params, seed=10):
        grads[2] = None
        torch_step(reference, reference_params, grads)
        fallback.step(grads)
        assert_params_equal(fallback_params, reference_params)
        # the fallback puts the previous .grad values back (the very same objects)
        assert all(p.grad is g for p, g in zip(fallback_params, previous, strict=True))
    assert_state_dicts_equal(fallback.optimizer.state_dict(), reference.state_dict())


def test_fallback_restores_grads_when_step_fails() -> None:
    sign_sgd = make_sign_sgd_class()
    params = make_params()
    with pytest.warns(FunctionalFormMissingWarning):
        fallback = FunctionalOptimizer(sign_sgd(params, lr=0.05))

    def failing_step(closure: Any = None) -> None:
        raise RuntimeError("boom")

    fallback.optimizer.step = failing_step  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="boom"):
        fallback.step(make_grads(params, seed=11, n_steps=1)[0])
    assert all(p.grad is None for p in params)


def test_registering_a_functional_form_removes_the_warning() -> None:
    sign_sgd = make_sign_sgd_class()
    register_functional(sign_sgd, sign_sgd_step)
    assert functional_form(sign_sgd) is sign_sgd_step

    reference_params, functional_params = make_params(), make_params()
    reference = sign_sgd(two_groups(reference_params), lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        functional = FunctionalOptimizer(sign_sgd(two_groups(functional_params), lr=0.05))
    assert functional.is_functional
    for grads in make_grads(reference_params, seed=12):
        torch_step(reference, reference_params, grads)
        functional.step(grads)
    assert_params_equal(functional_params, reference_params)
    assert all(p.grad is None for p in functional_params)
    assert_state_dicts_equal(functional.optimizer.state_dict(), reference.state_dict())


def test_duplicate_registration_needs_replace() -> None:
    sign_sgd = make_sign_sgd_class()
    register_functional(sign_sgd, sign_sgd_step)

    def other_step(group: dict, params: list[Tensor], grads: list[Tensor], states: list[dict]) -> None:
        raise AssertionError("not called")

    with pytest.raises(ConfigurationError, match="replace=True"):
        register_functional(sign_sgd, other_step)
    assert functional_form(sign_sgd) is sign_sgd_step
    register_functional(sign_sgd, other_step, replace=True)
    assert functional_form(sign_sgd) is other_step


def test_register_rejects_non_optimizer_classes() -> None:
    with pytest.raises(ConfigurationError):
        register_functional(torch.nn.Linear, sign_sgd_step)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        register_functional(make_sign_sgd_class(), "not callable")  # type: ignore[arg-type]


def test_subclass_inherits_the_form_only_when_it_keeps_the_step() -> None:
    class PlainAdam(torch.optim.Adam):
        pass

    class ClippedAdam(torch.optim.Adam):
        def step(self, closure: Any = None) -> Any:
            for group in self.param_groups:
                torch.nn.utils.clip_grad_norm_(group["params"], 1.0)
            return super().step(closure)

    assert functional_form(PlainAdam) is functional_form(torch.optim.Adam) is not None
    assert functional_form(ClippedAdam) is None

    # a subclass that changes the math keeps its own numbers through the fallback
    reference_params, fallback_params = make_params(), make_params()
    reference = ClippedAdam(reference_params, lr=0.01)
    with pytest.warns(FunctionalFormMissingWarning, match="ClippedAdam"):
        fallback = FunctionalOptimizer(ClippedAdam(fallback_params, lr=0.01))
    for grads in make_grads(reference_params, seed=13, n_steps=2):
        grads = [g * 10 for g in grads]  # large enough for the clipping to matter
        torch_step(reference, reference_params, grads)
        fallback.step(grads)
    assert_params_equal(fallback_params, reference_params)


# ----------------------------------------------------------------------------------- precisions


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ["sgd-nesterov-wd", "adam-amsgrad-wd", "adamw", "adagrad", "rmsprop"])
def test_half_precision_params(case: str, dtype: torch.dtype) -> None:
    cls, kwargs = CASES[case]
    skip_if_unsupported(cls, {**kwargs, "foreach": True})
    functional_params = make_params(dtype)
    functional = FunctionalOptimizer(cls(two_groups(functional_params), **kwargs))
    # same kernels (foreach) as the functional path: the same numbers
    foreach_params = make_params(dtype)
    foreach = cls(two_groups(foreach_params), **{**kwargs, "foreach": True})
    # torch's default on CPU loops tensor by tensor, which may round half precision differently by an ulp or so
    default_params = make_params(dtype)
    default = cls(two_groups(default_params), **kwargs)

    for grads in make_grads(functional_params, seed=14):
        functional.step(grads)
        torch_step(foreach, foreach_params, grads)
        torch_step(default, default_params, grads)
    assert all(p.dtype == dtype for p in functional_params)
    assert_params_equal(functional_params, foreach_params, rtol=0, atol=0)
    assert_params_equal(functional_params, default_params, rtol=2e-2, atol=1e-2)
    expected_state = foreach.state_dict()
    for group in expected_state["param_groups"]:
        group["foreach"] = kwargs.get("foreach")
    assert_state_dicts_equal(functional.optimizer.state_dict(), expected_state)


# ----------------------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "case", ["sgd-nesterov-wd", "adam-amsgrad-wd", "adamw", "adamw-fused", "sgd-fused", "adagrad", "rmsprop"]
)
def test_cuda_matches_torch_and_moves_host_gradients(case: str) -> None:
    cls, kwargs = CASES[case]
    skip_if_unsupported(cls, kwargs, device="cuda")
    reference_params, functional_params = make_params(device="cuda"), make_params(device="cuda")
    reference = cls(two_groups(reference_params), **kwargs)
    functional = FunctionalOptimizer(cls(two_groups(functional_params), **kwargs))
    for grads in make_grads(make_params(), seed=15):  # gradients on the host: moved to the GPU by step()
        torch_step(reference, reference_params, [g.cuda() for g in grads])
        functional.step(grads)
    torch.cuda.synchronize()
    assert all(p.device.type == "cuda" and p.grad is None for p in functional_params)
    assert_params_equal(functional_params, reference_params)
    assert_state_dicts_equal(functional.optimizer.state_dict(), reference.state_dict())


def test_lr_scheduler_drives_the_functional_step_without_warnings() -> None:
    reference_params, functional_params = make_params(), make_params()
    reference = torch.optim.SGD(two_groups(reference_params), lr=0.1, momentum=0.9)
    functional = FunctionalOptimizer(torch.optim.SGD(two_groups(functional_params), lr=0.1, momentum=0.9))
    reference_scheduler = torch.optim.lr_scheduler.StepLR(reference, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        functional_scheduler = torch.optim.lr_scheduler.StepLR(functional.optimizer, step_size=1, gamma=0.5)
        for grads in make_grads(reference_params, seed=16, n_steps=3):
            torch_step(reference, reference_params, grads)
            reference_scheduler.step()
            functional.step(grads)
            functional_scheduler.step()
    assert_params_equal(functional_params, reference_params)
    assert [g["lr"] for g in functional.optimizer.param_groups] == [g["lr"] for g in reference.param_groups]


def test_differentiable_group_added_later_is_rejected_at_step() -> None:
    params = make_params()
    functional = FunctionalOptimizer(torch.optim.Adam(params[:2], lr=0.1))
    functional.optimizer.add_param_group({"params": params[2:], "differentiable": True})
    before = [p.detach().clone() for p in params]
    with pytest.raises(ConfigurationError, match="differentiable"):
        functional.step(make_grads(params, seed=17, n_steps=1)[0])
    assert_params_equal(params, before)  # no group was stepped
