"""AlgorithmRunner: drives an AlgorithmImpl's hooks from ``Optimizer.step()`` and runs its bucket
operations (see :mod:`.base` for the order of the hooks): the :class:`~.base.StepEngine` of every
implementation that does not run its own steps.

Average operations at one position of the buckets' pipelines form one all-reduce round: the runner
keeps one :class:`~hivemind_ext.averaging.DecentralizedAverager` per (stage, position) over those
buckets' fused buffers, each bucket compressed with its own codec (PerTensorCompression keyed by
bucket name). A round that fails leaves the buckets' local values in place (logged): the model is
then updated from local values, as the Optimizer does with local gradients, and, when other peers
train, the peer downloads the swarm's state at its next step so that it does not drift apart (unless
the algorithm recovers on its own: ``AlgorithmImpl.resync_after_failed_round``). With rounds at the
epoch's end, a peer still looking for a group when the swarm has finished the epoch without it gives
up at once.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from hivemind_ext.averaging.averager import DecentralizedAverager, RoundReport
from hivemind_ext.compression import CompressionInfo, NoCompression, PerTensorCompression
from hivemind_ext.compression.resolve import as_codec
from hivemind_ext.errors import ConfigurationError, HivemindExtError, MatchmakingError
from hivemind_ext.optim.algorithms.base import AlgorithmContext, AlgorithmImpl, AverageOp, Bucket

if TYPE_CHECKING:
    from hivemind_ext.optim.grad_scaler import BoundGradScaler

logger = logging.getLogger(__name__)

# what waiting for a round that did not finish raises; the peer then keeps its local values
ROUND_ERRORS = (HivemindExtError, TimeoutError, concurrent.futures.TimeoutError, concurrent.futures.CancelledError)


# (position, buckets) -> the averager of that position's rounds (see AlgorithmRunner)
AveragerFactory = Callable[[int, list[Bucket]], DecentralizedAverager]


class AlgorithmRunner:
    """Runs ``impl``'s hooks and operations.

    :param averager_factory: builds the averager of one (stage, position) when its first round
        starts, from the position (-1 for :meth:`average`) and its buckets; by default a
        :class:`~hivemind_ext.averaging.DecentralizedAverager` on the context's DHT. A seam for
        tests: a stand-in averager runs the runner's rounds without a network.
    """

    def __init__(self, impl: AlgorithmImpl, *, averager_factory: AveragerFactory | None = None) -> None:
        self.impl = impl
        self._make_averager: AveragerFactory = averager_factory or self._new_averager
        self.stage = 0
        self.buckets: list[Bucket] = []
        self.rounds = 0  # all-reduce rounds run (for tests and benchmarks)
        self.failed_rounds = 0
        self.bytes_sent = 0
        # the report of the last round that succeeded: its group size tells what its bytes_sent compares with
        self.last_round: RoundReport | None = None
        self.blocked_seconds = 0.0  # time train_step spent in rounds that communicated
        self.epoch_samples = 0  # samples this peer processed in its current epoch
        self.samples_since_round = 0  # samples this peer processed since its last communication
        self._averagers: dict[tuple[int, int], DecentralizedAverager] = {}
        self._build()

    @property
    def context(self):
        return self.impl.context

    def _build(self) -> None:
        named = self.impl.init_tensors()
        groups = self.impl.tensors_to_buckets(named)
        self.buckets = [Bucket(f"s{self.stage}b{i}", group) for i, group in enumerate(groups)]
        for bucket in self.buckets:
            self.impl.init_operations(bucket)

    # ----- the StepEngine that Optimizer.step() drives

    def train_step(self, batch_size: int, grad_scaler: BoundGradScaler | None) -> None:
        """Skips a batch whose (unscaled) gradients overflowed, reports progress, runs :meth:`step`,
        and enters the next epoch once the swarm reached ``target_batch_size``."""
        context = self.context
        if grad_scaler is not None:
            if context.config.reuse_grad_buffers:
                raise ConfigurationError("a GradScaler with an algorithm needs reuse_grad_buffers=False")
            if grad_scaler.unscale_and_check():
                logger.log(context.status_loglevel, "gradients overflowed: skipping this batch (the scale is lowered)")
                return
        self.epoch_samples += batch_size
        context.tracker.report_local_progress(context.local_epoch, self.epoch_samples)
        started = time.perf_counter()
        if self.step(batch_size):
            self.blocked_seconds += time.perf_counter() - started
        if context.tracker.ready_to_update_epoch:
            self.epoch_samples = 0
            context.advance_epoch()

    def collect_background_work(self, wait: bool) -> None:
        """Nothing: an implementation's background work (e.g. AsyncModelAverage's thread) is its own."""

    def prepare_for_download(self) -> None:
        """Rounds run inside ``step()``; the implementation settles its own background rounds."""
        self.impl.prepare_for_download()

    def discard_local_progress(self) -> None:
        """Nothing: the implementation's accumulators belong to its own schedule."""

    def on_state_loaded(self) -> None:
        self.impl.on_state_loaded()

    # ----- the hooks

    def step(self, batch_size: int) -> bool:
        """One ``Optimizer.step()``; returns whether the algorithm communicated (and updated the model)."""
        impl = self.impl
        impl.on_backward(batch_size)
        self.samples_since_round += batch_size
        if impl.need_reset():
            impl.reset()
            self._close_averagers()
            self.stage += 1
            self._build()
        if not impl.should_communicate():
            return False
        self.communicate()
        self.samples_since_round = 0
        with self.context.state_lock:
            impl.optimizer_step()
            self.context.state.copy_to_model()
        impl.on_optimizer_step()
        return True

    def communicate(self) -> None:
        """Runs every bucket's operations, position by position; averages at one position share a round."""
        depth = max((len(b.ops) for b in self.buckets), default=0)
        for position in range(depth):
            here = [(b, b.ops[position]) for b in self.buckets if position < len(b.ops)]
            averaged = [b for b, op in here if isinstance(op, AverageOp)]
            if averaged:
                self._average_at(position, averaged)
            for bucket, op in here:
                if not isinstance(op, AverageOp):
                    op.run([bucket], self)

    def average(self, buckets: Sequence[Bucket]) -> None:
        """For custom operations: average these buckets now, in one round (position -1)."""
        self._average_at(-1, list(buckets))

    def _average_at(self, position: int, buckets: list[Bucket]) -> None:
        averager = self._averager(position, buckets)
        ops = [b.ops[position] if position >= 0 else AverageOp() for b in buckets]
        weight = _weight(ops)
        for bucket in buckets:
            bucket.pack()
        rounds = self.context.rounds
        # rounds at the epoch's end (the default should_communicate): the swarm moving to the next epoch
        # while this peer still looks for a group means the round happened without it. Algorithms
        # that communicate on their own schedule (DiLoCo: every H steps) wait out the round instead.
        epoch_rounds = type(self.impl).should_communicate is AlgorithmImpl.should_communicate
        try:
            if epoch_rounds and rounds.missed_this_epoch():
                # a search now could only wait for the swarm's next round and average this epoch's values
                # with that epoch's (a late peer then stayed an epoch behind, missing round after round)
                raise MatchmakingError("the swarm averaged this epoch before this peer reached its end")
            # the group forms as soon as every peer the swarm reports is looking, else at the scheduled
            # time with whoever is (peers reach the epoch's end up to a tracker refresh apart; rounds on
            # the algorithm's own clock also wait for the swarm's slowest trainer to reach theirs)
            last = averager.last_round.group_size if averager.last_round is not None else None
            patience = 0.0 if epoch_rounds else rounds.straggler_patience(self.samples_since_round)
            plan = rounds.plan(last_group_size=last, patience=patience)
            # the speed this peer reports, which the others' patience follows, is its pace of inner steps:
            # with the waits in it, peers waiting for a straggler looked slower and waited longer each round
            with contextlib.nullcontext() if epoch_rounds else self.context.tracker.performance_ema.pause():
                rounds.wait(plan.begin(averager, weight=weight), watch_swarm=epoch_rounds)
        except ROUND_ERRORS as e:
            self.failed_rounds += 1
            outcome = rounds.after_failure()
            resync = outcome.resync and self.impl.resync_after_failed_round and self.context.request_resync()
            logger.warning(
                f"averaging failed ({e!r}): proceeding with local values"
                + ("; the state will be downloaded from peers at the next step" if resync else "")
            )
            self.impl.on_average_result(False, None)
            return
        self.rounds += 1
        self.last_round = averager.last_round
        if averager.last_round is not None:
            self.bytes_sent += averager.last_round.bytes_sent
        with averager.get_tensors():
            for bucket in buckets:
                bucket.unpack()
        self.impl.on_average_result(True, averager.last_round)

    def _averager(self, position: int, buckets: list[Bucket]) -> DecentralizedAverager:
        key = (self.stage, position)
        averager = self._averagers.get(key)
        if averager is None:
            averager = self._averagers[key] = self._make_averager(position, buckets)
        return averager

    def _new_averager(self, position: int, buckets: list[Bucket]) -> DecentralizedAverager:
        ops = [b.ops[position] if position >= 0 else AverageOp() for b in buckets]
        return bucket_averager(self.context, f"s{self.stage}p{position}", buckets, [op.codec for op in ops])

    def _close_averagers(self) -> None:
        for averager in self._averagers.values():
            try:
                averager.shutdown()
            except Exception as e:  # e.g. the DHT's daemon is already gone: the others must still close
                logger.debug(f"error while shutting down an algorithm's averager: {e!r}")
        self._averagers.clear()

    def shutdown(self) -> None:
        try:
            self.impl.shutdown()
        finally:
            self._close_averagers()


def bucket_averager(
    context: AlgorithmContext, suffix: str, buckets: Sequence[Bucket], codecs: Sequence[Any]
) -> DecentralizedAverager:
    """A :class:`~hivemind_ext.averaging.DecentralizedAverager` over the buckets' fused buffers, each
    bucket compressed with its own codec (None: uncompressed), meeting peers under
    ``context.prefix(suffix)``: the averager of one round position (here) or of one DiLoCo fragment."""
    return DecentralizedAverager(
        [b.flat for b in buckets],
        context.dht,
        start=True,
        prefix=context.prefix(suffix),
        compression=PerTensorCompression(
            {b.name: as_codec(c if c is not None else NoCompression()) for b, c in zip(buckets, codecs, strict=True)}
        ),
        tensor_infos=[CompressionInfo.from_tensor(b.flat, key=b.name) for b in buckets],
        allow_state_sharing=False,
        **context.averager_options,
    )


def _weight(ops: list[AverageOp]) -> float:
    weights = {op.weight() if op.weight is not None else 1.0 for op in ops}
    if len(weights) != 1:
        raise ConfigurationError(f"average operations of one round disagree on this peer's weight: {weights}")
    return float(weights.pop())
