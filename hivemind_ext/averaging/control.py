"""StepControl: the user's handle on one averaging step that runs in the background.

``DecentralizedAverager.step(wait=False)`` returns one. The training thread can wait for the
result, cancel the step, change its weight or scheduled time until the all-reduce begins, and, with
``require_trigger=True``, hold the all-reduce back until :meth:`StepControl.allow_allreduce` (so
matchmaking can run ahead of time while gradients are still being accumulated).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import math
import threading
from typing import Any

from hivemind_ext.errors import ConfigurationError


class AveragingMode(enum.Enum):
    """How a peer takes part in averaging (hivemind's ``AveragingMode``, with the same names and values).

    NODE: contributes tensors and accepts connections; CLIENT: contributes tensors but accepts no
    connections (so it owns no part of the all-reduce); AUX: accepts connections and helps reduce,
    contributing no tensors. A member equals hivemind's member of the same name, so scripts that compare
    ``averager.mode == hivemind.averaging.averager.AveragingMode.CLIENT`` keep working without the
    library importing hivemind's averaging modules.
    """

    NODE = 0
    CLIENT = 1
    AUX = 2

    def __eq__(self, other: object) -> bool:
        if isinstance(other, enum.Enum) and type(other).__name__ == "AveragingMode":
            return (other.name, other.value) == (self.name, self.value)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.name)  # what enum.Enum hashes, so a member and hivemind's are one dict key


class AveragingStage(enum.Enum):
    IDLE = enum.auto()
    LOOKING_FOR_GROUP = enum.auto()
    AWAITING_TRIGGER = enum.auto()
    RUNNING_ALLREDUCE = enum.auto()
    FINISHED = enum.auto()


class StepControl(concurrent.futures.Future):
    """A future for one averaging step's result (the gathered metadata), with controls.

    Thread-safe: the training thread reads and sets fields, the averager's loop thread runs the step.
    """

    def __init__(
        self,
        *,
        scheduled_time: float,
        deadline: float,
        allow_retries: bool,
        weight: float,
        gather: Any,
        expected_group_size: int | None = None,
    ) -> None:
        super().__init__()
        self.expected_group_size = expected_group_size  # see MatchmakingConfig.expected_group_size
        if not deadline > scheduled_time:
            raise ConfigurationError(f"scheduled time {scheduled_time} does not fit before the deadline {deadline}")
        check_weight(weight)
        self._lock = threading.Lock()
        self._scheduled_time, self._weight = scheduled_time, float(weight)
        self.deadline, self.allow_retries, self.gather = deadline, allow_retries, gather
        self.report: Any = None  # the averager's RoundReport of the round, set before the step's result
        self._stage = AveragingStage.IDLE
        self._trigger_set = threading.Event()
        self._groupmate_started = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._trigger: asyncio.Event | None = None

    # ----- set from the training thread

    @property
    def scheduled_time(self) -> float:
        return self._scheduled_time

    @scheduled_time.setter
    def scheduled_time(self, value: float) -> None:
        with self._lock:
            if self._stage not in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP):
                raise RuntimeError(f"cannot change the scheduled time at stage {self._stage.name}")
            self._scheduled_time = float(value)

    @property
    def weight(self) -> float:
        return self._weight

    @weight.setter
    def weight(self, value: float) -> None:
        check_weight(value)
        with self._lock:
            if self.began_allreduce:
                raise RuntimeError("cannot change the weight once the all-reduce has begun")
            self._weight = float(value)

    def allow_allreduce(self) -> None:
        """Lets the step run its all-reduce as soon as it has a group."""
        self._trigger_set.set()
        with self._lock:
            if self._loop is not None and self._trigger is not None:
                self._loop.call_soon_threadsafe(self._trigger.set)

    @property
    def triggered(self) -> bool:
        return self._trigger_set.is_set()

    @property
    def groupmate_started(self) -> bool:
        """True once a member of this step's group began its all-reduce while this step still waits
        for its trigger: the training thread can take that as the signal to end its epoch now."""
        return self._groupmate_started.is_set()

    def mark_groupmate_started(self) -> None:
        self._groupmate_started.set()

    # ----- read by both sides

    @property
    def stage(self) -> AveragingStage:
        return self._stage

    @stage.setter
    def stage(self, value: AveragingStage) -> None:
        with self._lock:
            self._stage = value

    @property
    def began_allreduce(self) -> bool:
        return self._stage in (AveragingStage.RUNNING_ALLREDUCE, AveragingStage.FINISHED)

    # ----- used by the averager's loop

    def bind_to_running_loop(self) -> None:
        """Creates the loop-side trigger event; called once the step's task starts."""
        with self._lock:
            self._loop = asyncio.get_running_loop()
            self._trigger = asyncio.Event()
            if self._trigger_set.is_set():
                self._trigger.set()

    async def wait_for_trigger(self) -> None:
        if self._trigger is None:
            raise RuntimeError("bind_to_running_loop() must be called first")
        await self._trigger.wait()


def check_weight(weight: Any) -> None:
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) or weight < 0:
        raise ConfigurationError(f"weight must be a finite non-negative number, got {weight!r}")
