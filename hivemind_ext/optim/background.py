"""One background worker for the Optimizer's delayed work (averaging and optimizer steps).

A single thread runs one job at a time, so delayed steps apply in order and at most one round is
in flight (hivemind's "one round of staleness"). The Optimizer owns it: ``wait()`` bounds every
wait for a job, and ``shutdown()`` waits a bounded time for the job in flight, then abandons it.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from typing import Any

from hivemind_ext.errors import ClosedError, DeadlineExceededError

logger = logging.getLogger(__name__)


class BackgroundWorker:
    def __init__(self, name: str) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._job: concurrent.futures.Future | None = None
        self._closed = False

    @property
    def busy(self) -> bool:
        return self._job is not None and not self._job.done()

    @property
    def pending(self) -> bool:
        """A job was submitted and its result has not been collected by ``wait()`` yet."""
        return self._job is not None

    def submit(self, fn: Callable[[], Any]) -> None:
        if self._closed:
            raise ClosedError("the optimizer is shut down")
        if self._job is not None:
            raise RuntimeError("collect the previous background job with wait() first")
        self._job = self._executor.submit(fn)

    def wait(self, timeout: float | None) -> Any:
        """The result of the job in flight (None if there is none); re-raises what the job raised.

        :raises DeadlineExceededError: the job did not finish within ``timeout`` seconds (it keeps running)
        """
        job = self._job
        if job is None:
            return None
        try:
            result = job.result(timeout)
        except (TimeoutError, concurrent.futures.TimeoutError):
            raise DeadlineExceededError(f"a background step did not finish within {timeout} s") from None
        finally:
            if job.done():
                self._job = None
        return result

    def shutdown(self, timeout: float) -> None:
        self._closed = True
        if self._job is not None and not self._job.done():
            try:
                self._job.result(timeout)
            except Exception as e:  # the job's own errors were logged where they happened
                logger.debug(f"background job ended with {e!r} at shutdown")
        self._executor.shutdown(wait=False, cancel_futures=True)
