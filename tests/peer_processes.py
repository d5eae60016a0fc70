"""Peer processes in network namespaces, driven by lines over stdin/stdout (tests and benchmarks).

A peer is a Python process started in its namespace (``Topology.popen``) that prints lines of the
form ``<word> <rest>`` (e.g. ``addrs [...]``, ``ready 0``, ``result {...}``) and reads commands from
stdin. :class:`PeerProcesses` starts such peers, waits for a given word from one of them with a
deadline (a peer that died or said nothing in time raises with the end of its stderr), writes lines
to them, and stops them in one place: every peer is asked to stop (``stop_line``, then its stdin is
closed), given ``grace`` seconds, then killed. tests/netns_averager.py and benchmarks/thin_link.py
drive their peers through it.
"""

from __future__ import annotations

import queue
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any


class PeerProcesses:
    """One process per started peer of a built ``netns.Topology``; see the module docstring."""

    def __init__(self, topology: Any, timeout: float, *, stop_line: str = "stop", grace: float = 20.0) -> None:
        self.topology, self.timeout, self.stop_line, self.grace = topology, timeout, stop_line, grace
        self.processes: list[subprocess.Popen] = []
        self.lines: list[queue.Queue[str | None]] = []
        self.logs: list[Any] = []

    def __len__(self) -> int:
        return len(self.processes)

    def start(self, index: int, argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        """Starts ``argv`` in peer ``index``'s namespace (peers are started in index order)."""
        if index != len(self.processes):
            raise ValueError(f"peer {index} started out of order (next is {len(self.processes)})")
        log = tempfile.TemporaryFile("w+")
        process = self.topology.popen(
            self.topology.peers[index],
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=None if env is None else dict(env),
        )
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_pump, args=(process.stdout, lines), daemon=True).start()
        self.processes.append(process)
        self.lines.append(lines)
        self.logs.append(log)

    def expect(self, index: int, word: str, timeout: float | None = None) -> str:
        """The rest of peer ``index``'s next line that starts with ``word`` (other lines are skipped);
        RuntimeError with its stderr if it exits or says no such line within ``timeout`` (default: the
        swarm's)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            try:
                line = self.lines[index].get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                raise RuntimeError(
                    f"peer {index} said no {word!r} in time; its stderr ends with:\n{self.stderr(index)}"
                )
            head, _, rest = line.partition(" ")
            if head == word:
                return rest

    def first(self, word: str, timeout: float | None = None, poll: float = 0.001) -> int:
        """The index of the first peer whose next line starting with ``word`` arrives (each peer's
        other lines before it are skipped, as by :meth:`expect`; the line is consumed); RuntimeError
        with a peer's stderr if that peer exits, or with none if no peer says it within ``timeout``."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while time.monotonic() < deadline:
            for index, lines in enumerate(self.lines):
                try:
                    line = lines.get_nowait()
                except queue.Empty:
                    continue
                if line is None:
                    raise RuntimeError(f"peer {index} exited before saying {word!r}:\n{self.stderr(index)}")
                if line.partition(" ")[0] == word:
                    return index
            time.sleep(poll)
        raise RuntimeError(f"no peer said {word!r} in time")

    def send(self, line: str, indices: Sequence[int] | None = None) -> None:
        """Writes ``line`` to the stdin of the given peers (default: every peer)."""
        for index in range(len(self.processes)) if indices is None else indices:
            stdin = self.processes[index].stdin
            if stdin is None:
                raise RuntimeError(f"peer {index} has no stdin")
            stdin.write(line + "\n")
            stdin.flush()

    def stderr(self, index: int) -> str:
        """The last 4000 characters peer ``index`` wrote to stderr."""
        log = self.logs[index]
        log.seek(0)
        return log.read()[-4000:]

    def close(self) -> None:
        """Asks every peer to stop (``stop_line``, then end of input), waits ``grace`` seconds for each,
        kills those still running; idempotent."""
        for process in self.processes:
            try:
                if process.stdin is not None:
                    process.stdin.write(self.stop_line + "\n")
                    process.stdin.close()
            except (OSError, ValueError):  # it already exited (broken pipe) or its stdin is closed
                pass
        for process in self.processes:
            try:
                process.wait(timeout=self.grace)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for log in self.logs:
            log.close()
        self.processes, self.lines, self.logs = [], [], []


def _pump(stream: Any, lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)
