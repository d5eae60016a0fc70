"""DiLoCo: many local (inner) optimizer steps, then one outer Nesterov step on averaged pseudo-gradients.

Each peer runs the wrapped torch optimizer (the INNER optimizer) on its own gradients at every
``step()``. After ``inner_steps`` (H) inner steps since the last outer step, the peers average their
pseudo-gradients ``anchor - params`` (``anchor`` = the parameters at the start of the round, the
same on every peer), weighted by the samples of the round's inner steps, and every peer applies the
same outer SGD step with Nesterov momentum to the anchor::

    m      = mu * m + pg                      # momentum buffer, kept by the implementation
    update = pg + mu * m                      # Nesterov (update = m without Nesterov)
    params = anchor - outer_lr * update
    anchor = params                           # the next round starts here

So the swarm communicates once per H steps. The anchor, the momentum buffer and the round phase
(inner steps done in the current round, outer steps done) are registered as extra state tensors of
the Optimizer: a peer that joins late (or catches up, or recovers from a failed round) downloads
them with the parameters. It then finishes the swarm's current round with weight 0 (it receives
the average, contributes nothing: its local steps in that round did not start from the anchor) and
contributes from the next round on, i.e. once it has done H inner steps from a round start.

A round that fails while other peers are around (a timeout, a member that died, a part of the
all-reduce that was not averaged) does NOT move the anchor: the peer takes no outer step, keeps its
inner steps, and retries at the end of the next H inner steps with the pseudo-gradient of the whole
time since the anchor (``anchor - params`` keeps growing; the weight, its samples, too). Anchors only
move on a successful round, where every member applies the same average, so peers at the same round
index hold the same anchor and momentum whatever failed before. (The library's generic rule,
:func:`hivemind_ext.optim.rounds.after_failed_round`, steps locally and downloads the state at the
next step; for DiLoCo that went wrong when a round failed for a whole group, e.g. the survivors of a
dead peer: each stepped on its own pseudo-gradient and they downloaded each other's state at the
same moment, i.e. swapped states, then sat the next round out with weight 0, so that round had no
weight, failed too, and so on for good.) A peer alone (the progress tracker sees no other peer)
applies the outer step to its own pseudo-gradient instead of waiting ``averaging_timeout`` for a group.

Rounds are every H inner steps on each peer's own clock, not at the swarm's epoch end: a round waits
for every peer the swarm reports for as long as the slowest live trainer needs for the round's samples
(:func:`hivemind_ext.optim.rounds.straggler_patience`, at most half ``averaging_timeout``). Without it,
peers of one round index that drifted more than a matchmaking window apart (a slower pair, a loaded
machine) formed separate groups at their own scheduled times, every round, and ended on two models.

Peers meet under one matchmaking key whatever their round: a peer that waited for a group past
the end of the others' round could average with their NEXT round. So each round also averages the
peers' round index (one uncompressed float, same weights). A peer whose index is below the group's
weighted mean (it missed a round the others completed) takes no step and downloads the state from
peers at its next step; a peer whose index is above it keeps its values and retries, as after a
failed round (it is in line with the swarm; the average mixed in a stale pseudo-gradient).

Peers must start from the same parameters (the same seed, or a state download), as with any
gradient-averaging optimizer: DiLoCo averages differences, never the parameters themselves.

In groups smaller than the swarm (``averager_opts=dict(target_group_size=k)``) anchors would part,
one group's mean pseudo-gradient at a time: each round then also averages the anchor and the outer
momentum, and rounds that mix round indices are not failures (see :mod:`.outer_mixing`).

With ``overlap=True`` the outer round runs in the background while the inner steps go on, and its
outer update is applied when it arrives, keeping the inner steps made meanwhile (DiLoCo with a
one-step delay; Streaming DiLoCo with ``fragments`` > 1): see :mod:`.streaming`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

from hivemind_ext.compression import ErrorFeedback, Float16Compression, SparseTopK
from hivemind_ext.compression.error_feedback import Snapshot, find_error_feedback
from hivemind_ext.errors import ConfigurationError
from hivemind_ext.optim.algorithms.base import Algorithm, AlgorithmContext, AlgorithmImpl, Bucket, NamedTensor
from hivemind_ext.optim.algorithms.diloco_outer import OuterRoundsImpl, averaged_by_group, outer_step, round_offset
from hivemind_ext.optim.algorithms.outer_mixing import OuterStateMixing
from hivemind_ext.optim.algorithms.streaming import OverlappedDiLoCoImpl

logger = logging.getLogger(__name__)

_DEFAULT = object()


@dataclasses.dataclass(frozen=True)
class OuterDefaults:
    """The outer optimizer's settings that :class:`DiLoCo` uses unless told otherwise."""

    outer_lr: float
    outer_momentum: float
    nesterov: bool


PAPER_OUTER = OuterDefaults(outer_lr=0.7, outer_momentum=0.9, nesterov=True)  # DiLoCo (Douillard et al.)
SPARSE_OUTER = OuterDefaults(outer_lr=1.0, outer_momentum=0.0, nesterov=False)  # SparseLoCo (Sarfi et al.)


def sparse_codec(codec: Any) -> bool:
    """Whether ``codec`` sends a sparse subset of the values (:class:`~hivemind_ext.compression.SparseTopK`,
    bare or inside :class:`~hivemind_ext.compression.ErrorFeedback`): DiLoCo's outer defaults follow."""
    return isinstance(codec.codec if isinstance(codec, ErrorFeedback) else codec, SparseTopK)


class DiLoCo(Algorithm):
    """DiLoCo (Douillard et al., 2023) on top of the Optimizer's averaging machinery.

    :param inner_steps: H, inner (local) optimizer steps between two outer steps
    :param outer_lr: the outer SGD learning rate. Default: 0.7 (the paper's), 1.0 with a sparse codec
    :param outer_momentum: the outer momentum. Default: 0.9 (the paper's), 0 with a sparse codec
    :param nesterov: Nesterov momentum for the outer step. Default: True (the paper's), False with a
      sparse codec
    :param codec: the codec of the pseudo-gradient all-reduce. Default: ``Float16Compression()``:
      pseudo-gradients are differences of parameters, small and tolerant of rounding (the paper
      reports no loss with far coarser quantization), and float16 halves the traffic. Pass
      ``None`` (or ``NoCompression()``) for exact float32 averaging. A sparse codec
      (``ErrorFeedback(SparseTopK(...))``, :func:`sparse_codec`) changes the outer optimizer's
      defaults to SparseLoCo's (Sarfi et al., 2025): plain averaged descent, ``outer_lr=1``, no
      momentum. Error feedback already acts as a momentum: a value that was not sent waits in the
      residual and goes out, grown by the rounds since, a few rounds later; outer momentum on top of
      these delayed bursts overshoots and can diverge (benchmarks/RESULTS.md, Session 7: 4 peers,
      25% density, H = 100, a 0.2M-parameter MLP: held-out loss 0.48 with the paper's settings,
      0.12 with SparseLoCo's, 0.13 for float16 DiLoCo). Without momentum the default nesterov is
      False. With ``overlap``, an :class:`~hivemind_ext.compression.ErrorFeedback` codec (or a codec
      wrapping one) gets its residuals put back after a round that is not applied, whose
      pseudo-gradient the next round resends
    :param overlap: run each outer round in the background while the inner steps continue, and apply
      its outer update when it arrives (at most one round late: a round's update is applied before
      that fragment's next round starts, or dropped). Default False: every peer waits for the round
      at the end of its H inner steps (plain DiLoCo). See :mod:`.streaming`.
    :param fragments: with ``overlap``: split the model's tensors into this many fragments of about
      equal size, whose rounds are staggered across the H inner steps (Streaming DiLoCo): fragment
      ``f`` averages at inner steps ``f * H // F + k * H``, so each round carries 1/F of the model
    :param alpha: with ``overlap``: how much of a fragment's outer update enters the local parameters
      when it arrives: ``params += alpha * (new_anchor - params_at_round_start)`` (1.0, the default:
      the swarm's parameters plus the inner steps made during the round). The result is
      ``(1 - alpha) * params_at_round_start + alpha * new_anchor`` plus the inner steps made while
      the round ran, which always keep weight 1: alpha mixes the round's snapshot, not those steps
    """

    def __init__(
        self,
        inner_steps: int,
        *,
        outer_lr: float | None = None,
        outer_momentum: float | None = None,
        nesterov: bool | None = None,
        codec: Any = _DEFAULT,
        overlap: bool = False,
        fragments: int = 1,
        alpha: float = 1.0,
    ) -> None:
        if isinstance(inner_steps, bool) or not isinstance(inner_steps, int) or inner_steps < 1:
            raise ConfigurationError(f"inner_steps must be a positive integer, got {inner_steps!r}")
        codec = Float16Compression() if codec is _DEFAULT else codec
        defaults = SPARSE_OUTER if sparse_codec(codec) else PAPER_OUTER
        outer_lr = defaults.outer_lr if outer_lr is None else outer_lr
        outer_momentum = defaults.outer_momentum if outer_momentum is None else outer_momentum
        nesterov = (defaults.nesterov and outer_momentum != 0) if nesterov is None else nesterov
        if not (isinstance(outer_lr, int | float) and math.isfinite(outer_lr) and outer_lr > 0):
            raise ConfigurationError(f"outer_lr must be a positive number, got {outer_lr!r}")
        if not (isinstance(outer_momentum, int | float) and 0 <= outer_momentum < 1):
            raise ConfigurationError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
        if nesterov and outer_momentum == 0:
            raise ConfigurationError("nesterov needs outer_momentum > 0")
        if isinstance(fragments, bool) or not isinstance(fragments, int) or not 1 <= fragments <= inner_steps:
            raise ConfigurationError(f"fragments must be an integer in [1, inner_steps], got {fragments!r}")
        if not (isinstance(alpha, int | float) and 0 < alpha <= 1):
            raise ConfigurationError(f"alpha must be in (0, 1], got {alpha!r}")
        if not overlap and (fragments != 1 or alpha != 1):
            raise ConfigurationError("fragments and alpha apply to overlapped rounds: pass overlap=True")
        self.inner_steps = inner_steps
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.nesterov = bool(nesterov)
        self.codec = codec
        self.overlap = bool(overlap)
        self.fragments = fragments
        self.alpha = float(alpha)

    def reify(self, context: AlgorithmContext) -> AlgorithmImpl:
        if self.overlap:
            return OverlappedDiLoCoImpl(context, self)
        return DiLoCoImpl(context, self)


class DiLoCoImpl(OuterRoundsImpl):
    """DiLoCo bound to one optimizer. Counters: those of :class:`~.diloco_outer.OuterRoundsImpl`
    (``failed_rounds`` here: rounds that failed or mixed round indices, with no outer step: this peer
    retried at the next round's end, or downloaded the state if it was behind), and ``last_group_size``.
    ``history``: per round, (swarm round index after it, how it ended, this peer's weight, group size);
    how it ended: "swarm" / "solo" (outer steps), "retry" (failed or ahead of the group: no step),
    "behind" (the group was at a later round: no step, a state download). The phase is
    ``[inner steps in this round, outer steps]``.
    """

    def __init__(self, context: AlgorithmContext, algorithm: DiLoCo) -> None:
        super().__init__(context, algorithm, phase_size=2)
        self.pseudo_grads = [torch.zeros_like(a) for a in self.anchor]
        self._index = {id(t): i for i, t in enumerate(self.pseudo_grads)}
        # averaged alongside (uncompressed, same round, same weight): the group's mean round index
        # tells a peer whether it averaged with peers of another round (see optimizer_step)
        self.round_check = torch.zeros(1, dtype=torch.float32)
        #: in groups smaller than the swarm, each round also averages the anchor and momentum (see .outer_mixing)
        self.mixing = OuterStateMixing(self.anchor, self.momentum) if context.rounds.in_groups else None
        self.steps_in_round = 0
        self.samples_in_round = 0
        self.contributing = True  # False from a state download to the end of that round
        self._round_ok: bool | None = None
        self._stepped = False  # whether the last round ended with an outer step
        self.last_group_size = 0
        #: the codec's error feedback, or None; its residuals before the round in flight, and those to put
        #: back before the next round (a round that was not applied is resent: see ErrorFeedback.snapshot)
        self.error_feedback = find_error_feedback(algorithm.codec)
        self._residuals: Snapshot | None = None
        self._unsent_residuals: Snapshot | None = None

    # ----- what and how

    def init_tensors(self) -> list[NamedTensor]:
        outer = self.mixing.named_tensors() if self.mixing is not None else []
        grads = [(f"pseudo_grad{i}", t) for i, t in enumerate(self.pseudo_grads)]
        return [*grads, ("round_check", self.round_check), *outer]

    def tensors_to_buckets(self, tensors: Sequence[NamedTensor]) -> list[list[NamedTensor]]:
        def outer(tensor: torch.Tensor) -> bool:
            return self.mixing is not None and self.mixing.owns(tensor)

        check = [(name, t) for name, t in tensors if t is self.round_check]
        grads = [(name, t) for name, t in tensors if t is not self.round_check and not outer(t)]
        mixed = [(name, t) for name, t in tensors if outer(t)]
        return [*super().tensors_to_buckets(grads), check, *(super().tensors_to_buckets(mixed) if mixed else [])]

    def init_operations(self, bucket: Bucket) -> None:
        if bucket.tensors[0] is self.round_check:
            bucket.append_python(self._load_round_check)
            bucket.append_average(None, weight=self.round_weight)
            return
        if self.mixing is not None and self.mixing.owns(bucket.tensors[0]):
            bucket.append_python(self._load_outer_state)
            bucket.append_average(None, weight=self.round_weight)  # float32: see .outer_mixing
            return
        bucket.append_python(self._load_pseudo_gradients)
        bucket.append_average(self.algorithm.codec, weight=self.round_weight)

    def round_weight(self) -> float:
        """This peer's weight in the pseudo-gradient average: the samples of its inner steps in the
        round, or 0 in the round it joined (it receives the average but contributes nothing)."""
        return float(self.samples_in_round) if self.contributing else 0.0

    def _load_round_check(self, bucket: Bucket) -> None:
        self.round_check.fill_(float(self.round_index))

    def _load_outer_state(self, bucket: Bucket) -> None:
        if self.mixing is not None:
            with self._lock:
                self.mixing.load()

    def _load_pseudo_gradients(self, bucket: Bucket) -> None:
        with self._lock, torch.no_grad():
            for tensor in bucket.tensors:
                i = self._index[id(tensor)]
                torch.sub(self.anchor[i], self._params[i].detach().float(), out=tensor)

    # ----- when, and the callbacks

    def on_backward(self, batch_size: int) -> None:
        """One inner step on the local gradients (after a failed round, the Optimizer downloads the
        state before this step and skips it: those gradients belong to the old parameters)."""
        grads = [p.grad for p in self.context.params]
        with self._lock:
            self._state.apply_gradients(grads)
            self._state.copy_to_model()
            self.steps_in_round += 1
            self.samples_in_round += batch_size
            self.phase[0] = float(self.steps_in_round)
        self.inner_steps += 1

    def should_communicate(self) -> bool:
        # every H inner steps since the anchor (after a failed round: 2H, 3H, ..., in step with the others)
        if self.steps_in_round < self.algorithm.inner_steps or self.steps_in_round % self.algorithm.inner_steps:
            return False
        if self._peers() <= 1:
            # alone: a round could only time out; step on the local pseudo-gradient now
            with self._lock:
                self._solo_step()
                self._state.copy_to_model()
            self._end_round()
            return False
        self._round_ok = None
        if self.error_feedback is not None:
            # put back the residuals from before a round that was not applied: its pseudo-gradient is in
            # this round's (anchor - params) again. Here, a whole round after it ended, not when it failed:
            # a round given up at its deadline may still be compressing then
            if self._unsent_residuals is not None:
                self.error_feedback.restore(self._unsent_residuals)
                self._unsent_residuals = None
            self._residuals = self.error_feedback.snapshot()
        return True

    def on_average_result(self, succeeded: bool, report: Any = None) -> None:
        self.last_group_size = report.group_size if report is not None else 1
        if succeeded and report is not None and report.group_size > 1:
            succeeded = averaged_by_group(report, str(self.context.dht.peer_id), self.round_weight() > 0)
        self._round_ok = succeeded

    def optimizer_step(self) -> None:
        """The outer step after a round that averaged with peers of this round index; otherwise none
        (the runner holds the state lock and publishes the parameters after it)."""
        # mixed outer states average peers of any round index into one state (see .outer_mixing)
        checked = self._round_ok and self.mixing is None
        offset = round_offset(float(self.round_check.item()), self.round_index) if checked else 0
        weight, group = self.round_weight(), self.last_group_size
        self._stepped = False
        if self._round_ok and offset == 0:
            if self.mixing is not None:
                self.mixing.adopt()  # the group's mean anchor and momentum: the step below is the group's
            self._outer_step(self.pseudo_grads)
            self._stepped = True
            self.swarm_rounds += 1
            if self.contributing:
                self.contributing_rounds += 1
            self.history.append((self.round_index, "swarm", weight, group))
            return
        self.failed_rounds += 1
        self._unsent_residuals = self._residuals  # nothing of this round was applied: see should_communicate
        if offset < 0:
            # the group was at a later round: this peer missed one that the others completed; the
            # download replaces the anchor, momentum, phase and parameters
            self.context.request_resync()
            self.history.append((self.round_index, "behind", weight, group))
            logger.log(
                self.context.status_loglevel, f"the group was past round {self.round_index}: downloading its state"
            )
        elif self._peers() > 1:
            # failed, or this peer is ahead of (some of) the group: keep the anchor and retry at the next
            # round's end with the pseudo-gradient since the anchor. A peer that joined this round (weight
            # 0) contributes to the retry: its pseudo-gradient also starts from the anchor (it counts its
            # donor's inner steps before the download twice, a bias of one round, not a divergence)
            self.contributing = True
            self.history.append((self.round_index, "retry", weight, group))
            logger.log(self.context.status_loglevel, f"round {self.round_index} did not average: retrying at the next")
        else:
            self._solo_step()  # the others are gone: no one to retry with

    def on_optimizer_step(self) -> None:
        if self._stepped:
            self._end_round()

    def on_state_loaded(self) -> None:
        """The anchor, momentum and phase were overwritten in place with a peer's: adopt its phase
        and sit out (weight 0) the rest of its round."""
        self.steps_in_round = int(self.phase[0].item())
        self.samples_in_round = 0
        self.contributing = False
        self.state_loads += 1

    # ----- the outer step

    def _solo_step(self) -> None:
        """The outer step on this peer's own pseudo-gradient (the caller holds the state lock)."""
        with torch.no_grad():
            for anchor, param, pg in zip(self.anchor, self._params, self.pseudo_grads, strict=True):
                torch.sub(anchor, param.detach().float(), out=pg)
        self._outer_step(self.pseudo_grads)
        self._stepped = True
        self.solo_rounds += 1
        self.history.append((self.round_index, "solo", float(self.samples_in_round), 1))

    def _outer_step(self, pseudo_grads: Sequence[torch.Tensor]) -> None:
        outer_step(self.algorithm, self.anchor, self.momentum, pseudo_grads)
        with torch.no_grad():
            for anchor, param in zip(self.anchor, self._params, strict=True):
                param.copy_(anchor)
            self.phase[1] += 1
        self.rounds += 1

    def _end_round(self) -> None:
        with self._lock:
            self.steps_in_round = 0
            self.samples_in_round = 0
            self.phase[0] = 0.0
        self.contributing = True

    @property
    def resync_pending(self) -> bool:
        """The last round failed or mixed rounds: the next ``step()`` downloads the state from peers."""
        return self.context.rounds.resync_pending

    @property
    def round_index(self) -> int:
        """The swarm's outer steps so far (downloaded with the state: the same on every peer)."""
        return int(self.phase[1].item())

    def _peers(self) -> int:
        return int(self.context.tracker.global_progress.num_trainers)
