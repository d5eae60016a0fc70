"""GradScaler: ``torch.amp.GradScaler`` for training with :class:`hivemind_ext.Optimizer`.

Without ``reuse_grad_buffers``, a plain ``torch.amp.GradScaler`` already works: ``scaler.step(opt)``
unscales the model's gradients through ``opt.param_groups``, skips the batch when they overflowed,
and the Optimizer accumulates the unscaled gradients. This class does the same, and also supports
``reuse_grad_buffers=True``, where autograd sums *scaled* gradients in ``.grad`` over a whole epoch:
there the scale must stay constant until the epoch ends, so ``unscale_`` and ``update`` are deferred
to the epoch boundary. If the epoch's summed gradients overflowed, this peer contributes nothing to
that round (weight 0) and the scale is reduced as usual.

Use it exactly like torch's::

    scaler = hivemind_ext.GradScaler()
    with torch.autocast(device_type="cuda", dtype=torch.float16):
        loss = model(batch)
    scaler.scale(loss).backward()
    scaler.step(opt)     # calls opt.step(grad_scaler=scaler)
    scaler.update()
"""

from __future__ import annotations

from typing import Any

import torch


class GradScaler(torch.amp.GradScaler):
    def __init__(self, device: str | None = None, **kwargs: Any) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(device, **kwargs)
        self._deferred = False  # reuse_grad_buffers: unscale_/update wait for the epoch boundary

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if _is_ours(optimizer):
            return optimizer.step(*args, grad_scaler=self, **kwargs)
        return super().step(optimizer, *args, **kwargs)

    def unscale_(self, optimizer: Any) -> None:
        if _is_ours(optimizer) and (self._deferred or optimizer.reuse_grad_buffers):
            # the scaled sum in .grad is unscaled once, at the end of the epoch (also on the epoch's
            # first micro-step, before opt.step() has marked this scaler deferred)
            return
        super().unscale_(optimizer)

    def update(self, new_scale: Any = None) -> None:
        if self._deferred:
            return
        if not self._per_optimizer_states or not any(
            state.get("found_inf_per_device") for state in self._per_optimizer_states.values()
        ):
            return  # nothing was unscaled since the last update (a deferred micro-step)
        super().update(new_scale)

    # ----- called by hivemind_ext.Optimizer

    def unscale_and_check(self, optimizer: Any) -> bool:
        """Unscales the model's gradients (once per step) and returns whether any overflowed."""
        self._deferred = False
        state = self._per_optimizer_states[id(optimizer)]
        if not state.get("found_inf_per_device"):
            super().unscale_(optimizer)
        return any(bool(v.item()) for v in state["found_inf_per_device"].values())

    def defer(self) -> None:
        """Keeps the scale fixed (reuse_grad_buffers, between two epoch boundaries)."""
        self._deferred = True


def _is_ours(optimizer: Any) -> bool:
    """A hivemind_ext.Optimizer (it takes ``step(grad_scaler=...)``); told by a class marker, because
    the Optimizer imports this module (importing it back would be a cycle)."""
    return bool(getattr(type(optimizer), "steps_with_grad_scaler", False))


class BoundGradScaler:
    """The GradScaler of one ``Optimizer.step(grad_scaler=...)``, as the Optimizer hands it to its
    algorithm: bound to that Optimizer (torch keys a scaler's unscaling state by its optimizer, whose
    ``param_groups`` it unscales), so the algorithm never holds the Optimizer itself."""

    def __init__(self, scaler: GradScaler, optimizer: Any) -> None:
        self.scaler, self._optimizer = scaler, optimizer

    def unscale_and_check(self) -> bool:
        """Unscales the model's gradients (once per step) and returns whether any overflowed."""
        return self.scaler.unscale_and_check(self._optimizer)

    def defer(self) -> None:
        """Keeps the scale fixed until the epoch's end (reuse_grad_buffers)."""
        self.scaler.defer()
