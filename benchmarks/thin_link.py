"""Training on thin links: compute utilization, bytes per inner step and held-out loss, per algorithm.

Four peers (``--peers``), each in its own network namespace with a 20 Mbit/s link both ways
(``tc tbf``, tests/netns.py; needs root), train the same 11.1M-parameter MLP (128 -> 2048 -> 5120
-> 64, ReLU) on a teacher-student regression: ``y = tanh(x A) B + 0.1 noise`` with a fixed random
teacher (A: 128 x 32, B: 32 x 64), ``x ~ N(0, I)``, a batch of 8 per peer per step, each peer its own
deterministic stream (``--seed`` picks the model's initialization and the streams); Adam (lr 3e-4, fused) is
the inner (local) optimizer everywhere. Each peer's compute is real (forward, backward and Adam on one
CPU thread) padded with a sleep to ``--step-seconds`` per step: the time an accelerator would take,
during which the CPU is free for communication, as it would be.

Per configuration, every peer runs ``--steps`` inner steps (the same samples in every
configuration) and reports:

- compute utilization: time in forward/backward (padded), in the torch optimizer's own step and in
  ``zero_grad()`` (the training loop's, the same in every configuration), over the wall time from its
  first step to its last; everything else in ``step()`` (the library's or hivemind's work around the
  inner step: rounds, snapshots, outer updates) counts as time not computing;
- bytes sent per peer per inner step: the transmitted bytes of its namespace's interface (all
  traffic: DHT, matchmaking, progress records, all-reduce, and the overlapped rounds still in flight
  after the last step), over its steps;
- held-out loss: MSE on 256 held-out samples, the mean over peers of their final models' (after
  overlapped rounds in flight were applied).

Every peer stays up until all have finished a configuration (a peer that left at once would fail the
others' last round). ``THIN_LINK_LOGS=<folder>``: each peer's debug log of the library there.

Configurations: ``sync`` (synchronous gradient averaging every step, float16), ``diloco`` (H inner
steps, float16 pseudo-gradients), ``diloco8`` (8-bit min-max, Bagua's MinMaxUInt8), ``overlap``
(overlapped rounds, float16), ``overlap_sparse`` (overlapped, ``ErrorFeedback(SparseTopK(...))``,
``--density`` / ``--bits``), ``hivemind`` (hivemind.Optimizer with ``use_local_updates``, parameters
averaged in float16 every H steps' worth of samples); not in the default run: ``streaming`` (the
overlapped sparse rounds in ``--fragments`` fragments staggered over the H steps).

Synchronous averaging moves 33 MB per peer per round (a butterfly of 22 MB of float16 gradients),
~15 s at 20 Mbit/s: ``--steps`` real rounds would take most of an hour. It runs ``--sync-rounds``
rounds (epochs of ``target_batch_size`` = 8 x peers: one synchronous step of every peer) over the
links, and its figures are per round, i.e. per synchronous step: utilization over those rounds,
bytes per round; the peers' models are compared with each other (every peer applied the same averaged
gradients: they must be equal) and the samples each round averaged are printed (a peer adds local
batches to an epoch until it learns that the swarm reached the target, so a round averages more than
one batch per peer). Its held-out loss at the others' samples is that of the in-process equivalent
(Adam on the mean gradient of every peer's batch, each of ``--steps`` steps; no float16 rounding).
The byte goal's baseline, synchronous fp32 averaging every step, is computed: a butterfly all-reduce
of every float32 gradient, 2 (n - 1) / n x 4 bytes x 11.1M per peer per step.

Defaults: H = 100 (the issue's), 200 steps (2 outer rounds), 0.2 s of compute per step, 2 rounds of
synchronous averaging: 5 configurations x 40 s of compute, plus blocking rounds (~15 s each for
float16 DiLoCo), set-up and the in-process reference, sized for 10 minutes on a quiet 2-core machine
(what the machine's load does to it: benchmarks/RESULTS.md). ``--full``: 400 steps (4 outer rounds,
about twice as long). A configuration's figures are printed as soon as it ends; the JSON line comes last.

    sudo python benchmarks/thin_link.py
    sudo python benchmarks/thin_link.py --full
    sudo python benchmarks/thin_link.py --configs diloco overlap_sparse --seed 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from peer_processes import PeerProcesses  # noqa: E402

CONFIGS = ["sync", "diloco", "diloco8", "overlap", "overlap_sparse", "streaming", "hivemind"]
DEFAULT_CONFIGS = [name for name in CONFIGS if name != "streaming"]  # the list
IN, HIDDEN, HIDDEN2, OUT, TEACHER = 128, 2048, 5120, 64, 32
BATCH, EVAL = 8, 256
LR = 3e-4
FULL = {"inner_steps": 100, "steps": 400}
DEFAULT = {"inner_steps": 100, "steps": 200}


# ----- the model and the data (the same in every peer and in the in-process reference)


def make_model(seed: int = 0) -> torch.nn.Module:
    """11.1M parameters, nearly all in the 2048 x 5120 layer: a round's bytes matter."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN2),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN2, OUT),
    )


def data_stream(seed: int, index: int) -> torch.Generator:
    """Peer ``index``'s batches (the same in every configuration and in the in-process reference)."""
    return torch.Generator().manual_seed(100 + index + 1000 * seed)


class Teacher:
    """``y = tanh(x A) B + 0.1 noise``: learnable from a few thousand samples (the loss falls ~4x in 60
    steps of one peer), so that a difference between configurations shows at equal samples."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.a = torch.randn(IN, TEACHER, generator=generator) / IN**0.5
        self.b = torch.randn(TEACHER, OUT, generator=generator) / TEACHER**0.5

    def batch(self, generator: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(size, IN, generator=generator)
        return x, torch.tanh(x @ self.a) @ self.b + 0.1 * torch.randn(size, OUT, generator=generator)


def held_out_loss(models: list[torch.nn.Module], teacher: Teacher) -> float:
    x, y = teacher.batch(torch.Generator().manual_seed(999), EVAL)
    with torch.no_grad():
        return sum(float(torch.nn.functional.mse_loss(m(x), y)) for m in models) / len(models)


class TimedAdam(torch.optim.Adam):
    """Adam that adds the time of its own steps to ``seconds`` (the inner steps count as compute).

    Every Adam here is ``fused=True``: on one CPU thread its step of the 11.1M parameters takes ~6 ms of
    CPU against ~57 ms for the default (per-tensor) implementation, and four peers' default steps
    alone, with their forward/backward (~32 ms), kept both cores of a 2-core machine busy (4 x 93 ms
    of CPU per 0.2 s step): under other load every configuration then ran 2-3x slower than its
    simulated compute and the default run overran 10 minutes."""

    seconds = 0.0

    def step(self, closure: Any = None) -> Any:
        started = time.perf_counter()
        try:
            return super().step(closure)
        finally:
            TimedAdam.seconds += time.perf_counter() - started


# ----- one peer (this file with --peer), in its namespace


def tx_bytes() -> int:
    """Bytes this namespace's interface has transmitted."""
    return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())


def make_optimizer(config: dict[str, Any], dht: Any, model: torch.nn.Module) -> Any:
    name, peers, inner = config["name"], config["peers"], config["inner_steps"]
    common = dict(
        dht=dht,
        run_id=f"thin_{name}_{config['seed']}",
        batch_size_per_step=BATCH,
        params=model.parameters(),
        optimizer=lambda params: TimedAdam(params, lr=LR, fused=True),
        matchmaking_time=config["matchmaking_time"],
        averaging_timeout=config["averaging_timeout"],
        # a 2 MiB chunk on one of three streams sharing 20 Mbit/s takes seconds (the default is 1 s)
        next_chunk_timeout=config["next_chunk_timeout"],
    )
    if name == "hivemind":
        import hivemind
        from hivemind.compression import Float16Compression as HivemindFloat16

        return hivemind.Optimizer(
            **common,
            target_batch_size=peers * BATCH * inner,
            use_local_updates=True,
            state_averaging_compression=HivemindFloat16(),
        )
    import hivemind_ext
    from hivemind_ext.compression import ErrorFeedback, Float16Compression, MinMaxUInt8, SparseTopK
    from hivemind_ext.optim.algorithms import DiLoCo

    # every link is the same: equal parts in every round (measured throughputs would move the part
    # boundaries from round to round: harmless to error feedback, which locates residuals by offset,
    # but noise in the bytes and times measured here)
    common["averager_opts"] = {"bandwidth": config["rate_mbit"]}
    if name == "sync":
        return hivemind_ext.Optimizer(
            **common,
            target_batch_size=peers * BATCH,
            grad_compression=Float16Compression(),
            offload_optimizer=False,
            # every step is one epoch: the state averager has nothing to add, and its background
            # rounds would share the 20 Mbit/s with the gradients'
            average_state_every=1 << 30,
        )
    if name == "overlap_sparse" or name == "streaming":
        codec: Any = ErrorFeedback(SparseTopK(density=config["density"], bits=config["bits"]))
    else:
        codec = {"diloco": Float16Compression(), "diloco8": MinMaxUInt8(), "overlap": Float16Compression()}[name]
    overlap = name.startswith("overlap") or name == "streaming"
    algorithm = DiLoCo(inner, codec=codec, overlap=overlap, fragments=config["fragments"] if name == "streaming" else 1)
    return hivemind_ext.Optimizer(**common, target_batch_size=1 << 40, algorithm=algorithm, offload_optimizer=False)


def run_peer(peer: dict[str, Any]) -> None:
    """One peer: its DHT, then each configuration in turn (a fresh model and optimizer each), in
    lockstep with the others through the driver (``ready <name>``, ``go``, ``result <json>``)."""
    import hivemind

    torch.set_num_threads(1)
    if os.environ.get("THIN_LINK_LOGS"):  # a folder: each peer's debug log there (a diagnosis)
        import logging

        logging.basicConfig(
            filename=Path(os.environ["THIN_LINK_LOGS"]) / f"peer{peer['index']}.log",
            format="%(asctime)s.%(msecs)03d %(name)s %(levelname)s: %(message)s",
            datefmt="%H:%M:%S",
        )
        logging.getLogger("hivemind_ext").setLevel(logging.DEBUG)
    dht = hivemind.DHT(host_maddrs=[f"/ip4/{peer['address']}/tcp/0"], initial_peers=peer["initial_peers"], start=True)
    print("addrs", json.dumps([str(a) for a in dht.get_visible_maddrs()]), flush=True)
    try:
        for config in peer["configs"]:
            if not train_one(peer, config, dht):
                break
    finally:
        dht.shutdown()


def finished(config: dict[str, Any], opt: Any, steps: int) -> bool:
    """Whether this peer's run of ``config`` is over: after ``steps`` inner steps, or for ``sync`` once
    the swarm has averaged ``sync_rounds`` epochs (every peer ends at the same round: how many local
    batches a peer adds to an epoch depends on when it learns that the swarm reached the target)."""
    if config["name"] == "sync":
        return opt.local_epoch >= config["sync_rounds"]
    return steps >= config["steps"]


def train_one(peer: dict[str, Any], config: dict[str, Any], dht: Any) -> bool:
    teacher, model = Teacher(), make_model(config["seed"])
    opt = make_optimizer(config, dht, model)
    try:
        # hivemind's tracker may not count every peer before its first step: do not wait long for it
        give_up = time.monotonic() + (5 if config["name"] == "hivemind" else 120)
        while opt.tracker.global_progress.num_peers < config["peers"] and time.monotonic() < give_up:
            time.sleep(0.2)
        print("ready", config["name"], flush=True)
        if sys.stdin.readline().strip() != "go":
            return False
        generator = data_stream(config["seed"], peer["index"])
        TimedAdam.seconds = compute = in_step = 0.0
        averaged: list[int] = []  # sync: the samples each epoch's round averaged (the group's total)
        sent_before, started = tx_bytes(), time.perf_counter()
        steps, slowest = 0, []  # slowest: (seconds in step() beyond the inner step, at which step)
        while not finished(config, opt, steps):
            step_started = time.perf_counter()
            x, y = teacher.batch(generator, BATCH)
            torch.nn.functional.mse_loss(model(x), y).backward()
            time.sleep(max(0.0, step_started + config["step_seconds"] - time.perf_counter()))  # the accelerator
            compute += time.perf_counter() - step_started
            step_started = time.perf_counter()
            epoch = opt.local_epoch
            opt.step()
            adam, TimedAdam.seconds = TimedAdam.seconds, 0.0
            beyond = time.perf_counter() - step_started - adam
            zeroing = time.perf_counter()
            opt.zero_grad()  # the training loop's own work (on CPU, freeing 44 MB of .grad: ~5-8 ms)
            compute += adam + time.perf_counter() - zeroing
            in_step += beyond
            steps += 1
            slowest = sorted([*slowest, (round(beyond, 3), steps)], reverse=True)[:5]
            if config["name"] == "sync" and opt.local_epoch != epoch:
                averaged.append(opt.last_epoch_samples)
        wall = time.perf_counter() - started
        impl = getattr(opt, "algorithm_impl", None)
        if hasattr(impl, "settle"):
            impl.settle()  # overlapped rounds in flight: the model every peer evaluates is after them
        sent = tx_bytes() - sent_before  # with the rounds in flight: every round of these steps counts
        # every peer stays up until all are done: a peer that left at once would fail the others' last round
        print("done", flush=True)
        if sys.stdin.readline().strip() != "finish":
            return False
        path = Path(peer["out"]) / f"{config['name']}{peer['index']}.pt"
        torch.save([p.detach().clone() for p in model.parameters()], path)
        history = [list(h) for h in list(getattr(impl, "history", []))[-6:]] if not averaged else averaged
        result = {
            "compute": compute,
            "wall": wall,
            "waited": in_step,
            "slowest": slowest,
            "bytes_per_step": sent / steps,
            "steps": steps,
            "history": history,
        }
        print("result", json.dumps(result), flush=True)
        return True
    finally:
        opt.shutdown()


# ----- the driver


class Swarm:
    """The peers: one process per namespace (tests/peer_processes.py) running the configurations in
    lockstep."""

    def __init__(self, topology: Any, peer: dict[str, Any], timeout: float) -> None:
        self.topology, self.peer = topology, peer
        self.peers = PeerProcesses(topology, timeout)

    def start(self) -> None:
        initial_peers = self._start(0, [])
        for index in range(1, len(self.topology.peers)):
            self._start(index, initial_peers)
        for index in range(1, len(self.topology.peers)):
            self.peers.expect(index, "addrs")

    def _start(self, index: int, initial_peers: list[str]) -> list[str]:
        peer = self.topology.peers[index]
        config = {**self.peer, "index": index, "address": peer.address, "initial_peers": initial_peers}
        argv = [sys.executable, str(Path(__file__).resolve()), "--peer", json.dumps(config)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.peers.start(index, argv, env=env)
        return json.loads(self.peers.expect(index, "addrs")) if index == 0 else []

    def run(self, name: str) -> list[dict[str, Any]]:
        """Runs configuration ``name`` on every peer once all are ready; every peer's result."""
        for index in range(len(self.peers)):
            if self.peers.expect(index, "ready") != name:
                raise RuntimeError(f"peer {index} is not at configuration {name}")
        self.peers.send("go")
        for index in range(len(self.peers)):
            self.peers.expect(index, "done")
        self.peers.send("finish")
        return [json.loads(self.peers.expect(i, "result")) for i in range(len(self.peers))]

    def close(self) -> None:
        self.peers.close()


def sync_reference(peers: int, steps: int, teacher: Teacher, seed: int) -> torch.nn.Module:
    """Synchronous averaging every step, in one process: Adam on the mean gradient of every peer's batch
    (the gradient of the MSE over their concatenation: the batches are equally large), all threads."""
    model = make_model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=LR, fused=True)
    generators = [data_stream(seed, index) for index in range(peers)]
    for _ in range(steps):
        opt.zero_grad()
        batches = [teacher.batch(generator, BATCH) for generator in generators]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model


def load_models(name: str, peers: int, out: Path, seed: int) -> list[torch.nn.Module]:
    """The peers' final models of configuration ``name``."""
    models = []
    for index in range(peers):
        model = make_model(seed)
        with torch.no_grad():
            for param, value in zip(model.parameters(), torch.load(out / f"{name}{index}.pt"), strict=True):
                param.copy_(value)
        models.append(model)
    return models


def summarize(results: list[dict[str, Any]], models: list[torch.nn.Module], teacher: Teacher) -> dict[str, Any]:
    """The configuration's figures: means over the peers, the held-out loss of their final models."""
    return {
        "utilization": sum(r["compute"] / r["wall"] for r in results) / len(results),
        "bytes_per_step": sum(r["bytes_per_step"] for r in results) / len(results),
        "loss": held_out_loss(models, teacher),
        "wall": max(r["wall"] for r in results),
        "waited": sum(r["waited"] for r in results) / len(results),
        "steps": sum(r["steps"] for r in results) / len(results),
        "history": results[0]["history"],
        "slowest": results[0]["slowest"],
    }


@torch.no_grad()
def max_difference(models: list[torch.nn.Module], reference: torch.nn.Module) -> float:
    """The largest difference of any parameter of any model from the reference's."""
    return max(
        float((p - q).abs().max())
        for model in models
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )


def main() -> None:
    from common import describe_machine, emit, higher_is_better, lower_is_better
    from netns import Link, Topology, unavailable_reason

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=DEFAULT_CONFIGS)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rate-mbit", type=float, default=20.0)
    parser.add_argument("--full", action="store_true", help=f"4 outer rounds: {FULL} unless given")
    parser.add_argument("--inner-steps", type=int, default=None, help=f"H (default {DEFAULT['inner_steps']})")
    parser.add_argument("--steps", type=int, default=None, help=f"inner steps per peer (default {DEFAULT['steps']})")
    parser.add_argument("--sync-rounds", type=int, default=2, help="rounds (epochs) of synchronous averaging")
    parser.add_argument("--step-seconds", type=float, default=0.2, help="simulated compute per step")
    parser.add_argument("--fragments", type=int, default=4, help="fragments of the streaming config")
    parser.add_argument("--density", type=float, default=0.25, help="top-k density of the sparse configs")
    parser.add_argument("--bits", type=int, default=4, help="bits per kept value of the sparse configs")
    parser.add_argument("--seed", type=int, default=0, help="the model's initialization and the data streams")
    parser.add_argument("--matchmaking-time", type=float, default=1.0)
    parser.add_argument("--averaging-timeout", type=float, default=60.0)
    parser.add_argument("--next-chunk-timeout", type=float, default=15.0)
    args = parser.parse_args()
    preset = FULL if args.full else DEFAULT
    inner_steps = args.inner_steps if args.inner_steps is not None else preset["inner_steps"]
    steps = args.steps if args.steps is not None else preset["steps"]
    missing = unavailable_reason()
    if missing is not None:
        raise SystemExit(f"thin_link needs network namespaces (run as root): {missing}")
    print(f"machine: {describe_machine()}; load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"H = {inner_steps}, {steps} steps, {args.step_seconds} s per step, seed {args.seed}", flush=True)
    base = dict(
        peers=args.peers,
        inner_steps=inner_steps,
        step_seconds=args.step_seconds,
        fragments=args.fragments,
        density=args.density,
        bits=args.bits,
        seed=args.seed,
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=args.averaging_timeout,
        next_chunk_timeout=args.next_chunk_timeout,
        rate_mbit=args.rate_mbit,
        sync_rounds=args.sync_rounds,
    )
    teacher = Teacher()
    measured: dict[str, dict[str, Any]] = {}
    configs = [{**base, "name": name, "steps": steps} for name in args.configs]
    began = time.perf_counter()
    with (
        tempfile.TemporaryDirectory() as out,
        Topology([Link(rate_mbit=args.rate_mbit)] * args.peers, prefix="hxtl") as topology,
    ):
        swarm = Swarm(topology, {"configs": configs, "out": out}, timeout=args.averaging_timeout * 4 + 180)
        try:
            swarm.start()
            for config in configs:
                name, started = config["name"], time.perf_counter()
                results = swarm.run(name)
                models = load_models(name, args.peers, Path(out), args.seed)
                figures = summarize(results, models, teacher)
                note = ""
                if name == "sync":
                    # per synchronous step (one round), not per local batch: a peer adds batches to an
                    # epoch until it learns that the swarm reached the target; the peers' models must
                    # agree (every peer applied the same averaged gradients); the loss at the others'
                    # samples is the in-process equivalent's
                    local = figures["bytes_per_step"]
                    figures["bytes_per_step"] = local * figures["steps"] / args.sync_rounds
                    note = (
                        f"; {args.sync_rounds} rounds over the links: {figures['steps']:.1f} local batches per "
                        f"peer ({local / 1e3:.1f} kB per batch), samples averaged per round {figures['history']}, "
                        f"held-out loss {figures['loss']:.4f}, largest parameter difference between peers "
                        f"{max_difference(models[1:], models[0]):.2e}"
                    )
                    figures["loss"] = None  # the in-process equivalent at the others' samples, once the links are idle
                measured[name] = figures
                loss = "(below)" if figures["loss"] is None else f"{figures['loss']:.4f}"
                print(
                    f"{name:>15}: utilization {figures['utilization']:6.1%}, "
                    f"{figures['bytes_per_step'] / 1e3:9.1f} kB sent per peer per step, held-out loss "
                    f"{loss} ({figures['steps']:.0f} steps in {figures['wall']:.1f} s, "
                    f"{figures['waited']:.1f} s of them in step() beyond the inner step; with set-up "
                    f"{time.perf_counter() - started:.0f} s; load {os.getloadavg()[0]:.1f})"
                    + (note or f"; last rounds: {figures['history'][-4:]}")
                    + f"; peer 0's slowest steps (s, step): {figures['slowest']}",
                    flush=True,
                )
        finally:
            swarm.close()
    if "sync" in measured:
        measured["sync"]["loss"] = held_out_loss([sync_reference(args.peers, steps, teacher, args.seed)], teacher)
        print(f"{'sync':>15}: held-out loss {measured['sync']['loss']:.4f} (in-process, {steps} steps)", flush=True)
    print(f"held-out loss of the initial model: {held_out_loss([make_model(args.seed)], teacher):.4f}")
    # the baseline of the byte goal: a butterfly all-reduce of float32 gradients every step, in which
    # each peer sends (n-1)/n of its values to the owners and (n-1)/n of its own part back
    numel = sum(p.numel() for p in make_model().parameters())
    fp32 = 2 * (args.peers - 1) / args.peers * 4 * numel
    print(f"synchronous fp32 averaging sends {fp32 / 1e6:.1f} MB per peer per step (payload, computed)")
    for name, figures in measured.items():
        print(f"{name:>15}: {fp32 / figures['bytes_per_step']:8.1f}x fewer bytes per step than sync fp32")
    if "diloco" in measured:
        for name, figures in measured.items():
            ratio = figures["loss"] / measured["diloco"]["loss"]
            print(f"{name:>15}: held-out loss {ratio:.4f}x DiLoCo fp16's")
    print(f"wall time {time.perf_counter() - began:.0f} s; load {os.getloadavg()[0]:.1f}", flush=True)
    hivemind_figures = measured.get("hivemind", {})
    theirs = {k: round(v, 5) for k, v in hivemind_figures.items() if isinstance(v, (int, float))}
    results = []
    for name, figures in measured.items():
        if name == "hivemind":
            continue
        utilization = round(figures["utilization"], 4)
        results.append(higher_is_better(f"{name} utilization", "fraction", utilization, theirs.get("utilization")))
        sent = round(figures["bytes_per_step"])
        results.append(lower_is_better(f"{name} bytes per step", "bytes/peer/step", sent, theirs.get("bytes_per_step")))
        results.append(lower_is_better(f"{name} held-out loss", "mse", round(figures["loss"], 5), theirs.get("loss")))
        results.append(higher_is_better(f"{name} fewer bytes than sync fp32", "x", round(fp32 / sent, 1), None))
        if "diloco" in measured:
            ratio = round(figures["loss"] / measured["diloco"]["loss"], 4)
            results.append(lower_is_better(f"{name} loss / DiLoCo fp16 loss", "ratio", ratio, None))
    emit("thin_link", results)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--peer":
        run_peer(json.loads(sys.argv[2]))
    else:
        main()
