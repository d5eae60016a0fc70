"""Gradient averaging in hops with real peers: 4 peers (threads of one process, each with its own DHT
and daemon) in rotating groups of 2, ``grad_averaging_hops=2``: after one epoch every peer's averaged
gradient is the global mean, weighted by samples (one hop gives only its pair's mean). The rules as
pure functions: ``test_grad_hops.py``."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch
from optim_swarm import FAST_TRACKER, quiet_hivemind
from swarm import local_swarm

import hivemind_ext

PEERS, GROUP = 4, 2
BATCHES = (1, 2, 3, 4)  # samples per step of each peer: the mean is weighted by them


def peer_gradient(index: int) -> torch.Tensor:
    return torch.tensor([float(index + 1) ** 2, -3.0 * index, 10.0 if index == 0 else 0.0])


@pytest.mark.timeout(60)
def test_two_hops_of_pairs_give_four_peers_the_global_weighted_mean() -> None:
    expected = sum(b * peer_gradient(i) for i, b in enumerate(BATCHES)) / sum(BATCHES)
    # each peer takes two steps (its gradient, its batch size), the second once the swarm has seen
    # every first one (lockstep, as benchmarks/scale_training.py): one more sample than the first
    # steps ends the epoch, and every peer's second step joins its round
    all_but_last = sum(BATCHES)
    with quiet_hivemind(), local_swarm(PEERS) as dhts:
        params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(PEERS)]
        optimizers = []
        try:
            for dht, param in zip(dhts, params, strict=True):
                optimizers.append(
                    hivemind_ext.Optimizer(
                        dht=dht,
                        run_id="grad_hops_peers",
                        target_batch_size=all_but_last + 1,
                        optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
                        params=[param],
                        matchmaking_time=2.0,
                        averaging_timeout=15.0,
                        shutdown_timeout=2.0,
                        average_state_every=1000,  # no parameter rounds: they would mix what the hops left
                        tracker_opts=dict(FAST_TRACKER),
                        averager_opts=dict(target_group_size=GROUP),
                        grad_averaging_hops=2,
                    )
                )
            errors: list[str] = []

            def train(index: int) -> None:
                opt, param = optimizers[index], params[index]
                try:
                    for step in range(2):
                        if step == 1:
                            deadline = time.monotonic() + 30
                            while opt.tracker.global_progress.samples_accumulated < all_but_last:
                                if opt.local_epoch > 0 or time.monotonic() > deadline:
                                    break
                                time.sleep(0.05)
                        param.grad = peer_gradient(index).clone()
                        opt.step(batch_size=BATCHES[index])
                except Exception as e:  # reported below, with the peer
                    errors.append(f"peer {index}: {e!r}")

            threads = [threading.Thread(target=train, args=(i,), daemon=True) for i in range(PEERS)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(45)
            assert not errors, errors
            assert [opt.local_epoch for opt in optimizers] == [1] * PEERS
            for index, opt in enumerate(optimizers):
                assert len(opt.last_round_samples) == GROUP, (index, opt.last_round_samples)  # the first hop: a pair
                assert opt.engine.hops.last_hops == [GROUP], index  # the second hop: another pair
                assert opt.last_epoch_samples == 2 * sum(BATCHES), index  # the mean covers every sample
                with opt.grad_averager.use_averaged_gradients() as (averaged,):
                    assert torch.allclose(averaged, expected, atol=1e-5), (index, averaged, expected)
                assert torch.allclose(params[index].detach(), -expected, atol=1e-5), index  # SGD, lr 1
        finally:
            for opt in optimizers:
                with contextlib.suppress(Exception):
                    opt.shutdown()
