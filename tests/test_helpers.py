"""The shared test helpers themselves (tests/swarm.py)."""

import time

import pytest
from swarm import wait_for


def test_wait_for_returns_the_first_truthy_value() -> None:
    calls = []

    def condition() -> list[int]:
        calls.append(len(calls))
        return calls[2:]  # falsy twice, then the calls so far

    assert wait_for(condition, 5.0, interval=0.001) == [2]
    assert len(calls) == 3


def test_wait_for_fails_with_the_message_after_the_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"timed out after 0.2 s waiting for the answer \(last value: 0\)"):
        wait_for(lambda: 0, 0.2, interval=0.01, message="the answer")
    assert 0.2 <= time.monotonic() - started < 2.0
