"""Auxiliary peers never make training slower (issue 11 item 4): with real peers on 127.0.0.1.

An auxiliary peer has no gradients of its own; it only helps reduce. With one trainer there is nothing
to average, so the auxiliary peer must stay out of the way: the trainer steps alone, as fast as without
it. With two trainers it takes part in their rounds, and the result is their weighted mean.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import hivemind
import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey
from swarm import local_swarm, wait_for

import hivemind_ext
from hivemind_ext.optim.auxiliary import run_auxiliary_peer

MATCHMAKING_TIME = 1.0
AVERAGING_TIMEOUT = 5.0
TARGET_BATCH_SIZE = 32
BATCH_SIZE = 4
FAST_TRACKER = dict(min_refresh_period=0.05, max_refresh_period=0.5, default_refresh_period=0.2)
MEASURE_SECONDS = 5.0  # a lone trainer makes 2-3 epochs a second even at load 50

pytestmark = pytest.mark.slow


class ConstantGradient(torch.nn.Module):
    """The gradient is the same constant ``c`` on every peer: each epoch moves the weights by exactly
    ``-lr * c`` when the round averages the trainers' gradients (an auxiliary peer's weight is 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(64))
        self.register_buffer("c", torch.arange(1.0, 65.0) / 64)

    def forward(self) -> torch.Tensor:
        return (self.weight * self.c).sum()


def make_trainer(
    dht: hivemind.DHT, run_id: str, average_state_every: int = 1
) -> tuple[hivemind_ext.Optimizer, ConstantGradient]:
    model = ConstantGradient()
    opt = hivemind_ext.Optimizer(
        dht=dht,
        run_id=run_id,
        target_batch_size=TARGET_BATCH_SIZE,
        batch_size_per_step=BATCH_SIZE,
        optimizer=lambda params: torch.optim.SGD(params, lr=1.0),
        params=model.parameters(),
        matchmaking_time=MATCHMAKING_TIME,
        averaging_timeout=AVERAGING_TIMEOUT,
        average_state_every=average_state_every,
        tracker_opts=dict(FAST_TRACKER, private_key=RSAPrivateKey()),
    )
    return opt, model


class Loop:
    """Runs ``step`` in a thread until stopped; keeps the first error."""

    def __init__(self, step: Any, name: str) -> None:
        self.step, self.error, self.result = step, None, None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        try:
            self.result = self.step(self.stop)
        except BaseException as e:
            self.error = e
            raise

    def __enter__(self) -> Loop:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)
        assert not self.thread.is_alive(), f"{self.thread.name} did not stop"
        assert self.error is None, f"{self.thread.name} failed: {self.error!r}"


def training_loop(opt: hivemind_ext.Optimizer, model: ConstantGradient, pause: float = 0.01) -> Any:
    def run(stop: threading.Event) -> None:
        while not stop.is_set():
            model().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(pause)

    return run


def aux_loop(dht: hivemind.DHT, run_id: str) -> Any:
    def run(stop: threading.Event) -> int:
        return run_auxiliary_peer(
            dht,
            run_id=run_id,
            target_batch_size=TARGET_BATCH_SIZE,
            matchmaking_time=MATCHMAKING_TIME,
            averaging_timeout=AVERAGING_TIMEOUT,
            tracker_opts=dict(FAST_TRACKER, private_key=RSAPrivateKey()),
            stop=stop,
            on_status=lambda line: None,
        )

    return run


def check_weighted_mean(opt: hivemind_ext.Optimizer, model: ConstantGradient) -> None:
    """Every epoch moved the weights by exactly ``-c``: the trainers' (equal) gradients, averaged with
    the auxiliary peer's given no weight."""
    torch.testing.assert_close(model.weight.detach(), -model.c * opt.local_epoch, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(150)
def test_an_auxiliary_peer_never_slows_a_lone_trainer() -> None:
    """Two runs at the same time (so that the machine's load hits both alike): a trainer alone, and a
    trainer with an auxiliary peer. The second must train about as fast as the first."""
    with local_swarm(3) as dhts:
        solo, solo_model = make_trainer(dhts[0], "solo")
        helped, helped_model = make_trainer(dhts[1], "helped")
        try:
            with Loop(aux_loop(dhts[2], "helped"), "aux") as aux:
                # the auxiliary peer is in the run before the trainer's first epoch ends
                wait_for(lambda: helped.tracker.fetch_now().num_peers == 2, 30, message="the auxiliary peer")
                with Loop(training_loop(solo, solo_model), "solo"), Loop(training_loop(helped, helped_model), "helped"):
                    time.sleep(1.0)  # warm up: first epochs, first DHT reads
                    start = (solo.local_epoch, helped.local_epoch)
                    time.sleep(MEASURE_SECONDS)
                    end = (solo.local_epoch, helped.local_epoch)
            solo_epochs, helped_epochs = end[0] - start[0], end[1] - start[1]
            print(f"epochs in {MEASURE_SECONDS} s: alone {solo_epochs}, with an auxiliary peer {helped_epochs}")
            assert solo_epochs >= 5, f"the lone trainer made only {solo_epochs} epochs in {MEASURE_SECONDS} s"
            assert helped_epochs >= 0.8 * solo_epochs, (
                f"with an auxiliary peer the trainer made {helped_epochs} epochs in {MEASURE_SECONDS} s, "
                f"alone {solo_epochs}: the auxiliary peer slowed it down"
            )
            assert aux.result == 0, f"the auxiliary peer joined {aux.result} rounds of a single trainer"
            check_weighted_mean(solo, solo_model)
            check_weighted_mean(helped, helped_model)
        finally:
            solo.shutdown()
            helped.shutdown()


@pytest.mark.timeout(150)
def test_an_auxiliary_peer_helps_two_trainers() -> None:
    with local_swarm(3) as dhts:
        trainers: Sequence[tuple[hivemind_ext.Optimizer, ConstantGradient]] = [
            make_trainer(dhts[i], "pair", average_state_every=1000) for i in range(2)
        ]
        try:
            with Loop(aux_loop(dhts[2], "pair"), "aux") as aux:
                wait_for(lambda: trainers[0][0].tracker.fetch_now().num_peers == 3, 30, message="the auxiliary peer")
                loops = [
                    Loop(training_loop(opt, model, pause=0.05), f"trainer{i}")
                    for i, (opt, model) in enumerate(trainers)
                ]
                for loop in loops:
                    loop.__enter__()
                try:
                    wait_for(
                        lambda: any(
                            (report := opt.grad_averager.last_round) is not None and report.group_size == 3
                            for opt, _ in trainers
                        ),
                        60,
                        message="a round with the auxiliary peer",
                    )
                    wait_for(lambda: min(opt.local_epoch for opt, _ in trainers) >= 3, 60, message="epoch 3")
                finally:
                    for loop in loops:
                        loop.__exit__()
            assert aux.result is not None and aux.result > 0, f"the auxiliary peer helped {aux.result} rounds"
            for opt, model in trainers:
                check_weighted_mean(opt, model)
        finally:
            for opt, _ in trainers:
                opt.shutdown()
