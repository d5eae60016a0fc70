"""Start-up time of a peer: from process start to its first ``opt.step()``, phase by phase, for
``hivemind_ext.Optimizer`` next to ``hivemind.Optimizer`` on the same work in the same run.

Each measurement runs in a fresh Python process (imports are only slow once per process), which
times: the imports (torch, hivemind, the library), the DHT's start, torch's first optimizer (which
imports ``torch._dynamo``: the same for both libraries and for plain torch), the Optimizer's
constructor, and its first ``step()``. Two cases: a peer alone, and a peer joining a live 1-peer swarm (a donor in
this process, same library, a few epochs ahead, so the newcomer's first step downloads its state).
Repeats alternate between the libraries; the benchmark prints the medians and their ratio.

    python benchmarks/startup.py
    python benchmarks/startup.py --repeats 5 --library-path /work/main   # another checkout's code
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
PHASES = ("import", "dht", "torch_optimizer", "constructor", "first_step", "total")
TARGET_BATCH_SIZE = 256
BATCH_SIZE = 16
HIDDEN = 256


def make_model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 10))


def optimizer_kwargs(library: str, dht: Any, model: Any) -> dict[str, Any]:
    import torch

    kwargs = dict(
        dht=dht,
        run_id=f"startup_{library}",
        target_batch_size=TARGET_BATCH_SIZE,
        batch_size_per_step=BATCH_SIZE,
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-3),
        params=model.parameters(),
        matchmaking_time=2.0,
        averaging_timeout=10.0,
        load_state_timeout=60.0,
    )
    if library == "hivemind":
        kwargs["verbose"] = False
    return kwargs


def batch_step(model: Any, opt: Any) -> None:
    import torch

    x = torch.randn(BATCH_SIZE, 64)
    loss = torch.nn.functional.cross_entropy(model(x), torch.randint(0, 10, (BATCH_SIZE,)))
    loss.backward()
    opt.step()
    opt.zero_grad()


# ----- the measured process


def measure(library: str, initial_peers: list[str], spawned: float) -> dict[str, float]:
    """Runs in a fresh process that its parent spawned at ``spawned`` (``time.monotonic()``, one clock
    for every process of the machine); the interpreter's own start counts as part of the imports."""
    started = spawned
    marks = {}
    import hivemind
    import torch

    if library == "hivemind_ext":
        import hivemind_ext

        optimizer_class = hivemind_ext.Optimizer
    else:
        optimizer_class = hivemind.Optimizer
    marks["import"] = time.monotonic()
    dht = hivemind.DHT(start=True, host_maddrs=LOOPBACK, initial_peers=initial_peers)
    marks["dht"] = time.monotonic()
    # torch's own cost, the same for every library: the first torch.optim optimizer of a process imports
    # torch._dynamo (its methods are wrapped in torch._disable_dynamo); without this line, it would be
    # counted in the constructor below, which builds one
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    marks["torch_optimizer"] = time.monotonic()
    model = make_model()
    opt = optimizer_class(**optimizer_kwargs(library, dht, model))
    marks["constructor"] = time.monotonic()
    batch_step(model, opt)
    marks["first_step"] = time.monotonic()
    epoch = opt.local_epoch
    opt.shutdown()
    dht.shutdown()
    phases, previous = {}, started
    for name in PHASES[:-1]:
        phases[name] = marks[name] - previous
        previous = marks[name]
    phases["total"] = marks["first_step"] - started
    phases["epoch"] = epoch
    return phases


def run_child(library: str, initial_peers: list[str], library_path: str | None) -> dict[str, float]:
    env = dict(os.environ)
    if library_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [library_path, env.get("PYTHONPATH")]))
    started = time.monotonic()
    command = [sys.executable, __file__, "--child", library, "--spawned", repr(started), "--initial-peers"]
    output = subprocess.run([*command, *initial_peers], env=env, capture_output=True, text=True, timeout=300)
    wall = time.monotonic() - started
    lines = [line for line in output.stdout.splitlines() if line.startswith("{")]
    if output.returncode != 0 or not lines:
        raise RuntimeError(f"the {library} start-up process failed:\n{output.stdout[-3000:]}\n{output.stderr[-3000:]}")
    result = json.loads(lines[-1])
    result["process"] = wall
    return result


# ----- the donor of the "join" case


class Donor:
    """A live peer of the same library, a few epochs ahead, in this process."""

    def __init__(self, library: str) -> None:
        import hivemind

        self.dht = hivemind.DHT(start=True, host_maddrs=LOOPBACK)
        self.model = make_model()
        if library == "hivemind_ext":
            import hivemind_ext

            optimizer_class = hivemind_ext.Optimizer
        else:
            optimizer_class = hivemind.Optimizer
        self.opt = optimizer_class(**optimizer_kwargs(library, self.dht, self.model))
        while self.opt.local_epoch < 2:  # alone, each epoch ends after TARGET_BATCH_SIZE samples
            batch_step(self.model, self.opt)

    @property
    def initial_peers(self) -> list[str]:
        return [str(maddr) for maddr in self.dht.get_visible_maddrs()]

    def shutdown(self) -> None:
        self.opt.shutdown()
        self.dht.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--baseline-path",
        default=None,
        help="also measure hivemind_ext from this checkout (e.g. the code before a change)",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--spawned", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:  # before importing anything heavy: the imports are measured
        print(json.dumps(measure(args.child, args.initial_peers, args.spawned)), flush=True)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import describe_machine, emit, lower_is_better

    print(f"machine: {describe_machine()}")
    print(f"PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE', '')!r}, load {os.getloadavg()}")
    variants = [("ours", "hivemind_ext", None), ("hivemind", "hivemind", None)]
    if args.baseline_path is not None:
        variants.insert(1, ("baseline", "hivemind_ext", args.baseline_path))
    samples: dict[tuple[str, str], list[dict[str, float]]] = {}
    for case in ("alone", "join"):
        donors = {}
        try:
            if case == "join":  # the baseline joins the current code's donor (the same protocol)
                donors = {library: Donor(library) for library in ("hivemind_ext", "hivemind")}
            for _ in range(args.repeats):
                for label, library, path in variants:
                    peers = donors[library].initial_peers if case == "join" else []
                    result = run_child(library, peers, path)
                    samples.setdefault((case, label), []).append(result)
                    print(
                        f"{case:5s} {label:8s} "
                        + " ".join(f"{k} {result[k]:5.2f}" for k in (*PHASES, "process"))
                        + f" | epoch after the first step {result['epoch']}"
                    )
        finally:
            for donor in donors.values():
                donor.shutdown()
    results = []
    for case in ("alone", "join"):
        medians = {
            label: {phase: statistics.median(run[phase] for run in samples[(case, label)]) for phase in PHASES}
            for label, _, _ in variants
        }
        for label, _, _ in variants:
            print(f"median {case:5s} {label:8s} " + " ".join(f"{p} {medians[label][p]:5.2f}" for p in PHASES))
        for phase in PHASES:
            results.append(lower_is_better(f"{case}: {phase}", "s", medians["ours"][phase], medians["hivemind"][phase]))
            if args.baseline_path is not None:
                results.append(
                    lower_is_better(
                        f"{case}: {phase}, code at {args.baseline_path}",
                        "s",
                        medians["baseline"][phase],
                        medians["hivemind"][phase],
                    )
                )
    emit("startup", results)


if __name__ == "__main__":
    main()
