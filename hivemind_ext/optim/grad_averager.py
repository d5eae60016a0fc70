"""GradientAverager: accumulate local gradients, then average them with peers, weighted by samples.

A :class:`~hivemind_ext.averaging.DecentralizedAverager` over float32 buffers the size of the
parameters. ``accumulate_grads_(batch_size)`` adds the model's current gradients to the
:class:`.GradientAccumulator`; ``step()`` (or a step scheduled earlier with ``schedule_step()``)
writes the local mean gradient into the buffers, averages them with the group (each peer weighted
by its samples), and leaves the result in the buffers, where ``averaged_gradients()`` reads it.
Usable with the Optimizer's ``grad_averager_factory``: ``factory(parameters, dht=..., prefix=...,
reuse_grad_buffers=..., start=..., allow_state_sharing=False, **averager_opts)`` must return one of
these (the Optimizer downloads the state averager's state, never this one's, so it is not advertised
unless ``averager_opts`` asks for it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from hivemind import DHT

from hivemind_ext.averaging.averager import DecentralizedAverager
from hivemind_ext.averaging.control import StepControl
from hivemind_ext.optim.grad_accumulator import GradientAccumulator
from hivemind_ext.optim.rounds import wait_on_round


class GradientAverager(DecentralizedAverager):
    """:param parameters: the model's parameters (their ``.grad`` is read)
    :param reuse_grad_buffers: accumulate in the parameters' ``.grad`` (the user must not zero it)
    :param kwargs: DecentralizedAverager's keywords (prefix, start, compression, client_mode, ...)
    """

    def __init__(
        self,
        parameters: Iterable[torch.Tensor],
        *,
        dht: DHT,
        prefix: str,
        reuse_grad_buffers: bool = False,
        warn: bool = True,
        **kwargs: Any,
    ) -> None:
        del warn  # hivemind's switch for a warning about .grad use; our accumulator never reads stale .grad
        self.parameters = list(parameters)
        self.accumulator = GradientAccumulator(self.parameters, reuse_grad_buffers=reuse_grad_buffers)
        auxiliary = bool(kwargs.get("auxiliary", False))
        buffers = [] if auxiliary else [torch.zeros_like(p, dtype=torch.float32) for p in self.parameters]
        super().__init__(buffers, dht, **kwargs, prefix=prefix)
        self.keep_concurrent_updates = False  # the buffers are only written between rounds

    @property
    def local_samples_accumulated(self) -> int:
        return self.accumulator.samples

    def accumulate_grads_(self, batch_size: int) -> None:
        """Adds the parameters' current gradients for a micro-batch of ``batch_size`` samples."""
        self.accumulator.accumulate(batch_size)

    def load_accumulators_into_averager_(self) -> None:
        """Writes the local mean gradient into the buffers that the next round averages."""
        with self.get_tensors() as buffers:
            self.accumulator.mean_gradients(buffers)

    def reset_accumulated_grads_(self) -> None:
        self.accumulator.reset()

    def schedule_step(self, scheduled_time: float | None = None, **kwargs: Any) -> StepControl:
        """Starts matchmaking now for a round that begins only when triggered (see ``step(control=...)``)."""
        kwargs.setdefault("gather", None)
        control = DecentralizedAverager.step(
            self, scheduled_time=scheduled_time, wait=False, require_trigger=True, **kwargs
        )
        assert isinstance(control, StepControl)
        return control

    def step(  # type: ignore[override]
        self,
        weight: float | None = None,
        reset_accumulators: bool = True,
        control: StepControl | None = None,
        timeout: float | None = None,
        wait: bool = True,
        **kwargs: Any,
    ) -> Any:
        """Averages the accumulated gradients with a group: the one ``control`` found, or a new one.

        :param weight: this peer's weight (default: its accumulated samples)
        :param reset_accumulators: start a new accumulation once the buffers are loaded
        :returns: the gathered data (wait=True) or the StepControl
        """
        if control is None:
            scheduled = kwargs.pop("scheduled_time", None)
            control = self.schedule_step(scheduled_time=scheduled, timeout=timeout, **kwargs)
        if not self.auxiliary:
            self.load_accumulators_into_averager_()
        if weight is None:
            weight = 0.0 if self.auxiliary else float(self.local_samples_accumulated)
        if not control.began_allreduce and not control.done():
            control.weight = weight
        if reset_accumulators:
            self.reset_accumulated_grads_()
        control.allow_allreduce()
        if not wait:
            return control
        return wait_on_round(control)  # the round driver's one wait: until the round's deadline (and a grace)

    @contextlib.contextmanager
    def use_averaged_gradients(self) -> Iterator[Sequence[torch.Tensor]]:
        """The buffers (the averaged gradients after a successful round), locked against the averager."""
        with self.get_tensors() as buffers:
            yield buffers
