"""Shared plumbing for the benchmarks: timing, the machine description, and the final JSON line.

Every benchmark ends its output with one JSON line:
``{"benchmark": NAME, "results": [{"case", "metric", "ours", "hivemind", "speedup"}, ...]}``
where ``speedup`` > 1 means hivemind_ext is better.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy
import torch


@dataclass
class Result:
    case: str
    metric: str
    ours: float | None
    hivemind: float | None
    speedup: float | None


def higher_is_better(case: str, metric: str, ours: float | None, hivemind: float | None) -> Result:
    """For throughputs: speedup = ours / hivemind."""
    speedup = ours / hivemind if ours is not None and hivemind else None
    return Result(case, metric, ours, hivemind, _round(speedup))


def lower_is_better(case: str, metric: str, ours: float | None, hivemind: float | None) -> Result:
    """For times and errors: speedup = hivemind / ours."""
    speedup = hivemind / ours if ours and hivemind is not None else None
    return Result(case, metric, ours, hivemind, _round(speedup))


def _round(value: float | None) -> float | None:
    return None if value is None else float(f"{value:.4g}")


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1, sync: Callable[[], None] | None = None):
    """Median wall time of ``fn`` over ``repeats`` runs after ``warmup`` runs (``sync`` waits for a device)."""
    sync = sync or (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def describe_machine() -> str:
    import hivemind

    cuda = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA"
    return (
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, {cuda}; "
        f"python {platform.python_version()}, torch {torch.__version__}, numpy {numpy.__version__}, "
        f"hivemind {hivemind.__version__}"
    )


def start(parser: argparse.ArgumentParser, detail: str = "") -> argparse.Namespace:
    """Parses the command line, makes stdout line-buffered (progress shows at once when piped to a log)
    and prints the machine line, with the load average beside it (every figure here is noisy) and
    ``detail`` after it."""
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)
    print(f"machine: {describe_machine()}; load {os.getloadavg()[0]:.1f}{detail}")
    return args


def butterfly_bytes(peers: int, numel: int) -> float:
    """Bytes each peer must send (and receive) in a butterfly all-reduce of ``numel`` float32 values:
    its slice of every other peer's part, then the other peers' slices of its average."""
    return 2 * (peers - 1) / peers * numel * 4


# ----- one averaging group of a given size (group_formation.py, robust.py)


def full_group_averager(impl: str, tensors: list[torch.Tensor], dht: Any, prefix: str, peers: int, **extra: Any) -> Any:
    """hivemind's DecentralizedAverager (``impl == "hivemind"``) or ours, started, that averages only in a
    group of all ``peers`` (waiting up to 30 s for it); ``extra`` goes to ours only (e.g. ``aggregator``)."""
    settings: dict[str, Any] = dict(
        prefix=prefix,
        target_group_size=peers,
        min_group_size=peers,
        min_matchmaking_time=30.0,
        request_timeout=3.0,
        start=True,
    )
    if impl == "hivemind":
        from hivemind.averaging import DecentralizedAverager as HivemindAverager

        return HivemindAverager(tensors, dht, **settings)
    from hivemind_ext.averaging import DecentralizedAverager

    return DecentralizedAverager(tensors, dht, **settings, **extra)


def emit(benchmark: str, results: list[Result]) -> None:
    """Prints the closing JSON line of the output contract."""
    print(json.dumps({"benchmark": benchmark, "results": [asdict(r) for r in results]}), flush=True)


# ----- the digits problem (algorithms.py, robust.py)


@dataclass
class Digits:
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


def digits_mlp(hidden: int, seed: int = 0) -> torch.nn.Module:
    """The digits classifier: 64 pixels -> two hidden ReLU layers -> 10 classes; one seed, one initialisation."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


def load_digits() -> Digits:
    from sklearn.datasets import load_digits as sklearn_digits

    data = sklearn_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    test, train = order[:300], order[300:]
    return Digits(x[train], y[train], x[test], y[test])
