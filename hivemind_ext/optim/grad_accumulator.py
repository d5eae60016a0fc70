"""Local gradient accumulation toward the swarm's target batch.

Two ways to hold the running sum (hivemind's ``reuse_grad_buffers``):

- separate buffers (default): after each ``backward``, ``accumulate(batch_size)`` adds
  ``batch_size * param.grad`` to a float32 buffer; the user zeroes ``.grad`` as usual. The mean
  gradient is the sample-weighted mean of the micro-batches' gradients (exactly the gradient of the
  mean loss over every sample seen, when each micro-batch loss is a mean).
- the model's ``.grad`` (``reuse_grad_buffers=True``): autograd sums the micro-batches' gradients
  in ``.grad`` and the user must not zero it; the mean gradient is ``.grad / micro_steps``, so each
  micro-batch counts equally whatever its size. Saves a copy of the parameters' size.

Non-finite gradients are refused (``NonFiniteTensorError``) before anything is added, so the
samples accumulated so far are kept and the caller can skip the bad batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hivemind_ext.errors import ConfigurationError, NonFiniteTensorError


class GradientAccumulator:
    def __init__(self, params: Sequence[torch.Tensor], *, reuse_grad_buffers: bool = False) -> None:
        self.params = list(params)
        self.reuse_grad_buffers = reuse_grad_buffers
        self.samples = 0  # samples accumulated since the last reset
        self.micro_steps = 0
        self._buffers: list[torch.Tensor] | None = None  # allocated on first use (float32, on each param's device)

    def accumulate(self, batch_size: int, *, check_finite: bool = True) -> None:
        """Adds the current ``.grad`` of every parameter, for a micro-batch of ``batch_size`` samples."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigurationError(f"batch_size must be a positive integer, got {batch_size!r}")
        grads = [p.grad for p in self.params if p.grad is not None]
        if check_finite and grads and not _all_finite(grads):
            raise NonFiniteTensorError(
                "the gradients hold NaN or Inf: this batch was not accumulated (the samples accumulated before it "
                "are kept). With AMP, use a GradScaler; otherwise check the loss or lower the learning rate."
            )
        if not self.reuse_grad_buffers:
            buffers = self._ensure_buffers()
            for param, buffer in zip(self.params, buffers, strict=True):
                if param.grad is not None:
                    buffer.add_(param.grad.detach().to(buffer.dtype), alpha=float(batch_size))
        self.samples += batch_size
        self.micro_steps += 1

    def mean_gradients(self, out: Sequence[torch.Tensor]) -> None:
        """Writes the mean gradient per parameter into ``out`` (zeros when nothing was accumulated)."""
        if len(out) != len(self.params):
            raise ConfigurationError(f"{len(out)} output tensors for {len(self.params)} parameters")
        for index, target in enumerate(out):
            self.mean_into(index, target)

    def mean_into(self, index: int, out: torch.Tensor) -> None:
        """Writes the mean gradient of parameter ``index`` into ``out`` (zeros when nothing was accumulated)."""
        if self.reuse_grad_buffers:
            grad = self.params[index].grad
            if grad is None:
                out.zero_()
            else:
                torch.div(grad.detach().to(out.dtype), float(max(self.micro_steps, 1)), out=out)
        elif self._buffers is None:
            out.zero_()
        else:
            torch.div(self._buffers[index].to(out.device), float(max(self.samples, 1)), out=out)

    def mean(self, index: int) -> torch.Tensor:
        """The mean gradient of parameter ``index``, as a new float32 tensor."""
        out = torch.empty_like(self.params[index], dtype=torch.float32)
        self.mean_into(index, out)
        return out

    def reset(self) -> None:
        """Starts a new accumulation (zeroes the buffers, or the model's ``.grad`` when reused)."""
        self.samples = 0
        self.micro_steps = 0
        if self.reuse_grad_buffers:
            for param in self.params:
                if param.grad is not None:
                    param.grad.zero_()
        elif self._buffers is not None:
            torch._foreach_zero_(self._buffers)

    def _ensure_buffers(self) -> list[torch.Tensor]:
        if self._buffers is None:
            self._buffers = [
                torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format) for p in self.params
            ]
        return self._buffers


def _all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """One host sync for all tensors: the largest magnitude (which cannot overflow) is finite iff every value is."""
    norms = torch._foreach_norm([t.detach() for t in tensors], ord=float("inf"))
    return bool(torch.isfinite(torch.stack([n.float().to(norms[0].device) for n in norms])).all())
