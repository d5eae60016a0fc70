"""Shared test helpers: real hivemind DHT peers (each with its own libp2p daemon) on 127.0.0.1 only,
and :func:`wait_for`, the one way tests wait for something to happen."""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import hivemind
from hivemind.utils import get_dht_time

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
# HIVEMIND_EXT_TEST_LOOP=uvloop runs the async tests on uvloop (the loop production code uses).
USE_UVLOOP = os.environ.get("HIVEMIND_EXT_TEST_LOOP", "asyncio") == "uvloop"

T = TypeVar("T")
# A call into a live local DHT process returns well within this; hivemind's own blocking calls have no
# deadline and wait for ever on a DHT process that died (seen once: EAGAIN on its pipe killed it).
DHT_CALL_SECONDS = 30.0


def wait_for(
    condition: Callable[[], T], timeout: float, *, interval: float = 0.05, message: str = "the condition"
) -> T:
    """Polls ``condition()`` every ``interval`` seconds until it returns something truthy, and returns
    that; fails the test if ``timeout`` seconds pass first. ``message`` says what was awaited.

    For waiting until something happens. A check that something does NOT happen within a window
    (nothing arrives, a thread stays alive) still sleeps for the window, then asserts."""
    give_up = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() >= give_up:
            raise AssertionError(f"timed out after {timeout} s waiting for {message} (last value: {value!r:.200})")
        time.sleep(interval)
    return value


def within(what: str, call: Callable[..., T], /, *args: Any, seconds: float = DHT_CALL_SECONDS, **kwargs: Any) -> T:
    """Returns ``call(*args, **kwargs)``, made in a daemon thread; fails the test if it has not returned
    after ``seconds``.

    For hivemind's blocking DHT calls (``store``, ``get``, ``add_validators``, ``get_visible_maddrs``)
    in set-ups: a DHT process that died makes them wait for ever, and the test should fail naming
    ``what`` it waited for instead (the abandoned thread stays blocked; it is a daemon)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, call(*args, **kwargs)))
        except BaseException as e:  # handed to the caller's thread, raised there
            outcome.append((False, e))

    thread = threading.Thread(target=run, daemon=True, name=f"within: {what}")
    thread.start()
    thread.join(seconds)
    if not outcome:
        raise AssertionError(f"{what} did not return within {seconds} s (did a DHT process die?)")
    returned, value = outcome[0]
    if not returned:
        raise value
    return value


def new_test_loop() -> asyncio.AbstractEventLoop:
    """A new event loop of the kind the test run asks for (asyncio unless HIVEMIND_EXT_TEST_LOOP=uvloop)."""
    if USE_UVLOOP:
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def wait_until_connected(dhts: Sequence[hivemind.DHT], timeout: float = 30.0) -> None:
    """Every DHT must read what every other DHT stored: four local peers have been seen to form two
    separate DHTs (hivemind issue 624), which would make multi-peer tests fail for the wrong reason."""
    key = f"swarm-check-{secrets.token_hex(4)}"
    for index, dht in enumerate(dhts):
        assert within("a DHT store", dht.store, key, index, get_dht_time() + 120, subkey=index)

    def sees_everyone(dht: hivemind.DHT) -> bool:
        found = within("a DHT get", dht.get, key, latest=True)
        return found is not None and len(found.value) == len(dhts)

    give_up = time.monotonic() + timeout
    for dht in dhts:
        wait_for(
            lambda dht=dht: sees_everyone(dht),
            max(give_up - time.monotonic(), 0.0),
            interval=0.1,
            message="the test swarm to be connected",
        )


def new_peer(initial_peers: Sequence[str] = (), client_mode: bool = False, **dht_kwargs: Any) -> hivemind.DHT:
    """One started DHT peer listening on 127.0.0.1 only, bootstrapped from ``initial_peers`` (multiaddrs);
    ``dht_kwargs`` go to :class:`hivemind.DHT` as they are (e.g. ``await_ready=False``: the caller
    waits for it to be ready; by default it waits here, at most ``DHT_CALL_SECONDS``)."""
    await_ready = dht_kwargs.pop("await_ready", True)
    dht = hivemind.DHT(
        start=True,
        host_maddrs=LOOPBACK,
        initial_peers=list(initial_peers),
        client_mode=client_mode,
        await_ready=False,
        **dht_kwargs,
    )
    if await_ready:
        dht.wait_until_ready(timeout=DHT_CALL_SECONDS)
    return dht


def addresses(dht: hivemind.DHT) -> list[str]:
    """The multiaddrs other peers bootstrap from to join ``dht``'s swarm."""
    return [str(maddr) for maddr in within("the DHT's addresses", dht.get_visible_maddrs)]


# the DHT lists of the local_swarm()s now running, with their client-mode indices (see revive_dead_peers)
_RUNNING_SWARMS: list[tuple[list[hivemind.DHT], frozenset[int]]] = []


@contextmanager
def local_swarm(size: int, client_indices: Sequence[int] = ()) -> Iterator[list[hivemind.DHT]]:
    """``size`` connected DHTs, all bootstrapped from the first; those in ``client_indices`` in client mode."""
    dhts = [new_peer()]
    entry = (dhts, frozenset(client_indices))
    try:
        initial_peers = addresses(dhts[0])
        for index in range(1, size):
            dhts.append(new_peer(initial_peers, client_mode=index in client_indices, await_ready=False))
        for dht in dhts:
            dht.wait_until_ready(timeout=30)
        wait_until_connected(dhts)
        _RUNNING_SWARMS.append(entry)
        yield dhts
    finally:
        if entry in _RUNNING_SWARMS:
            _RUNNING_SWARMS.remove(entry)
        for dht in dhts:
            dht.shutdown()


def revive_dead_peers() -> list[int]:
    """Replaces, in place, every DHT of a running :func:`local_swarm` whose process has died, with a new
    one in the same mode that joins through a live peer, and waits until the swarm is connected again;
    returns the replaced indices. Module-scoped swarms outlive tests: one dead DHT (a process that died
    under load) would otherwise fail every later test of the module, each after waiting on it."""
    replaced: list[int] = []
    for dhts, client_indices in _RUNNING_SWARMS:
        dead = [index for index, dht in enumerate(dhts) if not dht.is_alive()]
        if not dead:
            continue
        servers = [dht for index, dht in enumerate(dhts) if index not in dead and index not in client_indices]
        initial_peers = addresses(servers[0]) if servers else []
        for index in dead:
            dhts[index].shutdown()
            dhts[index] = new_peer(initial_peers, client_mode=index in client_indices)
            if not initial_peers:
                initial_peers = addresses(dhts[index])
        wait_until_connected(dhts)
        replaced.extend(dead)
    return replaced
