"""Deadlines: absolute points on the event loop's clock that bound every network wait.

A deadline is a float on ``loop.time()`` (a monotonic clock), so it can be handed down through
nested calls unchanged while each level computes what is left. Public functions accept either a
relative ``timeout`` or an absolute ``deadline``; :func:`resolve_deadline` turns whichever was
given (or a default timeout) into one deadline, so no wait is ever unbounded.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable
from typing import TypeVar

from hivemind_ext.errors import ConfigurationError, DeadlineExceededError

T = TypeVar("T")

# asyncio.timeout_at (3.11+) bounds a wait without spawning a task; on 3.10 we fall back to
# asyncio.wait_for, which wraps the awaitable in a task (slower per call, same semantics).
_HAS_TIMEOUT_AT = hasattr(asyncio, "timeout_at")
_CLOCK_SLACK = 1e-3  # timers may fire a hair early; within this of the deadline, a timeout is ours


def now() -> float:
    """The current time on the running loop's clock, the clock deadlines are expressed in."""
    return asyncio.get_running_loop().time()


def resolve_deadline(timeout: float | None, deadline: float | None, default_timeout: float) -> float:
    """One absolute deadline from an optional relative ``timeout`` and an optional absolute ``deadline``.

    If both are given the earlier wins; if neither, ``default_timeout`` from now applies, so every
    wait stays bounded even when a caller forgets to pass one.
    """
    if timeout is not None and (not isinstance(timeout, int | float) or math.isnan(timeout) or timeout < 0):
        raise ConfigurationError(f"timeout must be a non-negative number of seconds, got {timeout!r}")
    if deadline is not None and (not isinstance(deadline, int | float) or math.isnan(deadline)):
        raise ConfigurationError(f"deadline must be a number on the loop clock, got {deadline!r}")
    candidates = [deadline] if deadline is not None else []
    if timeout is not None:
        candidates.append(now() + timeout)
    if not candidates:
        candidates.append(now() + default_timeout)
    return min(candidates)


def check_durations(config: object, *names: str) -> None:
    """Raises :class:`ConfigurationError` unless every attribute ``names`` of ``config`` (a settings
    object, checked as it is built) is a positive finite number of seconds."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int | float) or not 0 < value < math.inf:
            raise ConfigurationError(f"{name} must be a positive finite number of seconds, got {value!r}")


def remaining(deadline: float) -> float:
    """Seconds left until ``deadline`` (negative once it has passed)."""
    return deadline - now()


async def wait_until(awaitable: Awaitable[T], deadline: float, what: str) -> T:
    """Awaits ``awaitable`` and raises :class:`DeadlineExceededError` if ``deadline`` passes first.

    Cancellation from outside propagates unchanged; only this deadline's own expiry becomes
    ``DeadlineExceededError``. ``what`` names the wait in the error message.
    """
    if remaining(deadline) <= 0:
        # Don't start an operation that can only time out; close a coroutine we will not run.
        close = getattr(awaitable, "close", None)
        if close is not None:
            close()
        raise DeadlineExceededError(f"{what}: deadline passed before the wait started")
    if _HAS_TIMEOUT_AT:
        scope = asyncio.timeout_at(deadline)
        try:
            async with scope:
                return await awaitable
        except TimeoutError as e:
            if not scope.expired():
                raise  # an unrelated TimeoutError (e.g. an OS-level ETIMEDOUT), or a nested deadline's error
            raise DeadlineExceededError(f"{what}: deadline exceeded") from e
    try:
        return await asyncio.wait_for(awaitable, timeout=max(remaining(deadline), 0.0))
    except asyncio.TimeoutError as e:  # on 3.10 a distinct class from the builtin TimeoutError
        if isinstance(e, DeadlineExceededError) or remaining(deadline) > _CLOCK_SLACK:
            raise  # a nested deadline's error, or a TimeoutError raised by the work itself
        raise DeadlineExceededError(f"{what}: deadline exceeded") from e
