"""Peers for the DiLoCo / AsyncModelAverage tests: real Optimizers (threads, each with its own DHT from
:func:`swarm.local_swarm`) on a linear regression with a known loss floor, the training loop, a
round hook that fails one round, and a swarm that a peer joins late."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import hivemind
import torch
from optim_swarm import signing_key
from swarm import wait_for

from hivemind_ext import Optimizer
from hivemind_ext.optim.algorithms import Algorithm
from hivemind_ext.optim.rounds import RoundHooks

FAST_TRACKER = dict(min_refresh_period=0.05, max_refresh_period=0.5, default_refresh_period=0.2)
MATCHMAKING_TIME = 0.3
AVERAGING_TIMEOUT = 5.0
FEATURES = 8
BATCH = 16
W_TRUE = torch.linspace(-1.0, 1.0, FEATURES).unsqueeze(1)
NOISE = 0.1  # the loss floor is NOISE**2 = 0.01


def make_optimizer(
    dht: hivemind.DHT,
    params: Sequence[torch.nn.Parameter],
    run_id: str,
    algorithm: Algorithm | None,
    *,
    lr: float = 0.1,
    target_batch_size: int = 10_000,
    round_hooks: RoundHooks | None = None,
) -> Optimizer:
    return Optimizer(
        dht=dht,
        run_id=run_id,
        target_batch_size=target_batch_size,
        batch_size_per_step=BATCH,
        optimizer=lambda p: torch.optim.SGD(p, lr=lr),
        params=list(params),
        matchmaking_time=MATCHMAKING_TIME,
        averaging_timeout=AVERAGING_TIMEOUT,
        offload_optimizer=False,
        shutdown_timeout=2.0,
        # one tracker key per peer: in one process every DHT shares hivemind's process-wide key
        tracker_opts={**FAST_TRACKER, "private_key": signing_key(dht)},
        algorithm=algorithm,
        round_hooks=round_hooks,
    )


def linear_model(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(FEATURES, 1)


def batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(BATCH, FEATURES, generator=generator)
    return x, x @ W_TRUE + NOISE * torch.randn(BATCH, 1, generator=generator)


def test_loss(model: torch.nn.Module) -> float:
    generator = torch.Generator().manual_seed(12345)
    x = torch.randn(2048, FEATURES, generator=generator)
    y = x @ W_TRUE + NOISE * torch.randn(2048, 1, generator=generator)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), y))


test_loss.__test__ = False  # a helper, not a test


def train_step(model: torch.nn.Module, opt: Optimizer, generator: torch.Generator) -> None:
    x, y = batch(generator)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def run_peers(worker: Callable[[int], None], count: int, timeout: float = 90.0) -> None:
    errors: list[BaseException] = []

    def wrapped(index: int) -> None:
        try:
            worker(index)
        except BaseException as e:  # re-raised in the test thread below
            errors.append(e)

    threads = [threading.Thread(target=wrapped, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(t.is_alive() for t in threads), "a peer's training loop hung"
    if errors:
        raise errors[0]


class FailOneRound(RoundHooks):
    """The round driver's seam: this peer's ``index``-th round (from 0) fails as if it timed out."""

    def __init__(self, index: int) -> None:
        self.index, self.rounds = index, 0

    def before_round(self, control: Any, *, watch_swarm: bool) -> None:
        self.rounds += 1
        if self.rounds == self.index + 1:
            raise TimeoutError("injected: the round did not finish before its deadline")


class LateJoinSwarm:
    """``len(dhts) - 1`` peers that train from the start (seed 0) and a last one (other initial
    parameters, seed 1) that joins once the others are far enough: its worker calls :meth:`join`.
    ``opts[-1]`` is None until then. A context manager: every optimizer shuts down on exit."""

    def __init__(self, dhts: Sequence[hivemind.DHT], run_id: str, algorithm: Algorithm, **kwargs: Any) -> None:
        self.dhts, self.run_id, self.algorithm, self.kwargs = list(dhts), run_id, algorithm, kwargs
        self.models = [linear_model(seed=0) for _ in self.dhts[:-1]] + [linear_model(seed=1)]
        self.opts: list[Any] = [
            make_optimizer(d, m.parameters(), run_id, algorithm, **kwargs)
            for d, m in zip(self.dhts[:-1], self.models[:-1], strict=True)
        ] + [None]
        self.joined = threading.Event()

    def join(self, ready: Callable[[Optimizer], bool], what: str, timeout: float = 60.0, **kwargs: Any) -> Optimizer:
        """Waits until ``ready(opt)`` holds for every early peer, then starts the joiner's optimizer (with
        ``kwargs`` of :func:`make_optimizer` on top of the swarm's, e.g. its own ``round_hooks``)."""
        wait_for(lambda: all(ready(opt) for opt in self.opts[:-1]), timeout, message=what)
        self.opts[-1] = make_optimizer(
            self.dhts[-1], self.models[-1].parameters(), self.run_id, self.algorithm, **{**self.kwargs, **kwargs}
        )
        self.joined.set()
        return self.opts[-1]

    def __enter__(self) -> LateJoinSwarm:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for opt in self.opts:
            if opt is not None:
                opt.shutdown()
