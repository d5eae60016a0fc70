"""One all-reduce round over shaped links: each peer a process in its own network namespace.

The driver (:func:`shaped_round`) builds nothing itself: it takes a :class:`~netns.Topology`,
starts one peer process per namespace (this file run as a script), lets them all start the round at
once, and returns what each peer reports: how long its round took, the largest difference between
its result and the exact mean of every peer's inputs (each peer regenerates the others' inputs from
their seeds), and what its result says about the round (complete or not, who was excluded, why).

Modes (``mode=``):

- ``"service"``: our :class:`AllreduceService` with a fixed group, no DHT (cheap: for tests);
- ``"ours"`` / ``"hivemind"``: ``DecentralizedAverager.step()`` of hivemind_ext / of hivemind, with
  a DHT per peer and matchmaking (for measurements against hivemind on the same links).

Peers listen on fixed ports of their namespace's address with identities generated beforehand, so
every peer knows every other's multiaddr from the start and dials it directly.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

PORT = 4310
READY_TIMEOUT = 120.0


def shaped_round(
    topology: Any,
    *,
    size: int,
    config: dict[str, Any] | None = None,
    mode: str = "service",
    rounds: int = 1,
    timeout: float = 120.0,
) -> list[list[dict[str, Any]]]:
    """Runs ``rounds`` rounds of ``size`` float32 values per peer on ``topology``'s peers; returns,
    per round, one report per peer (see the module docstring)."""
    from hivemind.p2p import P2P, PeerID

    peers = topology.peers
    with tempfile.TemporaryDirectory(prefix="hx-round-") as directory:
        identities = []
        for index in range(len(peers)):
            path = os.path.join(directory, f"peer{index}.key")
            P2P.generate_identity(path)
            os.chmod(path, 0o600)
            with open(path, "rb") as key:
                identities.append((path, PeerID.from_identity(key.read()).to_base58()))
        maddrs = [
            f"/ip4/{peer.address}/tcp/{PORT}/p2p/{peer_id}"
            for peer, (_, peer_id) in zip(peers, identities, strict=True)
        ]
        spec = {
            "mode": mode,
            "size": size,
            "config": config or {},
            "maddrs": maddrs,
            "names": [name for _, name in identities],
            "group_id": os.urandom(16).hex(),
            "rounds": rounds,
        }
        processes = []
        try:
            for index, peer in enumerate(peers):
                argv = [sys.executable, str(Path(__file__).resolve()), json.dumps({**spec, "index": index,
                        "identity": identities[index][0], "address": peer.address})]  # fmt: skip
                processes.append(
                    topology.popen(peer, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env())
                )
            _expect(processes[0], "ready", READY_TIMEOUT)  # the others bootstrap from it: it must listen first
            for process in processes[1:]:  # they have imported everything meanwhile
                _say(process, "start")
            reports: list[list[dict[str, Any]]] = [[] for _ in range(rounds)]
            for round_index in range(rounds):
                for index, process in enumerate(processes):
                    if round_index or index:
                        _expect(process, "ready", READY_TIMEOUT)
                for process in processes:  # all at once: the peers start their round within a few ms
                    _say(process, "go")
                for process in processes:
                    reports[round_index].append(json.loads(_expect(process, "{", timeout)))
            return reports
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                process.wait(timeout=10)
                _LINES.pop(process.pid, None)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def _say(process: subprocess.Popen, line: str) -> None:
    process.stdin.write(line + "\n")
    process.stdin.flush()


def _expect(process: subprocess.Popen, prefix: str, timeout: float) -> str:
    """The next line of ``process`` that starts with ``prefix`` (other lines are passed through)."""
    lines = _lines(process)
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"a peer process said nothing starting with {prefix!r} in {timeout} s") from None
        if line is None:
            raise RuntimeError(f"a peer process exited with {process.wait()} before saying {prefix!r}")
        if line.startswith(prefix):
            return line
        sys.stderr.write(line)


_LINES: dict[int, queue.Queue] = {}


def _lines(process: subprocess.Popen) -> queue.Queue:
    """The lines ``process`` prints, read by a thread (None at its end), so that waits can time out."""
    if process.pid not in _LINES:
        lines = _LINES[process.pid] = queue.Queue()

        def pump() -> None:
            for line in process.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
    return _LINES[process.pid]


# ----- the peer process


def _inputs(size: int, seed: int):
    import torch

    return torch.randn(size, generator=torch.Generator().manual_seed(seed))


async def _peer(spec: dict[str, Any]) -> None:
    import asyncio

    import hivemind  # noqa: F401  (imported while peer 0 starts: the slow part of starting)
    import torch

    import hivemind_ext.averaging  # noqa: F401

    torch.set_num_threads(1)
    index, names, size = spec["index"], spec["names"], spec["size"]
    tensor = _inputs(size, index)
    mean = sum(_inputs(size, seed) for seed in range(len(names))) / len(names)
    loop = asyncio.get_running_loop()
    if index:  # peer 0 must listen before the others bootstrap from it
        await loop.run_in_executor(None, sys.stdin.readline)
    runner = await _start(spec, tensor)
    try:
        for _ in range(spec["rounds"]):
            print("ready", flush=True)
            await loop.run_in_executor(None, sys.stdin.readline)
            started = time.monotonic()
            result, report = await runner(tensor.clone())
            seconds = time.monotonic() - started
            error = float((result - mean).abs().max())
            print(json.dumps({"index": index, "seconds": seconds, "max_error": error, **report}), flush=True)
    finally:
        await runner(None)


async def _start(spec: dict[str, Any], tensor: Any):
    """A coroutine function: ``await run(tensor)`` -> (averaged tensor, report); ``run(None)`` shuts down."""
    import hivemind

    others = spec["maddrs"][:1] if spec["index"] else []  # everyone bootstraps from peer 0
    host = [f"/ip4/{spec['address']}/tcp/{PORT}"]
    if spec["mode"] == "service":
        return await _service_runner(spec, host, others)
    dht = hivemind.DHT(initial_peers=others, host_maddrs=host, identity_path=spec["identity"],
                       check_if_identity_free=False, start=True)  # fmt: skip
    if spec["mode"] == "ours":
        from hivemind_ext.averaging import DecentralizedAverager
    else:
        from hivemind.averaging import DecentralizedAverager
    peers = len(spec["maddrs"])
    averager = DecentralizedAverager(
        [tensor], dht, prefix="netns_round", target_group_size=peers, min_group_size=peers,
        min_matchmaking_time=30.0, start=True, **spec["config"],
    )  # fmt: skip

    async def run(values: Any):
        if values is None:
            averager.shutdown()
            dht.shutdown()
            return None
        with averager.get_tensors() as tensors:
            tensors[0].copy_(values)
        import asyncio

        await asyncio.get_running_loop().run_in_executor(None, lambda: averager.step(timeout=300))
        with averager.get_tensors() as tensors:
            averaged = tensors[0].clone()
        last = getattr(averager, "last_round", None)  # None for hivemind's averager
        return averaged, {"excluded": dict(last.excluded) if last is not None else {}}

    return run


async def _service_runner(spec: dict[str, Any], host: list[str], others: list[str]):
    from hivemind.p2p import P2P

    from hivemind_ext.averaging.allreduce import AllreduceConfig, AllreduceService
    from hivemind_ext.averaging.matchmaking.group import GroupInfo, Member
    from hivemind_ext.p2p import RPCClient, RPCServer

    p2p = await P2P.create(
        host_maddrs=host, initial_peers=others, identity_path=spec["identity"], check_if_identity_free=False
    )
    server = RPCServer(p2p, "netns_round")
    service = AllreduceService(server, RPCClient(p2p, "netns_round"))
    await service.start()
    members = tuple(Member(name, "attempt", None, False, False) for name in spec["names"])
    config = AllreduceConfig(**spec["config"])
    rounds = 0
    trace = _new_trace() if os.environ.get("HX_ROUND_TRACE") else None

    async def run(values: Any):
        nonlocal rounds
        if values is None:
            await service.shutdown()
            await server.shutdown()
            await p2p.shutdown()
            return None
        group = GroupInfo(bytes.fromhex(spec["group_id"]) + rounds.to_bytes(4, "big"), members)
        rounds += 1
        if trace is not None:
            trace.start()
        result = await service.run_round(group, [values], config=config, hooks=trace)
        excluded = {str(peer): reason for peer, reason in result.excluded.items()}
        missing = {str(peer): reason for peer, reason in getattr(result, "missing", {}).items()}
        report = {"excluded": excluded, "missing": missing, "all_averaged": result.all_averaged}
        if trace is not None:
            report["trace"] = trace.events
        return result.tensors[0], report

    return run


def _new_trace() -> Any:
    """Round hooks that note when this peer's first and last chunks leave for each owner, when its
    own part's chunks arrive and when its results go out (seconds from the round's start), for
    measurements (HX_ROUND_TRACE=1); the notes come back in the peer's report as "trace"."""
    from hivemind_ext.averaging.allreduce import RoundHooks

    class Trace(RoundHooks):
        def start(self) -> None:
            self.started, self.events = time.monotonic(), {}

        def note(self, what: str) -> None:
            key = f"{what} first" if f"{what} first" not in self.events else f"{what} last"
            self.events[key] = round(time.monotonic() - self.started, 3)

        async def before_send_chunk(self, owner: Any, part: int, index: int, message: Any) -> Any:
            self.note(f"send to part {part}")
            return message

        async def after_receive_chunk(self, sender: Any, part: int, index: int, message: Any) -> None:
            self.note("own part: chunk in")

        async def before_send_result(self, sender: Any, part: int, index: int | None, message: Any) -> Any:
            self.note("own part: result out")
            return message

    return Trace()


if __name__ == "__main__":
    import asyncio

    asyncio.run(_peer(json.loads(sys.argv[1])))
