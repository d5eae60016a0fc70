"""A local test swarm of real hivemind DHTs (each with its own libp2p daemon) on 127.0.0.1 only."""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import hivemind
from hivemind.utils import get_dht_time

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
# HIVEMIND_EXT_TEST_LOOP=uvloop runs the async tests on uvloop (the loop production code uses).
USE_UVLOOP = os.environ.get("HIVEMIND_EXT_TEST_LOOP", "asyncio") == "uvloop"


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
    give_up = time.monotonic() + timeout
    for dht in dhts:
        while (found := dht.get(key, latest=True)) is None or len(found.value) != len(dhts):
            assert time.monotonic() < give_up, "the test swarm is not connected"
            time.sleep(0.1)


@contextmanager
def local_swarm(size: int, client_indices: Sequence[int] = ()) -> Iterator[list[hivemind.DHT]]:
    """``size`` connected DHTs, all bootstrapped from the first; those in ``client_indices`` in client mode."""
    dhts = [hivemind.DHT(start=True, host_maddrs=LOOPBACK)]
    try:
        initial_peers = [str(maddr) for maddr in dhts[0].get_visible_maddrs()]
        for index in range(1, size):
            dhts.append(
                hivemind.DHT(
                    start=True,
                    await_ready=False,
                    host_maddrs=LOOPBACK,
                    initial_peers=initial_peers,
                    client_mode=index in client_indices,
                )
            )
        for dht in dhts:
            dht.wait_until_ready(timeout=30)
        wait_until_connected(dhts)
        yield dhts
    finally:
        for dht in dhts:
            dht.shutdown()
