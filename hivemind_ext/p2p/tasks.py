"""A small owner for background tasks, so that none outlives the object that started it.

``asyncio.TaskGroup`` needs Python 3.11 and fails the whole group when one task fails; the p2p
layer needs something simpler that also runs on 3.10: spawn tasks, adopt tasks that asyncio
created for us (a stream server's per-connection handlers), and cancel and await all of them at
shutdown. A task that ends with an unexpected exception is logged, never silently dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from hivemind_ext.errors import ClosedError, DeadlineExceededError

logger = logging.getLogger(__name__)
T = TypeVar("T")


class TaskOwner:
    """Holds tasks and, on :meth:`aclose`, cancels every one still running and waits for it to finish.

    Usable as ``async with TaskOwner() as owner: owner.spawn(...)``; leaving the block closes it.
    """

    def __init__(self, name: str = "tasks") -> None:
        self.name = name
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False

    def __len__(self) -> int:
        return len(self._tasks)

    @property
    def closing(self) -> bool:
        return self._closing

    def spawn(
        self, coro: Coroutine[Any, Any, T], *, name: str | None = None, report_errors: bool = True
    ) -> asyncio.Task[T]:
        """Starts ``coro`` as a task owned by this owner.

        :param report_errors: log the task's exception if it fails; pass False when the spawning
          code collects the result itself (``task.result()``), so that errors are not reported twice
        """
        if self._closing:
            coro.close()  # never started, so it must be closed to avoid a "never awaited" warning
            raise ClosedError(f"{self.name} is shutting down and accepts no new tasks")
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.adopt(task, report_errors=report_errors)
        return task

    def adopt(self, task: asyncio.Task[Any], *, report_errors: bool = True) -> None:
        """Takes ownership of a task created elsewhere (e.g. by ``asyncio.start_unix_server``)."""
        if self._closing:
            task.cancel()
            raise ClosedError(f"{self.name} is shutting down and accepts no new tasks")
        self._tasks.add(task)
        task.add_done_callback(self._forget if report_errors else self._forget_quietly)

    def _forget(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error(f"{self.name}: task {task.get_name()} failed", exc_info=task.exception())

    def _forget_quietly(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)

    async def aclose(self, timeout: float | None = None) -> None:
        """Cancels all owned tasks and waits until each has finished; idempotent.

        The calling task may itself be one of the owned tasks (a handler that shuts the server
        down): it is skipped rather than cancelled. If the caller is cancelled while waiting, the
        children have already been cancelled, and the caller's cancellation propagates.

        :param timeout: give up waiting after this many seconds and raise DeadlineExceededError
          naming the tasks that ignored their cancellation (only code that swallows CancelledError
          can cause this); by default, wait for as long as they take
        """
        self._closing = True
        current = asyncio.current_task()
        pending = [task for task in self._tasks if task is not current]
        for task in pending:
            task.cancel()
        if not pending:
            return
        _, still_running = await asyncio.wait(pending, timeout=timeout)
        if still_running:
            names = sorted(task.get_name() for task in still_running)
            raise DeadlineExceededError(f"{self.name}: tasks ignored cancellation for {timeout} s: {names}")

    async def __aenter__(self) -> TaskOwner:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
