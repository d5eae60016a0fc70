"""A progress bar for :class:`~hivemind_ext.optim.Optimizer` (``progress=True``): one tqdm line, e.g.::

    epoch 12: 62%|######|  160/256 samples [412.3 samples/s | peers 3: 1 trainer, 1 client, 1 aux | avg 3 peers 0.05s]

What it shows comes from what the peer knows already: the epoch, the samples toward
``target_batch_size`` and the swarm's samples/s from the progress tracker's view of the swarm; the
peers from the tracker (those that publish progress, and which of them are in client mode) and the
last round (members that contributed no tensors: auxiliary peers); the last round's result from the
round driver. The training thread updates it from ``step()``; rendering is throttled to a few lines
a second, so a step costs a clock read. :func:`progress_status` (pure) builds what is shown, so tests
can compare it with the tracker's figures.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from typing import Any, TextIO

import tqdm

from hivemind_ext.errors import ConfigurationError
from hivemind_ext.optim.progress import GlobalTrainingProgress
from hivemind_ext.optim.rounds import RoundOutcome

MIN_INTERVAL = 0.25  # seconds between two renders (an epoch change renders at once)
BAR_FORMAT = "{{desc}}: {{percentage:3.0f}}%|{{bar}}| {{n}}/{{total}} samples [{status}]"  # tqdm's, with our status


def bar_format(postfix: str) -> str:
    """tqdm's ``bar_format`` showing ``postfix`` after the counts (tqdm's own postfix field starts with a comma)."""
    return BAR_FORMAT.format(status=postfix.replace("{", "{{").replace("}", "}}"))


@dataclasses.dataclass(frozen=True)
class ProgressStatus:
    """One render of the bar."""

    epoch: int  # this peer's epoch
    samples: int  # the swarm's samples toward the target, at the swarm's epoch
    target: int
    samples_per_second: float  # the swarm's
    peers: int  # peers that publish progress, this one included
    clients: int  # of which in client mode
    auxiliary: int  # of which auxiliary peers (they help average, bring no gradients)
    last_round: str  # RoundOutcome.describe(short=True), or "no round yet"

    @property
    def trainers(self) -> int:
        """Peers that train and accept connections (not in client mode, not auxiliary)."""
        return max(0, self.peers - self.clients - self.auxiliary)

    @property
    def postfix(self) -> str:
        roles = f"{self.trainers} trainer{'s' if self.trainers != 1 else ''}, {self.clients} client"
        roles += f", {self.auxiliary} aux"
        return f"{self.samples_per_second:.1f} samples/s | peers {self.peers}: {roles} | {self.last_round}"


def progress_status(progress: GlobalTrainingProgress, local_epoch: int, last: RoundOutcome | None) -> ProgressStatus:
    """What the bar shows for the tracker's ``progress``, this peer's epoch and its ``last`` round."""
    return ProgressStatus(
        epoch=local_epoch,
        samples=progress.samples_accumulated,
        target=progress.target_batch_size,
        samples_per_second=progress.samples_per_second,
        peers=progress.num_peers,
        clients=progress.num_clients,
        auxiliary=progress.num_auxiliary,
        last_round=last.describe(short=True) if last is not None else "no round yet",
    )


class ProgressBar:
    """The bar of one Optimizer: reads ``tracker.global_progress`` and ``rounds.last_outcome``.

    :param file: where to draw (default: stderr at each render); any text stream, such as a StringIO
    :param min_interval: seconds between two renders
    """

    def __init__(
        self, *, tracker: Any, rounds: Any, file: TextIO | None = None, min_interval: float = MIN_INTERVAL
    ) -> None:
        self.tracker, self.rounds, self.min_interval = tracker, rounds, float(min_interval)
        self._lock = threading.Lock()
        self._closed = False
        self._last_render = -float("inf")
        self._last_epoch: int | None = None
        #: what the bar showed last (None before the first render)
        self.last_status: ProgressStatus | None = None
        self._file = file
        self._bar: tqdm.tqdm | None = None  # created at the first render, so that it starts with a full line

    def update(self, local_epoch: int, *, force: bool = False) -> None:
        """Renders the current status, unless it rendered less than ``min_interval`` s ago at the same epoch."""
        now = time.monotonic()
        if not force and now - self._last_render < self.min_interval and local_epoch == self._last_epoch:
            return
        with self._lock:
            if self._closed:
                return
            self._render(local_epoch)
            self._last_render, self._last_epoch = now, local_epoch

    def _render(self, local_epoch: int) -> None:
        status = progress_status(self.tracker.global_progress, local_epoch, self.rounds.last_outcome)
        if self._bar is None:
            self._bar = tqdm.tqdm(
                desc=f"epoch {status.epoch}",
                total=status.target,
                initial=status.samples,
                file=self._file if self._file is not None else sys.stderr,
                bar_format=bar_format(status.postfix),
                dynamic_ncols=self._file is None,
                mininterval=0,
                leave=True,
            )
        else:
            bar = self._bar
            bar.total, bar.n = status.target, status.samples
            bar.set_description_str(f"epoch {status.epoch}", refresh=False)
            bar.bar_format = bar_format(status.postfix)
            bar.refresh()
        self.last_status = status

    def close(self, local_epoch: int | None = None) -> None:
        """Renders the final status (at ``local_epoch``, if given) and ends the line. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if local_epoch is not None:
                    self._render(local_epoch)
            finally:
                if self._bar is not None:
                    self._bar.close()


def make_progress_bar(option: bool | TextIO | None, *, verbose: bool, tracker: Any, rounds: Any) -> ProgressBar | None:
    """The Optimizer's ``progress`` keyword: True (on stderr), a text stream to draw on, False (none), or
    None: on stderr when ``verbose`` and stderr is a terminal."""
    if option is None:
        option = verbose and _stderr_is_terminal()
    if option is False:
        return None
    file = None if option is True else option
    if file is not None and not callable(getattr(file, "write", None)):
        raise ConfigurationError(f"progress must be a bool or a text stream, got {type(option).__name__}")
    return ProgressBar(tracker=tracker, rounds=rounds, file=file)


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without isatty, or closed
        return False


__all__ = ["ProgressBar", "ProgressStatus", "make_progress_bar", "progress_status"]
