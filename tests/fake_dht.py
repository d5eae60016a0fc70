"""A stand-in for ``hivemind.DHT`` whose start never completes, shared by the CLI and Lightning tests."""

from __future__ import annotations

import time


class StuckDHT:
    """Stands for ``hivemind.DHT`` (in ``hivemind-ext aux``, the Lightning strategy): its start never
    completes (a daemon or a bootstrap that hangs). A wait without a deadline fails after 5 s instead of
    hanging the test."""

    made: list[StuckDHT] = []

    def __init__(self, initial_peers=None, *, start: bool, **kwargs) -> None:
        self.shut_down = False
        StuckDHT.made.append(self)
        if start:
            self.run_in_background(await_ready=True)

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        if await_ready:
            self.wait_until_ready(timeout)

    def wait_until_ready(self, timeout: float | None = None) -> None:
        time.sleep(5.0 if timeout is None else min(timeout, 5.0))
        if timeout is None:
            raise AssertionError("waited for the DHT to start without a deadline")
        raise TimeoutError

    def shutdown(self) -> None:
        self.shut_down = True
