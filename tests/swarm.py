"""Shared test helpers: real hivemind DHT peers (each with its own libp2p daemon) on 127.0.0.1 only,
and :func:`wait_for`, the one way tests wait for something to happen."""

from __future__ import annotations

import asyncio
import os
import secrets
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
        assert dht.store(key, index, get_dht_time() + 120, subkey=index)

    def sees_everyone(dht: hivemind.DHT) -> bool:
        found = dht.get(key, latest=True)
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
    ``dht_kwargs`` go to :class:`hivemind.DHT` as they are (e.g. ``await_ready=False``)."""
    return hivemind.DHT(
        start=True, host_maddrs=LOOPBACK, initial_peers=list(initial_peers), client_mode=client_mode, **dht_kwargs
    )


def addresses(dht: hivemind.DHT) -> list[str]:
    """The multiaddrs other peers bootstrap from to join ``dht``'s swarm."""
    return [str(maddr) for maddr in dht.get_visible_maddrs()]


@contextmanager
def local_swarm(size: int, client_indices: Sequence[int] = ()) -> Iterator[list[hivemind.DHT]]:
    """``size`` connected DHTs, all bootstrapped from the first; those in ``client_indices`` in client mode."""
    dhts = [new_peer()]
    try:
        initial_peers = addresses(dhts[0])
        for index in range(1, size):
            dhts.append(new_peer(initial_peers, client_mode=index in client_indices, await_ready=False))
        for dht in dhts:
            dht.wait_until_ready(timeout=30)
        wait_until_connected(dhts)
        yield dhts
    finally:
        for dht in dhts:
            dht.shutdown()
