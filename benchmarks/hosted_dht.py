"""Many lightweight DHT peers in one Python process, for benchmarks with dozens of real peers.

A ``hivemind.DHT`` is a process of its own (a full Python interpreter with torch) that runs one
``DHTNode``, plus the node's libp2p daemon (``p2pd``). On a 2-core machine 16 of them overloaded
it. :class:`HostedDHT` runs hivemind's own ``DHTNode`` (the same Kademlia code, with its own libp2p
daemon and its own key) on an event loop that it shares with the other nodes hosted by the same
process (:class:`DHTHost`), and answers ``get`` / ``store`` / ``run_coroutine`` there instead of
across a pipe. It has the methods of ``hivemind_ext.p2p.dht_calls.DHTLike`` and what an averager
reads of a DHT (``peer_id``, ``client_mode``, ``kwargs``, ``add_validators``), so a
``hivemind_ext`` averager takes it in place of a ``hivemind.DHT``. A peer is then: its DHT node
(shared loop), its libp2p daemon, and the averager's own event-loop thread.

hivemind's averager cannot use it: ``hivemind.averaging.DecentralizedAverager`` is a forked process
that reaches its DHT across a pipe, so hivemind peers keep a real ``hivemind.DHT``
(:class:`CountingDHT` counts what such a peer asks of it).

Both count the requests a peer makes of its DHT and the bytes of the records those requests
return (:class:`DHTCounters`, in shared memory so that a forked averager's requests are counted).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing as mp
import time
from collections.abc import Callable, Sequence
from typing import Any

import hivemind
from hivemind.dht import DHTNode
from hivemind.dht.validation import CompositeValidator
from hivemind.utils import MSGPackSerializer
from hivemind.utils.timed_storage import ValueWithExpiration

from hivemind_ext.p2p.loop_thread import LoopThread

CREATE_TIMEOUT = 120.0  # a node's bootstrap on a loaded machine (hivemind's own wait has no limit)


class DHTCounters:
    """Requests a peer made of its DHT and bytes of records they returned, shared across processes."""

    def __init__(self) -> None:
        self._values = mp.get_context("fork").Array("q", 2, lock=True)

    def add(self, requests: int, num_bytes: int) -> None:
        with self._values.get_lock():
            self._values[0] += requests
            self._values[1] += num_bytes

    def snapshot(self) -> tuple[int, int]:
        with self._values.get_lock():
            return self._values[0], self._values[1]


def record_bytes(result: Any) -> int:
    """The msgpack size of what a DHT request returned (records with their expiration times): the
    same measure for both libraries' reads, whatever container hivemind returns them in."""
    return len(MSGPackSerializer.dumps(_plain(result)))


def _plain(value: Any) -> Any:
    if isinstance(value, ValueWithExpiration):
        return [_plain(value.value), value.expiration_time]
    if isinstance(value, dict):
        return {_plain_key(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    try:
        MSGPackSerializer.dumps(value)
        return value
    except Exception:  # an object msgpack cannot encode: count its text form
        return str(value)


def _plain_key(key: Any) -> Any:
    return key if isinstance(key, (str, bytes, int)) else str(key)


def _counted(future: Any, counters: DHTCounters) -> Any:
    """Counts one request now and its result's bytes when it arrives."""
    counters.add(1, 0)

    def on_done(done: Any) -> None:
        if not done.cancelled() and done.exception() is None:
            counters.add(0, record_bytes(done.result()))

    future.add_done_callback(on_done)
    return future


class AwaitableFuture(concurrent.futures.Future):
    """A thread-safe future that an event loop can also await, as hivemind's ``MPFuture`` can
    (callers of ``dht.run_coroutine(..., return_future=True)`` await it)."""

    def __await__(self) -> Any:
        return asyncio.wrap_future(self).__await__()


def _awaitable(inner: concurrent.futures.Future) -> AwaitableFuture:
    outer = AwaitableFuture()

    def copy(done: concurrent.futures.Future) -> None:
        if done.cancelled():
            outer.cancel()
        elif done.exception() is not None:
            outer.set_exception(done.exception())
        else:
            outer.set_result(done.result())

    inner.add_done_callback(copy)
    outer.add_done_callback(lambda done: inner.cancel() if done.cancelled() else None)
    return outer


class DHTHost:
    """One event loop thread that runs the DHT nodes of every :class:`HostedDHT` of this process."""

    def __init__(self, name: str = "dht-host") -> None:
        self.loop_thread = LoopThread(name)

    def close(self) -> None:
        self.loop_thread.stop()


class HostedDHT:
    """A hivemind ``DHTNode`` with its own libp2p daemon, run on a :class:`DHTHost`'s loop; a
    DHT-like object for ``hivemind_ext`` components (see the module docstring)."""

    def __init__(
        self,
        host: DHTHost,
        initial_peers: Sequence[str] = (),
        *,
        counters: DHTCounters | None = None,
        **kwargs: Any,
    ) -> None:
        self.host, self.kwargs = host, dict(kwargs)
        self.counters = counters if counters is not None else DHTCounters()
        self.node: DHTNode = host.loop_thread.run(
            DHTNode.create(initial_peers=list(initial_peers), record_validator=CompositeValidator(), **kwargs),
            timeout=CREATE_TIMEOUT,
        )
        self._alive = True

    # ----- what DHTLike components call

    def get(self, key: Any, latest: bool = False, return_future: bool = False, **kwargs: Any) -> Any:
        return self._request(lambda: self.node.get(key, latest=latest, **kwargs), return_future)

    def store(
        self,
        key: Any,
        value: Any,
        expiration_time: float,
        subkey: Any = None,
        return_future: bool = False,
        **kwargs: Any,
    ) -> Any:
        return self._request(
            lambda: self.node.store(key, value, expiration_time, subkey=subkey, **kwargs), return_future
        )

    def run_coroutine(self, coro: Callable[..., Any], return_future: bool = False) -> Any:
        return self._request(lambda: coro(self, self.node), return_future)

    def _request(self, make: Callable[[], Any], return_future: bool) -> Any:
        if not self._alive:
            raise BrokenPipeError("this hosted DHT node is shut down")  # what a dead DHT process's pipe raises
        future = _counted(_awaitable(self.host.loop_thread.submit(make())), self.counters)
        return future if return_future else future.result()

    # ----- what an averager reads of its DHT

    @property
    def peer_id(self) -> Any:
        return self.node.peer_id

    @property
    def client_mode(self) -> bool:
        return bool(self.node.protocol.client_mode)

    def is_alive(self) -> bool:
        return self._alive

    def add_validators(self, validators: Any) -> None:
        async def extend() -> None:
            self.node.protocol.record_validator.extend(validators)

        self.host.loop_thread.run(extend(), timeout=30.0)

    def get_visible_maddrs(self) -> list[Any]:
        return self.host.loop_thread.run(self.node.get_visible_maddrs(), timeout=30.0)

    def shutdown(self) -> None:
        if self._alive:
            self._alive = False
            try:
                self.host.loop_thread.run(self.node.shutdown(), timeout=30.0)
            except Exception:  # a daemon that is gone already: nothing left to stop
                pass


class CountingDHT(hivemind.DHT):
    """A ``hivemind.DHT`` (its own process and daemon) that counts the requests made through it,
    from any process (hivemind's averager calls it from its own forked process)."""

    def __init__(self, *args: Any, counters: DHTCounters, **kwargs: Any) -> None:
        self.counters = counters
        super().__init__(*args, **kwargs)

    def get(self, key: Any, latest: bool = False, return_future: bool = False, **kwargs: Any) -> Any:
        future = _counted(super().get(key, latest=latest, return_future=True, **kwargs), self.counters)
        return future if return_future else future.result()

    def store(self, *args: Any, return_future: bool = False, **kwargs: Any) -> Any:
        future = _counted(super().store(*args, return_future=True, **kwargs), self.counters)
        return future if return_future else future.result()

    def run_coroutine(self, coro: Callable[..., Any], return_future: bool = False) -> Any:
        # our matchmaking's reads and stores (scale.py --our-dht process); hivemind's averager calls get / store
        future = _counted(super().run_coroutine(coro, return_future=True), self.counters)
        return future if return_future else future.result()


def wait_created(make: Callable[[], Any], attempts: int = 3) -> Any:
    """``make()``, retried: on a loaded machine a bootstrap ping times out now and then."""
    for attempt in range(attempts):
        try:
            return make()
        except (RuntimeError, concurrent.futures.TimeoutError, asyncio.TimeoutError):
            if attempt == attempts - 1:
                raise
            time.sleep(1.0)
    raise AssertionError("unreachable")
