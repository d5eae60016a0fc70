"""The shared test helpers themselves (tests/swarm.py)."""

import os
import signal
import time

import pytest
from hivemind.utils import get_dht_time
from swarm import new_peer, wait_for, within


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


def test_within_returns_the_calls_value_and_raises_its_error() -> None:
    assert within("an addition", lambda a, b=0: a + b, 2, b=3) == 5
    with pytest.raises(KeyError, match="missing"):
        within("a lookup", {}.__getitem__, "missing")


@pytest.mark.timeout(30)
def test_within_fails_naming_the_call_when_a_dht_process_died() -> None:
    """hivemind's ``dht.store`` waits for ever on a DHT process that died (a fixture once hung so)."""
    dht = new_peer()
    try:
        assert within("a store", dht.store, "key", 1, get_dht_time() + 60)
        os.kill(dht.pid, signal.SIGKILL)
        dht.join(10)
        started = time.monotonic()
        with pytest.raises(AssertionError, match=r"a store did not return within 0.5 s \(did a DHT process die\?\)"):
            within("a store", dht.store, "key", 2, get_dht_time() + 60, seconds=0.5)
        assert time.monotonic() - started < 3.0
    finally:
        dht.shutdown()
