"""hivemind_ext.Optimizer: a drop-in replacement for ``hivemind.Optimizer``.

Same keyword arguments, same meaning (see ``../shared/reference`` and the README). One *epoch* is the
swarm processing ``target_batch_size`` samples together. The Optimizer is the torch facade (param
groups, state, state_dict, zero_grad, hooks), the epoch and the catch-up; the training itself is
always an algorithm's (:mod:`hivemind_ext.optim.algorithms`). Per call of ``step()``:

1. finish the algorithm's background work that is done (a delayed optimizer step, a state round);
2. if this peer fell behind the swarm (or its last averaging failed), download the state from peers;
3. hand the batch to the algorithm's :class:`~hivemind_ext.optim.algorithms.base.StepEngine`: by
   default :mod:`~hivemind_ext.optim.algorithms.sync_gradients` (accumulate the gradients, average
   them when the swarm reached ``target_batch_size``, step) or, with ``use_local_updates``,
   :mod:`~hivemind_ext.optim.algorithms.local_updates`; a custom ``algorithm`` (DiLoCo, QAdam, ...)
   through an :class:`~hivemind_ext.optim.algorithms.runner.AlgorithmRunner`;
4. when the algorithm's epoch ends, it asks the Optimizer (through its context) to enter the next
   epoch: the LR scheduler steps, and the swarm hears of it.

Peers whose round fails proceed with their local gradients, as in hivemind, and download the
state from their peers at their next step, which brings their parameters back in line. When rounds
are scheduled, whom they expect, how long to wait and what a missed or failed round means are
decided in :mod:`hivemind_ext.optim.rounds`, whose :class:`~hivemind_ext.optim.rounds.RoundDriver`
(``Optimizer.rounds``) also waits on every round of the algorithm.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TextIO

import torch
from hivemind import DHT

from hivemind_ext.averaging.control import StepControl
from hivemind_ext.averaging.matchmaking.rotation import Coordinates
from hivemind_ext.errors import ConfigurationError, HivemindExtError, RunMismatchError, StateLoadError
from hivemind_ext.logs import use_default_handler
from hivemind_ext.monitoring.publisher import MetricsPublisher
from hivemind_ext.optim.algorithms.base import Algorithm, AlgorithmContext, AlgorithmImpl, StepEngine, next_model_key
from hivemind_ext.optim.algorithms.runner import AlgorithmRunner
from hivemind_ext.optim.algorithms.sync_gradients import GradientAllReduce, SyncGradientsImpl
from hivemind_ext.optim.auxiliary import AuxiliaryPeer
from hivemind_ext.optim.config import OptimizerConfig
from hivemind_ext.optim.fingerprint import auxiliary_fingerprint, trainer_fingerprint
from hivemind_ext.optim.grad_averager import GradientAverager
from hivemind_ext.optim.grad_scaler import BoundGradScaler, GradScaler
from hivemind_ext.optim.keys import grad_prefix, progress_prefix, state_prefix
from hivemind_ext.optim.param_groups import group_views, require_trainable
from hivemind_ext.optim.progress import ProgressTracker
from hivemind_ext.optim.progress_bar import make_progress_bar
from hivemind_ext.optim.rounds import RoundDriver, RoundHooks, next_epoch
from hivemind_ext.optim.run_guard import RunGuard
from hivemind_ext.optim.state_averager import TrainingStateAverager
from hivemind_ext.optim.state_checks import StateBounds
from hivemind_ext.optim.state_digests import DigestBoard
from hivemind_ext.optim.state_trust import in_groups, make_digest_board, state_trust_options
from hivemind_ext.optim.training_state import TrainingState
from hivemind_ext.p2p.dht_calls import dht_client_mode, dht_peer_id

logger = logging.getLogger(__name__)

__all__ = ["Optimizer", "grad_prefix", "progress_prefix", "state_prefix"]  # the key prefixes live in .keys


class Optimizer(torch.optim.Optimizer):
    """Wraps a PyTorch optimizer to train one model together with peers (see the module docstring).

    Takes every keyword argument of ``hivemind.Optimizer`` with the same meaning; see the README for
    the list. Differences: ``client_mode=True`` is honoured even when the DHT is not in client mode,
    and ``grad_averager_factory`` must build a :class:`hivemind_ext.optim.GradientAverager`.

    Beyond hivemind's: ``algorithm`` (see :mod:`hivemind_ext.optim.algorithms`) and ``round_hooks``, a
    :class:`~hivemind_ext.optim.rounds.RoundHooks` called before and after every round this peer
    waits on (its gradient rounds and its algorithm's): a seam to watch rounds, or to fail one in a test;
    ``progress``: a progress bar (True: on stderr; a text stream: on it; None: on stderr when ``verbose``
    and stderr is a terminal; see :mod:`hivemind_ext.optim.progress_bar`). ``verbose=True`` shows the status
    lines on stderr even when logging is not configured (see :mod:`hivemind_ext.logs`).
    ``state_bounds``: what a downloaded state may hold (:class:`~hivemind_ext.optim.state_checks.StateBounds`;
    see :mod:`hivemind_ext.optim.state_trust` for how downloads are trusted).
    ``metrics_period``: publish this peer's metrics (epoch, speed, role, rounds, traffic, and the losses
    given to :meth:`report_loss`) as a signed DHT record every that many seconds, for ``hivemind-ext monitor``.
    ``grad_averaging_hops``: gradient rounds per epoch in rotating groups (see :mod:`hivemind_ext.optim.hops`).
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
        progress: bool | TextIO | None = None,
        metrics_period: float | None = None,
        state_bounds: StateBounds | None = None,
        grad_averaging_hops: int | str = 1,
    ) -> None:
        if not isinstance(dht, DHT):
            raise ConfigurationError(f"dht must be a running hivemind.DHT, got {type(dht).__name__}")
        params = list(params) if params is not None else None
        custom_algorithm = algorithm is not None and not isinstance(algorithm, GradientAllReduce)
        if offload_optimizer is None and custom_algorithm:
            offload_optimizer = False  # algorithms step the model's own parameters
        # asked with a deadline (hivemind's properties wait for ever on a hung DHT process), and then kept
        # by the DHT for every component that reads them
        dht_peer_id(dht)
        self.config = config = OptimizerConfig.resolve(
            dht_client_mode=dht_client_mode(dht),
            optimizer_from_factory=params is not None,
            custom_grad_averager=grad_averager_factory is not None,
            custom_algorithm=custom_algorithm,
            grad_averaging_hops=grad_averaging_hops,
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
        if verbose:  # as hivemind's: status lines on stderr with no logging set-up (see hivemind_ext.logs)
            use_default_handler()
        self.progress_bar = None  # see hivemind_ext.optim.progress_bar
        self._closed = False
        self._state_lock = threading.RLock()
        self.state_lock = self._state_lock  # held while the optimizer's parameters or state change
        if algorithm is not None and not isinstance(algorithm, Algorithm):
            raise ConfigurationError(f"algorithm must be a hivemind_ext Algorithm, got {type(algorithm).__name__}")
        self.algorithm = algorithm
        self.grad_compression = grad_compression
        self.averager_opts = dict(averager_opts or {})
        self._engine: StepEngine | None = None  # what step() drives (None on an auxiliary peer)
        self._runner: AlgorithmRunner | None = None  # the engine, when it is a runner around a custom algorithm
        self._aux: AuxiliaryPeer | None = None
        self.state_manager = TrainingState(
            optimizer=optimizer,
            params=params,
            scheduler=scheduler,
            offload=config.offload_optimizer,
            extra_tensors=extra_tensors,
            average_opt_statistics=average_opt_statistics,
        )
        if not config.auxiliary:
            require_trainable(self.state_manager.main_params)
        #: what must match on every peer of the run (see hivemind_ext.optim.fingerprint)
        self.fingerprint = (
            auxiliary_fingerprint(target_batch_size)
            if auxiliary
            else trainer_fingerprint(
                self.state_manager,
                target_batch_size=target_batch_size,
                grad_compression=grad_compression,
                state_averaging_compression=state_averaging_compression,
                algorithm=algorithm or GradientAllReduce(),
                use_local_updates=use_local_updates,
                average_state_every=average_state_every,
                grad_averaging_hops=grad_averaging_hops,
            )
        )
        self.averager_opts.setdefault("fingerprint", "" if auxiliary else self.fingerprint.digest)
        # one rotation per peer: in rotating groups, each epoch's parameter round then groups peers by the
        # digits its gradient round just dealt, and mixes across the gradient round's groups instead of
        # meeting them again (see hivemind_ext.averaging.matchmaking.rotation, "One rotation per peer")
        self.averager_opts.setdefault("rotation", Coordinates())
        self._param_groups: list = []
        self._param_group_ids: list[int] = []
        # what torch.optim.Optimizer's own methods and hooks expect to find
        self.defaults = dict(getattr(self.state_manager.optimizer, "defaults", {}))
        for hooks in ("step", "load_state_dict", "state_dict"):
            setattr(self, f"_optimizer_{hooks}_pre_hooks", OrderedDict())
            setattr(self, f"_optimizer_{hooks}_post_hooks", OrderedDict())
        self._first_step = True
        self._blocked_seconds = 0.0  # time step() spent downloading the state (the engine counts its own)
        self._started: list[Any] = []  # what shutdown() must stop, in start order
        self.metrics_publisher: MetricsPublisher | None = None  # with metrics_period
        self.state_digests: DigestBoard | None = None  # per-epoch state digests (see .state_trust)
        try:
            self._start_components(
                state_averaging_compression,
                load_state_compression,
                dict(self.averager_opts),
                {"fingerprint": self.fingerprint, **(tracker_opts or {})},
                state_bounds,
            )
            #: plans this peer's rounds and waits on them (its algorithm's rounds)
            self.rounds = RoundDriver(
                tracker=self.tracker,
                matchmaking_time=config.matchmaking_time,
                averaging_timeout=config.averaging_timeout,
                local_epoch=lambda: self.local_epoch,
                hooks=round_hooks,
                status_loglevel=self.status_loglevel,
                in_groups=in_groups(self),
            )
            self.progress_bar = make_progress_bar(progress, verbose=verbose, tracker=self.tracker, rounds=self.rounds)
            if self._aux is None:
                self._start_algorithm(algorithm or GradientAllReduce(), grad_averager_factory)
                self.state_digests = make_digest_board(self)
                self._started.extend([self.state_digests] if self.state_digests is not None else [])
            if metrics_period is not None:
                self.metrics_publisher = MetricsPublisher.for_optimizer(self, metrics_period)
                self._started.append(self.metrics_publisher)
        except BaseException:
            self.shutdown()
            raise

    # ----- construction

    def _start_components(
        self,
        state_averaging_compression: Any,
        load_state_compression: Any,
        averager_opts: dict[str, Any],
        tracker_opts: dict[str, Any],
        state_bounds: StateBounds | None = None,
    ) -> None:
        config = self.config
        tracker_opts.setdefault("performance_ema_alpha", config.performance_ema_alpha)
        try:
            self.tracker = ProgressTracker(
                self.dht,
                progress_prefix(config.run_id),
                config.target_batch_size,
                client_mode=config.client_mode,
                auxiliary=config.auxiliary,
                status_loglevel=self.status_loglevel,
                start=True,
                **tracker_opts,
            )
        except TypeError as e:
            raise ConfigurationError(f"tracker_opts: {e}") from e
        self._started.append(self.tracker)
        self.run_guard = RunGuard(self.tracker, config.run_id)
        self.run_guard.check()  # a peer of another model or other settings stops here, before it averages
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
                **state_trust_options(self, state_bounds, common),
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
        except TypeError as e:
            raise ConfigurationError(f"averager_opts: {e}") from e

    def _start_algorithm(self, algorithm: Algorithm, grad_averager_factory: Callable[..., Any] | None) -> None:
        """Binds the algorithm to this peer; its implementation is the engine, or a runner drives it."""
        impl = algorithm.reify(self._algorithm_context(next_model_key(algorithm, self.dht), grad_averager_factory))
        if impl.runs_own_steps:
            self._engine = impl  # type: ignore[assignment]  # such implementations are StepEngines
        else:
            self._engine = self._runner = AlgorithmRunner(impl)

    def _algorithm_context(self, key: str, grad_averager_factory: Callable[..., Any] | None) -> AlgorithmContext:
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
            grad_averager_factory=grad_averager_factory,
            state_averager=self.state_averager,
            epoch_advancer=self._advance_epoch,
            status_loglevel=self.status_loglevel,
        )

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
        self._check_run()
        if self.progress_bar is not None:
            self.progress_bar.update(self.local_epoch)
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
        engine = self._training_engine()
        engine.collect_background_work(wait=False)
        if self._should_catch_up():
            self.load_state_from_peers()
            engine.discard_local_progress()
            self.tracker.report_local_progress(self.local_epoch, 0)
            return loss
        engine.train_step(batch_size, BoundGradScaler(grad_scaler, self) if grad_scaler is not None else None)
        return loss

    def _check_run(self) -> None:
        """Leaves the swarm with one RunMismatchError if this peer does not match the run (see RunGuard)."""
        try:
            self.run_guard.check()
        except RunMismatchError:
            self.shutdown()
            raise

    def report_loss(self, loss: Any) -> None:
        """A training loss (a number or a one-element tensor) for the next metrics record, which
        publishes the mean of those reported since the previous one; does nothing without ``metrics_period``."""
        if self.metrics_publisher is not None:
            self.metrics_publisher.report_loss(loss)

    def _training_engine(self) -> StepEngine:
        if self._engine is None:
            raise HivemindExtError("an auxiliary peer runs no algorithm")
        return self._engine

    # ----- the algorithm

    @property
    def algorithm_impl(self) -> AlgorithmImpl | None:
        """The implementation of a custom ``algorithm`` that the runner drives (its counters, and
        controls such as AsyncModelAverage's ``abort()`` / ``resume()``); None for the default
        (``GradientAllReduce``: synchronous gradients or local updates), which runs its own steps."""
        return self._runner.impl if self._runner is not None else None

    @property
    def algorithm_runner(self) -> AlgorithmRunner | None:
        """The runner of a custom ``algorithm`` (its buckets, round counters); None for the default."""
        return self._runner

    @property
    def engine(self) -> StepEngine | None:
        """What ``step()`` drives: the default algorithm's implementation, or the runner of a custom
        one (None on an auxiliary peer)."""
        return self._engine

    @property
    def grad_averager(self) -> GradientAverager | None:
        """The gradient averager of the synchronous path (None with local updates, a custom algorithm, auxiliary)."""
        impl = self._engine
        return impl.grad_averager if isinstance(impl, SyncGradientsImpl) else None

    @property
    def scheduled_round(self) -> StepControl | None:
        """The gradient round pre-scheduled for this epoch's end, if any (its matchmaking runs ahead)."""
        impl = self._engine
        return impl.scheduled_round if isinstance(impl, SyncGradientsImpl) else None

    @property
    def scheduled_grads(self) -> StepControl | None:
        """hivemind's name for :attr:`scheduled_round`."""
        return self.scheduled_round

    @property
    def last_epoch_samples(self) -> int:
        """Samples averaged in this peer's last epoch (its group's total; synchronous path)."""
        impl = self._engine
        return impl.last_epoch_samples if isinstance(impl, SyncGradientsImpl) else 0

    @property
    def last_round_samples(self) -> dict[str, int]:
        """The same, per group member (base58 peer id)."""
        impl = self._engine
        return impl.last_round_samples if isinstance(impl, SyncGradientsImpl) else {}

    @property
    def blocked_seconds(self) -> float:
        """Time ``step()`` spent waiting for the swarm (averaging, background steps, downloads)."""
        return self._blocked_seconds + (self._engine.blocked_seconds if self._engine is not None else 0.0)

    def resync_after_failed_round(self) -> bool:
        """After a round this peer could not finish: download the swarm's state at the next step (its
        local update drifted from the swarm's) if other peers train. Returns whether it will."""
        return self.rounds.request_resync()

    def wait_for_round(self, control: StepControl, *, watch_swarm: bool = True) -> Any:
        """The round's gathered data: :meth:`hivemind_ext.optim.rounds.RoundDriver.wait` of this peer."""
        return self.rounds.wait(control, watch_swarm=watch_swarm)

    def swarm_epoch_is_over(self) -> bool:
        """Whether the swarm has accumulated ``target_batch_size`` samples in this peer's epoch."""
        return self.tracker.ready_to_update_epoch

    def collect_background_work(self, wait: bool = True) -> None:
        """Publishes a finished delayed step and applies a finished state round (``wait``: for up to
        about ``averaging_timeout`` while they run). ``step()`` does this itself, without waiting."""
        if self._engine is not None:
            self._engine.collect_background_work(wait)

    # ----- the epoch

    def _advance_epoch(self, *, before_announcing: Callable[[], Any] | None = None) -> int:
        """The one place where a training peer's epoch moves forward (the LR scheduler steps with it);
        ``before_announcing`` runs once the epoch is set, before the swarm hears of it. Algorithms
        call it through their context (``advance_epoch()``) when their epoch ends."""
        epoch = next_epoch(self.local_epoch, self.tracker.global_progress.epoch)
        with self._state_lock:
            self.state_manager.set_epoch(epoch)
        if before_announcing is not None:
            before_announcing()
        if self.state_digests is not None:
            self.state_digests.after_epoch(epoch)
        self._announce_epoch(epoch)
        swarm = self.tracker.global_progress
        logger.log(
            self.status_loglevel,
            f"transitioning to epoch {epoch} (the swarm: {swarm.samples_accumulated} samples of epoch {swarm.epoch} "
            f"from {swarm.num_peers} peers)",
        )
        return epoch

    def _announce_epoch(self, epoch: int) -> None:
        """Tells the swarm this peer's epoch: its progress record, and the version its state is shared as."""
        self.tracker.update_epoch(epoch)
        self.state_averager.state_sharing_priority = epoch

    # ----- catching up with the swarm

    def _should_catch_up(self) -> bool:
        global_epoch = self.tracker.global_progress.epoch
        first, self._first_step = self._first_step, False
        if self.rounds.resync_pending:
            return True
        return self.local_epoch < global_epoch - 1 or (first and self.local_epoch < global_epoch)

    def load_state_from_peers(self, **kwargs: Any) -> None:
        """Downloads the newest parameters, optimizer state and epoch from peers and applies them."""
        started = time.perf_counter()
        self.rounds.clear_resync()
        if self._engine is not None:
            self._engine.prepare_for_download()
        self.state_averager.cancel_round()
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
            if isinstance(donor_epoch, int) and not self.tracker.accepts_epoch(donor_epoch):
                swarm_epoch = self.tracker.global_progress.epoch
                logger.warning(f"refusing a state of epoch {donor_epoch}: the swarm agrees on {swarm_epoch}")
                return
            with self._state_lock:
                self.state_manager.load(metadata, tensors)
                if self._engine is not None:
                    self._engine.on_state_loaded()
                if self.state_digests is not None:
                    self.state_digests.forget()
        except StateLoadError as e:
            logger.warning(f"could not load the state from peers: {e}; keeping the local state")
            return
        except RunMismatchError:  # the donors' state has another layout: retrying cannot help
            self.shutdown()
            raise
        finally:
            self._blocked_seconds += time.perf_counter() - started
        logger.log(self.status_loglevel, f"loaded the state of epoch {self.local_epoch} from peers")
        self._announce_epoch(self.local_epoch)

    # ----- shutting down

    def shutdown(self) -> None:
        """Stops the algorithm and leaves the swarm; idempotent."""
        if self._closed:
            return
        self._closed = True
        if getattr(self, "progress_bar", None) is not None:
            self.progress_bar.close(self.local_epoch)
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.shutdown()
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
