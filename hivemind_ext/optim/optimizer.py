"""hivemind_ext.Optimizer: a drop-in replacement for ``hivemind.Optimizer``.

Same keyword arguments, same meaning (see ``../shared/reference`` and the README). One *epoch* is the
swarm processing ``target_batch_size`` samples together. Per call of ``step()``:

1. finish background work that is done (a delayed optimizer step, a state averaging round);
2. if this peer fell behind the swarm (or its last averaging failed), download the state from peers;
3. synchronous mode: add the batch's gradients to the local accumulator; local updates: step now;
4. report progress to the DHT (:class:`.ProgressTracker`); when the swarm's next epoch is near,
   start matchmaking for the gradient round ahead of time (pre-scheduled, held by a trigger);
5. when the swarm reached ``target_batch_size`` (or a groupmate already started the round): average
   the gradients, weighted by samples, step the optimizer, step the scheduler, and every
   ``average_state_every`` epochs average the parameters (in the background by default).

Peers whose round fails proceed with their local gradients, as in hivemind, and download the
state from their peers at their next step, which brings their parameters back in line. When rounds
are scheduled, whom they expect, how long to wait and what a missed or failed round means are
decided in :mod:`hivemind_ext.optim.rounds`, whose :class:`~hivemind_ext.optim.rounds.RoundDriver`
(``Optimizer.rounds``) also waits on every round, this Optimizer's and its algorithm's.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from hivemind import DHT
from hivemind.utils import get_dht_time

from hivemind_ext.averaging.control import AveragingStage, StepControl
from hivemind_ext.errors import (
    AllreduceError,
    ConfigurationError,
    DeadlineExceededError,
    HivemindExtError,
    MatchmakingError,
    StateLoadError,
)
from hivemind_ext.optim.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    GradientAllReduce,
    next_model_key,
)
from hivemind_ext.optim.algorithms.runner import AlgorithmRunner
from hivemind_ext.optim.auxiliary import AuxiliaryPeer
from hivemind_ext.optim.background import BackgroundWorker
from hivemind_ext.optim.config import OptimizerConfig
from hivemind_ext.optim.grad_averager import GradientAverager
from hivemind_ext.optim.grad_scaler import GradScaler
from hivemind_ext.optim.keys import grad_prefix, progress_prefix, state_prefix
from hivemind_ext.optim.param_groups import group_views
from hivemind_ext.optim.progress import ProgressTracker
from hivemind_ext.optim.rounds import RoundDriver, RoundHooks, missed_round, next_epoch, should_prepare_round
from hivemind_ext.optim.state_averager import TrainingStateAverager
from hivemind_ext.optim.training_state import TrainingState

logger = logging.getLogger(__name__)

ROUND_FAILURES = (MatchmakingError, AllreduceError, DeadlineExceededError)
__all__ = ["Optimizer", "grad_prefix", "progress_prefix", "state_prefix"]  # the key prefixes live in .keys


def _chain(first: Callable[[], None], then: Callable[[], None] | None) -> Callable[[], None]:
    def job() -> None:
        first()
        if then is not None:
            then()

    return job


def gathered_epochs(gathered: Any) -> set[int]:
    """The epochs that a gradient round's members reported (untrusted: only plain ints count)."""
    epochs = set()
    for data in (gathered or {}).values():
        epoch = data.get("epoch") if isinstance(data, dict) else None
        if isinstance(epoch, int) and not isinstance(epoch, bool) and 0 <= epoch < 2**62:
            epochs.add(epoch)
    return epochs


def gathered_samples(gathered: Any) -> dict[str, int]:
    """Samples per member from a gradient round's gathered data ({"samples": n} from each member);
    gather data is untrusted wire input: anything else (e.g. an auxiliary peer's None) counts as 0."""
    samples = {}
    for peer, data in (gathered or {}).items():
        value = data.get("samples") if isinstance(data, dict) else None
        ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**62
        samples[str(peer)] = value if ok else 0
    return samples


class Optimizer(torch.optim.Optimizer):
    """Wraps a PyTorch optimizer to train one model together with peers (see the module docstring).

    Takes every keyword argument of ``hivemind.Optimizer`` with the same meaning; see the README for
    the list. Differences: ``client_mode=True`` is honoured even when the DHT is not in client mode,
    and ``grad_averager_factory`` must build a :class:`hivemind_ext.optim.GradientAverager`.

    Beyond hivemind's: ``algorithm`` (see :mod:`hivemind_ext.optim.algorithms`) and ``round_hooks``, a
    :class:`~hivemind_ext.optim.rounds.RoundHooks` called before and after every round this peer
    waits on (its gradient rounds and its algorithm's): a seam to watch rounds, or to fail one in a test.
    """

    #: GradScaler.step(opt) hands itself to ``step(grad_scaler=...)`` (see hivemind_ext.optim.grad_scaler)
    steps_with_grad_scaler = True

    def __init__(
        self,
        *,
        dht: DHT,
        run_id: str,
        target_batch_size: int,
        batch_size_per_step: int | None = None,
        optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer],
        params: Iterable[Any] | None = None,
        scheduler: Any = None,
        matchmaking_time: float | None = 15.0,
        averaging_timeout: float | None = 60.0,
        allreduce_timeout: float | None = None,
        next_chunk_timeout: float | None = None,
        load_state_timeout: float = 600.0,
        reuse_grad_buffers: bool = False,
        offload_optimizer: bool | None = None,
        delay_optimizer_step: bool | None = None,
        delay_grad_averaging: bool = False,
        delay_state_averaging: bool = True,
        average_state_every: int = 1,
        use_local_updates: bool = False,
        client_mode: bool | None = None,
        auxiliary: bool = False,
        grad_compression: Any = None,
        grad_averager_factory: Callable[..., GradientAverager] | None = None,
        state_averaging_compression: Any = None,
        load_state_compression: Any = None,
        average_opt_statistics: Sequence[str] = (),
        extra_tensors: Sequence[torch.Tensor] = (),
        averager_opts: dict | None = None,
        tracker_opts: dict | None = None,
        performance_ema_alpha: float = 0.1,
        shutdown_timeout: float = 5,
        verbose: bool = False,
        algorithm: Algorithm | None = None,
        round_hooks: RoundHooks | None = None,
    ) -> None:
        if not isinstance(dht, DHT):
            raise ConfigurationError(f"dht must be a running hivemind.DHT, got {type(dht).__name__}")
        params = list(params) if params is not None else None
        if offload_optimizer is None and algorithm is not None and not isinstance(algorithm, GradientAllReduce):
            offload_optimizer = False  # algorithms step the model's own parameters
        self.config = config = OptimizerConfig.resolve(
            dht_client_mode=bool(dht.client_mode),
            optimizer_from_factory=params is not None,
            custom_grad_averager=grad_averager_factory is not None,
            client_mode=client_mode,
            delay_optimizer_step=delay_optimizer_step,
            delay_grad_averaging=delay_grad_averaging,
            offload_optimizer=offload_optimizer,
            use_local_updates=use_local_updates,
            matchmaking_time=matchmaking_time,
            averaging_timeout=averaging_timeout,
            allreduce_timeout=allreduce_timeout,
            next_chunk_timeout=next_chunk_timeout,
            run_id=run_id,
            target_batch_size=target_batch_size,
            batch_size_per_step=batch_size_per_step,
            load_state_timeout=load_state_timeout,
            reuse_grad_buffers=reuse_grad_buffers,
            delay_state_averaging=delay_state_averaging,
            average_state_every=average_state_every,
            auxiliary=auxiliary,
            performance_ema_alpha=performance_ema_alpha,
            shutdown_timeout=shutdown_timeout,
            verbose=verbose,
        )
        self.dht, self.run_id = dht, run_id
        self.status_loglevel = logging.INFO if verbose else logging.DEBUG
        self._closed = False
        self._state_lock = threading.RLock()
        self.state_lock = self._state_lock  # held while the optimizer's parameters or state change
        if algorithm is not None and not isinstance(algorithm, Algorithm):
            raise ConfigurationError(f"algorithm must be a hivemind_ext Algorithm, got {type(algorithm).__name__}")
        self.algorithm = algorithm
        self.grad_compression = grad_compression
        self.averager_opts = dict(averager_opts or {})
        self._runner: AlgorithmRunner | None = None
        self._aux: AuxiliaryPeer | None = None
        self.grad_averager: GradientAverager | None = None
        self._epoch_samples = 0  # samples this peer processed in its current epoch (algorithm path)
        self.state_manager = TrainingState(
            optimizer=optimizer,
            params=params,
            scheduler=scheduler,
            offload=config.offload_optimizer,
            extra_tensors=extra_tensors,
            average_opt_statistics=average_opt_statistics,
        )
        self._param_groups: list = []
        self._param_group_ids: list[int] = []
        # what torch.optim.Optimizer's own methods and hooks expect to find
        self.defaults = dict(getattr(self.state_manager.optimizer, "defaults", {}))
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()

        self._started: list[Any] = []  # what shutdown() must stop, in start order
        try:
            self._start_components(
                grad_compression,
                grad_averager_factory,
                state_averaging_compression,
                load_state_compression,
                dict(averager_opts or {}),
                dict(tracker_opts or {}),
            )
        except BaseException:
            self.shutdown()
            raise
        #: plans this peer's rounds and waits on them (its gradient rounds and its algorithm's)
        self.rounds = RoundDriver(
            tracker=self.tracker,
            matchmaking_time=config.matchmaking_time,
            averaging_timeout=config.averaging_timeout,
            local_epoch=lambda: self.local_epoch,
            hooks=round_hooks,
        )
        if algorithm is not None and self._custom_algorithm:
            try:
                impl = algorithm.reify(self._algorithm_context(next_model_key(algorithm, dht)))
                self._runner = AlgorithmRunner(impl) if not impl.uses_standard_path else None
            except BaseException:
                self.shutdown()
                raise
        self._background = BackgroundWorker(f"{run_id}-optimizer")
        self._scheduled_grads: StepControl | None = None
        self._first_step = True
        self.last_epoch_samples = 0  # samples averaged in this peer's last epoch (its group's total)
        self.last_round_samples: dict[str, int] = {}  # the same, per group member (base58 peer id)
        self.blocked_seconds = 0.0  # time step() spent waiting for the swarm (averaging, downloads)

    # ----- construction

    def _start_components(
        self,
        grad_compression: Any,
        grad_averager_factory: Callable[..., GradientAverager] | None,
        state_averaging_compression: Any,
        load_state_compression: Any,
        averager_opts: dict[str, Any],
        tracker_opts: dict[str, Any],
    ) -> None:
        config = self.config
        tracker_opts.setdefault("performance_ema_alpha", config.performance_ema_alpha)
        try:
            self.tracker = ProgressTracker(
                self.dht,
                progress_prefix(config.run_id),
                config.target_batch_size,
                client_mode=config.client_mode,
                status_loglevel=self.status_loglevel,
                start=True,
                **tracker_opts,
            )
        except TypeError as e:
            raise ConfigurationError(f"tracker_opts: {e}") from e
        self._started.append(self.tracker)
        common = dict(start=True, **config.averager_options(averager_opts))
        try:
            self.state_averager = TrainingStateAverager(
                self.state_manager,
                dht=self.dht,
                prefix=state_prefix(config.run_id),
                state_lock=self._state_lock,
                compression=state_averaging_compression,
                state_compression=load_state_compression,
                allow_state_sharing=not config.client_mode and not config.auxiliary,
                **common,
            )
            self._started.append(self.state_averager)
            if config.auxiliary:
                aux_averager = GradientAverager(
                    [], dht=self.dht, prefix=grad_prefix(config.run_id), auxiliary=True, **common
                )
                self._started.append(aux_averager)
                self._aux = AuxiliaryPeer(
                    averager=aux_averager,
                    tracker=self.tracker,
                    matchmaking_time=config.matchmaking_time,
                    averaging_timeout=config.averaging_timeout,
                    status_loglevel=self.status_loglevel,
                )
            elif config.averages_gradients and not self._custom_algorithm:
                factory = grad_averager_factory or GradientAverager
                self.grad_averager = factory(
                    self.state_manager.main_params,
                    dht=self.dht,
                    prefix=grad_prefix(config.run_id),
                    reuse_grad_buffers=config.reuse_grad_buffers,
                    compression=grad_compression,
                    **common,
                )
                if not isinstance(self.grad_averager, GradientAverager):
                    raise ConfigurationError("grad_averager_factory must return a hivemind_ext GradientAverager")
                self._started.append(self.grad_averager)
        except TypeError as e:
            raise ConfigurationError(f"averager_opts: {e}") from e

    def _algorithm_context(self, key: str) -> AlgorithmContext:
        """What an algorithm reaches the swarm through (it never calls back into this Optimizer)."""
        return AlgorithmContext(
            key=key,
            run_id=self.run_id,
            dht=self.dht,
            config=self.config,
            state=self.state_manager,
            state_lock=self._state_lock,
            tracker=self.tracker,
            rounds=self.rounds,
            averager_options=self.config.averager_options(self.averager_opts),
            grad_compression=self.grad_compression,
            downloader=self.load_state_from_peers,
            epoch_getter=lambda: self.local_epoch,
        )

    def _gradients(self) -> GradientAverager:
        """The gradient averager of the synchronous path (only that path calls this)."""
        if self.grad_averager is None:
            raise HivemindExtError("this optimizer averages no gradients (local updates, an algorithm, auxiliary)")
        return self.grad_averager

    # ----- what torch.optim.Optimizer users read

    @property
    def param_groups(self) -> list:  # type: ignore[override]
        groups = self.state_manager.optimizer.param_groups
        if [id(g) for g in groups] != self._param_group_ids:  # load_state_dict replaces the group dicts
            self._param_groups = group_views(self.state_manager.optimizer, self.state_manager.main_params)
            self._param_group_ids = [id(g) for g in groups]
        return self._param_groups

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        raise TypeError("hivemind_ext.Optimizer's param groups are fixed at construction")

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.state_manager.optimizer.state

    @property
    def opt(self) -> torch.optim.Optimizer:
        """The wrapped torch optimizer (it steps host copies of the parameters with offload_optimizer)."""
        return self.state_manager.optimizer

    @property
    def scheduler(self) -> Any:
        return self.state_manager.scheduler

    @property
    def local_epoch(self) -> int:
        """This peer's epoch, kept in line with the swarm's (downloads the state when it falls behind)."""
        return self.state_manager.epoch

    @property
    def use_local_updates(self) -> bool:
        return self.config.use_local_updates

    @property
    def reuse_grad_buffers(self) -> bool:
        return self.config.reuse_grad_buffers

    @property
    def client_mode(self) -> bool:
        return self.config.client_mode

    @property
    def auxiliary(self) -> bool:
        return self.config.auxiliary

    @property
    def target_batch_size(self) -> int:
        return self.config.target_batch_size

    @property
    def batch_size_per_step(self) -> int | None:
        return self.config.batch_size_per_step

    def add_param_group(self, param_group: dict) -> None:
        raise ConfigurationError("hivemind_ext.Optimizer cannot add param groups after construction")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Resets the model's gradients; with reuse_grad_buffers the Optimizer does that itself."""
        if self.config.reuse_grad_buffers:
            raise ConfigurationError(
                "with reuse_grad_buffers=True the Optimizer zeroes .grad after each epoch: do not call zero_grad"
            )
        for param in self.state_manager.main_params:
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                param.grad.detach_().zero_()

    def state_dict(self) -> dict[str, Any]:
        with self._state_lock:
            state_dict = self.state_manager.optimizer.state_dict()
        state_dict["local_epoch"] = self.local_epoch
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        epoch = state_dict.pop("local_epoch", None)
        with self._state_lock:
            self.state_manager.optimizer.load_state_dict(state_dict)
            if epoch is not None:  # the loaded param groups hold that epoch's lr already: do not re-step
                self.state_manager.adopt_epoch(int(epoch))
        if epoch is not None:
            self.tracker.update_epoch(int(epoch))

    def __repr__(self) -> str:
        return f"hivemind_ext.Optimizer(run_id={self.run_id!r}, epoch={self.local_epoch}, opt={self.opt!r})"

    # ----- the training step

    def step(
        self,
        closure: Callable[[], torch.Tensor] | None = None,
        batch_size: int | None = None,
        grad_scaler: GradScaler | None = None,
    ) -> torch.Tensor | None:
        """Reports ``batch_size`` more samples and does whatever the swarm's progress calls for (see
        the module docstring). Returns the closure's loss, if a closure was given."""
        if self._closed:
            raise HivemindExtError("the optimizer is shut down")
        if self._aux is not None:
            if closure is not None or batch_size is not None or grad_scaler is not None:
                raise ConfigurationError("auxiliary peers do not train: call step() without arguments")
            self._aux.step()
            self.state_manager.epoch = self._aux.local_epoch
            return None
        if grad_scaler is not None and not isinstance(grad_scaler, GradScaler):
            raise ConfigurationError("pass a hivemind_ext.GradScaler (or call scaler.step(opt) with torch's)")
        batch_size = batch_size if batch_size is not None else self.config.batch_size_per_step
        if batch_size is None:
            raise ConfigurationError("pass batch_size to step() or batch_size_per_step to the Optimizer")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigurationError(f"batch_size must be a positive integer, got {batch_size!r}")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        self._collect_background_work(wait=False)
        if self._should_catch_up():
            self.load_state_from_peers()
            self._discard_local_gradients()
            return loss
        if self._runner is not None:
            if grad_scaler is not None and self._skip_overflowed_batch(grad_scaler):
                return loss
            self._algorithm_step(batch_size)
            return loss
        if self.config.use_local_updates:
            if not self._local_update(batch_size, grad_scaler):
                return loss
            samples = self.tracker.local_progress.samples_accumulated + batch_size
        else:
            if not self._accumulate(batch_size, grad_scaler):
                return loss
            samples = self._gradients().local_samples_accumulated
        self.tracker.report_local_progress(self.local_epoch, samples)
        if self._epoch_is_over():
            self._end_epoch(grad_scaler)
        else:
            self._maybe_schedule_round()
        return loss

    def _skip_overflowed_batch(self, grad_scaler: GradScaler) -> bool:
        """Unscales the model's gradients in place; True if they overflowed (the batch is then skipped
        and the user's ``scaler.update()`` lowers the scale)."""
        if self.config.reuse_grad_buffers and self._runner is not None:
            raise ConfigurationError("a GradScaler with an algorithm needs reuse_grad_buffers=False")
        if grad_scaler.unscale_and_check(self):
            logger.log(self.status_loglevel, "gradients overflowed: skipping this batch (the scale is lowered)")
            return True
        return False

    def _accumulate(self, batch_size: int, grad_scaler: GradScaler | None) -> bool:
        averager = self._gradients()
        if grad_scaler is not None:
            if self.config.reuse_grad_buffers:
                grad_scaler.defer()  # .grad holds a sum of scaled gradients until the epoch ends
                averager.accumulator.accumulate(batch_size, check_finite=False)
                return True
            if self._skip_overflowed_batch(grad_scaler):
                return False
        averager.accumulate_grads_(batch_size)
        return True

    def _local_update(self, batch_size: int, grad_scaler: GradScaler | None) -> bool:
        if grad_scaler is not None and self._skip_overflowed_batch(grad_scaler):
            return False
        grads = [p.grad for p in self.state_manager.main_params]
        with self._state_lock:
            self.state_manager.apply_gradients(grads)
            self.state_manager.copy_to_model()
        return True

    def _epoch_is_over(self) -> bool:
        if self.tracker.ready_to_update_epoch:
            return True
        control = self._scheduled_grads
        return control is not None and control.groupmate_started

    def _maybe_schedule_round(self) -> None:
        """Starts matchmaking for the coming gradient round when the swarm's epoch end is near."""
        if self.grad_averager is None:
            return
        control = self._scheduled_grads
        if control is not None and not control.done():
            return
        if self._background.busy:
            return  # the previous round still runs in the background: its group tells whom to expect next
        now = get_dht_time()
        eta = self.tracker.estimated_next_update_time
        if not should_prepare_round(now, eta, self.config.matchmaking_time):
            return
        report = self.grad_averager.last_round
        plan = self.rounds.plan(eta=eta, last_group_size=report.group_size if report is not None else None)
        logger.log(self.status_loglevel, f"pre-scheduling the gradient round in {plan.scheduled_time - now:.2f} s")
        self._scheduled_grads = self.grad_averager.schedule_step(
            scheduled_time=plan.scheduled_time,
            timeout=plan.timeout(now),
            expected_group_size=plan.expected_group_size,
        )

    # ----- the end of an epoch

    def _end_epoch(self, grad_scaler: GradScaler | None) -> None:
        started = time.perf_counter()
        # no pause_updates() here: the tracker keeps publishing, so peers see this epoch's final count
        average_state = self._should_average_state(self._next_epoch())
        # the state round snapshots the parameters after this epoch's optimizer step on every peer (a
        # delayed step runs it in the background job, right after the step), or peers would average
        # parameters taken before the step on some and after it on others, and drift apart
        begin_state_round = self._begin_state_round if average_state else None
        if self.grad_averager is not None:
            self._wait_background()  # the buffers and the optimizer must be free
            control, self._scheduled_grads = self._scheduled_grads, None
            if control is not None and control.done() and not control.triggered:
                control = None  # matchmaking failed or expired before the epoch ended
            if self._swarm_averaged_without_us(control):
                self._skip_round(control)
            else:
                self._average_and_step(control, grad_scaler, then=begin_state_round)
        elif begin_state_round is not None:
            begin_state_round()
        apply_state_round = None
        if average_state and not self.config.delay_state_averaging and not self._background.pending:
            wait = self.config.averaging_timeout + self.config.matchmaking_time + 1.0
            apply_state_round = lambda: self.state_averager.apply_round(wait=wait)  # noqa: E731
        self._advance_epoch(before_announcing=apply_state_round)
        self.blocked_seconds += time.perf_counter() - started

    def _next_epoch(self) -> int:
        """The epoch this peer enters when its current one ends (the swarm's, if that is further)."""
        return next_epoch(self.local_epoch, self.tracker.global_progress.epoch)

    def _advance_epoch(self, *, before_announcing: Callable[[], Any] | None = None) -> int:
        """The one place where a training peer's epoch moves forward (the LR scheduler steps with it);
        ``before_announcing`` runs once the epoch is set, before the swarm hears of it."""
        epoch = self._next_epoch()
        with self._state_lock:
            self.state_manager.set_epoch(epoch)
        if before_announcing is not None:
            before_announcing()
        self._announce_epoch(epoch)
        return epoch

    def _announce_epoch(self, epoch: int) -> None:
        """Tells the swarm this peer's epoch: its progress record, and the version its state is shared as."""
        self.tracker.update_epoch(epoch)
        self.state_averager.state_sharing_priority = epoch

    def _average_and_step(
        self, control: StepControl | None, grad_scaler: GradScaler | None, *, then: Callable[[], None] | None
    ) -> None:
        """This epoch's gradient round (or a solo step), then the optimizer step, now or in the background;
        ``then`` runs right after the optimizer step (in the background job for delayed steps)."""
        config = self.config
        found_inf = grad_scaler is not None and config.reuse_grad_buffers and grad_scaler.unscale_and_check(self)
        if found_inf:
            logger.log(self.status_loglevel, "this epoch's gradients overflowed: contributing nothing")
            self._gradients().reset_accumulated_grads_()
        if self._alone(control):
            self._step_alone(control, found_inf=found_inf)
            return  # alone: no state round either
        if config.delay_grad_averaging:
            control = self._begin_gradient_round(control, zero_weight=found_inf)
            self._background.submit(_chain(lambda: self._finish_gradient_round(control, apply=not found_inf), then))
            return
        control = self._begin_gradient_round(control, zero_weight=found_inf)
        averaged = self._wait_gradient_round(control)
        if config.delay_optimizer_step:
            self._background.submit(_chain(lambda: self._apply_averaged_gradients(publish=False), then))
            return
        if averaged or not found_inf:
            self._apply_averaged_gradients(publish=True)
        if then is not None:
            then()

    def _swarm_averaged_without_us(self, control: StepControl | None) -> bool:
        """Another peer already finished this epoch's round and this one never found its group: a new
        search could only wait out ``averaging_timeout``."""
        return missed_round(
            searching=None
            if control is None
            else control.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP),
            swarm_epoch=self.tracker.global_progress.epoch,
            local_epoch=self.local_epoch,
            rounds_overlap_epochs=self.config.delay_grad_averaging,
        )

    def _skip_round(self, control: StepControl | None) -> None:
        logger.warning(
            f"the swarm averaged epoch {self.local_epoch} without this peer (it was late): "
            "dropping its gradients and downloading the state from peers"
        )
        if control is not None and not control.done():
            control.cancel()
        self._gradients().reset_accumulated_grads_()  # after_failed_round(missed=True): no step, resync
        self.rounds.request_resync(missed=True)

    def _alone(self, control: StepControl | None) -> bool:
        """No other peer reports progress and none started this round: a round could only time out."""
        if (control is not None and control.groupmate_started) or self.tracker.global_progress.num_peers > 1:
            return False
        try:  # the tracker's view may be a refresh period old (peers that just joined): confirm it
            return self.tracker.fetch_now().num_peers <= 1
        except HivemindExtError as e:
            logger.debug(f"could not refresh the swarm's progress ({e!r}): taking this peer as alone")
            return True

    def _step_alone(self, control: StepControl | None, *, found_inf: bool) -> None:
        """A solo peer steps on its own mean gradient at once, as hivemind does, instead of waiting
        ``averaging_timeout`` for a group that cannot form."""
        averager = self._gradients()
        if control is not None and not control.done():
            control.cancel()
        samples = 0 if found_inf else averager.local_samples_accumulated
        logger.log(self.status_loglevel, "no other peers: stepping with local gradients")
        averager.load_accumulators_into_averager_()
        averager.reset_accumulated_grads_()
        self.last_round_samples = {str(self.dht.peer_id): samples}
        self.last_epoch_samples = samples
        if found_inf:
            return
        if self.config.delay_optimizer_step:
            self._background.submit(lambda: self._apply_averaged_gradients(publish=False))
        else:
            self._apply_averaged_gradients(publish=True)

    def _begin_gradient_round(self, control: StepControl | None, *, zero_weight: bool) -> StepControl:
        averager = self._gradients()
        samples = averager.local_samples_accumulated
        if control is None:  # none was pre-scheduled: whoever is looking within a matchmaking time
            now = get_dht_time()
            plan = self.rounds.plan(expect_peers=False)
            control = averager.schedule_step(scheduled_time=plan.scheduled_time, timeout=plan.timeout(now))
        with contextlib.suppress(RuntimeError):  # too late to change the weight: the round has begun
            control.weight = 0.0 if zero_weight else float(samples)
        # groupmates learn how many samples each member averaged (read back in _wait_gradient_round);
        # the round packs control.gather only when it starts, after the trigger below
        control.gather = {"samples": 0 if zero_weight else int(samples), "epoch": self.local_epoch}
        averager.step(control=control, weight=0.0 if zero_weight else float(samples), wait=False)
        return control

    def _wait_gradient_round(self, control: StepControl, *, in_background: bool = False) -> bool:
        try:
            gathered = self.rounds.wait(control, watch_swarm=not in_background)
        except ROUND_FAILURES as e:
            logger.warning(f"averaging gradients failed ({e}): proceeding with local gradients")
            self.rounds.request_resync()
            return False
        except (
            TimeoutError,
            concurrent.futures.TimeoutError,
            concurrent.futures.CancelledError,
            HivemindExtError,
        ) as e:
            logger.warning(f"averaging gradients did not finish ({e!r}): proceeding with local gradients")
            self.rounds.request_resync()
            return False
        report = self.grad_averager.last_round if self.grad_averager is not None else None
        peers = report.group_size if report is not None else len(gathered or {})
        self.last_round_samples = gathered_samples(gathered)
        self.last_epoch_samples = sum(self.last_round_samples.values())
        logger.log(self.status_loglevel, f"averaged gradients with {peers} peers")
        if gathered_epochs(gathered) - {self.local_epoch}:
            # groupmates averaged another epoch's gradients (this peer was behind, e.g. right after a
            # download that raced their step): the update still helps, but download the state next
            logger.info(f"groupmates were at epochs {sorted(gathered_epochs(gathered))}: resynchronizing")
            self.rounds.request_resync(missed=True)  # the swarm is at another epoch: this peer missed its round
        return True

    def resync_after_failed_round(self) -> bool:
        """After a round this peer could not finish: download the swarm's state at the next step (its
        local update drifted from the swarm's) if other peers train. Returns whether it will."""
        return self.rounds.request_resync()

    def wait_for_round(self, control: StepControl, *, watch_swarm: bool = True) -> Any:
        """The round's gathered data: :meth:`hivemind_ext.optim.rounds.RoundDriver.wait` of this peer."""
        return self.rounds.wait(control, watch_swarm=watch_swarm)

    def _finish_gradient_round(self, control: StepControl, *, apply: bool) -> None:
        """Background job (delay_grad_averaging): wait for the round, then step on its result."""
        self._wait_gradient_round(control, in_background=True)
        if apply:
            self._apply_averaged_gradients(publish=False)

    def _apply_averaged_gradients(self, *, publish: bool) -> None:
        with self._state_lock, self._gradients().use_averaged_gradients() as grads:
            self.state_manager.apply_gradients(list(grads))
            if publish:
                self.state_manager.copy_to_model()

    # ----- pluggable algorithms

    @property
    def _custom_algorithm(self) -> bool:
        return self.algorithm is not None and not isinstance(self.algorithm, GradientAllReduce)

    @property
    def algorithm_impl(self) -> AlgorithmImpl | None:
        """The implementation of a custom ``algorithm`` bound to this optimizer (its counters, and
        controls such as AsyncModelAverage's ``abort()`` / ``resume()``); None on the standard path."""
        return self._runner.impl if self._runner is not None else None

    @property
    def algorithm_runner(self) -> AlgorithmRunner | None:
        """The runner of a custom ``algorithm`` (its buckets, round counters); None on the standard path."""
        return self._runner

    @property
    def scheduled_round(self) -> StepControl | None:
        """The gradient round pre-scheduled for this epoch's end, if any (its matchmaking runs ahead)."""
        return self._scheduled_grads

    def swarm_epoch_is_over(self) -> bool:
        """Whether the swarm has accumulated ``target_batch_size`` samples in this peer's epoch."""
        return self.tracker.ready_to_update_epoch

    def _algorithm_step(self, batch_size: int) -> None:
        runner = self._runner
        if runner is None:
            raise HivemindExtError("this optimizer runs no custom algorithm")
        self._epoch_samples += batch_size
        self.tracker.report_local_progress(self.local_epoch, self._epoch_samples)
        started = time.perf_counter()
        if runner.step(batch_size):
            self.blocked_seconds += time.perf_counter() - started
        if self.tracker.ready_to_update_epoch:
            self._epoch_samples = 0
            self._advance_epoch()

    def _should_average_state(self, epoch: int) -> bool:
        config = self.config
        if config.auxiliary or self.tracker.global_progress.num_peers < 2 or epoch % config.average_state_every:
            return False
        return not self.state_averager.has_round

    def _begin_state_round(self) -> None:
        """Starts a state averaging round (its result is applied by the training thread, in step())."""
        config = self.config
        if self.state_averager.has_round:
            return  # one still runs, or it finished and step() has not applied it yet (starting would lose it)
        self.state_averager.begin_round(
            timeout=config.averaging_timeout + config.matchmaking_time,
            scheduled_time=get_dht_time() + config.matchmaking_time,
        )

    def collect_background_work(self, wait: bool = True) -> None:
        """Publishes a finished delayed step and applies a finished state round (``wait``: for up to
        about ``averaging_timeout`` while they run). ``step()`` does this itself, without waiting."""
        self._collect_background_work(wait)

    def _collect_background_work(self, wait: bool) -> None:
        """Publishes a finished delayed step and applies a finished state round."""
        if self._background.pending and (wait or not self._background.busy):
            self._wait_background()
        self.state_averager.apply_round(wait=self.config.averaging_timeout + 1.0 if wait else 0.0)

    def _wait_background(self) -> None:
        if not self._background.pending:
            return
        started = time.perf_counter()
        try:
            self._background.wait(self.config.averaging_timeout + self.config.shutdown_timeout)
        except DeadlineExceededError as e:
            logger.warning(f"{e}: the step will be applied when it finishes")
            return
        except HivemindExtError as e:
            logger.warning(f"a background step failed: {e}")
        finally:
            self.blocked_seconds += time.perf_counter() - started
        with self._state_lock:
            self.state_manager.copy_to_model()

    # ----- catching up with the swarm

    def _should_catch_up(self) -> bool:
        global_epoch = self.tracker.global_progress.epoch
        first, self._first_step = self._first_step, False
        if self.rounds.resync_pending:
            return True
        return self.local_epoch < global_epoch - 1 or (first and self.local_epoch < global_epoch)

    def _discard_local_gradients(self) -> None:
        if self.grad_averager is not None:
            self.grad_averager.reset_accumulated_grads_()
        self.tracker.report_local_progress(self.local_epoch, 0)

    def load_state_from_peers(self, **kwargs: Any) -> None:
        """Downloads the newest parameters, optimizer state and epoch from peers and applies them."""
        started = time.perf_counter()
        self.rounds.clear_resync()
        self._wait_background()
        self.state_averager.cancel_round()
        if self._scheduled_grads is not None and not self._scheduled_grads.done():
            self._scheduled_grads.cancel()
        self._scheduled_grads = None
        timeout = kwargs.pop("timeout", self.config.load_state_timeout)
        try:
            loaded = self.state_averager.load_state_from_peers(timeout=timeout, **kwargs)
            if loaded is None:
                logger.log(self.status_loglevel, "no peer shares its state yet: keeping the local state")
                return
            metadata, tensors = loaded
            donor_epoch = metadata.get("epoch") if isinstance(metadata, dict) else None
            if isinstance(donor_epoch, int) and donor_epoch < self.local_epoch:
                # e.g. a resync after a failed round while the other peers lag: going back would lose progress
                logger.log(
                    self.status_loglevel,
                    f"the newest state that peers share is of epoch {donor_epoch}, behind this peer's "
                    f"{self.local_epoch}: keeping the local state",
                )
                return
            with self._state_lock:
                self.state_manager.load(metadata, tensors)
                if self._runner is not None:
                    self._runner.impl.on_state_loaded()
        except StateLoadError as e:
            logger.warning(f"could not load the state from peers: {e}; keeping the local state")
            return
        finally:
            self.blocked_seconds += time.perf_counter() - started
        logger.log(self.status_loglevel, f"loaded the state of epoch {self.local_epoch} from peers")
        self._announce_epoch(self.local_epoch)

    # ----- shutting down

    def shutdown(self) -> None:
        """Stops background work and leaves the swarm; idempotent."""
        if self._closed:
            return
        self._closed = True
        background = getattr(self, "_background", None)
        if background is not None:
            background.shutdown(self.config.shutdown_timeout)
        control = getattr(self, "_scheduled_grads", None)
        if control is not None and not control.done():
            control.cancel()
        runner = getattr(self, "_runner", None)
        if runner is not None:
            runner.shutdown()
        aux = getattr(self, "_aux", None)
        if aux is not None:
            aux.shutdown()
        if getattr(self, "state_averager", None) is not None:
            self.state_averager.cancel_round()
        for component in reversed(getattr(self, "_started", [])):
            try:
                component.shutdown()
            except Exception as e:
                logger.debug(f"error while shutting down {type(component).__name__}: {e!r}")

    def __enter__(self) -> Optimizer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
