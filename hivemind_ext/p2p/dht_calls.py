"""Calling hivemind's DHT with a deadline: one helper, one set of typed errors, no sentinels.

hivemind's ``DHT`` runs in its own process; ``get``, ``store`` and ``run_coroutine`` hand a request
over a pipe and return a future that resolves when the DHT process answers, or never, if that
process hangs. :class:`DHTCalls` awaits such a future for at most a deadline (on the event loop's
clock, see :mod:`~hivemind_ext.p2p.deadlines`) and turns every way it can fail into one of three
errors, so that each caller decides, in one ``except``, what a failed call means to it:

- :class:`~hivemind_ext.errors.DeadlineExceededError`: no answer before the deadline;
- :class:`~hivemind_ext.errors.PeerUnreachableError`: the DHT took the request and failed it;
- :class:`~hivemind_ext.errors.ClosedError`: the DHT refused the request (its process is gone).

Test seam: ``DHTCalls`` (and :class:`~hivemind_ext.p2p.runtime.PeerRuntime`, which holds one)
talks to any object with the methods of :class:`DHTLike`, not only a ``hivemind.DHT``. A test
injects faults by wrapping a real DHT (delegating what it does not break) and passing the wrapper
wherever a component takes ``dht=``: a wrapper whose ``get`` returns a future that never resolves
is a hung DHT process. ``tests/faulty_dht.py`` holds such a wrapper.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from typing import Any, Protocol, TypeVar

from hivemind.utils.mpfuture import MPFuture

from hivemind_ext.errors import ClosedError, DeadlineExceededError, PeerUnreachableError
from hivemind_ext.p2p.deadlines import remaining, resolve_deadline, wait_until

T = TypeVar("T")

DEFAULT_DHT_TIMEOUT = 30.0  # applies to a call that passes neither timeout nor deadline
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
    what = "add validators"
    request = partial(_extend_validators, validators=list(validators))
    future = DHTCalls._send(lambda: dht.run_coroutine(request, return_future=True), what)
    try:
        future.result(timeout)
    except concurrent.futures.TimeoutError:
        _cancel(future)
        raise DeadlineExceededError(
            f"DHT {what}: no answer within {timeout} s (is the DHT's process alive? see its log)"
        ) from None
    except Exception as e:  # the DHT process reports its failures as exceptions of any type
        raise PeerUnreachableError(f"DHT {what} failed: {type(e).__name__}: {e}") from e


async def _extend_validators(_dht: Any, node: Any, validators: list[Any]) -> None:
    """Runs inside the DHT process (what ``hivemind.DHT.add_validators`` runs there)."""
    node.protocol.record_validator.extend(validators)


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


__all__ = ["DEFAULT_DHT_TIMEOUT", "DHTCalls", "DHTLike", "add_validators"]
