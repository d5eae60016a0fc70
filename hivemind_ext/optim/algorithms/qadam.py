"""QAdam: Adam whose momentum is averaged in 8 bits after a full-precision warm-up (as Bagua's QAdam).

One QAdam step is one global step, at the end of a swarm epoch (``target_batch_size`` samples).
With ``g`` a mean gradient, ``t`` the step counter after the increment and ``T`` = ``warmup_steps``:

- warm-up (``t <= T``): the peers average their mean gradients in full precision (weighted by
  samples) into ``g``, then ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g**2`` and the model steps
  as Adam (bias-corrected, below);
- compression (``t > T``): each peer updates its momentum with its LOCAL mean gradient,
  ``m_i = b1 m + (1 - b1) g_i``; the peers average ``m_i`` compressed (MinMaxUInt8 by default,
  optionally with error feedback) into ``m``; ``v`` stays frozen; the model steps as Adam.

The update, in both stages::

    x -= lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * x)
    m_hat = m / (1 - b1**t),  v_hat = v / (1 - b2**min(t, T))

and once ``v`` is frozen (``t > T``) two guards, both on the bias-corrected ``v_hat``:

- ``v_hat`` is floored at 1% of the tensor's mean ``v_hat`` (see ``frozen_variance_floor``): entries
  that saw no gradient during warm-up would otherwise step ``m / eps`` and diverge;
- ``m_hat / sqrt(v_hat)`` is clamped to ``[-max_update, max_update]`` (default 1): no entry steps more
  than ``lr`` (before weight decay). ``max_update=None`` gives the bare algorithm (Bagua's).

Why the bound. Adam's step is bounded because ``v`` follows the gradients: ``|m_hat| / sqrt(v_hat)``
stays near 1 or below (Kingma & Ba, section 2.1: the effective step is about ``lr``). A frozen ``v``
drops that: the step grows with the ratio of the current gradients to those of the warm-up, without
limit. A longer step makes the weights, hence the gradients, larger: a feedback loop. With a short
warm-up the frozen ``v`` comes from the first steps from initialization, when the gradients are at
their smallest. In ``benchmarks/algorithms.py`` (digits MLP, 4 peers, 8 global steps, lr 2e-3,
warm-up 2) the full-precision RMS gradient was 1.5x ``sqrt(mean v_hat)`` at step 3 and 2-3x by step 8
on a trajectory that converged. ``m_hat / sqrt(v_hat)`` had an RMS of 30-115 and entries of 1e3-2e4 at
step 3; the loss reached 1e10 at step 4 and NaN at step 6. That happened with exact averaging as well
as with 8 bits: it is the algorithm, not the codec. With the floor but no clamp, warm-up 4 converged
and warm-up 2 still diverged. With the clamp both follow synchronous Adam: in a single-process
simulation, held-out loss 0.80 (warm-up 2) and 0.83 (warm-up 4) against 0.88 after 8 steps; in the
benchmark 0.79 and 0.82 against 0.87. With a frozen ``v`` that represents the later gradients (a long
warm-up, as Bagua's default of 100 steps) the ratio seldom exceeds 1 and the clamp seldom binds.

Until this was fixed the floor was computed on the raw ``v``, not on ``v_hat``: it was
``1 - b2**T`` times (1/500 at ``T = 2``) the intended size, so raising its fraction did not help.

Weight decay is DECOUPLED (AdamW's form) whether the wrapped optimizer is Adam or AdamW: in the
compression stage an L2 term would go into the momentum and through the 8-bit codec, and its
effect would depend on the frozen ``v``. ``v``'s bias correction counts only the steps that updated
it (``min(t, T)``), so the frozen ``v`` keeps its value rather than shrinking as ``t`` grows.

``m``, ``v`` and the step counter live in the wrapped optimizer's state (``opt.state[p]`` keys
``exp_avg``, ``exp_avg_sq``, ``step``, as torch's Adam keeps them), so a late joiner downloads them
with the Optimizer's state; after a download the step counter decides the stage (``need_reset``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from hivemind_ext.compression import ErrorFeedback, MinMaxUInt8
from hivemind_ext.errors import ConfigurationError
from hivemind_ext.optim.algorithms.base import Algorithm, AlgorithmContext, AlgorithmImpl, Bucket, NamedTensor

REQUIRED_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")


def adam_update_(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    variance_steps: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    variance_floor: float = 0.0,
    max_update: float | None = None,
) -> None:
    """``param -= lr * (clamp(m_hat / (sqrt(max(v_hat, variance_floor)) + eps), +-max_update) + weight_decay * param)``
    in place.

    ``step`` is the bias correction's count for ``exp_avg`` and ``variance_steps`` for ``exp_avg_sq``
    (they differ once ``v`` is frozen); ``variance_floor`` applies to the bias-corrected ``v_hat``.
    ``max_update`` (None: no limit) bounds each entry's ``|m_hat / sqrt(v_hat)|``, i.e. its step in
    units of ``lr`` before weight decay. The moments are not changed here.
    """
    beta1, beta2 = betas
    m_hat = exp_avg.float() / (1.0 - beta1**step)
    v_hat = exp_avg_sq.float() / (1.0 - beta2**variance_steps)
    if variance_floor > 0:
        v_hat.clamp_(min=variance_floor)  # an infinite floor: the tensor does not move
    denominator = v_hat.sqrt_().add_(eps)
    update = m_hat.div_(denominator)
    if max_update is not None:
        update.clamp_(-max_update, max_update)
    if weight_decay:
        update.add_(param.detach().float(), alpha=weight_decay)
    with torch.no_grad():
        param.sub_(update.mul_(lr).to(param.dtype))


def warmup_moments_(
    exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, betas: tuple[float, float]
) -> None:
    """Adam's moment updates with the swarm's averaged gradient: ``m``, then ``v``."""
    beta1, beta2 = betas
    exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)


class QAdam(Algorithm):
    """Hyperparameters of QAdam; Adam's own (lr, betas, eps, weight_decay) are read from the wrapped
    optimizer's param groups at every step, so schedulers and per-group values work.

    :param warmup_steps: global steps with full-precision gradient averaging (at least 1: the
      compression stage divides by the ``v`` that warm-up built)
    :param codec: how the momenta are compressed after warm-up (default MinMaxUInt8)
    :param error_feedback: wrap ``codec`` in :class:`~hivemind_ext.compression.ErrorFeedback`
    :param warmup_codec: how the gradients are compressed during warm-up (default none: float32)
    :param max_update: once ``v`` is frozen, the largest ``|m_hat / sqrt(v_hat)|`` of an entry, i.e. its
      step in units of ``lr`` (default 1: Adam's own nominal bound, which a frozen ``v`` no longer
      enforces; see the module's docstring). None: no limit (the bare algorithm, as Bagua's)
    """

    def __init__(
        self,
        warmup_steps: int = 100,
        *,
        error_feedback: bool = False,
        codec: Any = None,
        warmup_codec: Any = None,
        max_update: float | None = 1.0,
    ) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ConfigurationError(f"QAdam: warmup_steps must be an integer >= 1, got {warmup_steps!r}")
        valid = isinstance(max_update, int | float) and not isinstance(max_update, bool) and 0 < max_update < math.inf
        if max_update is not None and not valid:
            raise ConfigurationError(f"QAdam: max_update must be a positive finite number or None, got {max_update!r}")
        self.max_update = None if max_update is None else float(max_update)
        self.warmup_steps = warmup_steps
        self.error_feedback = bool(error_feedback)
        self.codec = codec if codec is not None else MinMaxUInt8()
        self.warmup_codec = warmup_codec

    def reify(self, context: AlgorithmContext) -> QAdamImpl:
        return QAdamImpl(context, self)


class QAdamImpl(AlgorithmImpl):
    def __init__(self, context: AlgorithmContext, algorithm: QAdam) -> None:
        super().__init__(context)
        self.warmup_steps = algorithm.warmup_steps
        self.codec = ErrorFeedback(algorithm.codec) if algorithm.error_feedback else algorithm.codec
        self.warmup_codec = algorithm.warmup_codec
        self.max_update = algorithm.max_update
        optimizer = context.torch_optimizer
        check_adam_like(optimizer)
        self.opt_params = [p for group in optimizer.param_groups for p in group["params"]]
        if len(self.opt_params) != len(self.mean_grads):
            raise ConfigurationError("QAdam: the wrapped optimizer's parameters differ from the model's")
        # what is averaged after warm-up: this peer's momentum, then the swarm's (copied into the state)
        self.momenta = [torch.zeros_like(g) for g in self.mean_grads]
        self._index = {id(t): i for i, t in enumerate(self.momenta)}
        with context.state_lock:
            self._ensure_state()
        self.compressing = self.step_count >= self.warmup_steps

    # ----- state (in the wrapped optimizer, so that it is shared with late joiners)

    def _ensure_state(self) -> None:
        state = self.context.torch_optimizer.state
        for param in self.opt_params:
            entry = state[param]
            if "exp_avg" not in entry:
                entry["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                entry["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                entry["step"] = torch.tensor(0.0)

    @property
    def step_count(self) -> int:
        """Global steps taken (the wrapped optimizer's ``step`` of the first parameter)."""
        step = self.context.torch_optimizer.state[self.opt_params[0]].get("step", 0)
        return int(step.item() if isinstance(step, torch.Tensor) else step)

    # ----- what and how

    def init_tensors(self) -> list[NamedTensor]:
        if self.compressing:
            return [(f"momentum{i}", t) for i, t in enumerate(self.momenta)]
        return super().init_tensors()

    def init_operations(self, bucket: Bucket) -> None:
        weight = lambda: float(self.samples)  # noqa: E731
        if self.compressing:
            bucket.append_python(self.local_momenta)
            bucket.append_average(self.codec, weight=weight)
        else:
            bucket.append_python(self.load_mean_gradients)
            bucket.append_average(self.warmup_codec, weight=weight)

    def local_momenta(self, bucket: Bucket) -> None:
        """A Python operation: ``m_i = b1 m + (1 - b1) g_i`` with this peer's mean gradient ``g_i``."""
        self._ensure_state()  # the user may have loaded a state dict without them
        state = self.context.torch_optimizer.state
        groups = self._group_of
        for tensor in bucket.tensors:
            index = self._index[id(tensor)]
            beta1 = float(groups[index]["betas"][0])
            momentum = state[self.opt_params[index]]["exp_avg"].to(tensor.device, torch.float32)
            torch.lerp(self.accumulator.mean(index), momentum, beta1, out=tensor)

    @property
    def _group_of(self) -> list[dict[str, Any]]:
        return [group for group in self.context.torch_optimizer.param_groups for _ in group["params"]]

    # ----- stages

    def need_reset(self) -> bool:
        return self.compressing != (self.step_count >= self.warmup_steps)

    def reset(self) -> None:
        self.compressing = self.step_count >= self.warmup_steps
        with self.context.state_lock:
            self._ensure_state()

    def on_state_loaded(self) -> None:
        """A downloaded state replaced ``opt.state`` (m, v and the step, read from there at every use);
        a donor that never stepped sends none, so create them. Its step counter picks the stage."""
        self._ensure_state()

    # ----- the update

    def optimizer_step(self) -> None:
        self._ensure_state()  # a downloaded state may lack them (a peer that never stepped)
        state = self.context.torch_optimizer.state
        for index, (param, group) in enumerate(zip(self.opt_params, self._group_of, strict=True)):
            entry = state[param]
            step = self.step_count_of(entry) + 1
            if self.compressing:
                entry["exp_avg"].copy_(self.momenta[index])
            else:
                grad = self.mean_grads[index].to(param.device, entry["exp_avg"].dtype)
                warmup_moments_(entry["exp_avg"], entry["exp_avg_sq"], grad, group["betas"])
            variance_steps = min(step, self.warmup_steps)
            floor = 0.0
            if self.compressing:  # a fraction of the mean bias-corrected v_hat, the v that the floor bounds
                floor = frozen_variance_floor(entry["exp_avg_sq"]) / (1.0 - float(group["betas"][1]) ** variance_steps)
            adam_update_(
                param,
                entry["exp_avg"],
                entry["exp_avg_sq"],
                step=step,
                variance_steps=variance_steps,
                lr=float(group["lr"]),
                betas=tuple(group["betas"]),
                eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                variance_floor=floor,
                max_update=self.max_update if self.compressing else None,
            )
            set_step(entry, step)

    @staticmethod
    def step_count_of(entry: dict[str, Any]) -> int:
        step = entry.get("step", 0)
        return int(step.item() if isinstance(step, torch.Tensor) else step)


FLOOR_FRACTION = 1e-2


def frozen_variance_floor(exp_avg_sq: torch.Tensor) -> float:
    """The smallest ``v`` used once ``v`` is frozen: a fraction of the tensor's mean ``v``. Pass the
    bias-corrected ``v_hat``, or divide the result by the bias correction, as the floor applies to it.

    Entries whose gradient was exactly zero through warm-up (dead units, constant inputs) have
    ``v = 0``; with a frozen ``v`` their first non-zero momentum would step ``m / eps``, about 1e8
    times too far, and the model would diverge. With the floor they step like a typical entry.
    A tensor that had no gradient at all through warm-up gets an infinite floor: it does not move."""
    mean = float(exp_avg_sq.float().mean()) if exp_avg_sq.numel() else 0.0
    return FLOOR_FRACTION * mean if math.isfinite(mean) and mean > 0 else math.inf


def set_step(entry: dict[str, Any], step: int) -> None:
    if isinstance(entry.get("step"), torch.Tensor):
        entry["step"].fill_(step)
    else:
        entry["step"] = torch.tensor(float(step))


def check_adam_like(optimizer: torch.optim.Optimizer) -> None:
    """Raises ConfigurationError unless every param group has Adam's hyperparameters and no variant
    that QAdam does not implement (amsgrad, maximize)."""
    for index, group in enumerate(optimizer.param_groups):
        missing = [key for key in REQUIRED_GROUP_KEYS if key not in group]
        if missing:
            raise ConfigurationError(
                f"QAdam needs an Adam-like optimizer (torch.optim.Adam / AdamW): param group {index} of "
                f"{type(optimizer).__name__} has no {', '.join(missing)}"
            )
        betas = group["betas"]
        if not isinstance(betas, Sequence) or len(betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
            raise ConfigurationError(f"QAdam: param group {index} has invalid betas {betas!r}")
        if isinstance(group["lr"], torch.Tensor):
            raise ConfigurationError("QAdam: a tensor learning rate is not supported")
        if float(group["eps"]) <= 0 or math.isnan(float(group["eps"])):
            raise ConfigurationError(f"QAdam: param group {index} needs eps > 0, got {group['eps']!r}")
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise ConfigurationError(f"QAdam does not implement {flag}=True")
