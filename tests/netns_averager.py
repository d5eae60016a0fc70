"""One averaging peer in its own network namespace, driven over stdin/stdout (tests and benchmarks/wan.py).

Run as ``python netns_averager.py '<json config>'`` inside a namespace (``Topology.python``), so that
any interpreter can run it (hivemind's 8-bit codecs need numpy < 2: the benchmark runs those peers
under another venv). The config (:func:`main`) says which averager (ours or hivemind's, both through
hivemind's API), the codec, the tensor and the swarm to join. The peer prints, one line each:

- ``addrs <json list>``: its DHT's visible multiaddrs (the first peer's are the others' initial peers);
- ``ready <round>``: it waits for a line on stdin: ``go`` runs the round, anything else stops it;
- ``allreduce <time>``: the round's all-reduce began (its step's stage; or the step ended before it);
- ``result <json>``: the round's timing (``started``: step called; ``allreduce``: the all-reduce
  began, as the step's stage showed; ``finished``), its max error against the exact mean of every
  peer's input, and what our averager reports (part sizes, measured and declared bandwidth).

Every peer's input is ``randn(numel)`` seeded with its index, reset before each round, so each peer
computes the exact mean itself. ``codec_error`` is the codec's own round-trip error on the input (a
mean of compressed contributions, compressed again, errs by about twice that).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from peer_processes import PeerProcesses


def exact_mean(numel: int, contributors: list[int]) -> Any:
    import torch

    total = torch.zeros(numel, dtype=torch.float64)
    for index in contributors:
        total += torch.randn(numel, generator=torch.Generator().manual_seed(index)).double()
    return (total / len(contributors)).float()


def make_averager(config: dict[str, Any], tensor: Any, dht: Any) -> tuple[Any, Any]:
    if config["impl"] == "ours":
        import hivemind_ext.compression as compression
        from hivemind_ext.averaging import DecentralizedAverager
    else:
        import hivemind.compression as compression
        from hivemind.averaging import DecentralizedAverager
    codec = getattr(compression, config["codec"])()
    averager = DecentralizedAverager(
        [tensor],
        dht,
        prefix=config.get("prefix", "wan"),
        target_group_size=config["group_size"],
        min_group_size=config["group_size"],
        min_matchmaking_time=config.get("min_matchmaking_time", 30.0),  # groups form because they are full
        compression=codec,
        client_mode=config.get("client_mode", False),
        start=True,
        **config.get("averager_kwargs", {}),
    )
    return averager, codec


def codec_error(impl: str, codec: Any, tensor: Any) -> float:
    """Max error of one compress/decompress of ``tensor`` with ``codec``."""
    if impl == "ours":
        from hivemind_ext.compression import CompressionInfo

        restored = codec.decompress(codec.compress(tensor, CompressionInfo.from_tensor(tensor)))
    else:
        from hivemind.compression import CompressionInfo, deserialize_torch_tensor

        restored = deserialize_torch_tensor(codec.compress(tensor, CompressionInfo.from_tensor(tensor)))
    return float((restored.float() - tensor).abs().max())


def wait_for_stage(control: Any, name: str, poll: float = 0.005) -> float:
    """The time the step reached stage ``name`` (or finished), polled."""
    while not control.done() and control.stage.name != name:
        time.sleep(poll)
    return time.time()


def main(config: dict[str, Any]) -> None:
    import hivemind
    import torch

    torch.set_num_threads(1)
    index, numel = config["index"], config["numel"]
    dht = hivemind.DHT(
        host_maddrs=[f"/ip4/{config['address']}/tcp/0"],
        initial_peers=config.get("initial_peers") or [],
        client_mode=config.get("client_mode", False),
        start=True,
    )
    averager = None
    try:
        print("addrs", json.dumps([str(a) for a in dht.get_visible_maddrs()]), flush=True)
        mine = torch.randn(numel, generator=torch.Generator().manual_seed(index))
        tensor = mine.clone()
        averager, codec = make_averager(config, tensor, dht)
        own_error = codec_error(config["impl"], codec, mine)
        expected = exact_mean(numel, config["contributors"])
        round_index = 0
        while True:
            print("ready", round_index, flush=True)
            if sys.stdin.readline().strip() != "go":
                break
            with averager.get_tensors() as tensors:
                tensors[0].copy_(mine)
            declared = getattr(averager, "declared_bandwidth", None)  # what this round's group was told
            started = time.time()
            control = averager.step(wait=False, timeout=config.get("step_timeout", 120.0))
            allreduce = wait_for_stage(control, "RUNNING_ALLREDUCE")
            print("allreduce", allreduce, flush=True)
            error_text = None
            try:
                control.result()
            except Exception as e:  # reported, the driver decides
                error_text = repr(e)
            finished = time.time()
            with averager.get_tensors() as tensors:
                max_error = float((tensors[0] - expected).abs().max())
            report = getattr(averager, "last_round", None)
            print(
                "result",
                json.dumps(
                    {
                        "index": index,
                        "round": round_index,
                        "started": started,
                        "allreduce": allreduce,
                        "finished": finished,
                        "error": error_text,
                        "max_error": max_error,
                        "codec_error": own_error,
                        "peer_id": str(dht.peer_id),
                        "part_sizes": getattr(report, "part_sizes", None),
                        "chunk_bytes": getattr(report, "chunk_bytes", None),
                        "receive_rate": getattr(report, "receive_rate", None),
                        "declared_bandwidth": declared,
                        "excluded": getattr(report, "excluded", None),
                        "transports": getattr(report, "transports", None),
                        "bytes_sent": getattr(report, "bytes_sent", None),
                    }
                ),
                flush=True,
            )
            round_index += 1
    finally:
        if averager is not None:
            averager.shutdown()
        dht.shutdown()


class AveragerSwarm:
    """The driver: one peer (this file as a script) per peer of a built ``netns.Topology``, rounds
    run in lockstep. ``configs[i]`` is peer i's config without ``index``/``address``/``initial_peers``,
    which the swarm fills in; ``python[i]`` is the interpreter it runs under (default: this one).

    ``with AveragerSwarm(topology, configs) as swarm: results = swarm.run_round()``: every peer's
    result dict for one round (raises RuntimeError if a peer died or said nothing in ``timeout``).
    """

    def __init__(
        self, topology: Any, configs: list[dict[str, Any]], python: list[str] | None = None, timeout: float = 120.0
    ) -> None:
        self.topology, self.configs = topology, configs
        self.python = python or [sys.executable] * len(configs)
        self.peers = PeerProcesses(topology, timeout)

    def __enter__(self) -> AveragerSwarm:
        try:
            initial_peers = self._start(0, [])
            for index in range(1, len(self.configs)):  # all at once: their start-up overlaps
                self._start(index, initial_peers)
            for index in range(len(self.configs)):
                if index:
                    self.peers.expect(index, "addrs")
                self.peers.expect(index, "ready")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _start(self, index: int, initial_peers: list[str]) -> list[str] | None:
        """Starts peer ``index``; the first peer's multiaddrs are awaited and returned."""
        peer = self.topology.peers[index]
        config = {**self.configs[index], "index": index, "address": peer.address, "initial_peers": initial_peers}
        self.peers.start(index, [self.python[index], str(Path(__file__).resolve()), json.dumps(config)])
        return json.loads(self.peers.expect(index, "addrs")) if index == 0 else None

    def stderr(self, index: int) -> str:
        return self.peers.stderr(index)

    def run_round(self, at_allreduce: Callable[[], Any] | None = None) -> list[dict[str, Any]]:
        """Every peer's result of one round; ``at_allreduce`` is called as soon as the first peer says
        its all-reduce began (matchmaking over: benchmarks/wan.py reads the link counters there)."""
        self.peers.send("go")
        if at_allreduce is not None:
            self.peers.first("allreduce")
            at_allreduce()
        results = [json.loads(self.peers.expect(index, "result")) for index in range(len(self.peers))]
        for index in range(len(self.peers)):
            self.peers.expect(index, "ready")
        return results

    def close(self) -> None:
        self.peers.close()


def round_seconds(results: list[dict[str, Any]]) -> float:
    """The group's all-reduce time: from the first peer entering it to the last peer done."""
    return max(r["finished"] for r in results) - min(r["allreduce"] for r in results)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
