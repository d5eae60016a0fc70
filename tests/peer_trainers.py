"""Optimizer peers that train a small regression task in threads: the one set of helpers for the
multi-peer Optimizer tests (``test_optimizer_peers.py``, ``test_verified_state.py``)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import hivemind
import torch
from optim_swarm import FAST_TRACKER, signing_key

import hivemind_ext

TARGET_BATCH_SIZE = 32
BATCH_SIZE = 4
LR = 0.01
MATCHMAKING_TIME = 1.0
AVERAGING_TIMEOUT = 5.0


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def make_optimizer(dht: hivemind.DHT, model: torch.nn.Module, run_id: str, **kwargs: Any) -> hivemind_ext.Optimizer:
    """An Optimizer with short test timings (Adam, lr ``LR``); ``kwargs`` override any keyword."""
    options: dict[str, Any] = dict(
        dht=dht,
        run_id=run_id,
        target_batch_size=TARGET_BATCH_SIZE,
        batch_size_per_step=BATCH_SIZE,
        optimizer=lambda params: torch.optim.Adam(params, lr=LR),
        params=model.parameters(),
        matchmaking_time=MATCHMAKING_TIME,
        averaging_timeout=AVERAGING_TIMEOUT,
        load_state_timeout=30.0,
        tracker_opts=dict(FAST_TRACKER, private_key=signing_key(dht)),
    )
    options.update(kwargs)
    return hivemind_ext.Optimizer(**options)


def params_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same_params(first: Sequence[torch.Tensor], second: Sequence[torch.Tensor], atol: float = 1e-6) -> bool:
    return all(torch.allclose(a, b, rtol=0, atol=atol) for a, b in zip(first, second, strict=True))


def assert_same_params(first: torch.nn.Module, second: torch.nn.Module) -> None:
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)


@dataclass
class Trainer:
    """One peer's training loop, run in a thread: a regression task, one micro-batch per step()."""

    opt: hivemind_ext.Optimizer
    model: torch.nn.Module
    seed: int
    step_seconds: list[float] = field(default_factory=list)
    history: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # epoch -> params when first reached
    latest: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # epoch -> params after its last step
    error: BaseException | None = None

    @property
    def steps(self) -> int:
        return len(self.step_seconds)

    def record(self) -> None:
        params = params_of(self.model)
        self.history.setdefault(self.opt.local_epoch, params)
        self.latest[self.opt.local_epoch] = params  # differs from history after a state download in the epoch

    def step_once(self, generator: torch.Generator) -> None:
        x = torch.randn(BATCH_SIZE, 16, generator=generator)
        loss = ((self.model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        loss.backward()
        started = time.perf_counter()
        self.opt.step()
        self.step_seconds.append(time.perf_counter() - started)
        self.record()
        self.opt.zero_grad()

    def train(self, until_epoch: int, *, deadline: float, pause: float = 0.02, stop: threading.Event | None = None):
        generator = torch.Generator().manual_seed(self.seed * 1000 + self.steps)
        try:
            while self.opt.local_epoch < until_epoch and time.monotonic() < deadline:
                if stop is not None and stop.is_set():
                    return
                self.step_once(generator)
                time.sleep(pause)
        except BaseException as e:
            self.error = e
            raise


def train_together(trainers: Sequence[Trainer], until_epoch: int, *, seconds: float = 60.0, **kwargs: Any) -> None:
    """Trains ``trainers`` in threads until each reaches ``until_epoch``; fails on a timeout or an error."""
    deadline = time.monotonic() + seconds
    threads = [
        threading.Thread(target=t.train, args=(until_epoch,), kwargs=dict(deadline=deadline, **kwargs), daemon=True)
        for t in trainers
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0) + 10)
    for trainer in trainers:
        assert trainer.error is None, f"peer {trainer.seed} failed: {trainer.error!r}"
        assert trainer.opt.local_epoch >= until_epoch, (
            f"peer {trainer.seed} reached epoch {trainer.opt.local_epoch} of {until_epoch} in {seconds} s"
        )


def make_trainers(
    dhts: Sequence[hivemind.DHT], optimizers: list[hivemind_ext.Optimizer], count: int, run_id: str, **kwargs: Any
) -> list[Trainer]:
    """``count`` peers on ``dhts[:count]``, all from the same initial model (as synchronous training
    assumes); their optimizers go into ``optimizers`` (a :func:`shutting_down` list)."""
    trainers = []
    for index in range(count):
        model = make_model(seed=0)
        optimizers.append(make_optimizer(dhts[index], model, run_id, **kwargs))
        trainers.append(Trainer(optimizers[-1], model, seed=index))
    return trainers


@contextlib.contextmanager
def shutting_down(optimizers: list[hivemind_ext.Optimizer] | None = None) -> Iterator[list[hivemind_ext.Optimizer]]:
    """Yields ``optimizers`` (a new list by default) and shuts every optimizer in it down at exit."""
    optimizers = [] if optimizers is None else optimizers
    try:
        yield optimizers
    finally:
        for opt in optimizers:
            opt.shutdown()
