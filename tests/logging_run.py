"""Run by tests/test_logging.py in a fresh interpreter (logging is process-wide state): trains small
swarms with hivemind_ext.Optimizer and prints nothing itself but phase markers on stderr, so the test
can tell which lines the library wrote in which phase.

``python tests/logging_run.py phases``:

1. ``quiet``: one peer, ``verbose=False``, no logging set-up: two epochs;
2. ``verbose``: two peers, ``verbose=True``, still no logging set-up: two epochs (with rounds);
3. ``root-after``: ``logging.basicConfig`` (lines prefixed ``ROOT``), then one verbose peer: two epochs.

``python tests/logging_run.py root-before``: ``logging.basicConfig`` first, then one verbose peer.

Each phase ends with the line ``=== <phase> done`` on stderr.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from swarm import addresses, new_peer

from hivemind_ext import Optimizer

ROOT_FORMAT = "ROOT %(name)s: %(message)s"
EPOCHS = 2


def train(opts: list[Optimizer], models: list[torch.nn.Module], *, until: float = 90.0) -> None:
    """Every optimizer in its own thread until each reaches EPOCHS (or ``until`` seconds pass)."""

    def loop(opt: Optimizer, model: torch.nn.Module) -> None:
        give_up = time.monotonic() + until
        while opt.local_epoch < EPOCHS and time.monotonic() < give_up:
            x = torch.randn(4, 8)
            torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True)).backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.02)

    threads = [threading.Thread(target=loop, args=pair) for pair in zip(opts, models, strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def peers(dhts: list, run_id: str, *, verbose: bool) -> None:
    models = [torch.nn.Linear(8, 1) for _ in dhts]
    opts = [
        Optimizer(
            dht=dht,
            run_id=run_id,
            target_batch_size=16 * len(dhts),
            batch_size_per_step=4,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
            params=model.parameters(),
            matchmaking_time=1.0,
            averaging_timeout=15.0,
            verbose=verbose,
            tracker_opts=dict(min_refresh_period=0.05, max_refresh_period=0.5, default_refresh_period=0.2),
        )
        for dht, model in zip(dhts, models, strict=True)
    ]
    try:
        train(opts, models)
    finally:
        for opt in opts:
            opt.shutdown()


def marker(phase: str) -> None:
    print(f"=== {phase} done", file=sys.stderr, flush=True)


def main(mode: str) -> None:
    first = new_peer()
    try:
        if mode == "phases":
            peers([first], "quiet", verbose=False)
            marker("quiet")
            second = new_peer(addresses(first))
            try:
                peers([first, second], "verbose", verbose=True)
            finally:
                second.shutdown()
            marker("verbose")
            logging.basicConfig(level=logging.INFO, format=ROOT_FORMAT)
            peers([first], "root-after", verbose=True)
            marker("root-after")
        elif mode == "root-before":
            logging.basicConfig(level=logging.INFO, format=ROOT_FORMAT)
            peers([first], "root-before", verbose=True)
            marker("root-before")
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    finally:
        first.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
