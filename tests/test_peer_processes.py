"""tests/peer_processes.py, the driver of namespace peers, on plain local processes (a stand-in
topology whose ``popen`` runs the command here): words awaited, lines sent, dead and stubborn peers."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest
from peer_processes import PeerProcesses

ECHO = """
import sys
print("addrs [1, 2]", flush=True)
for line in sys.stdin:
    if line.strip() != "go":
        break
    print("noise", flush=True)
    print("allreduce", sys.argv[1], flush=True)
    print("result ok", flush=True)
print("bye", file=sys.stderr, flush=True)
"""


@dataclass
class LocalTopology:
    """What PeerProcesses needs of a netns.Topology: ``peers`` and ``popen``, without namespaces."""

    peers: list[int]

    def popen(self, peer: int, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        return subprocess.Popen(argv, **kwargs)


@pytest.mark.timeout(60)
def test_peers_are_driven_by_words_and_lines_and_stopped() -> None:
    peers = PeerProcesses(LocalTopology([0, 1]), timeout=30)
    try:
        for index in range(2):
            peers.start(index, [sys.executable, "-c", ECHO, str(index)])
        assert [peers.expect(i, "addrs") for i in range(2)] == ["[1, 2]", "[1, 2]"]
        for _ in range(2):
            peers.send("go")
            assert peers.first("allreduce") in (0, 1)  # whichever said it first; the other's line is skipped below
            assert [peers.expect(i, "result") for i in range(2)] == ["ok", "ok"]  # "noise" lines skipped
        peers.send("go", indices=[1])
        assert peers.first("allreduce") == 1  # only peer 1 ran a round
        processes = list(peers.processes)
    finally:
        peers.close()
    assert [p.returncode for p in processes] == [0, 0]  # they stopped on the stop line, not killed


@pytest.mark.timeout(60)
def test_a_peer_that_dies_or_stays_silent_raises_with_its_stderr_and_a_stubborn_one_is_killed() -> None:
    peers = PeerProcesses(LocalTopology([0, 1]), timeout=1.0, grace=0.5)
    try:
        peers.start(0, [sys.executable, "-c", "import sys; print('dying', file=sys.stderr, flush=True)"])
        with pytest.raises(RuntimeError, match=r"(?s)peer 0 exited before saying 'addrs'.*dying"):
            peers.first("addrs")  # the only peer so far ends its output without the word
        peers.start(
            1,
            [
                sys.executable,
                "-c",
                "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('addrs x', flush=True); time.sleep(60)",
            ],
        )
        with pytest.raises(RuntimeError, match="dying"):
            peers.expect(0, "addrs")  # its end of output was taken by first(): it says nothing in time
        assert peers.expect(1, "addrs") == "x"
        with pytest.raises(RuntimeError, match="said no 'result'"):
            peers.expect(1, "result", timeout=0.5)
        with pytest.raises(RuntimeError, match="no peer said 'result' in time"):
            peers.first("result", timeout=0.3)
        with pytest.raises(ValueError):
            peers.start(5, [sys.executable, "-c", "pass"])
        stubborn = peers.processes[1]
    finally:
        peers.close()
    assert stubborn.returncode is not None and stubborn.returncode < 0  # killed after the grace period
