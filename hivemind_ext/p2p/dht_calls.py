"""Calling hivemind's DHT with a deadline: one helper, one set of typed errors, no sentinels.

hivemind's ``DHT`` runs in its own process; ``get``, ``store`` and ``run_coroutine`` hand a request
over a pipe and return a future that resolves when the DHT process answers, or never, if that
process hangs. :class:`DHTCalls` awaits such a future for at most a deadline (on the event loop's
clock, see :mod:`~hivemind_ext.p2p.deadlines`) and turns every way it can fail into one of three
errors, so that each caller decides, in one ``except``, what a failed call means to it:

- :class:`~hivemind_ext.errors.DeadlineExceededError`: no answer before the deadline;
- :class:`~hivemind_ext.errors.PeerUnreachableError`: the DHT took the request and failed it;
- :class:`~hivemind_ext.errors.ClosedError`: the DHT refused the request (its process is gone).

hivemind's blocking calls that a constructor or a command makes from its own thread (``dht.peer_id``
and ``dht.client_mode`` the first time, ``get_visible_maddrs``, ``add_validators``, and
``DHT(start=True)``, which waits until the DHT is ready) have no deadline either; :func:`dht_peer_id`,
:func:`dht_client_mode`, :func:`visible_maddrs`, :func:`add_validators` and :func:`start_dht` make
the same calls with one (:data:`DEFAULT_DHT_TIMEOUT`, 30 s; 60 s to start) and the same errors.

Test seam: ``DHTCalls`` (and :class:`~hivemind_ext.p2p.runtime.PeerRuntime`, which holds one)
talks to any object with the methods of :class:`DHTLike`, not only a ``hivemind.DHT``. A test
injects faults by wrapping a real DHT (delegating what it does not break) and passing the wrapper
wherever a component takes ``dht=``: a wrapper whose ``get`` returns a future that never resolves
is a hung DHT process. ``tests/faulty_dht.py`` holds such a wrapper.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from typing import Any, Protocol, TypeVar

import hivemind
from hivemind.utils.mpfuture import MPFuture

from hivemind_ext.errors import ClosedError, ConfigurationError, DeadlineExceededError, PeerUnreachableError
from hivemind_ext.p2p.deadlines import remaining, resolve_deadline, wait_until

T = TypeVar("T")

DEFAULT_DHT_TIMEOUT = 30.0  # applies to a call that passes neither timeout nor deadline
DEFAULT_DHT_START_TIMEOUT = 60.0  # starting a DHT: its daemon, then a bootstrap through the initial peers
# What handing a request to a DHT whose process is gone raises (a broken or closed pipe).
_REFUSED = (OSError, EOFError, ValueError, RuntimeError)


class DHTLike(Protocol):
    """What :class:`DHTCalls` uses of a ``hivemind.DHT``; each call returns a future (hivemind's
    ``MPFuture``, or any ``concurrent.futures.Future``) when ``return_future=True``."""

    def get(self, key: Any, latest: bool = ..., return_future: bool = ...) -> Any: ...

    def store(
        self, key: Any, value: Any, expiration_time: float, subkey: Any = ..., return_future: bool = ...
    ) -> Any: ...

    def run_coroutine(self, coro: Any, return_future: bool = ...) -> Any: ...


class DHTCalls:
    """Deadline-bound calls into ``dht``, each raising a typed error instead of returning a sentinel.

    Stateless apart from the DHT it wraps, so it can be awaited from any event loop; one
    :class:`~hivemind_ext.p2p.runtime.PeerRuntime` holds the one instance its components share.

    Every call takes an optional relative ``timeout`` (seconds) and an optional absolute
    ``deadline`` (loop clock); the earlier wins, and ``default_timeout`` applies if neither is given.
    """

    def __init__(self, dht: DHTLike | Any, *, default_timeout: float = DEFAULT_DHT_TIMEOUT) -> None:
        self.dht, self.default_timeout = dht, default_timeout

    def is_alive(self) -> bool:
        """Whether the DHT's process runs (a DHT-like object without ``is_alive`` counts as running):
        a request to a dead one would wait out its whole deadline."""
        is_alive = getattr(self.dht, "is_alive", None)
        return True if is_alive is None else bool(is_alive())

    async def get(
        self, key: Any, *, latest: bool = True, timeout: float | None = None, deadline: float | None = None
    ) -> Any:
        """``dht.get(key, latest)``: a ``ValueWithExpiration`` (for a dictionary key, its value maps
        subkeys to ``ValueWithExpiration``), or None if nothing is stored under ``key``."""
        return await self._call(
            lambda: self.dht.get(key, latest=latest, return_future=True), timeout, deadline, f"get {key!r}"
        )

    async def store(
        self,
        key: Any,
        value: Any,
        expiration_time: float,
        *,
        subkey: Any = None,
        timeout: float | None = None,
        deadline: float | None = None,
    ) -> bool:
        """``dht.store(...)``: whether the DHT accepted the record (False: every node refused it)."""
        stored = await self._call(
            lambda: self.dht.store(key, value, expiration_time, subkey=subkey, return_future=True),
            timeout,
            deadline,
            f"store {key!r}",
        )
        return bool(stored)

    async def run_coroutine(
        self, coro: Callable[..., Awaitable[T]], *, timeout: float | None = None, deadline: float | None = None
    ) -> T:
        """``dht.run_coroutine(coro)``: runs ``coro(dht, node)`` inside the DHT process, returns its result."""
        name = getattr(coro, "__name__", None) or getattr(getattr(coro, "func", None), "__name__", "a coroutine")
        return await self._call(lambda: self.dht.run_coroutine(coro, return_future=True), timeout, deadline, name)

    def run_coroutine_nowait(self, coro: Callable[..., Awaitable[Any]]) -> None:
        """Hands ``coro(dht, node)`` to the DHT process and does not wait for it (best-effort writes
        that nobody waits for). Raises :class:`ClosedError` if the DHT refused it."""
        name = getattr(coro, "__name__", None) or getattr(getattr(coro, "func", None), "__name__", "a coroutine")
        self._send(lambda: self.dht.run_coroutine(coro, return_future=True), name)

    def store_nowait(self, key: Any, value: Any, expiration_time: float, *, subkey: Any = None) -> None:
        """Hands a store to the DHT and does not wait for its answer (best-effort withdrawals at
        shutdown, where nobody is left to wait). Raises :class:`ClosedError` if the DHT refused it."""
        self._send(
            lambda: self.dht.store(key, value, expiration_time, subkey=subkey, return_future=True), f"store {key!r}"
        )

    async def _call(self, request: Callable[[], Any], timeout: float | None, deadline: float | None, what: str) -> Any:
        resolved = resolve_deadline(timeout, deadline, self.default_timeout)
        if remaining(resolved) <= 0:  # don't start a request that can only time out
            raise DeadlineExceededError(f"DHT {what}: deadline passed before the call started")
        future = _awaitable(self._send(request, what))
        try:
            return await wait_until(future, resolved, f"DHT {what}")
        except DeadlineExceededError:
            _cancel(future)
            raise
        except asyncio.CancelledError:
            _cancel(future)
            raise
        except Exception as e:  # the DHT process reports its failures as exceptions of any type
            raise PeerUnreachableError(f"DHT {what} failed: {type(e).__name__}: {e}") from e

    @staticmethod
    def _send(request: Callable[[], T], what: str) -> T:
        """Hands a request to the DHT process; the pipe to it fails only once the DHT is shut down."""
        try:
            return request()
        except _REFUSED as e:
            raise ClosedError(f"DHT {what}: the DHT is not running ({type(e).__name__}: {e})") from e


def add_validators(dht: DHTLike | Any, validators: Iterable[Any], *, timeout: float = DEFAULT_DHT_TIMEOUT) -> None:
    """``dht.add_validators(validators)``, from any thread, with a deadline: hivemind's own call waits for
    ever on a DHT process that died or hangs (an Optimizer's constructor then never returned).
    Raises :class:`DeadlineExceededError` after ``timeout`` seconds without an answer,
    :class:`ClosedError` if the DHT refused the request, :class:`PeerUnreachableError` if it failed it."""
    _blocking(dht, partial(_extend_validators, validators=list(validators)), "add validators", timeout)


def dht_peer_id(dht: DHTLike | Any, *, timeout: float | None = None) -> Any:
    """``dht.peer_id``, from any thread, with a deadline. hivemind's property asks the DHT process the
    first time (a round trip without a timeout: it waits for ever on a hung process) and keeps the
    answer; this asks the same question with a deadline and leaves the answer where the property
    finds it, so that later reads of ``dht.peer_id`` return at once. ``timeout``: seconds (None:
    :data:`DEFAULT_DHT_TIMEOUT`). Errors as :func:`add_validators`; a DHT-like object without
    ``run_coroutine`` (a test double) is read as it is."""
    return _cached(dht, "_peer_id", "peer_id", _get_peer_id, "peer id", timeout)


def dht_client_mode(dht: DHTLike | Any, *, timeout: float | None = None) -> bool:
    """``dht.client_mode``, from any thread, with a deadline (see :func:`dht_peer_id`)."""
    return bool(_cached(dht, "_client_mode", "client_mode", _get_client_mode, "client mode", timeout))


def visible_maddrs(dht: DHTLike | Any, *, latest: bool = False, timeout: float | None = None) -> list[Any]:
    """``dht.get_visible_maddrs(latest)``, from any thread, with a deadline (hivemind's call has none;
    ``latest`` asks the daemon to refresh them; ``timeout`` as :func:`dht_peer_id`). Errors as
    :func:`add_validators`."""
    return list(_blocking(dht, partial(_get_visible_maddrs, latest=latest), "visible multiaddrs", timeout))


def start_dht(dht: Any, *, timeout: float = DEFAULT_DHT_START_TIMEOUT) -> None:
    """Starts a ``hivemind.DHT`` built with ``start=False`` and waits until it is ready, for at most
    ``timeout`` seconds: ``hivemind.DHT(start=True)`` waits for ever on a daemon or bootstrap that
    hangs. :class:`DeadlineExceededError` if it is not ready in time (the process keeps running: the
    caller shuts the DHT down); a failure to start is raised as hivemind raises it."""
    check_timeout(timeout)
    dht.run_in_background(await_ready=False)
    try:
        dht.wait_until_ready(timeout)
    except concurrent.futures.TimeoutError:
        raise DeadlineExceededError(
            f"the DHT did not start within {timeout:g} s (are the initial peers reachable? see its log)"
        ) from None


def check_timeout(timeout: Any) -> float:
    """``timeout`` if it is a positive finite number of seconds; :class:`ConfigurationError` otherwise."""
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not 0 < timeout < math.inf:
        raise ConfigurationError(f"timeout must be a positive finite number of seconds, got {timeout!r}")
    return float(timeout)


def _cached(
    dht: Any, attribute: str, public: str, coro: Callable[..., Awaitable[T]], what: str, timeout: float | None
) -> T:
    """hivemind's cached answer in ``dht.<attribute>`` if it has one, else the DHT process's answer
    (then cached there too, where the DHT keeps it: a ``hivemind.DHT``, not a DHT-like wrapper)."""
    cached = getattr(dht, attribute, None)
    if cached is not None:
        return cached
    if not hasattr(dht, "run_coroutine"):
        return getattr(dht, public)
    answer = _blocking(dht, coro, what, timeout)
    if isinstance(dht, hivemind.DHT):
        setattr(dht, attribute, answer)
    return answer


def _blocking(dht: Any, coro: Callable[..., Awaitable[T]], what: str, timeout: float | None) -> T:
    """Runs ``coro(dht, node)`` in the DHT process and waits for its answer for at most ``timeout``
    seconds (None: :data:`DEFAULT_DHT_TIMEOUT`), from any thread (not from the DHT process itself)."""
    timeout = check_timeout(DEFAULT_DHT_TIMEOUT if timeout is None else timeout)
    future = DHTCalls._send(lambda: dht.run_coroutine(coro, return_future=True), what)
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        _cancel(future)
        raise DeadlineExceededError(
            f"DHT {what}: no answer within {timeout:g} s (is the DHT's process alive? see its log)"
        ) from None
    except Exception as e:  # the DHT process reports its failures as exceptions of any type
        raise PeerUnreachableError(f"DHT {what} failed: {type(e).__name__}: {e}") from e


async def _extend_validators(_dht: Any, node: Any, validators: list[Any]) -> None:
    """Runs inside the DHT process (what ``hivemind.DHT.add_validators`` runs there)."""
    node.protocol.record_validator.extend(validators)


async def _get_peer_id(_dht: Any, node: Any) -> Any:
    """Runs inside the DHT process (what ``hivemind.DHT.peer_id`` runs there)."""
    return node.peer_id


async def _get_client_mode(_dht: Any, node: Any) -> bool:
    """Runs inside the DHT process (what ``hivemind.DHT.client_mode`` runs there)."""
    return node.protocol.client_mode


async def _get_visible_maddrs(_dht: Any, node: Any, latest: bool = False) -> list[Any]:
    """Runs inside the DHT process (what ``hivemind.DHT.get_visible_maddrs`` runs there)."""
    return await node.get_visible_maddrs(latest=latest)


def _awaitable(future: Any) -> Awaitable[Any]:
    """hivemind's MPFuture is awaitable; a plain ``concurrent.futures.Future`` (from a DHT-like
    test wrapper) is wrapped for the running loop."""
    if isinstance(future, concurrent.futures.Future) and not hasattr(future, "__await__"):
        return asyncio.wrap_future(future)
    return future


def _cancel(future: Any) -> None:
    """Drops interest in an abandoned request. hivemind's cross-process future is left alone: its
    state is shared with the DHT process, which cannot answer a future cancelled from here and
    prints a traceback instead ("InvalidStateError", at every Ctrl-C); its answer, when it comes,
    is simply never read. A plain future (a test wrapper's) is cancelled."""
    if isinstance(future, MPFuture):
        return
    cancel = getattr(future, "cancel", None)
    if cancel is not None:
        cancel()


__all__ = [
    "DEFAULT_DHT_START_TIMEOUT",
    "DEFAULT_DHT_TIMEOUT",
    "DHTCalls",
    "DHTLike",
    "add_validators",
    "check_timeout",
    "dht_client_mode",
    "dht_peer_id",
    "start_dht",
    "visible_maddrs",
]
