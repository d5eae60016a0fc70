"""A peer behind NAT (tests/netns.py) joins two public peers in client mode and averages with them
over the direct data path where it can dial out, over libp2p otherwise.

Each peer is a process in its own network namespace; the NAT'd peer's router forwards nothing in.
Public peer 1 has a firewall that refuses the NAT router's connections to its direct port (but not
to libp2p), so that pair must fall back to libp2p. Skipped only where namespaces cannot be built.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from netns import Link, Topology, unavailable_reason

MISSING = unavailable_reason(nat=True)
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"no network namespaces with NAT: {MISSING}")

FIREWALLED_PORT = 47123
SIZE = 1000

PEER = r"""
import json, sys
import hivemind, torch
from hivemind_ext.averaging import DecentralizedAverager
from hivemind_ext.p2p import DirectConfig

index, address, client = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
initial, port = json.loads(sys.argv[4]), int(sys.argv[5])
host = "/ip4/0.0.0.0/tcp/0" if client else f"/ip4/{address}/tcp/0"
dht = hivemind.DHT(initial_peers=initial, host_maddrs=[host], client_mode=client, start=True)
print(json.dumps({"maddrs": [str(m) for m in dht.get_visible_maddrs()]}), flush=True)
options = dict(direct_data_path=DirectConfig(host=address, port=port)) if port else {}
tensor = torch.arange(int(sys.argv[6]), dtype=torch.float32) * (index + 1)
averager = DecentralizedAverager(
    [tensor], dht, prefix="nat", target_group_size=3, min_matchmaking_time=60, request_timeout=2, start=True, **options
)
averager.step(timeout=90)
with averager.get_tensors() as tensors:
    result = tensors[0].tolist()
report = averager.last_round
print(json.dumps(dict(peer=str(dht.peer_id), result=result, transports=report.transports,
                      failures=report.direct_failures, excluded=report.excluded)), flush=True)
averager.shutdown()
dht.shutdown()
"""


def start(topology: Topology, index: int, initial: list[str], port: int = 0) -> subprocess.Popen:
    peer = topology.peers[index]
    argv = [str(index), peer.address, "1" if peer.link.behind_nat else "0", json.dumps(initial), str(port), str(SIZE)]
    return topology.python(index, PEER, *argv, stdout=subprocess.PIPE, text=True)


def report_of(process: subprocess.Popen) -> dict:
    """The peer's last line (its round report), once it has exited."""
    rest = process.stdout.read()  # the same buffered reader as the first line's readline()
    assert process.wait(timeout=100) == 0, f"peer exited with {process.returncode}"
    return json.loads(rest.strip().splitlines()[-1])


@pytest.mark.timeout(180)
def test_a_peer_behind_nat_averages_directly_where_it_dials_out_and_over_libp2p_otherwise() -> None:
    links = [Link(), Link(), Link(behind_nat=True)]
    with Topology(links, prefix="hxd") as topology:
        router_address = "10.77.1.1"  # the NAT router's public side (netns.py: 10.<net>.1.<j+1>)
        firewall = ["iptables", "-A", "INPUT", "-p", "tcp", "--dport", str(FIREWALLED_PORT), "-s", router_address]
        assert topology.run(1, [*firewall, "-j", "REJECT", "--reject-with", "tcp-reset"]).returncode == 0
        processes = [start(topology, 0, [])]
        try:
            initial = json.loads(processes[0].stdout.readline())["maddrs"]
            processes.append(start(topology, 1, initial, FIREWALLED_PORT))
            processes.append(start(topology, 2, initial))  # the NAT'd peer joins through a public peer's multiaddrs
            for process in processes[1:]:
                process.stdout.readline()  # its addresses
            reports = [report_of(process) for process in processes]
        finally:
            for process in processes:
                process.kill()
    names = [report["peer"] for report in reports]
    mean = sum(range(1, 4)) / 3
    for report in reports:
        assert report["excluded"] == {}
        assert report["result"] == pytest.approx([i * mean for i in range(SIZE)], rel=1e-6)
        assert names[2] not in report["transports"]  # nobody dials the NAT'd peer (it owns no part)
    assert reports[0]["transports"] == {names[1]: "direct"}
    assert reports[1]["transports"] == {names[0]: "direct"}  # only the NAT router is firewalled
    nat = reports[2]
    assert nat["transports"] == {names[0]: "direct", names[1]: "libp2p"}
    assert list(nat["failures"]) == [names[1]] and "PeerUnreachableError" in nat["failures"][names[1]]
