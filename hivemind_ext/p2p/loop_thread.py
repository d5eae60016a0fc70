"""A background thread that owns an asyncio event loop (uvloop where available).

Averagers and optimizers are called from the user's training thread, which has no event loop of
its own; their networking runs on one of these, one per peer, owned by the peer's
:class:`~hivemind_ext.p2p.runtime.PeerRuntime`. ``submit`` hands a coroutine over and returns a
``concurrent.futures.Future``; ``stop`` cancels every task still on the loop, waits for them, and
joins the thread, so nothing outlives its owner.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from hivemind_ext.errors import ClosedError, DeadlineExceededError

logger = logging.getLogger(__name__)
T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # uvloop does not exist on Windows
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopThread:
    """Runs an event loop in a daemon thread until :meth:`stop`."""

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.name = name
        self.loop = loop if loop is not None else new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stopped = False
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedules ``coro`` on the loop; the future's ``cancel()`` cancels the task."""
        if not self.alive:
            coro.close()
            raise ClosedError(f"{self.name} is stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Runs ``coro`` on the loop and waits for its result from another thread, at most ``timeout`` s."""
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError(f"{self.name}: run() would deadlock when called from the loop's own thread")
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError as e:
            future.cancel()
            raise DeadlineExceededError(f"{self.name}: no result within {timeout} s") from e

    def stop(self, timeout: float = 10.0) -> None:
        """Cancels all tasks on the loop, waits up to ``timeout`` for them to finish, stops the loop; idempotent."""
        if self._stopped or not self._thread.is_alive():
            self._stopped = True
            return
        if self.in_loop_thread():
            raise RuntimeError(f"{self.name}: stop() cannot be called from the loop's own thread")
        try:
            asyncio.run_coroutine_threadsafe(self._cancel_all(), self.loop).result(timeout)
        except concurrent.futures.TimeoutError:
            logger.warning(f"{self.name}: some tasks did not finish within {timeout} s of being cancelled")
        finally:
            self._stopped = True
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)

    @staticmethod
    async def _cancel_all() -> None:
        current = asyncio.current_task()
        tasks = [task for task in asyncio.all_tasks() if task is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
