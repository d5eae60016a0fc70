"""One runtime per peer: the event loop, P2P replica, RPC server and DHT calls its components share.

A peer (one ``hivemind.DHT`` object) runs several networked components: the averagers of an
Optimizer (gradients, state), its progress tracker, matchmaking, state donors, the neighbours of
decentralized SGD. Each of them calls ``PeerRuntime.acquire(dht)`` and gets the same
:class:`PeerRuntime`, which owns, once for the peer:

- one event-loop thread (:class:`~hivemind_ext.p2p.loop_thread.LoopThread`) that runs all their networking;
- one P2P replica of the DHT's libp2p daemon (:func:`replicate_dht_daemon`), made on first use
  (:meth:`PeerRuntime.start_network`), so a component that only reads the DHT starts no replica;
- one root :class:`~hivemind_ext.p2p.server.RPCServer`; a component registers its handlers on a
  scope of it (``runtime.server.scope(namespace)``), and two scopes with one namespace are refused,
  so the handlers of several averagers on one peer cannot collide (averagers use their prefix);
- one :class:`~hivemind_ext.p2p.dht_calls.DHTCalls`: every DHT call with a deadline and typed errors.

Lifecycle: every ``acquire`` is matched by one :meth:`PeerRuntime.release`, which a component calls
at the end of its own ``shutdown()`` after stopping what it started. The last release stops, in
order, the closers registered with :meth:`PeerRuntime.add_closer` (newest first), then the RPC
server (every scope still open), the P2P replica and the loop thread. A runtime used after its
last release raises :class:`~hivemind_ext.errors.ClosedError`; the next ``acquire`` for the same
DHT starts a fresh one. Nothing relies on ``__del__``.

Test seam: ``acquire`` accepts any DHT-like object (see :class:`~hivemind_ext.p2p.dht_calls.DHTLike`);
runtimes are keyed by the object's identity, so a component built on a faulty wrapper of a real
DHT gets a runtime whose DHT calls go through that wrapper.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from hivemind.p2p import P2P

from hivemind_ext.errors import ClosedError, HivemindExtError
from hivemind_ext.p2p.deadlines import now, wait_until
from hivemind_ext.p2p.dht_calls import DHTCalls
from hivemind_ext.p2p.loop_thread import LoopThread
from hivemind_ext.p2p.server import RPCServer

logger = logging.getLogger(__name__)
T = TypeVar("T")

ROOT_NAMESPACE = "peer"  # the root server's own namespace; components register on scopes of it
START_TIMEOUT = 60.0  # starting the P2P replica is a round trip to the DHT process and its daemon
STOP_TIMEOUT = 10.0  # each stage of the final shutdown (closers, server, replica) gets this long


async def replicate_dht_daemon(dht: Any) -> P2P:
    """A P2P replica of ``dht``'s libp2p daemon owned by the calling event loop (``dht.replicate_p2p()``
    caches one per process, whose listener dies with the loop that first registered a handler on it)."""
    return await P2P.replicate(await dht.run_coroutine(_daemon_listen_maddr, return_future=True))


async def _daemon_listen_maddr(_dht: Any, node: Any) -> Any:
    """Runs inside the DHT's process: the address its libp2p daemon listens on for clients."""
    return node.p2p.daemon_listen_maddr


class PeerRuntime:
    """The shared runtime of one peer; obtain it with :meth:`acquire`, give it back with :meth:`release`."""

    _registry: dict[int, PeerRuntime] = {}  # id(dht) -> its live runtime
    _registry_lock = threading.Lock()

    def __init__(self, dht: Any, *, name: str | None = None) -> None:
        """Use :meth:`acquire`: a runtime made directly is not shared with the peer's other components."""
        self._dht = dht
        self._dht_calls = DHTCalls(dht)
        self._references = 0
        self._closed = False
        self._lock = threading.Lock()  # guards the reference count and the closed flag
        self._loop_thread = LoopThread(name or f"peer-runtime[{id(dht):x}]")
        self._network_lock: asyncio.Lock | None = None  # made on the loop, in start_network
        self._p2p: P2P | None = None
        self._server: RPCServer | None = None
        self._closers: list[tuple[str, Callable[[], Awaitable[None]]]] = []

    @classmethod
    def acquire(cls, dht: Any) -> PeerRuntime:
        """The runtime of ``dht``'s peer, started if this is its first user; pair with :meth:`release`."""
        with cls._registry_lock:
            runtime = cls._registry.get(id(dht))
            if runtime is None or runtime._dht is not dht:
                runtime = cls._registry[id(dht)] = cls(dht)
            with runtime._lock:
                runtime._references += 1
            return runtime

    def release(self) -> None:
        """Gives one reference back; the last one shuts the runtime down (see the module docstring).

        :raises ClosedError: every reference was released already
        """
        with self._registry_lock:
            with self._lock:
                if self._closed:
                    raise ClosedError("this peer runtime was released already")
                self._references -= 1
                if self._references > 0:
                    return
                self._closed = True
            if self._registry.get(id(self._dht)) is self:
                del self._registry[id(self._dht)]
        self._shutdown()

    # ----- what components use

    @property
    def dht(self) -> Any:
        """The DHT (or DHT-like object) this runtime serves."""
        return self._dht

    @property
    def dht_calls(self) -> DHTCalls:
        """The peer's one way to call the DHT with a deadline (raises typed errors)."""
        self._check_open()
        return self._dht_calls

    @property
    def loop_thread(self) -> LoopThread:
        """The peer's event-loop thread (``loop_thread.alive`` is False once the runtime is closed)."""
        return self._loop_thread

    @property
    def references(self) -> int:
        """How many acquisitions are not released yet."""
        return self._references

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def p2p(self) -> P2P:
        """The P2P replica of the DHT's daemon; :meth:`start_network` must have run."""
        self._check_open()
        if self._p2p is None:
            raise ClosedError("the peer runtime's network is not started: await start_network() first")
        return self._p2p

    @property
    def server(self) -> RPCServer:
        """The root RPC server on :attr:`p2p`; components register handlers on ``server.scope(namespace)``."""
        self._check_open()
        if self._server is None:
            raise ClosedError("the peer runtime's network is not started: await start_network() first")
        return self._server

    @property
    def network_started(self) -> bool:
        return self._p2p is not None

    async def start_network(self) -> P2P:
        """Starts the P2P replica and the root RPC server on first call (run on :attr:`loop_thread`)."""
        self._check_open()
        if self._network_lock is None:
            self._network_lock = asyncio.Lock()
        async with self._network_lock:
            if self._p2p is None:
                p2p = await wait_until(
                    replicate_dht_daemon(self._dht), now() + START_TIMEOUT, "replicating the DHT's daemon"
                )
                self._server = RPCServer(p2p, ROOT_NAMESPACE)
                self._p2p = p2p
        return self._p2p

    def add_closer(self, name: str, close: Callable[[], Awaitable[None]]) -> None:
        """Registers ``close()`` (a coroutine function, run on the loop) to run at the last release,
        before the RPC server stops; closers run newest first."""
        self._check_open()
        self._closers.append((name, close))

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedules ``coro`` on the loop thread; see :meth:`LoopThread.submit`."""
        if self._closed:
            coro.close()
            raise ClosedError("this peer runtime was released")
        return self._loop_thread.submit(coro)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Runs ``coro`` on the loop thread and waits for it (from another thread), at most ``timeout`` s."""
        if self._closed:
            coro.close()
            raise ClosedError("this peer runtime was released")
        return self._loop_thread.run(coro, timeout)

    # ----- shutdown

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this peer runtime was released")

    def _shutdown(self) -> None:
        """Closers, then the RPC server, the P2P replica and the loop thread, each bounded in time."""
        if self._loop_thread.alive and not self._loop_thread.in_loop_thread():
            try:
                self._loop_thread.run(self._stop_network(), timeout=3 * STOP_TIMEOUT + 1)
            except (HivemindExtError, TimeoutError) as e:
                logger.debug(f"the peer runtime did not stop cleanly: {e!r}")
        self._loop_thread.stop(timeout=STOP_TIMEOUT)

    async def _stop_network(self) -> None:
        stages: list[tuple[str, Callable[[], Awaitable[Any]]]] = list(reversed(self._closers))
        self._closers.clear()
        server, p2p = self._server, self._p2p
        if server is not None:
            stages.append(("the RPC server", lambda: server.shutdown(timeout=STOP_TIMEOUT)))
        if p2p is not None:
            stages.append(("the P2P replica", p2p.shutdown))
        for name, stop in stages:
            try:
                await wait_until(stop(), now() + STOP_TIMEOUT, f"stopping {name}")
            except (HivemindExtError, OSError) as e:  # OSError: the daemon is gone already
                logger.debug(f"error while stopping {name}: {e!r}")


__all__ = ["PeerRuntime", "replicate_dht_daemon"]
