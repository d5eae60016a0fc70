"""The Algorithm API: what is communicated, when, with whom, and how the model is updated.

Two classes, as in Bagua:

- an :class:`Algorithm` holds hyperparameters only. ``Optimizer(..., algorithm=alg)`` calls
  ``alg.reify(context)`` to get an implementation bound to that optimizer and swarm, so one
  ``Algorithm`` object can serve several models (each gets its own implementation and DHT keys);
- an :class:`AlgorithmImpl` does the work through hooks, which the Optimizer calls at every
  ``step()`` (see :class:`~hivemind_ext.optim.algorithms.runner.AlgorithmRunner`)::

      impl.on_backward(batch_size)          # after backward: accumulate, or take a local step, ...
      if impl.need_reset():                 # a new stage (e.g. QAdam after warm-up)
          impl.reset(); re-run init_tensors / tensors_to_buckets / init_operations
      if impl.should_communicate():         # when: default, when the swarm reached target_batch_size
          run every bucket's operations     # what and how: average with a codec, Python steps, exchanges
          impl.optimizer_step()             # how the model is updated
          impl.on_optimizer_step()          # after the update (clear accumulators, ...)

  Which tensors are communicated is ``init_tensors()``; ``tensors_to_buckets()`` groups them into
  :class:`Bucket` s (fused float32 buffers); ``init_operations(bucket)`` appends the bucket's
  operations. Operations run position by position across buckets, and all ``average`` operations at
  one position form ONE all-reduce round (one matchmaking), each bucket with its own codec.

Every ``Optimizer.step()`` drives an algorithm: the Optimizer calls a :class:`StepEngine` (what one
step does, background work, what a state download means to it). An implementation whose
``runs_own_steps`` is False (the default: custom algorithms, DiLoCo, QAdam, ...) is driven through
the hooks above by an :class:`~hivemind_ext.optim.algorithms.runner.AlgorithmRunner`, which is its
engine; the built-in synchronous gradient averaging (:mod:`.sync_gradients`, what the default
``GradientAllReduce()`` reifies into) and local updates (:mod:`.local_updates`) own their round
scheduling and background work, and are engines themselves.

The swarm-wide epoch (``target_batch_size`` samples) still drives the LR scheduler and state
downloads for late joiners, whatever the algorithm: an engine asks the Optimizer to enter the next
epoch through its context (``advance_epoch()``), and the Optimizer downloads the state when behind.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hivemind_ext.errors import ConfigurationError
from hivemind_ext.optim.config import OptimizerConfig
from hivemind_ext.optim.grad_accumulator import GradientAccumulator
from hivemind_ext.optim.progress import ProgressTracker
from hivemind_ext.optim.rounds import RoundDriver
from hivemind_ext.optim.training_state import TrainingState

if TYPE_CHECKING:
    from hivemind_ext.optim.grad_scaler import BoundGradScaler
    from hivemind_ext.optim.state_averager import TrainingStateAverager

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 16 << 20

NamedTensor = tuple[str, torch.Tensor]


@dataclasses.dataclass
class AlgorithmContext:
    """What an implementation is bound to: one model's training state in one swarm.

    Algorithms reach the swarm through this context, never through the Optimizer that runs them
    (which imports them): the training state and its lock, the progress tracker, the round driver
    (plan a round, wait on it, the rule for a failed one), the averager options, the state averager
    (parameter-averaging rounds), and three requests to the Optimizer: ``download_state()`` now,
    ``request_resync()`` at the next step, ``advance_epoch()`` when this peer's epoch ends.

    :param key: distinguishes models that share one Algorithm object (part of every DHT prefix)
    :param state: the model's :class:`~hivemind_ext.optim.training_state.TrainingState`
    :param state_lock: held while the parameters or the optimizer state change
    :param rounds: the :class:`~hivemind_ext.optim.rounds.RoundDriver` of this peer
    :param averager_options: keywords for every averager the algorithm starts (the Optimizer's settings
      with the user's ``averager_opts`` on top)
    :param grad_compression: the Optimizer's ``grad_compression`` (the default codec of gradients)
    :param grad_averager_factory: the Optimizer's ``grad_averager_factory`` (None: GradientAverager)
    :param state_averager: the peer's TrainingStateAverager (its state rounds: ``average_state_every``)
    :param downloader: what ``download_state()`` calls (the Optimizer's catch-up)
    :param epoch_advancer: what ``advance_epoch()`` calls (the Optimizer's one epoch advance)
    :param status_loglevel: the level of progress messages (INFO with ``verbose=True``)
    """

    key: str
    run_id: str
    dht: Any
    config: OptimizerConfig
    state: TrainingState
    state_lock: Any
    tracker: ProgressTracker
    rounds: RoundDriver
    averager_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    grad_compression: Any = None
    downloader: Callable[..., Any] | None = None
    epoch_getter: Callable[[], int] | None = None
    grad_averager_factory: Callable[..., Any] | None = None
    state_averager: TrainingStateAverager | None = None
    epoch_advancer: Callable[..., int] | None = None
    status_loglevel: int = logging.DEBUG

    @property
    def params(self) -> list[torch.Tensor]:
        """The model's parameters, in param-group order."""
        return self.state.main_params

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        """The wrapped torch optimizer (its param groups hold the model's parameters, no offload)."""
        return self.state.optimizer

    @property
    def local_epoch(self) -> int:
        """This peer's epoch (the swarm's epochs of ``target_batch_size`` samples)."""
        return self.epoch_getter() if self.epoch_getter is not None else self.state.epoch

    def swarm_epoch_is_over(self) -> bool:
        """Whether the swarm has accumulated ``target_batch_size`` samples in this peer's epoch."""
        return bool(self.tracker.ready_to_update_epoch)

    def download_state(self, **kwargs: Any) -> Any:
        """Downloads the swarm's newest training state now and applies it (``on_state_loaded`` follows)."""
        if self.downloader is None:
            raise ConfigurationError("this context cannot download a state (no downloader)")
        return self.downloader(**kwargs)

    def advance_epoch(self, *, before_announcing: Callable[[], Any] | None = None) -> int:
        """This peer's epoch ended: the Optimizer enters the next one (the swarm's, if further), steps
        the LR scheduler, runs ``before_announcing`` and tells the swarm. Returns the new epoch."""
        if self.epoch_advancer is None:
            raise ConfigurationError("this context cannot advance the epoch (no epoch_advancer)")
        return self.epoch_advancer(before_announcing=before_announcing)

    def request_resync(self) -> bool:
        """After a round this peer could not finish: the Optimizer downloads the swarm's state at the
        next step if other peers train (:func:`~hivemind_ext.optim.rounds.after_failed_round`).
        Returns whether it will."""
        return self.rounds.request_resync()

    def prefix(self, suffix: str) -> str:
        """A DHT prefix for this model's traffic: peers of the same run and model key meet under it."""
        return f"{self.run_id}_{self.key}_{suffix}"


class StepEngine(Protocol):
    """What ``Optimizer.step()`` drives, once it has validated the call and caught up with the swarm:
    an :class:`AlgorithmRunner` around an implementation (``runs_own_steps = False``) or an
    implementation that runs its steps itself (the built-in synchronous gradients, local updates).
    It reaches the swarm through its :class:`AlgorithmContext` only."""

    #: seconds its steps spent waiting for the swarm (added to ``Optimizer.blocked_seconds``)
    blocked_seconds: float

    def train_step(self, batch_size: int, grad_scaler: BoundGradScaler | None) -> None:
        """One ``step()``: the user's backward left the gradients of ``batch_size`` samples in ``.grad``
        (scaled by ``grad_scaler``, if any). Reports progress; at the epoch's end, communicates,
        updates the model and calls ``context.advance_epoch()``."""

    def collect_background_work(self, wait: bool) -> None:
        """Applies background work that finished (with ``wait``: waits a bounded time for it)."""

    def prepare_for_download(self) -> None:
        """The Optimizer is about to replace the state: finish or cancel what would write to it."""

    def discard_local_progress(self) -> None:
        """After a catch-up: the gradients accumulated toward an epoch the swarm has left are dropped."""

    def on_state_loaded(self) -> None:
        """A state downloaded from peers was applied (see :meth:`AlgorithmImpl.on_state_loaded`)."""

    def shutdown(self) -> None:
        """Stops what the engine started (threads, averagers, rounds in flight)."""


class Averaging(Protocol):
    """What an operation may ask of the runner that runs it."""

    def average(self, buckets: Sequence[Bucket]) -> None:
        """Averages these buckets with the swarm now, in one round."""


class Operation(abc.ABC):
    """One step of a bucket's pipeline."""

    @abc.abstractmethod
    def run(self, buckets: Sequence[Bucket], runner: Averaging) -> None:
        """Runs on ``buckets`` (every bucket that has this kind of operation at this position)."""


@dataclasses.dataclass
class AverageOp(Operation):
    """Average the bucket with the swarm (weighted mean), compressed with ``codec``.

    :param codec: a codec from hivemind_ext.compression (or hivemind's); None = no compression
    :param weight: returns this peer's weight at the time of the round (default 1)
    """

    codec: Any = None
    weight: Callable[[], float] | None = None

    def run(self, buckets: Sequence[Bucket], runner: Averaging) -> None:
        runner.average(buckets)


@dataclasses.dataclass
class PythonOp(Operation):
    """Run ``fn(bucket)`` (a local computation, e.g. update a momentum before it is averaged)."""

    fn: Callable[[Bucket], None]

    def run(self, buckets: Sequence[Bucket], runner: Averaging) -> None:
        for bucket in buckets:
            self.fn(bucket)


class Bucket:
    """Tensors communicated together, fused into one float32 buffer (``flat``).

    ``pack()`` copies the tensors into ``flat``; ``unpack()`` copies ``flat`` back into them.
    Average operations pack before and unpack after the round; Python operations see the tensors.
    """

    def __init__(self, name: str, named_tensors: Sequence[NamedTensor]) -> None:
        if not named_tensors:
            raise ConfigurationError(f"bucket {name!r} is empty")
        self.name = name
        self.names = [n for n, _ in named_tensors]
        self.tensors = [t for _, t in named_tensors]
        for tensor_name, tensor in named_tensors:
            if not isinstance(tensor, torch.Tensor) or not tensor.dtype.is_floating_point:
                raise ConfigurationError(f"bucket {name!r}: {tensor_name} is not a floating-point tensor")
        device = self.tensors[0].device
        self.flat = torch.zeros(sum(t.numel() for t in self.tensors), dtype=torch.float32, device=device)
        self.ops: list[Operation] = []

    def pack(self) -> None:
        offset = 0
        for tensor in self.tensors:
            self.flat[offset : offset + tensor.numel()].copy_(tensor.detach().reshape(-1))
            offset += tensor.numel()

    def unpack(self) -> None:
        offset = 0
        with torch.no_grad():
            for tensor in self.tensors:
                tensor.copy_(self.flat[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()

    def append_average(self, codec: Any = None, *, weight: Callable[[], float] | None = None) -> Bucket:
        self.ops.append(AverageOp(codec=codec, weight=weight))
        return self

    def append_python(self, fn: Callable[[Bucket], None]) -> Bucket:
        self.ops.append(PythonOp(fn))
        return self

    def append_op(self, op: Operation) -> Bucket:
        if not isinstance(op, Operation):
            raise ConfigurationError(f"expected an Operation, got {type(op).__name__}")
        self.ops.append(op)
        return self

    def __repr__(self) -> str:
        return f"Bucket({self.name!r}, {len(self.tensors)} tensors, {self.flat.numel()} values, {len(self.ops)} ops)"


class AlgorithmImpl:
    """An algorithm bound to one optimizer. The defaults implement synchronous gradient averaging
    through the generic machinery: accumulate sample-weighted gradients, average them when the
    swarm reaches ``target_batch_size`` (weighted by samples), step the wrapped optimizer. (The
    built-in default, :class:`~.sync_gradients.SyncGradientsImpl`, does the same with hivemind's
    refinements: pre-scheduled rounds, delayed steps, offloading; it runs its own steps.)"""

    #: False: an AlgorithmRunner drives this implementation's hooks and bucket operations (its engine);
    #: True: the implementation is a :class:`StepEngine` itself and owns its round scheduling and
    #: background work (the built-in synchronous gradients and local updates)
    runs_own_steps = False
    #: bytes per bucket in the default ``tensors_to_buckets``
    bucket_bytes = DEFAULT_BUCKET_BYTES
    #: after an averaging round that failed, the Optimizer downloads the swarm's state at the next step
    #: (when other peers train), as on the standard path; False for algorithms that recover on their own
    resync_after_failed_round = True

    def __init__(self, context: AlgorithmContext) -> None:
        self.context = context
        self.samples = 0  # samples accumulated since the last communication
        self._accumulator: GradientAccumulator | None = None
        self._mean_grads: list[torch.Tensor] | None = None
        self._index_of_mean: dict[int, int] = {}

    @property
    def accumulator(self) -> GradientAccumulator:
        """The library's one gradient accumulator (finite check, ``reuse_grad_buffers``), created on
        first use: algorithms that never accumulate (DiLoCo, AsyncModelAverage) allocate nothing."""
        if self._accumulator is None:
            config = getattr(self.context, "config", None)
            reuse = bool(getattr(config, "reuse_grad_buffers", False))
            self._accumulator = GradientAccumulator(self.context.params, reuse_grad_buffers=reuse)
        return self._accumulator

    @property
    def mean_grads(self) -> list[torch.Tensor]:
        """Float32 buffers the default path communicates: the local, then the swarm's, mean gradients."""
        if self._mean_grads is None:
            self._mean_grads = [torch.zeros_like(p, dtype=torch.float32) for p in self.context.params]
            self._index_of_mean = {id(t): i for i, t in enumerate(self._mean_grads)}
        return self._mean_grads

    # ----- what and how

    def init_tensors(self) -> list[NamedTensor]:
        """The tensors to communicate in the current stage (default: the mean gradients)."""
        return [(f"grad{i}", t) for i, t in enumerate(self.mean_grads)]

    def tensors_to_buckets(self, tensors: Sequence[NamedTensor]) -> list[list[NamedTensor]]:
        """Groups tensors into buckets (default: in order, about ``bucket_bytes`` each)."""
        buckets: list[list[NamedTensor]] = [[]]
        size = 0
        for name, tensor in tensors:
            nbytes = tensor.numel() * 4
            if buckets[-1] and size + nbytes > self.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append((name, tensor))
            size += nbytes
        return [b for b in buckets if b]

    def init_operations(self, bucket: Bucket) -> None:
        """Appends the bucket's operations (default: compute the local mean gradient, then average it
        with the swarm weighted by samples, with the Optimizer's ``grad_compression``)."""
        bucket.append_python(self.load_mean_gradients)
        bucket.append_average(self.context.grad_compression, weight=lambda: float(self.samples))

    # ----- when, and the callbacks

    def on_backward(self, batch_size: int) -> None:
        """Called by ``step()`` after the user's backward (default: accumulate the gradients; a batch
        whose gradients hold NaN or Inf is refused with NonFiniteTensorError, as on the standard path)."""
        self.accumulator.accumulate(batch_size)
        self.samples += batch_size

    def should_communicate(self) -> bool:
        """Whether to run the operations now (default: the swarm reached ``target_batch_size``)."""
        return self.context.swarm_epoch_is_over()

    def optimizer_step(self) -> None:
        """Updates the model (default: the wrapped optimizer steps on the averaged mean gradients)."""
        self.context.state.apply_gradients(self.mean_grads)

    def on_optimizer_step(self) -> None:
        """Called after ``optimizer_step`` (default: start a new accumulation)."""
        if self._accumulator is not None:
            self._accumulator.reset()
        self.samples = 0

    def need_reset(self) -> bool:
        """True when the algorithm enters a new stage; the runner then calls ``reset()`` and rebuilds
        the tensors, buckets and operations."""
        return False

    def reset(self) -> None:
        """Prepares the new stage."""

    def shutdown(self) -> None:
        """Stops what the implementation started (threads, services)."""

    def on_average_result(self, succeeded: bool, report: Any = None) -> None:
        """Called by the runner after each all-reduce round of the operations: whether it succeeded
        (a failed round leaves the buckets' local values in place) and, if it did, the averager's
        :class:`~hivemind_ext.averaging.averager.RoundReport` (group size, contributors, ...)."""

    def prepare_for_download(self) -> None:
        """Called by the Optimizer before it downloads a training state from peers (a catch-up or a
        resync): settle background work that would write to the state (default: nothing)."""

    def on_state_loaded(self) -> None:
        """Called by the Optimizer after it applied a training state downloaded from peers (late
        join or catch-up): the parameters, optimizer state and extra tensors have just changed."""

    # ----- helpers for subclasses

    def load_mean_gradients(self, bucket: Bucket) -> None:
        """A Python operation: the bucket's mean-gradient buffers = the accumulator's mean gradients."""
        for tensor in bucket.tensors:
            self.accumulator.mean_into(self._index_of_mean[id(tensor)], tensor)


class Algorithm(abc.ABC):
    """Hyperparameters of an algorithm; ``reify`` binds them to one optimizer and swarm."""

    @abc.abstractmethod
    def reify(self, context: AlgorithmContext) -> AlgorithmImpl:
        """Returns a new implementation bound to ``context`` (called once per model)."""


_model_counts: dict[tuple[int, int], int] = {}
_model_counts_lock = threading.Lock()


def next_model_key(algorithm: Algorithm, dht: Any) -> str:
    """A key per model that one Algorithm object serves on one DHT: its class name and the order in
    which the models were bound (peers must create their optimizers in the same order to meet)."""
    with _model_counts_lock:
        index = _model_counts.get((id(algorithm), id(dht)), 0)
        _model_counts[(id(algorithm), id(dht))] = index + 1
    return f"{type(algorithm).__name__.lower()}{index}"
