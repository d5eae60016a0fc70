"""Overlapped (streaming) DiLoCo: outer rounds in the background, applied when they arrive.

``DiLoCo(H, overlap=True)`` does not stop the peers at the end of their H inner steps. At that
step each peer snapshots its parameters, starts the all-reduce of its pseudo-gradient
``anchor - snapshot`` in the background (the averager's own event loop: no thread of its own) and
goes on with its inner steps. When the round's average arrives, at the first step after it, the peer
takes the outer step on the anchor (as plain DiLoCo) and moves its live parameters by what the outer
step changed relative to the snapshot, keeping the inner steps made during the round (the library's
one "snapshot, average, apply the delta" rule, :func:`~hivemind_ext.averaging.delta.apply_average`)::

    snapshot = params;  pg = anchor - snapshot              # step k*H: the round starts
    ... inner steps go on ...
    anchor   = outer_step(anchor, mean(pg))                 # the round's average arrived
    params  += alpha * (anchor - snapshot)                  # the swarm's model + the local progress

The inner steps made during the round count once: they are part of the next round's pseudo-gradient.
This is DiLoCo with a one-step delay (the outer update is at most one round old).

``fragments=F`` (Streaming DiLoCo): the model's tensors are split into F fragments of about equal
size (:func:`fragment_tensors`), each with its own anchor rounds, staggered across the H inner steps
(:func:`round_is_due`): each round carries 1/F of the model, so the link is busy all the time at
1/F of the peak. ``alpha`` mixes an arriving update into the local parameters (1: fully).

**Matchmaking.** A round is scheduled one window (the time of H inner steps, :func:`round_window`)
plus the usual matchmaking time ahead: the group forms as soon as every peer the swarm reports is
looking, and otherwise waits that long for peers that lag (a slower peer, a late joiner that lost
time downloading the state), which would otherwise meet the others only at their next round.

**Staleness bound.** A fragment's round must end before that fragment's next round starts: at its
next due step the peer waits for it (up to the round's deadline, through the round driver), so an
outer update is at most H inner steps old; :func:`update_is_fresh` is the rule, and an update that
breaks it is dropped (not applied; the anchor stays). A round that fails (deadline, a dead member, a
part not averaged, a group at another round index) moves nothing, as in plain DiLoCo: the next
round's pseudo-gradient covers the whole time since the anchor, or, if the group was at a later
round, the peer downloads the state. With an :class:`~hivemind_ext.compression.ErrorFeedback` codec,
the fragment's residuals are put back as they were before such a round (at the start of the next round
of that fragment, when no compression of the cancelled one can still be running), so the resent
pseudo-gradient is not counted twice; another fragment's residuals are left alone.

**State and late joiners.** The anchors, outer momenta and a phase ``[inner step, seconds per inner
step, round index of each fragment]`` are extra tensors of the training state: a late joiner
downloads them with the parameters, follows the swarm's schedule from the donor's inner step, and
sits out (weight 0) each fragment's rounds until one of them applies (a round that fails does not
say that the joiner is in step, and a contribution at another round index would fail the others'
round). A phase that no honest peer holds (:func:`check_phase`: NaN, a round index beyond the rounds
due by the served inner step, ...) is refused before it is adopted: the donor is banned and another
one asked. The swarm went on while it downloaded: the joiner skips as many inner steps as the
donor's pace (also in the phase) says the swarm made meanwhile (:func:`steps_missed`), and starts at
once the rounds that fell due in them. A donor may have a round in flight, whose outer update the
joiner cannot compute: the joiner then finds itself one round behind at its next round of that
fragment, in which it takes part with weight 0, so it receives the others' average; it keeps that
average (and those of the rounds it takes part in until then: its own rounds are settled before a
download) and downloads the state again; if the donor is at one of those rounds, it takes the same
outer steps as the donor (:func:`after_download`). (A peer whose downloads take far longer than H
inner steps keeps missing its groups.) Before a download the peer settles its own rounds in flight;
a fragment in which it is further than the donor (the donor had not yet applied a round that this
peer applied) keeps this peer's anchor, momentum, round index and parameters.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Collection, Sequence
from typing import Any, Protocol

import torch
from hivemind.utils import get_dht_time

from hivemind_ext.averaging.averager import DecentralizedAverager
from hivemind_ext.averaging.control import StepControl
from hivemind_ext.averaging.delta import apply_average, take_snapshot
from hivemind_ext.compression.error_feedback import Snapshot, find_error_feedback
from hivemind_ext.errors import HivemindExtError, UntrustedStateError
from hivemind_ext.optim.algorithms.base import AlgorithmContext, Bucket, NamedTensor
from hivemind_ext.optim.algorithms.diloco_outer import (
    MAX_COUNT,
    OuterRoundsImpl,
    OuterSettings,
    averaged_by_group,
    check_count,
    outer_step,
    round_offset,
)
from hivemind_ext.optim.algorithms.outer_mixing import OuterStateMixing
from hivemind_ext.optim.algorithms.runner import ROUND_ERRORS, bucket_averager

logger = logging.getLogger(__name__)

_STEP, _SECONDS_PER_STEP, _ROUNDS = 0, 1, 2  # positions in the phase tensor
MAX_HELD = 3  # averages of rounds in which a peer was behind, kept per fragment until its download


class OverlapSettings(OuterSettings, Protocol):
    """What overlapped rounds read from their :class:`~.diloco.DiLoCo`."""

    inner_steps: int
    codec: Any
    fragments: int
    alpha: float


# ----- the schedule and the staleness bound (pure)


def fragment_tensors(sizes: Sequence[int], fragments: int) -> list[list[int]]:
    """Tensor indices per fragment: consecutive tensors, cut where the running size crosses each
    ``k / fragments`` of the total, so fragments are about equally large (a tensor is never split).
    At most ``len(sizes)`` fragments are non-empty; empty ones are dropped."""
    total = sum(sizes)
    groups: list[list[int]] = [[] for _ in range(fragments)]
    done = 0
    for i, size in enumerate(sizes):
        # the fragment whose share of the total this tensor's middle falls in
        middle = done + size / 2
        groups[min(fragments - 1, int(middle * fragments / max(total, 1)))].append(i)
        done += size
    return [g for g in groups if g]


def fragment_offset(fragment: int, inner_steps: int, fragments: int) -> int:
    """The inner step (mod H) at which ``fragment``'s rounds start: fragments are spread evenly."""
    return fragment * inner_steps // fragments


def round_is_due(step: int, fragment: int, inner_steps: int, fragments: int) -> bool:
    """Whether ``fragment`` starts a round after inner step ``step`` (counted from 1, swarm-wide)."""
    return step > 0 and (step - fragment_offset(fragment, inner_steps, fragments)) % inner_steps == 0


def update_is_fresh(
    *, started_step: int, now_step: int, inner_steps: int, started_round: int, round_index: int
) -> bool:
    """The staleness bound: an outer update may be applied when it is at most one round old (at most
    H inner steps since its snapshot) and the fragment is still at the round index it started from
    (a state download in between moved it). Anything else is dropped."""
    return started_round == round_index and 0 <= now_step - started_step <= inner_steps


def round_window(step_ends: Sequence[float], inner_steps: int) -> float:
    """Seconds of H inner steps, from the times at which the last steps ended (0 with fewer than two):
    how long a round may take before the next round of its fragment is due."""
    if len(step_ends) < 2:
        return 0.0
    return (step_ends[-1] - step_ends[0]) / (len(step_ends) - 1) * inner_steps


def steps_missed(download_seconds: float, seconds_per_step: float, limit: int) -> int:
    """Inner steps the swarm made while a peer downloaded its state (the donor's pace, from the state):
    the peer skips them so that it reaches the next rounds when the others do. The download's length
    over the pace, at most ``limit`` (one round: a donor's pace is its word, not a fact); 0 when the
    pace is unknown or not a positive number."""
    if not (math.isfinite(seconds_per_step) and seconds_per_step > 0 and 0 < download_seconds < math.inf):
        return 0
    return int(min(download_seconds / seconds_per_step, limit))


def sanitized_phase(phase: Sequence[float]) -> list[float]:
    """A downloaded phase as this peer uses it: counters are whole numbers in [0, MAX_COUNT] and the
    pace a non-negative number; anything else (NaN, Inf, negative: a donor's bad word) becomes 0."""
    clean = []
    for i, value in enumerate(phase):
        if not (math.isfinite(value) and value >= 0):
            clean.append(0.0)
        else:
            clean.append(float(value) if i == _SECONDS_PER_STEP else float(min(math.floor(value), MAX_COUNT)))
    return clean


def rounds_due(step: int, fragment: int, inner_steps: int, fragments: int) -> int:
    """How many rounds ``fragment`` started in inner steps 1..``step`` (:func:`round_is_due`)."""
    offset = fragment_offset(fragment, inner_steps, fragments)
    if step < max(offset, 1):
        return 0
    return (step - offset) // inner_steps + (1 if offset > 0 else 0)


def check_phase(phase: Sequence[float], inner_steps: int, fragments: int) -> None:
    """Refuses a donor's phase ``[inner step, seconds per step, round index per fragment]`` that no honest
    peer holds (UntrustedStateError; the loader bans the donor and downloads from another): counters
    that are not whole numbers in [0, MAX_COUNT], a pace that is not a finite non-negative number, or
    a fragment that applied more rounds than were due by its inner step (with a slack of 2: a peer
    that kept its own further fragment after a download, :func:`after_download`, can be one round
    ahead of its donor's step). A huge round index would put the joiner ahead of every group: it would
    never average again, and a contributing peer at another round index makes the others' rounds fail."""
    if len(phase) < _ROUNDS:
        raise UntrustedStateError(f"the downloaded phase has {len(phase)} entries")
    step = check_count(phase[_STEP], "inner step")
    pace = phase[_SECONDS_PER_STEP]
    if not (math.isfinite(pace) and pace >= 0):
        raise UntrustedStateError(f"the downloaded pace is {pace!r:.40} seconds per step")
    for f, value in enumerate(phase[_ROUNDS:]):
        limit = rounds_due(step, f, inner_steps, fragments) + 2
        check_count(value, f"round index of fragment {f} (at inner step {step})", limit=limit)


def after_download(*, mine: int, served: int, held: Collection[int]) -> tuple[str, int]:
    """Per fragment, whose values a peer keeps after a state download (round indices of that fragment),
    and how many held averages it then applies: ``("mine", 0)`` when it was further than the donor (the
    donor had not applied a round this peer had); ``("held", n)`` when it holds the others' averages of
    rounds ``served, served + 1, ... served + n - 1`` (the donor's rounds in flight, in which this peer
    took part with weight 0: it takes the same outer steps); else ``("donor", 0)``."""
    if mine > served:
        return "mine", 0
    count = 0
    while served + count in held:
        count += 1
    return ("held", count) if count else ("donor", 0)


# ----- one fragment's rounds


@dataclasses.dataclass
class _Round:
    """A round in flight: its control, and what is needed to apply its result."""

    control: StepControl
    started_step: int
    round_index: int
    snapshot: list[torch.Tensor]  # the fragment's parameters when the round started (float32)
    samples: int  # the samples its pseudo-gradient covers
    weight: float
    residuals: Snapshot | None  # the fragment's error-feedback residuals before the round (see _start)


class _Fragment:
    """Tensors whose rounds go together: buffers for the all-reduce, the round in flight."""

    def __init__(
        self, index: int, tensors: list[int], anchors: Sequence[torch.Tensor], mixing: OuterStateMixing | None = None
    ) -> None:
        self.index = index
        self.tensors = tensors
        self.pseudo_grads = [torch.zeros_like(anchors[i]) for i in tensors]
        named = [(f"pseudo_grad{i}", t) for i, t in zip(tensors, self.pseudo_grads, strict=True)]
        self.bucket = Bucket(f"f{index}", named)
        # averaged alongside, uncompressed, same weight: the group's mean round index (see round_offset)
        self.check = Bucket(f"f{index}check", [("round_check", torch.zeros(1))])
        # in groups smaller than the swarm: the fragment's anchors and momenta, averaged too (see .outer_mixing)
        self.mixing = mixing
        self.outer = mixing.bucket(f"f{index}outer") if mixing is not None else None
        self.averager: DecentralizedAverager | None = None
        self.pending: _Round | None = None
        self.samples = 0  # samples of inner steps since the anchor's snapshot
        self.contributing = True  # False from a state download to the end of that round
        self.last_group_size: int | None = None
        #: the others' round index and average, from a round in which this peer was behind (see _settle)
        self.held: dict[int, list[torch.Tensor]] = {}
        self.catch_up = False  # a download skipped this fragment's due step: start its round at the next
        #: error-feedback residuals to put back before the next round: those before a round not applied
        self.unsent_residuals: Snapshot | None = None


class OverlappedDiLoCoImpl(OuterRoundsImpl):
    """DiLoCo with overlapped (and optionally fragmented) outer rounds; see the module docstring.

    Counters: those of :class:`~.diloco_outer.OuterRoundsImpl`, and ``dropped_rounds`` (stale updates
    not applied), ``waited_seconds`` (inner steps held up by the staleness bound or a download),
    ``bytes_sent``. ``history``: per settled round, (fragment, its round index, how it ended, this
    peer's weight, group size, age in inner steps); how it ended: "swarm" / "solo" (outer step),
    "retry" (failed: no step), "behind" (the group was at a later round: a download follows), "stale"
    (dropped by the staleness bound).
    """

    def __init__(self, context: AlgorithmContext, algorithm: OverlapSettings) -> None:
        groups = fragment_tensors([p.numel() for p in context.state.opt_params], algorithm.fragments)
        # [inner step, seconds per inner step, round index of each fragment]
        super().__init__(context, algorithm, phase_size=_ROUNDS + len(groups))
        in_groups = context.rounds.in_groups
        self.fragments = [
            _Fragment(f, tensors, self.anchor, self._mixing(tensors) if in_groups else None)
            for f, tensors in enumerate(groups)
        ]
        self._saved: list[tuple[int, list[torch.Tensor]]] | None = None  # see prepare_for_download
        self._download_started: float | None = None
        self._downloading = False  # prepare_for_download is settling the rounds in flight
        self._closed = False
        self.dropped_rounds = 0
        self.waited_seconds = 0.0
        self.bytes_sent = 0
        self._step_ends: deque[float] = deque(maxlen=algorithm.inner_steps + 1)  # for round_window
        #: the codec's error feedback (residuals per fragment: the key is the fragment's bucket name), or None
        self.error_feedback = find_error_feedback(algorithm.codec)
        try:
            self.start_averagers()
        except BaseException:
            self.shutdown()
            raise

    def check_downloaded_phase(self, phase: list[float]) -> None:
        check_phase(phase, self.algorithm.inner_steps, self.algorithm.fragments)

    def _mixing(self, tensors: Sequence[int]) -> OuterStateMixing:
        return OuterStateMixing([self.anchor[i] for i in tensors], [self.momentum[i] for i in tensors])

    # ----- the schedule

    @property
    def step_index(self) -> int:
        """Inner steps of the swarm so far (downloaded with the state: one schedule for all peers)."""
        return int(self.phase[_STEP].item())

    @property
    def round_indices(self) -> list[int]:
        """Outer steps applied per fragment (the same on every peer in step with the swarm)."""
        return [int(v) for v in self.phase[_ROUNDS:].tolist()]

    @property
    def rounds_in_flight(self) -> int:
        return sum(f.pending is not None for f in self.fragments)

    def init_tensors(self) -> list[NamedTensor]:
        return []  # the runner averages nothing: each fragment runs its own background rounds

    def should_communicate(self) -> bool:
        return False

    def on_backward(self, batch_size: int) -> None:
        """The inner step; then apply the rounds that arrived, and start the rounds that are due."""
        if self._closed:
            raise HivemindExtError("the algorithm is shut down")
        grads = [p.grad for p in self.context.params]
        self._step_ends.append(time.monotonic())
        with self._lock:
            self._state.apply_gradients(grads)
            self._state.copy_to_model()
            self.phase[_STEP] += 1
            window = round_window(list(self._step_ends), 1)
            if window > 0:
                self.phase[_SECONDS_PER_STEP] = window
        for fragment in self.fragments:
            fragment.samples += batch_size
        self.inner_steps += 1
        step, alg = self.step_index, self.algorithm
        for fragment in self.fragments:
            due = round_is_due(step, fragment.index, alg.inner_steps, alg.fragments) or fragment.catch_up
            fragment.catch_up = False
            if fragment.pending is not None and (due or fragment.pending.control.done()):
                self._settle(fragment)  # when due, this waits: the round ends before the next starts
            if due:
                self._start(fragment)

    # ----- a round's start and end

    def _start(self, fragment: _Fragment) -> None:
        f = fragment.index
        keys = {fragment.bucket.name}
        residuals = None
        if self.error_feedback is not None:
            # a round that was not applied is resent (the next pseudo-gradient covers it): its residuals
            # must not count what it "sent" (see ErrorFeedback.snapshot). Put back here, a whole round
            # after it ended, not when it failed: a cancelled round may still be compressing then
            if fragment.unsent_residuals is not None:
                self.error_feedback.restore(fragment.unsent_residuals, keys=keys)
                fragment.unsent_residuals = None
            residuals = self.error_feedback.snapshot(keys=keys)
        with self._lock:
            snapshot = take_snapshot([self._params[i] for i in fragment.tensors])
            with torch.no_grad():
                for i, pg, before in zip(fragment.tensors, fragment.pseudo_grads, snapshot, strict=True):
                    torch.sub(self.anchor[i], before, out=pg)
            round_index = int(self.phase[_ROUNDS + f].item())
        weight = float(fragment.samples) if fragment.contributing else 0.0
        if self.context.rounds.peers_seen <= 1:
            # alone: a round could only time out; step on the local pseudo-gradient now
            self._apply(fragment, fragment.pseudo_grads, snapshot, fragment.samples)
            self.solo_rounds += 1
            self.history.append((f, round_index, "solo", weight, 1, 0))
            return
        averager = self._averager(fragment)
        with averager.get_tensors():
            fragment.bucket.pack()
            fragment.check.flat.fill_(float(round_index))
            if fragment.mixing is not None and fragment.outer is not None:
                with self._lock:
                    fragment.mixing.load()
                fragment.outer.pack()
        # the group waits for peers that lag by up to one round's window (e.g. a late joiner, which lags
        # by its download): they reach this round's step that much later, and would otherwise meet the
        # others only at their next round, at another round index
        window = round_window(list(self._step_ends), self.algorithm.inner_steps)
        plan = self.context.rounds.plan(eta=get_dht_time() + window, last_group_size=fragment.last_group_size)
        control = plan.begin(averager, weight=weight)
        if not isinstance(control, StepControl):
            raise HivemindExtError("a step with wait=False must return its StepControl")
        fragment.pending = _Round(control, self.step_index, round_index, snapshot, fragment.samples, weight, residuals)

    def _averager(self, fragment: _Fragment) -> DecentralizedAverager:
        """The fragment's averager, started at its first round (or by :meth:`start_averagers`)."""
        if fragment.averager is None:
            outer = [fragment.outer] if fragment.outer is not None else []
            fragment.averager = bucket_averager(
                self.context,
                f"stream{self.algorithm.fragments}f{fragment.index}",
                [fragment.bucket, fragment.check, *outer],
                [self.algorithm.codec, None, *(None for _ in outer)],
            )
        return fragment.averager

    def start_averagers(self) -> None:
        """Starts every fragment's averager now, before training: starting one (its RPC handlers, its
        record signing in the DHT: a DHT round trip) took ~0.4 s of the training thread at the first
        round of each fragment on the thin-link benchmark, an inner step's worth of compute lost."""
        for fragment in self.fragments:
            self._averager(fragment)

    def _settle(self, fragment: _Fragment) -> None:
        """Waits for the fragment's round (the round driver: hooks, deadline), then applies its outer
        update, or records why not."""
        pending, fragment.pending = fragment.pending, None
        if pending is None:
            return
        f, alg = fragment.index, self.algorithm
        started = time.perf_counter()
        try:
            self.context.rounds.wait(pending.control, watch_swarm=False)
        except ROUND_ERRORS as e:
            self.waited_seconds += time.perf_counter() - started
            self._not_applied(fragment, pending, "retry", 0, f"failed ({e!r})")
            return
        self.waited_seconds += time.perf_counter() - started
        report = getattr(pending.control, "report", None)
        group = report.group_size if report is not None else 1
        fragment.last_group_size = group
        if report is not None:
            self.bytes_sent += report.bytes_sent
        averager = fragment.averager
        if averager is None:  # a round ran on it; this keeps type checkers informed
            return
        with averager.get_tensors():
            fragment.bucket.unpack()
            group_round = float(fragment.check.flat.item())
            if fragment.outer is not None:
                fragment.outer.unpack()
        me = str(self.context.dht.peer_id)
        if not math.isfinite(group_round):  # a member sent garbage for its round index: trust nothing of it
            self._not_applied(fragment, pending, "retry", group, "averaged a round index that is not a number")
            return
        if group > 1 and report is not None and not averaged_by_group(report, me, pending.weight > 0):
            self._not_applied(fragment, pending, "retry", group, "did not average every part")
            return
        # mixed outer states average peers of any round index into one state (see .outer_mixing)
        offset = round_offset(group_round, pending.round_index) if fragment.mixing is None else 0
        if offset < 0:
            # the group was at a later round: this peer missed one; the download replaces this fragment.
            # With weight 0 the group's mean is the others' round index k and this peer received their
            # average: once it holds their round-k anchor (the download), it takes the same outer step
            if pending.weight == 0 and abs(group_round - round(group_round)) < 1e-3:
                fragment.held[round(group_round)] = [pg.clone() for pg in fragment.pseudo_grads]
                while len(fragment.held) > MAX_HELD:  # the oldest go first
                    fragment.held.pop(min(fragment.held))
            if not self._downloading:  # (a download is what it needs: no second one right after it)
                self.context.request_resync()
            self._not_applied(fragment, pending, "behind", group, "was behind the group: downloading its state")
            return
        if offset > 0:
            self._not_applied(fragment, pending, "retry", group, "averaged with peers of an earlier round")
            return
        age = self.step_index - pending.started_step
        current = int(self.phase[_ROUNDS + f].item())
        if not update_is_fresh(
            started_step=pending.started_step,
            now_step=self.step_index,
            inner_steps=alg.inner_steps,
            started_round=pending.round_index,
            round_index=current,
        ):
            self.dropped_rounds += 1
            self._not_applied(fragment, pending, "stale", group, f"is stale ({age} inner steps): dropped")
            return
        if fragment.mixing is not None:
            with self._lock:
                fragment.mixing.adopt()  # the group's mean anchors and momenta: the step below is the group's
        self._apply(fragment, fragment.pseudo_grads, pending.snapshot, pending.samples)
        self.swarm_rounds += 1
        if fragment.contributing and pending.weight > 0:
            self.contributing_rounds += 1
        fragment.contributing = True
        self.history.append((f, current, "swarm", pending.weight, group, age))

    def _apply(
        self, fragment: _Fragment, pseudo_grads: Sequence[torch.Tensor], snapshot: Sequence[torch.Tensor], samples: int
    ) -> None:
        """The outer step on the fragment's anchors, and ``params += alpha * (anchor - snapshot)``."""
        anchors = [self.anchor[i] for i in fragment.tensors]
        with self._lock:
            outer_step(self.algorithm, anchors, [self.momentum[i] for i in fragment.tensors], pseudo_grads)
            params = [self._params[i] for i in fragment.tensors]
            apply_average(params, anchors, snapshot, alpha=self.algorithm.alpha)
            self.phase[_ROUNDS + fragment.index] += 1
            self._state.copy_to_model()
        fragment.samples = max(0, fragment.samples - samples)  # the inner steps made meanwhile stay
        self.rounds += 1

    def _not_applied(self, fragment: _Fragment, pending: _Round, kind: str, group: int, why: str) -> None:
        """No outer step: the anchor stays, and the next round's pseudo-gradient (and weight) covers
        the whole time since it. A peer that joined in this round contributes to the next, unless it
        was behind the group (it then waits for its download)."""
        if kind != "stale":
            self.failed_rounds += 1
        fragment.unsent_residuals = pending.residuals
        # behind: its pseudo-gradient starts from an older anchor than the others'; weight 0 until the download.
        # A peer that took part with weight 0 (after a download) stays at 0 until a round applies: a failed
        # round does not tell it that it is in step, and a contribution at another round index than the
        # group's would fail the others' round
        fragment.contributing = fragment.contributing and kind != "behind"
        age = self.step_index - pending.started_step
        self.history.append((fragment.index, pending.round_index, kind, pending.weight, group, age))
        logger.log(
            self.context.status_loglevel, f"fragment {fragment.index} round {pending.round_index} {why}: no outer step"
        )

    # ----- state downloads

    def settle(self) -> None:
        """Waits for the rounds in flight (each at most until its deadline) and applies their outer
        updates: e.g. before evaluating or saving a model that every peer holds at the same round."""
        started = time.perf_counter()
        for fragment in self.fragments:
            if fragment.pending is not None:
                self._settle(fragment)
        self.waited_seconds += time.perf_counter() - started

    def prepare_for_download(self) -> None:
        """Settles the rounds in flight (they write to the state), then remembers each fragment's
        round index, anchors, momenta and parameters: where this peer is further than the donor, it
        keeps its own (see :meth:`on_state_loaded`)."""
        self._downloading = True
        try:
            self.settle()
        finally:
            self._downloading = False
        self._download_started = time.monotonic()
        with self._lock:
            self._saved = [
                (
                    int(self.phase[_ROUNDS + fragment.index].item()),
                    [
                        t.detach().clone()
                        for i in fragment.tensors
                        for t in (self.anchor[i], self.momentum[i], self._params[i])
                    ],
                )
                for fragment in self.fragments
            ]

    def on_state_loaded(self) -> None:
        """The anchors, momenta, phase and parameters are the donor's now (the state lock is held):
        follow its schedule and, per fragment, :func:`after_download`'s choice: this peer's own values
        (it was further), the donor's plus the held average of the round the donor had in flight, or
        the donor's alone (this peer then sits out, with weight 0, the rest of that round)."""
        saved, self._saved = self._saved, None
        started, self._download_started = self._download_started, None
        self.state_loads += 1
        # the swarm went on while this peer downloaded: skip the inner steps it missed, and start the
        # rounds that were due meanwhile at the next step (the others' groups wait that long for it)
        self.phase.copy_(torch.tensor(sanitized_phase(self.phase.tolist()), dtype=self.phase.dtype))
        loaded_step = self.step_index
        missed = steps_missed(
            time.monotonic() - started if started is not None else 0.0,
            float(self.phase[_SECONDS_PER_STEP].item()),
            self.algorithm.inner_steps,
        )
        self.phase[_STEP] = float(loaded_step + missed)
        self._step_ends.clear()
        alg = self.algorithm
        for fragment in self.fragments:
            f = fragment.index
            held, fragment.held = fragment.held, {}
            fragment.pending = None  # none: prepare_for_download settled them
            fragment.samples = 0
            mine_round, values = saved[f] if saved is not None else (-1, [])
            served = int(self.phase[_ROUNDS + f].item())
            choice, count = after_download(mine=mine_round, served=served, held=held.keys())
            fragment.contributing = choice != "donor"
            fragment.catch_up = any(
                round_is_due(s, f, alg.inner_steps, alg.fragments)
                for s in range(loaded_step + 1, loaded_step + missed + 1)
            )
            anchors = [self.anchor[i] for i in fragment.tensors]
            with torch.no_grad():
                if choice == "mine":
                    for k, i in enumerate(fragment.tensors):
                        anchor, momentum, param = values[3 * k : 3 * k + 3]
                        self.anchor[i].copy_(anchor)
                        self.momentum[i].copy_(momentum)
                        self._params[i].copy_(param)
                    self.phase[_ROUNDS + f] = float(mine_round)
                elif choice == "held":
                    # the donor's outer steps of its rounds in flight, on the same averages: the same anchor
                    for k in range(served, served + count):
                        outer_step(self.algorithm, anchors, [self.momentum[i] for i in fragment.tensors], held[k])
                    for i in fragment.tensors:
                        self._params[i].copy_(self.anchor[i])
                    self.phase[_ROUNDS + f] = float(served + count)
        self._state.copy_to_model()

    # ----- shutting down

    def shutdown(self) -> None:
        """Cancels the rounds in flight and stops the fragments' averagers."""
        if self._closed:
            return
        self._closed = True
        for fragment in self.fragments:
            pending, fragment.pending = fragment.pending, None
            if pending is not None and not pending.control.done():
                pending.control.cancel()
            if fragment.averager is not None:
                try:
                    fragment.averager.shutdown()
                except Exception as e:  # e.g. the DHT's daemon is already gone: the others must still close
                    logger.debug(f"error while shutting down a fragment's averager: {e!r}")
