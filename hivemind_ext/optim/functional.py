"""Functional optimizer steps: a torch optimizer's math applied with explicit gradients.

The Optimizer steps its torch optimizer in a background thread (``delay_optimizer_step``) or on host
copies of the parameters (``offload_optimizer``). Reading gradients from ``.grad`` there would race
with the training loop, so the step takes the gradients as arguments instead: a *functional step*
updates one param_group's parameters in place from a list of gradients and the per-parameter state
dicts, which stay the optimizer's own ``optimizer.state[p]`` (so ``state_dict()`` and
``load_state_dict()`` keep working unchanged).

Built-in functional steps (SGD, Adam, AdamW, Adagrad, RMSprop) initialize state exactly as the torch
optimizer's ``_init_group`` does (same keys, dtypes and devices) and then call PyTorch's own functional
implementation (``torch.optim.adam.adam`` ...) with foreach kernels, or fused ones where the
param_group asked for them. Other optimizer classes can be added with :func:`register_functional`;
for a class without a functional form, :class:`FunctionalOptimizer` warns and falls back to swapping
``.grad`` around ``optimizer.step()``.
"""

from __future__ import annotations

import inspect
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.optim.adagrad import adagrad
from torch.optim.adam import adam
from torch.optim.adamw import adamw
from torch.optim.rmsprop import rmsprop
from torch.optim.sgd import sgd

from hivemind_ext.errors import ConfigurationError

__all__ = [
    "FunctionalFormMissingWarning",
    "FunctionalOptimizer",
    "FunctionalStep",
    "adagrad_step",
    "adam_step",
    "adamw_step",
    "functional_form",
    "register_functional",
    "rmsprop_step",
    "sgd_step",
]


class FunctionalStep(Protocol):
    """One optimizer step for one param_group, with gradients passed explicitly.

    ``group`` is the torch param_group dict (lr, betas, weight_decay, ...); ``params``, ``grads`` and
    ``states`` are parallel lists holding only the parameters that have a gradient this step;
    ``states[i]`` is ``optimizer.state[params[i]]``, empty before the first step and initialized
    lazily by the step exactly as the torch optimizer would. The step updates ``params`` and
    ``states`` in place, never reads or writes ``.grad`` and never modifies ``grads``. It is called
    under ``torch.no_grad()``.
    """

    def __call__(
        self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor], states: list[dict]
    ) -> None: ...


class FunctionalFormMissingWarning(UserWarning):
    """An optimizer class has no registered functional step; the slower, not thread-safe fallback is used."""


# ------------------------------------------------------------------------------------------ registry

_registry: dict[type[torch.optim.Optimizer], FunctionalStep] = {}
_registry_lock = threading.Lock()


def register_functional(
    optimizer_class: type[torch.optim.Optimizer], step: FunctionalStep, *, replace: bool = False
) -> None:
    """Register ``step`` as the functional form of ``optimizer_class`` (and of subclasses that keep its step).

    Raises :class:`ConfigurationError` if ``optimizer_class`` is not a torch optimizer class, if ``step``
    is not callable, or if the class already has a functional form and ``replace`` is false.
    """
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise ConfigurationError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")
    if not callable(step):
        raise ConfigurationError(f"step must be callable, got {step!r}")
    with _registry_lock:
        if optimizer_class in _registry and not replace:
            raise ConfigurationError(
                f"{optimizer_class.__qualname__} already has a functional form; pass replace=True to override it"
            )
        _registry[optimizer_class] = step


def functional_form(optimizer_class: type[torch.optim.Optimizer]) -> FunctionalStep | None:
    """The functional step registered for ``optimizer_class``, or None.

    The exact class is looked up first, then its bases in MRO order. A base's form is inherited only if
    the subclass runs the same math: it must not override ``step`` or ``_init_group`` (a subclass that
    changes the update needs a registration of its own, else it falls back to its own ``step``).
    """
    with _registry_lock:
        exact = _registry.get(optimizer_class)
        if exact is not None:
            return exact
        for base in optimizer_class.__mro__[1:]:
            step = _registry.get(base)
            if step is not None and _same_math(optimizer_class, base):
                return step
    return None


def _same_math(cls: type, base: type) -> bool:
    # torch wraps `step` (profiling hook, grad-mode decorator) and may store the wrapper on the subclass,
    # so compare the functions underneath the wrappers.
    for name in ("step", "_init_group"):
        mine, theirs = getattr(cls, name, None), getattr(base, name, None)
        if (mine is None) != (theirs is None):
            return False
        if mine is not None and inspect.unwrap(mine) is not inspect.unwrap(theirs):
            return False
    return True


# -------------------------------------------------------------------------------- FunctionalOptimizer


class FunctionalOptimizer:
    """Steps a torch optimizer's math with explicit gradients.

    The parameters, param_groups (lr, betas, ...) and state stay those of ``optimizer``: an LR scheduler
    attached to it and its ``state_dict()`` keep working. :meth:`step` takes one gradient (or None) per
    parameter, in the order ``[p for g in optimizer.param_groups for p in g["params"]]``.

    If the optimizer's class has no functional form (see :func:`register_functional`), a
    :class:`FunctionalFormMissingWarning` is issued and :meth:`step` falls back to assigning the gradients
    to ``.grad``, calling ``optimizer.step()`` and restoring the previous ``.grad`` values; that fallback
    is not thread-safe with code that reads or writes ``.grad`` at the same time.

    Unlike ``optimizer.step()``, the functional path does not run the optimizer's step hooks, and it does
    not see a GradScaler's ``grad_scale`` / ``found_inf``: pass unscaled gradients.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigurationError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self._step_fn = functional_form(type(optimizer))
        self.is_functional: bool = self._step_fn is not None
        if self._step_fn is None:
            name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
            warnings.warn(
                f"{name} has no functional form, so its steps temporarily assign .grad and call "
                f"optimizer.step(), which is slower and not thread-safe with code that uses .grad. Register one "
                f"with hivemind_ext.optim.functional.register_functional({type(optimizer).__qualname__}, step_fn), "
                f"where step_fn(group, params, grads, states) updates params in place.",
                FunctionalFormMissingWarning,
                stacklevel=2,
            )
        if self.is_functional:
            for group in optimizer.param_groups:
                _reject_differentiable(group)

    def step(self, grads: Sequence[Tensor | None]) -> None:
        """Apply one optimizer step with ``grads`` (one per parameter, None to leave a parameter unchanged).

        Raises :class:`ConfigurationError` if the number of gradients, or a gradient's shape or dtype, does
        not match the parameters. A gradient on another device is copied to its parameter's device.
        """
        groups = self.optimizer.param_groups
        grads_by_group = self._check_grads(groups, list(grads))
        if self._step_fn is None:
            self._fallback_step(groups, grads_by_group)
            return
        for group in groups:  # again: a param_group may have been added since construction
            _reject_differentiable(group)
        with torch.no_grad():
            for group, group_grads in zip(groups, grads_by_group, strict=True):
                self._functional_group_step(self._step_fn, group, group_grads)
        # what an LR scheduler's wrapper around optimizer.step() records; without it, the scheduler's first
        # step() would warn that it was called before optimizer.step()
        self.optimizer._opt_called = True  # type: ignore[attr-defined]

    def _functional_group_step(self, step_fn: FunctionalStep, group: dict, group_grads: list[Tensor | None]) -> None:
        params, grads, states = [], [], []
        created: list[tuple[Tensor, dict]] = []
        for param, grad in zip(group["params"], group_grads, strict=True):
            if grad is None:
                continue
            # Reading optimizer.state (a defaultdict) would insert an empty entry for optimizers that keep
            # no state (SGD without momentum), which torch never does and which state_dict() would show.
            state = self.optimizer.state.get(param)
            if state is None:
                state = {}
                created.append((param, state))
            params.append(param)
            grads.append(grad)
            states.append(state)
        if not params:
            return
        step_fn(group, params, grads, states)
        for param, state in created:
            if state:
                self.optimizer.state[param] = state

    def _fallback_step(self, groups: list[dict], grads_by_group: list[list[Tensor | None]]) -> None:
        params = [p for group in groups for p in group["params"]]
        grads = [g for group_grads in grads_by_group for g in group_grads]
        saved = [p.grad for p in params]
        try:
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad
            self.optimizer.step()
        finally:
            for param, grad in zip(params, saved, strict=True):
                param.grad = grad

    @staticmethod
    def _check_grads(groups: list[dict], grads: list[Any]) -> list[list[Tensor | None]]:
        n_params = sum(len(group["params"]) for group in groups)
        if len(grads) != n_params:
            raise ConfigurationError(f"expected {n_params} gradients (one per parameter), got {len(grads)}")
        checked: list[list[Tensor | None]] = []
        index = 0
        for group in groups:
            group_grads: list[Tensor | None] = []
            for param in group["params"]:
                group_grads.append(_check_grad(index, param, grads[index]))
                index += 1
            checked.append(group_grads)
        return checked


def _reject_differentiable(group: dict) -> None:
    if group.get("differentiable", False):
        raise ConfigurationError("FunctionalOptimizer does not support param_groups with differentiable=True")


def _check_grad(index: int, param: Tensor, grad: Any) -> Tensor | None:
    if grad is None:
        return None
    if not isinstance(grad, Tensor):
        raise ConfigurationError(f"gradient {index} must be a Tensor or None, got {type(grad).__name__}")
    if grad.shape != param.shape:
        raise ConfigurationError(
            f"gradient {index} has shape {tuple(grad.shape)}, its parameter has shape {tuple(param.shape)}"
        )
    if grad.dtype != param.dtype:
        raise ConfigurationError(
            f"gradient {index} has dtype {grad.dtype}, its parameter has dtype {param.dtype}; cast it first"
        )
    if grad.device != param.device:
        grad = grad.to(param.device)
    return grad.detach()


# ----------------------------------------------------------------------------- kernels and arguments


def _scalar_dtype(fused: bool = False) -> torch.dtype:
    # the dtype torch gives the 'step' counters (torch.optim.optimizer._get_scalar_dtype)
    if fused:
        return torch.float32
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _kernel_flags(group: dict, tensors: list[Tensor], *, fused_supported: bool = True) -> tuple[bool, bool]:
    """(foreach, fused) for this step: the group's explicit choices, else foreach kernels where they apply.

    Fused kernels are used only where the group asks for them, as the torch optimizer does, since they round
    differently; unlike torch (which loops over tensors one by one on CPU), foreach is the default everywhere.
    """
    if fused_supported and group.get("fused"):
        return False, True
    foreach = group.get("foreach")
    if foreach is None:
        foreach = all(type(t) in (Tensor, torch.nn.Parameter) and not t.is_sparse for t in tensors)
    return bool(foreach), False


_signatures: dict[Callable, frozenset[str]] = {}


def _call_torch(fn: Callable[..., None], *args: Any, **kwargs: Any) -> None:
    """Call a torch functional optimizer, leaving out keywords an older torch lacks when they are off anyway."""
    accepted = _signatures.get(fn)
    if accepted is None:
        accepted = _signatures[fn] = frozenset(inspect.signature(fn).parameters)
    for name in [k for k in kwargs if k not in accepted]:
        if kwargs[name] not in (None, False):
            raise ConfigurationError(f"the installed torch's {fn.__qualname__} does not support {name}={kwargs[name]}")
        del kwargs[name]
    fn(*args, **kwargs)


def _has_complex(params: list[Tensor]) -> bool:
    return any(torch.is_complex(p) for p in params)


def _reject_sparse(name: str, grads: list[Tensor]) -> None:
    if any(g.is_sparse for g in grads):
        raise ConfigurationError(f"{name} does not support sparse gradients")


def _reject_tensor_lr_with_foreach(group: dict, foreach: bool) -> None:
    if foreach and torch.is_tensor(group["lr"]) and not group.get("capturable", False):
        raise ConfigurationError("a Tensor lr is not supported with foreach=True and capturable=False")


# ------------------------------------------------------------------------------ built-in functional steps


def sgd_step(group: dict[str, Any], params: list[Tensor], grads: list[Tensor], states: list[dict]) -> None:
    """Functional torch.optim.SGD (momentum, dampening, nesterov, weight_decay, maximize)."""
    momentum = group.get("momentum", 0.0)
    buffers: list[Tensor | None] = [state.get("momentum_buffer") for state in states] if momentum != 0 else []
    has_sparse_grad = any(g.is_sparse for g in grads)
    foreach, fused = _kernel_flags(group, params + grads)
    _call_torch(
        sgd,
        params,
        grads,
        buffers,
        has_sparse_grad=has_sparse_grad,
        foreach=foreach,
        fused=fused,
        weight_decay=group.get("weight_decay", 0.0),
        momentum=momentum,
        lr=group["lr"],
        dampening=group.get("dampening", 0.0),
        nesterov=group.get("nesterov", False),
        maximize=group.get("maximize", False),
    )
    if momentum != 0:
        # sgd() creates the buffers of a first step in the list; keep them in the state as SGD.step does
        for state, buffer in zip(states, buffers, strict=True):
            state["momentum_buffer"] = buffer


def _adam_family_step(
    group: dict[str, Any], params: list[Tensor], grads: list[Tensor], states: list[dict], *, decoupled: bool
) -> None:
    _reject_sparse("Adam", grads)
    amsgrad = group.get("amsgrad", False)
    capturable = group.get("capturable", False)
    foreach, fused = _kernel_flags(group, params + grads)
    _reject_tensor_lr_with_foreach(group, foreach)
    for param, state in zip(params, states, strict=True):
        if len(state) == 0:
            # as Adam._init_group: 'step' stays on CPU unless capturable or fused
            if capturable or fused:
                state["step"] = torch.zeros((), dtype=_scalar_dtype(fused), device=param.device)
            else:
                state["step"] = torch.tensor(0.0, dtype=_scalar_dtype(), device="cpu")
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if amsgrad:
                state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    beta1, beta2 = group["betas"]
    _call_torch(
        adamw if decoupled else adam,
        params,
        grads,
        [state["exp_avg"] for state in states],
        [state["exp_avg_sq"] for state in states],
        [state["max_exp_avg_sq"] for state in states] if amsgrad else [],
        [state["step"] for state in states],
        foreach=foreach,
        capturable=capturable,
        differentiable=False,
        fused=fused,
        has_complex=_has_complex(params),
        amsgrad=amsgrad,
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group.get("weight_decay", 0.0),
        eps=group.get("eps", 1e-8),
        maximize=group.get("maximize", False),
    )


def adam_step(group: dict[str, Any], params: list[Tensor], grads: list[Tensor], states: list[dict]) -> None:
    """Functional torch.optim.Adam (amsgrad, weight_decay, maximize; decoupled_weight_decay as the group says)."""
    _adam_family_step(group, params, grads, states, decoupled=bool(group.get("decoupled_weight_decay", False)))


def adamw_step(group: dict[str, Any], params: list[Tensor], grads: list[Tensor], states: list[dict]) -> None:
    """Functional torch.optim.AdamW: Adam with decoupled weight decay."""
    _adam_family_step(group, params, grads, states, decoupled=True)


def adagrad_step(group: dict[str, Any], params: list[Tensor], grads: list[Tensor], states: list[dict]) -> None:
    """Functional torch.optim.Adagrad (lr_decay, weight_decay, initial_accumulator_value, maximize).

    torch creates Adagrad's state for every parameter in the constructor, so the lazy initialization here
    only serves parameters added later; it uses the group's ``initial_accumulator_value``.
    """
    fused_flag = bool(group.get("fused"))
    for param, state in zip(params, states, strict=True):
        if len(state) == 0:
            if fused_flag:
                state["step"] = torch.zeros((), dtype=_scalar_dtype(True), device=param.device)
            else:
                state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
            initial = group.get("initial_accumulator_value", 0.0)
            fill = complex(initial, initial) if torch.is_complex(param) else initial
            state["sum"] = torch.full_like(param, fill, memory_format=torch.preserve_format)
    has_sparse_grad = any(g.is_sparse for g in grads)
    foreach, fused = _kernel_flags(group, params + grads)
    _call_torch(
        adagrad,
        params,
        grads,
        [state["sum"] for state in states],
        [state["step"] for state in states],
        fused=fused,
        has_sparse_grad=has_sparse_grad,
        foreach=foreach,
        differentiable=False,
        has_complex=_has_complex(params),
        lr=group["lr"],
        weight_decay=group.get("weight_decay", 0.0),
        lr_decay=group.get("lr_decay", 0.0),
        eps=group.get("eps", 1e-10),
        maximize=group.get("maximize", False),
    )


def rmsprop_step(group: dict[str, Any], params: list[Tensor], grads: list[Tensor], states: list[dict]) -> None:
    """Functional torch.optim.RMSprop (alpha, momentum, centered, weight_decay, maximize)."""
    _reject_sparse("RMSprop", grads)
    momentum = group.get("momentum", 0.0)
    centered = group.get("centered", False)
    capturable = group.get("capturable", False)
    for param, state in zip(params, states, strict=True):
        if len(state) == 0:
            state["step"] = torch.zeros((), dtype=_scalar_dtype(), device=param.device if capturable else None)
            state["square_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if momentum > 0:
                state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if centered:
                state["grad_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    foreach, _ = _kernel_flags(group, params + grads, fused_supported=False)
    _reject_tensor_lr_with_foreach(group, foreach)
    _call_torch(
        rmsprop,
        params,
        grads,
        [state["square_avg"] for state in states],
        [state["grad_avg"] for state in states] if centered else [],
        [state["momentum_buffer"] for state in states] if momentum > 0 else [],
        [state["step"] for state in states],
        foreach=foreach,
        maximize=group.get("maximize", False),
        differentiable=False,
        capturable=capturable,
        has_complex=_has_complex(params),
        lr=group["lr"],
        alpha=group.get("alpha", 0.99),
        eps=group.get("eps", 1e-8),
        weight_decay=group.get("weight_decay", 0.0),
        momentum=momentum,
        centered=centered,
    )


register_functional(torch.optim.SGD, sgd_step)
register_functional(torch.optim.Adam, adam_step)
register_functional(torch.optim.AdamW, adamw_step)
register_functional(torch.optim.Adagrad, adagrad_step)
register_functional(torch.optim.RMSprop, rmsprop_step)
