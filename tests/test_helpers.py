"""The shared test helpers themselves (tests/swarm.py)."""

import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import pytest
from hivemind.utils import get_dht_time
from swarm import local_swarm, new_peer, revive_dead_peers, wait_for, within


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


def run_spawned(scenario: Callable[[Connection], None], seconds: float = 45.0) -> None:
    """Runs ``scenario(report)`` in a spawned interpreter and fails with the text it reports, if any.

    DHT processes are killed only in such interpreters, never in this one: every process forked from
    one interpreter shares hivemind's ``MPFuture._update_lock``, and a DHT process SIGKILLed while it
    sends a result holds that lock for ever, so every DHT this test run starts afterwards would hang
    (it happened in CI: every later multi-peer test failed in its set-up, and the run timed out)."""
    context = multiprocessing.get_context("spawn")
    reader, writer = context.Pipe(duplex=False)
    child = context.Process(target=_reporting, args=(scenario, writer))
    child.start()
    try:
        assert reader.poll(seconds), f"the scenario's process sent nothing within {seconds} s"
        failure = reader.recv()
        assert failure is None, failure
    finally:
        child.join(15)
        if child.is_alive():
            child.kill()
            child.join()


def _reporting(scenario: Callable[[Connection], None], report: Connection) -> None:
    try:
        scenario(report)
        report.send(None)
    except BaseException as error:  # handed to the test in the parent process
        report.send(f"{type(error).__name__}: {error}")


def _within_on_a_killed_dht(report: Connection) -> None:
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


@pytest.mark.timeout(60)
def test_within_fails_naming_the_call_when_a_dht_process_died() -> None:
    """hivemind's ``dht.store`` waits for ever on a DHT process that died (a fixture once hung so)."""
    run_spawned(_within_on_a_killed_dht)


def _a_dead_swarm_peer_is_replaced(report: Connection) -> None:
    with local_swarm(3) as dhts:
        assert revive_dead_peers() == []
        first = dhts[0]
        os.kill(first.pid, signal.SIGKILL)  # the bootstrap peer: the new one must join through another
        first.join(10)
        assert revive_dead_peers() == [0]
        assert dhts[0] is not first and dhts[0].is_alive()
        assert within("a store", dhts[0].store, "revived", "yes", get_dht_time() + 60)
        found = wait_for(lambda: within("a get", dhts[2].get, "revived", latest=True), 10, message="the record")
        assert found.value == "yes"


@pytest.mark.timeout(90)
def test_a_module_swarm_peer_that_died_is_replaced_before_the_next_test() -> None:
    run_spawned(_a_dead_swarm_peer_is_replaced, seconds=75)
