"""Awaiting a transfer that must keep making progress: :func:`unless_idle`.

A frame's bytes may take long to arrive (a large payload on a slow link), so its read has no
deadline of its own beyond the call's; but a peer that stops sending in the middle of a frame
holds that frame's buffer for nothing. :func:`unless_idle` raises once ``progress()`` (a count of
bytes received, or taken by the transport on the way out) has not moved for ``seconds``: one timer
every ``seconds``, not one per read, so it costs nothing on a busy stream. A transfer that keeps
moving at whatever rate the link allows is never cut: only silence is.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from hivemind_ext.errors import DeadlineExceededError, ProtocolError

T = TypeVar("T")
Progress = Callable[[], int]


class IdleStreamError(ProtocolError):
    """The peer sent nothing for the idle timeout (in the middle of a frame, or while one was due)."""


class StalledWriteError(DeadlineExceededError):
    """The peer took none of our bytes for the idle timeout while a frame was being written (it
    stopped reading): the frame is cut short, so the stream cannot be used any more."""


async def unless_idle(
    work: Coroutine[Any, Any, T], seconds: float, progress: Progress, what: str, *, writing: bool = False
) -> T:
    """Awaits ``work``; cancels it and raises :class:`IdleStreamError` (:class:`StalledWriteError`
    if ``writing``) if ``progress()`` stays the same for ``seconds``. Cancellation from outside
    propagates unchanged."""
    if sys.version_info >= (3, 11):
        return await _with_timeout_scope(work, seconds, progress, what, writing)
    return await _with_child_task(work, seconds, progress, what, writing)  # pragma: no cover - Python 3.10


def _idle_error(seconds: float, what: str, writing: bool) -> Exception:
    if writing:
        return StalledWriteError(f"the peer took none of our bytes for {seconds:g} s {what}")
    return IdleStreamError(f"the peer sent nothing for {seconds:g} s {what}")


class _Watchdog:
    """Expires an ``asyncio.timeout`` scope once progress stops (see the module)."""

    def __init__(self, seconds: float, progress: Progress, scope: Any) -> None:
        self.seconds, self.progress, self.scope = seconds, progress, scope
        self.fired = False
        self.last = progress()
        self.handle: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(seconds, self.check)

    def check(self) -> None:
        if self.handle is None:
            return
        current = self.progress()
        loop = asyncio.get_running_loop()
        if current == self.last:
            self.fired, self.handle = True, None
            self.scope.reschedule(loop.time())
            return
        self.last = current
        self.handle = loop.call_later(self.seconds, self.check)

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
        self.handle = self.scope = None  # no cycle through the timer's callback outlives the read


async def _with_timeout_scope(
    work: Coroutine[Any, Any, T], seconds: float, progress: Progress, what: str, writing: bool
) -> T:
    watchdog: _Watchdog | None = None
    try:
        async with asyncio.timeout(None) as scope:
            watchdog = _Watchdog(seconds, progress, scope)
            return await work
    except TimeoutError:
        if watchdog is None or not watchdog.fired:
            raise
        raise _idle_error(seconds, what, writing) from None
    finally:
        if watchdog is not None:
            watchdog.stop()


async def _with_child_task(
    work: Coroutine[Any, Any, T], seconds: float, progress: Progress, what: str, writing: bool
) -> T:  # pragma: no cover - Python 3.10 only (no asyncio.timeout there)
    task = asyncio.ensure_future(work)
    try:
        last = progress()
        while True:
            done, _ = await asyncio.wait({task}, timeout=seconds)
            if done:
                return task.result()
            current = progress()
            if current == last:
                break
            last = current
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    raise _idle_error(seconds, what, writing)
