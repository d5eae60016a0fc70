"""PeerRuntime: one event loop, P2P replica, RPC server and DHT helper per peer, one ordered shutdown.

Real DHTs on 127.0.0.1; DHT faults come through the public seam (tests/faulty_dht.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import hivemind
import pytest
import torch
from faulty_dht import FaultyDHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time
from swarm import local_swarm, new_peer, within

from hivemind_ext.averaging import DecentralizedAverager
from hivemind_ext.errors import (
    ClosedError,
    ConfigurationError,
    DeadlineExceededError,
    PeerUnreachableError,
)
from hivemind_ext.optim.progress import ProgressTracker
from hivemind_ext.p2p import DHTCalls, PeerRuntime
from hivemind_ext.p2p.dht_calls import (
    DEFAULT_DHT_TIMEOUT,
    add_validators,
    dht_client_mode,
    dht_peer_id,
    start_dht,
    visible_maddrs,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]
_names = itertools.count()


@pytest.fixture(scope="module")
def swarm() -> Iterator[list[hivemind.DHT]]:
    with local_swarm(2) as dhts:
        yield dhts


def fresh(name: str) -> str:
    return f"runtime-test-{name}-{next(_names)}"


def averager(dht: hivemind.DHT, prefix: str, value: float) -> DecentralizedAverager:
    return DecentralizedAverager(
        [torch.full((10,), value)], dht, prefix=prefix, target_group_size=2, min_matchmaking_time=30.0, start=True
    )


def test_two_averagers_and_a_tracker_of_one_peer_share_one_runtime(swarm) -> None:
    x, y = fresh("x"), fresh("y")
    first, second = averager(swarm[0], x, 1.0), averager(swarm[0], y, 10.0)
    tracker = ProgressTracker(swarm[0], fresh("progress"), 100, start=False)
    others = [averager(swarm[1], x, 3.0), averager(swarm[1], y, 30.0)]
    try:
        runtime = first.runtime
        assert runtime is not None and runtime is second.runtime is tracker.runtime
        assert runtime.references == 3 and runtime is PeerRuntime.acquire(swarm[0])
        runtime.release()
        assert runtime.loop_thread is second.runtime.loop_thread and runtime.loop_thread.alive
        assert runtime.p2p is second.runtime.p2p and runtime.server is second.runtime.server
        # each component serves on its own scope of the one server, named after its prefix
        assert {f"averager.{x}", f"averager.{y}"} <= set(runtime.server.scopes)
        with pytest.raises(ConfigurationError, match="already served"):
            runtime.server.scope(f"averager.{x}")
        assert others[0].runtime is not runtime  # another DHT is another peer

        # both averagers of one peer average through the one server, each with its own group
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            steps = [pool.submit(a.step, timeout=30) for a in (first, second, *others)]
            for step in steps:
                step.result(timeout=60)
        for one, expected in ((first, 2.0), (second, 20.0)):
            with one.get_tensors() as tensors:
                torch.testing.assert_close(tensors[0], torch.full((10,), expected))
    finally:
        for component in (first, second, tracker, *others):
            component.shutdown()


def test_a_second_averager_with_the_same_prefix_is_refused_and_releases_the_runtime(swarm) -> None:
    prefix = fresh("same")
    first = averager(swarm[0], prefix, 1.0)
    try:
        runtime = first.runtime
        assert runtime is not None
        with pytest.raises(ConfigurationError, match="already served"):
            averager(swarm[0], prefix, 2.0)
        assert runtime.references == 1 and not runtime.closed
    finally:
        first.shutdown()


def test_the_last_release_shuts_everything_down_in_order(swarm) -> None:
    first, second = averager(swarm[0], fresh("a"), 1.0), averager(swarm[0], fresh("b"), 1.0)
    tracker = ProgressTracker(swarm[0], fresh("progress"), 100, start=True)
    runtime = first.runtime
    assert runtime is not None
    server, loop_thread = runtime.server, runtime.loop_thread
    order: list[str] = []

    async def closer(name: str) -> None:
        order.append(f"{name}: scopes {sorted(server.scopes)}")

    runtime.add_closer("first", lambda: closer("first"))
    runtime.add_closer("second", lambda: closer("second"))

    first.shutdown()
    first.shutdown()  # a second shutdown is a no-op
    assert not first.is_alive() and second.is_alive() and runtime.references == 2
    assert f"averager.{first.prefix}" not in server.scopes and f"averager.{second.prefix}" in server.scopes
    tracker.shutdown()
    tracker.shutdown()
    assert loop_thread.alive and order == []
    left_open = server.scope("left-open-by-a-test")  # the server shuts down every scope still open

    second.shutdown()
    assert runtime.closed and runtime.references == 0
    # closers newest first, while the server still serves; then the server, the replica, the loop
    assert order == ["second: scopes ['left-open-by-a-test']", "first: scopes ['left-open-by-a-test']"]
    assert server.scopes == () and left_open.handlers == ()
    assert not loop_thread.alive
    assert all(thread.name != loop_thread.name for thread in threading.enumerate())
    for use in (lambda: runtime.dht_calls, lambda: runtime.p2p, lambda: runtime.server, runtime.release):
        with pytest.raises(ClosedError):
            use()
    with pytest.raises(ClosedError):
        runtime.run(asyncio.sleep(0), timeout=1)

    fresh_runtime = PeerRuntime.acquire(swarm[0])  # the peer's next component starts a new one
    try:
        assert fresh_runtime is not runtime and fresh_runtime.loop_thread.alive
    finally:
        fresh_runtime.release()
    assert not fresh_runtime.loop_thread.alive


def test_a_tracker_alone_starts_no_p2p_replica(swarm) -> None:
    tracker = ProgressTracker(swarm[1], fresh("alone"), 100, start=True)
    try:
        assert not tracker.runtime.network_started
        with pytest.raises(ClosedError, match="not started"):
            _ = tracker.runtime.p2p
    finally:
        tracker.shutdown()


def test_the_dht_helper_stores_and_reads_through_a_real_dht(swarm) -> None:
    async def scenario() -> object:
        calls, key = DHTCalls(swarm[0]), fresh("key")
        assert await calls.store(key, "value", get_dht_time() + 60, subkey="me", timeout=10)
        return await calls.get(key, timeout=10)

    found = asyncio.run(scenario())
    assert found is not None and found.value["me"].value == "value"


@pytest.mark.parametrize("method", ["get", "store", "run_coroutine"])
def test_the_dht_helper_raises_deadline_exceeded_when_the_dht_hangs(swarm, method: str) -> None:
    calls = DHTCalls(FaultyDHT(swarm[0], hang={method}))
    requests = {
        "get": lambda: calls.get("k", timeout=0.3),
        "store": lambda: calls.store("k", 1, get_dht_time() + 10, timeout=0.3),
        "run_coroutine": lambda: calls.run_coroutine(_noop, timeout=0.3),
    }
    started = time.monotonic()
    with pytest.raises(DeadlineExceededError):
        asyncio.run(requests[method]())
    assert time.monotonic() - started < 2.0


def test_the_dht_helper_raises_typed_errors_not_sentinels(swarm) -> None:
    failing, refusing = DHTCalls(FaultyDHT(swarm[0], fail={"get"})), DHTCalls(FaultyDHT(swarm[0], refuse={"store"}))
    with pytest.raises(PeerUnreachableError, match="FaultyDHT fails get"):
        asyncio.run(failing.get("k", timeout=5))
    with pytest.raises(ClosedError, match="not running"):
        asyncio.run(refusing.store("k", 1, get_dht_time() + 10, timeout=5))
    with pytest.raises(ClosedError):
        refusing.store_nowait("k", 1, get_dht_time() + 10)
    with pytest.raises(ClosedError):
        DHTCalls(FaultyDHT(swarm[0], refuse={"run_coroutine"})).run_coroutine_nowait(_get_peer_id_of_node)

    async def past_deadline() -> None:
        await failing.get("k", deadline=asyncio.get_running_loop().time() - 1)

    with pytest.raises(DeadlineExceededError, match="before the call started"):
        asyncio.run(past_deadline())


def test_a_runtime_built_on_a_faulty_dht_hands_its_faults_to_its_components(swarm) -> None:
    faulty = FaultyDHT(swarm[1], hang={"get"})
    runtime = PeerRuntime.acquire(faulty)
    try:
        real = PeerRuntime.acquire(swarm[1])  # runtimes are keyed by the DHT-like object itself
        real.release()
        assert runtime.dht is faulty and runtime is not real
        with pytest.raises(DeadlineExceededError):
            runtime.run(runtime.dht_calls.get("k", timeout=0.3), timeout=5)
        faulty.hang.clear()
        faulty.fail.add("get")
        with pytest.raises(PeerUnreachableError):
            runtime.run(runtime.dht_calls.get("k", timeout=5), timeout=10)
    finally:
        runtime.release()


async def _noop(_dht: object, _node: object) -> None:
    return None


ABANDONED_CALL = """
import asyncio, sys
import hivemind
from hivemind_ext.errors import DeadlineExceededError
from hivemind_ext.p2p import DHTCalls

async def answer_late(dht, node):
    await asyncio.sleep(0.8)
    return 1

async def scenario(calls, how):
    if how == "cancelled":
        call = asyncio.ensure_future(calls.run_coroutine(answer_late, timeout=10))
        await asyncio.sleep(0.2)
        call.cancel()
        try:
            await call
        except asyncio.CancelledError:
            pass
    else:
        try:
            await calls.run_coroutine(answer_late, timeout=0.2)
        except DeadlineExceededError:
            pass
    await asyncio.sleep(1.2)  # the DHT process answers the abandoned call meanwhile
    assert await calls.run_coroutine(answer_late, timeout=10) == 1  # and goes on serving
    print("served", flush=True)

dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
try:
    asyncio.run(scenario(DHTCalls(dht), sys.argv[1]))
finally:
    dht.shutdown()
"""


@pytest.mark.parametrize("how", ["cancelled", "deadline"])
def test_a_dht_call_abandoned_mid_flight_leaves_the_dht_process_quiet(how: str) -> None:
    """Ctrl-C and deadlines abandon DHT calls that the DHT process still works on; when it answers
    later, it must not print a traceback (cancelling hivemind's cross-process future makes the DHT
    process fail to answer it: "InvalidStateError" was printed at every Ctrl-C of `hivemind-ext train`)."""
    done = subprocess.run(
        [sys.executable, "-c", ABANDONED_CALL, how], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0 and "served" in done.stdout, done.stderr
    assert "InvalidStateError" not in done.stderr and "Traceback" not in done.stderr, done.stderr


class RefusesEverything(RecordValidatorBase):
    """A record validator that rejects every record (it is pickled into the DHT's process)."""

    def validate(self, record: DHTRecord) -> bool:
        return False

    def sign_value(self, record: DHTRecord) -> bytes:
        return record.value

    def strip_value(self, record: DHTRecord) -> bytes:
        return record.value


class AnsweringDHT:
    """A DHT-like object whose process answers ``run_coroutine`` at once, or never (``hang``), or
    with an error (``fail``), or whose pipe is gone (``refuse``)."""

    def __init__(self, *, hang: bool = False, fail: bool = False, refuse: bool = False) -> None:
        self.hang, self.fail, self.refuse = hang, fail, refuse
        self.node = SimpleNamespace(peer_id="the peer id", protocol=SimpleNamespace(client_mode=True))
        self.node.get_visible_maddrs = self._maddrs
        self.asked = 0

    @staticmethod
    async def _maddrs(latest: bool = False) -> list[str]:
        return ["/ip4/10.0.0.1/tcp/1", f"latest={latest}"]

    def run_coroutine(self, coro, return_future: bool = False):
        assert return_future, "a blocking call without a deadline"
        self.asked += 1
        if self.refuse:
            raise BrokenPipeError("the DHT process is gone")
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self.fail:
            future.set_exception(KeyError("inside the DHT process"))
        elif not self.hang:
            future.set_result(asyncio.run(coro(self, self.node)))
        return future


@pytest.mark.timeout(30)
def test_the_dht_s_own_questions_have_a_deadline_and_typed_errors() -> None:
    """``dht.peer_id``, ``dht.client_mode`` (the first time) and ``dht.get_visible_maddrs()`` wait for ever on
    a hung DHT process; ours give up after their timeout (30 s by default) with a typed error."""
    assert dht_peer_id(AnsweringDHT()) == "the peer id"
    assert dht_client_mode(AnsweringDHT()) is True
    assert visible_maddrs(AnsweringDHT(), latest=True) == ["/ip4/10.0.0.1/tcp/1", "latest=True"]
    for ask, what in ((dht_peer_id, "peer id"), (dht_client_mode, "client mode"), (visible_maddrs, "visible")):
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError, match=rf"DHT {what}.*no answer within 0\.2 s"):
            ask(AnsweringDHT(hang=True), timeout=0.2)
        assert time.monotonic() - started < 2.0
        with pytest.raises(PeerUnreachableError, match=f"DHT {what}.* failed: KeyError"):
            ask(AnsweringDHT(fail=True), timeout=5)
        with pytest.raises(ClosedError, match="not running"):
            ask(AnsweringDHT(refuse=True), timeout=5)
        with pytest.raises(ConfigurationError, match="timeout"):
            ask(AnsweringDHT(), timeout=float("inf"))
    assert DEFAULT_DHT_TIMEOUT == 30.0  # what a call without a timeout waits
    assert dht_client_mode(SimpleNamespace(client_mode=False)) is False  # a test double: read as it is


@pytest.mark.timeout(30)
def test_a_dht_that_never_answers_or_never_starts_gives_up_at_its_deadline() -> None:
    """A real ``hivemind.DHT`` whose process never runs: nobody reads its pipe, as with a hung process."""
    dht = hivemind.DHT(start=False)
    started = time.monotonic()
    with pytest.raises(DeadlineExceededError, match=r"DHT peer id: no answer within 0\.2 s"):
        dht_peer_id(dht, timeout=0.2)
    assert time.monotonic() - started < 2.0

    class AnswersOnce(hivemind.DHT):  # a DHT process that answers the first question, then hangs
        asked = 0

        def run_coroutine(self, coro, return_future: bool = False):
            AnswersOnce.asked += 1
            future: concurrent.futures.Future = concurrent.futures.Future()
            if AnswersOnce.asked == 1:
                node = SimpleNamespace(peer_id="known", protocol=SimpleNamespace(client_mode=False))
                future.set_result(asyncio.run(coro(self, node)))
            return future if return_future else future.result()

    once = AnswersOnce(start=False)
    assert dht_peer_id(once, timeout=0.2) == "known"
    # kept where hivemind keeps it: its own property and later calls no longer ask the process
    assert once.peer_id == "known" and dht_peer_id(once, timeout=0.2) == "known" and AnswersOnce.asked == 1

    class NeverReady:  # a daemon or bootstrap that hangs: DHT(start=True) waited for ever
        def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
            assert not await_ready

        def wait_until_ready(self, timeout: float | None = None) -> None:
            assert timeout is not None, "waited without a deadline"
            time.sleep(timeout)
            raise concurrent.futures.TimeoutError

    with pytest.raises(DeadlineExceededError, match=r"the DHT did not start within 0\.2 s"):
        start_dht(NeverReady(), timeout=0.2)


@pytest.mark.timeout(120)
def test_the_dht_s_own_questions_answer_as_hivemind_does() -> None:
    fresh = new_peer()  # asked nothing yet: hivemind has not cached its answers
    try:
        assert dht_peer_id(fresh, timeout=10) == fresh.peer_id
        assert dht_client_mode(fresh, timeout=10) == fresh.client_mode is False
        assert visible_maddrs(fresh, timeout=10) == fresh.get_visible_maddrs()
    finally:
        fresh.shutdown()


def test_adding_validators_has_a_deadline_and_works_on_a_live_dht(swarm) -> None:
    """hivemind's ``dht.add_validators`` waits for ever on a hung or dead DHT process (an Optimizer's
    constructor hung so in a test run); ours gives up after its timeout with a typed error."""
    started = time.monotonic()
    with pytest.raises(DeadlineExceededError, match=r"add validators: no answer within 0\.3 s"):
        add_validators(FaultyDHT(swarm[0], hang={"run_coroutine"}), [RSASignatureValidator()], timeout=0.3)
    assert time.monotonic() - started < 2.0
    with pytest.raises(PeerUnreachableError, match="add validators failed"):
        add_validators(FaultyDHT(swarm[0], fail={"run_coroutine"}), [RSASignatureValidator()], timeout=5)

    lone = new_peer()  # its own DHT: the validator must not change the module's swarm
    try:
        assert within("a store", lone.store, "before", 1, get_dht_time() + 60)
        add_validators(lone, [RefusesEverything()], timeout=10)
        assert not within("a store", lone.store, "after", 1, get_dht_time() + 60)
    finally:
        lone.shutdown()


async def _get_peer_id_of_node(_dht: object, node: hivemind.dht.DHTNode) -> object:
    return node.peer_id
