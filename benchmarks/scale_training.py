"""scale.py's training case (issue 14): 16 peers train a small MLP on sklearn's digits with synchronous
gradient averaging, once in rotating groups of 4 (``averager_opts=dict(target_group_size=4)``) and
once in one group of all 16, on the same swarm, the same initial parameters and the same batches,
every peer until it reaches ``epochs`` (each epoch is ``target_batch_size`` samples when rounds keep
up with the steps; the samples processed are reported, since slow rounds let peers accumulate more;
stopping every peer after a fixed number of samples instead ended runs before any round).
Reported per case: the held-out loss and accuracy (mean over the peers' final models), the spread
of parameters across peers (the largest distance of a peer's parameters from the peers' mean,
relative to the mean's largest value), the samples, epochs reached and seconds. The goal: groups
of 4 within 2% of one group of 16 in held-out loss.

Peers are kept light for a small shared machine: threads of one process, each with its own
hivemind DHT and libp2p daemon (every peer must have its own peer id), a 64-32-10 MLP (2,410
parameters), batches of 8, and no state averaging beyond the Optimizer's default.
"""

from __future__ import annotations

import contextlib
import secrets
import statistics
import threading
import time
import traceback
from typing import Any

import torch
from algorithms import FAST_TRACKER, BatchStream, evaluate, local_swarm
from common import Digits, load_digits
from hivemind.utils.crypto import RSAPrivateKey

HIDDEN = 32


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)  # every peer, both cases: the same initial parameters
    return torch.nn.Sequential(torch.nn.Linear(64, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 10))


def relative_spread(params: list[torch.Tensor]) -> float:
    """The largest distance of a peer's parameters from the peers' mean, relative to the mean's size."""
    mean = torch.stack(params).mean(0)
    return max(float((p - mean).abs().max()) for p in params) / float(mean.abs().max())


def train_case(
    dhts: list[Any],
    keys: list[RSAPrivateKey],
    data: Digits,
    *,
    group: int | None,
    epochs: int,
    batch: int,
    steps_per_epoch: int,
    lr: float,
    timeout: float,
) -> dict[str, Any]:
    """Every peer trains until it reaches ``epochs``; ``group``: target_group_size (None: one group)."""
    import hivemind_ext

    peers = len(dhts)
    models = [small_model() for _ in dhts]
    averager_opts = dict(target_group_size=group) if group is not None else {}
    run_id = f"scale_digits_{group or peers}_{secrets.token_hex(3)}"
    optimizers = [
        hivemind_ext.Optimizer(
            dht=dht,
            run_id=run_id,
            target_batch_size=peers * batch * steps_per_epoch,
            batch_size_per_step=batch,
            optimizer=lambda p: torch.optim.Adam(p, lr=lr),
            params=model.parameters(),
            matchmaking_time=3.0,
            averaging_timeout=30.0,
            shutdown_timeout=2.0,
            tracker_opts={**FAST_TRACKER, "private_key": key},
            averager_opts=averager_opts,
        )
        for dht, model, key in zip(dhts, models, keys, strict=True)
    ]
    samples = [0] * peers
    errors: list[str] = []
    stop = threading.Event()

    def train(index: int) -> None:
        opt, model = optimizers[index], models[index]
        stream = BatchStream(data, index, batch)
        try:
            while opt.local_epoch < epochs and not stop.is_set():
                x, y = stream.next_batch()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                samples[index] += len(x)
                time.sleep(0.02)
        except Exception:
            errors.append(f"peer {index}: {traceback.format_exc()}")
            stop.set()

    try:
        threads = [threading.Thread(target=train, args=(i,), daemon=True) for i in range(peers)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(1.0, started + timeout - time.monotonic()))
        seconds = time.monotonic() - started
        stop.set()
        for thread in threads:
            thread.join(30)
        finished = [opt.local_epoch for opt in optimizers]
        scores = [evaluate(model, data) for model in models]
        params = [torch.cat([p.detach().flatten() for p in model.parameters()]) for model in models]
        initial = torch.cat([p.detach().flatten() for p in small_model().parameters()])
    finally:
        for opt in optimizers:
            with contextlib.suppress(Exception):
                opt.shutdown()
    return dict(
        loss=statistics.mean(s[0] for s in scores),
        accuracy=statistics.mean(s[1] for s in scores),
        spread=relative_spread(params),
        moved=relative_spread([params[0], initial]),
        samples=sum(samples),
        epochs=(min(finished), max(finished)),
        seconds=seconds,
        error=errors[0].strip().splitlines()[-1][:200] if errors else None,
    )


def compare_groups(
    peers: int = 16, group: int = 4, epochs: int = 12, batch: int = 8, steps_per_epoch: int = 2, timeout: float = 200.0
) -> dict[str, dict[str, Any]]:
    """Both cases on one swarm of ``peers`` DHTs: ``{"groups": ..., "one group": ...}``."""
    data = load_digits()
    keys = [RSAPrivateKey() for _ in range(peers)]
    outcomes = {}
    # 16 daemons start at once and ping each other on a small machine: longer start-up and RPC timeouts
    with local_swarm(peers, startup_timeout=120, wait_timeout=10) as dhts:
        for name, size in ((f"groups of {group}", group), ("one group", None)):
            outcome = train_case(
                dhts,
                keys,
                data,
                group=size,
                epochs=epochs,
                batch=batch,
                steps_per_epoch=steps_per_epoch,
                lr=0.01,
                timeout=timeout,
            )
            outcomes[name] = outcome
            error = f", ERROR {outcome['error']}" if outcome["error"] else ""
            print(
                f"digits, {peers} peers, {name}: held-out loss {outcome['loss']:.4f}, "
                f"accuracy {outcome['accuracy']:.3f}, spread {outcome['spread']:.4f} (moved {outcome['moved']:.3f}), "
                f"{outcome['samples']} samples, epochs {outcome['epochs']}, {outcome['seconds']:.0f} s{error}",
                flush=True,
            )
    return outcomes
