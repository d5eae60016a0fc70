"""TrainingStateAverager: average a trainer's parameters (and chosen optimizer statistics) with peers,
and serve the whole training state to newcomers.

Rounds work on copies: ``begin_round()`` copies the current values into the averager's buffers and
keeps that snapshot; when the round is done, ``apply_round()`` adds ``average - snapshot`` to the live
tensors. So the optimizer (or the training loop, with local updates) keeps stepping while the round
runs in the background, and the progress it made meanwhile is kept: ``x += mean(snapshot) - snapshot``.
Every read and write of the live tensors holds ``state_lock``, which the Optimizer also holds while
it steps.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
from hivemind import DHT

from hivemind_ext.averaging.averager import DecentralizedAverager
from hivemind_ext.averaging.control import StepControl
from hivemind_ext.averaging.delta import apply_average, take_snapshot
from hivemind_ext.averaging.tensor_layout import TensorSpec
from hivemind_ext.errors import HivemindExtError
from hivemind_ext.optim.rounds import epochs_mix_well, gathered_epochs
from hivemind_ext.optim.state_checks import StateBounds, check_state_values
from hivemind_ext.optim.training_state import TrainingState

logger = logging.getLogger(__name__)


class TrainingStateAverager(DecentralizedAverager):
    def __init__(
        self,
        training_state: TrainingState,
        *,
        dht: DHT,
        prefix: str,
        state_lock: threading.RLock,
        state_bounds: StateBounds | None = None,
        swarm_epoch: Callable[[], int] | None = None,
        in_groups: bool = False,
        **kwargs: Any,
    ) -> None:
        """:param state_bounds: what a downloaded state may hold (see :mod:`.state_checks`)
        :param swarm_epoch: the swarm's epoch as this peer sees it (bounds a downloaded epoch)
        :param in_groups: the swarm averages in rotating groups smaller than itself (the Optimizer's
          ``target_group_size``): rounds may then mix nearby epochs (:func:`~.rounds.epochs_mix_well`)"""
        self.training_state = training_state
        self.state_lock = state_lock
        self.state_bounds = state_bounds if state_bounds is not None else StateBounds()
        self.swarm_epoch = swarm_epoch
        self.in_groups = in_groups
        kwargs.setdefault("reject_non_finite_state", True)  # a training state is finite (see check_snapshot)
        with state_lock:
            training_state.ensure_statistics()
            live = training_state.averaged_tensors()
        self._snapshot: list[torch.Tensor] | None = None
        self._round: StepControl | None = None
        buffers = [] if kwargs.get("auxiliary") else [t.detach().float().clone() for t in live]
        super().__init__(buffers, dht, **kwargs, prefix=prefix)
        self.keep_concurrent_updates = False  # the buffers are only written between rounds

    def expected_state_tensors(self) -> list[TensorSpec]:
        """A training state begins with the optimizer's parameters and the extra tensors (see
        TrainingState.snapshot): a donor whose state has other shapes trains another model."""
        state = self.training_state
        return [TensorSpec.of(t) for t in (*state.opt_params, *state.extra_tensors)]

    def check_downloaded_state(self, metadata: Any, tensors: list[torch.Tensor]) -> None:
        """Refuses a state that does not fit this optimizer, or holds values out of ``state_bounds``."""
        state, bounds = self.training_state, self.state_bounds
        state.check_snapshot(metadata, tensors)
        state.check_extra_values(tensors)
        max_epoch = None
        if bounds.max_epochs_ahead is not None:
            swarm = self.swarm_epoch() if self.swarm_epoch is not None else 0
            max_epoch = max(swarm, state.epoch) + bounds.max_epochs_ahead
        with self.state_lock:
            groups = [dict(group) for group in state.optimizer.param_groups]
        check_state_values(metadata, tensors, bounds=bounds, local_groups=groups, max_epoch=max_epoch)

    def get_current_state(self) -> tuple[Any, list[torch.Tensor]]:
        """What newcomers download: the whole training state (see TrainingState.snapshot)."""
        with self.state_lock:
            return self.training_state.snapshot()

    @property
    def has_round(self) -> bool:
        """A round was begun and not yet applied (or discarded) by ``apply_round``."""
        return self._round is not None

    @property
    def round_in_progress(self) -> bool:
        return self._round is not None and not self._round.done()

    def begin_round(
        self,
        *,
        timeout: float,
        scheduled_time: float | None = None,
        control: StepControl | None = None,
        epoch: int | None = None,
        expected_group_size: int | None = None,
    ) -> StepControl:
        """Snapshots the live tensors into the buffers and starts a round in the background.

        :param epoch: the epoch whose end this round averages. Peers' rounds begun at different epochs
          can meet in one group (a peer whose previous round is still pending skips an epoch's round);
          their average would mix parameters from before and after a step and pull the peers apart.
          With ``epoch`` given, every member tells its epoch, and a round whose members disagree is
          discarded by every member alike (see :meth:`apply_round`); ``in_groups``, only when their
          epochs are far apart (:func:`~hivemind_ext.optim.rounds.epochs_mix_well`).
        :param expected_group_size: see :meth:`DecentralizedAverager.step` (the round driver's plan)
        """
        if self.round_in_progress:
            raise HivemindExtError("a state averaging round is already running")
        with self.state_lock, self.get_tensors() as buffers:
            live = self.training_state.averaged_tensors()
            snapshot = take_snapshot(live)
            torch._foreach_copy_(list(buffers), snapshot)
            self._snapshot = snapshot
        if control is None:
            control = self.step(
                wait=False,
                timeout=timeout,
                scheduled_time=scheduled_time,
                require_trigger=True,
                expected_group_size=expected_group_size,
            )
            assert isinstance(control, StepControl)
        if epoch is not None:
            control.gather = {"epoch": int(epoch)}
        control.allow_allreduce()
        self._round = control
        return control

    def apply_round(self, wait: float | None = 0.0) -> bool | None:
        """Applies a finished round: None if none is pending or it is still running after ``wait``
        seconds, else whether it succeeded (a failed round changes nothing)."""
        control = self._round
        if control is None:
            return None
        try:
            gathered = control.result(wait)
        except (TimeoutError, concurrent.futures.TimeoutError):
            return None
        except concurrent.futures.CancelledError:
            self._round, self._snapshot = None, None
            return False
        except HivemindExtError as e:
            logger.info(f"state averaging failed ({e}); keeping the local state")
            self._round, self._snapshot = None, None
            return False
        self._round = None
        epochs = gathered_epochs(gathered)
        if not epochs_mix_well(epochs, in_groups=self.in_groups):
            logger.info(f"a state averaging round mixed epochs {sorted(epochs)}: discarded, keeping the local state")
            self._snapshot = None
            return False
        with self.state_lock, self.get_tensors() as buffers:
            live = self.training_state.averaged_tensors()
            assert self._snapshot is not None
            apply_average(live, buffers, self._snapshot)
            self._snapshot = None
            self.training_state.copy_to_model()
        return True

    def cancel_round(self) -> None:
        if self._round is not None and not self._round.done():
            self._round.cancel()
        self._round, self._snapshot = None, None
