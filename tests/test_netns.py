"""The namespace harness itself (tests/netns.py): links are really shaped, NAT really blocks dial-in,
and nothing is left behind. Skipped only where this machine cannot create namespaces."""

from __future__ import annotations

import subprocess
import time

import pytest
from netns import Link, Topology, namespaces_with_prefix, unavailable_reason

MISSING = unavailable_reason()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"no network namespaces: {MISSING}")

SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5001)); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); total = 0
while (n := len(c.recv(1 << 16))): total += n
print(total, flush=True)
"""

CLIENT = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 5001), timeout=float(sys.argv[3]))
start = time.monotonic(); c.sendall(b"x" * int(sys.argv[2])); c.shutdown(socket.SHUT_WR)
c.recv(1); print(time.monotonic() - start, flush=True)
"""


def send(topology: Topology, sender: int, receiver_address: str, nbytes: int, timeout: float = 5.0) -> str:
    return topology.run(sender, ["python3", "-c", CLIENT, receiver_address, str(nbytes), str(timeout)], timeout=60)


def start_server(topology: Topology, peer: int) -> subprocess.Popen:
    server = topology.python(peer, SERVER, topology.peers[peer].address, stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "ready"
    return server


@pytest.mark.timeout(60)
def test_a_shaped_link_runs_at_its_rate_and_everything_is_removed_afterwards():
    with Topology([Link(rate_mbit=20), Link(rate_mbit=None)], prefix="hxt") as topology:
        server = start_server(topology, 1)
        before = topology.link_bytes()
        try:
            started = time.monotonic()
            sent = send(topology, 0, topology.peers[1].address, 2_500_000)
            elapsed = time.monotonic() - started
            assert sent.returncode == 0, sent.stderr
            assert server.wait(timeout=10) == 0
            assert int(server.stdout.read().split()[-1]) == 2_500_000
        finally:
            server.kill()
        after = topology.link_bytes()
        up, acknowledgements = after[0][0] - before[0][0], after[0][1] - before[0][1]
        # the shaper charged the payload plus its headers (~4.5% at 1448 payload bytes a segment),
        # and the sender's (shaped) download carried only acknowledgements
        assert 2_500_000 * 1.03 < up < 2_500_000 * 1.1, up
        assert 0 < acknowledgements < 2_500_000 * 0.05, acknowledgements
        assert after[1] == before[1] == (0, 0)  # peer 1's link is not shaped
        # 20 Mbit/s is 2.5 MB/s: 2.5 MB take ~1 s (plus the tbf bucket); unshaped loopback-speed takes ~10 ms
        assert 0.8 < elapsed < 3.0, elapsed
        topology.set_rate(0, 200)
        server = start_server(topology, 1)
        try:
            started = time.monotonic()
            assert send(topology, 0, topology.peers[1].address, 2_500_000).returncode == 0
            assert time.monotonic() - started < 0.8
        finally:
            server.kill()
    assert namespaces_with_prefix("hxt") == []


@pytest.mark.timeout(60)
@pytest.mark.skipif(unavailable_reason(nat=True) is not None, reason=f"no NAT: {unavailable_reason(nat=True)}")
def test_a_peer_behind_nat_dials_out_but_nobody_dials_in():
    with Topology([Link(rate_mbit=100), Link(rate_mbit=100, behind_nat=True)], prefix="hxn") as topology:
        public, client = topology.peers
        server = start_server(topology, public.index)
        try:
            outgoing = send(topology, client.index, public.address, 1000)
            assert outgoing.returncode == 0, outgoing.stderr
        finally:
            server.kill()
        server = start_server(topology, client.index)
        try:
            for address in (client.address, "10.77.1.1"):  # its private address, its router's public one
                incoming = send(topology, public.index, address, 1000, timeout=2.0)
                assert incoming.returncode != 0
                assert "Error" in incoming.stderr or "refused" in incoming.stderr or "timed out" in incoming.stderr
        finally:
            server.kill()
    assert namespaces_with_prefix("hxn") == []


@pytest.mark.timeout(30)
def test_a_failed_build_leaves_no_namespace_behind():
    with pytest.raises(ValueError):
        with Topology([Link(rate_mbit=20)], prefix="hxf"):
            assert namespaces_with_prefix("hxf")
            raise ValueError("the test body failed")
    assert namespaces_with_prefix("hxf") == []
