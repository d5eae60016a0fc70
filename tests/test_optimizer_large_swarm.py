"""The Optimizer in a swarm larger than its groups: 8 peers (threads of one process, each with its own
DHT and daemon, see optim_swarm) averaging in rotating groups of 4 (``averager_opts``), with
synchronous gradients and with DiLoCo; local updates with 4 of them in rotating groups of 2 (cheaper,
the same mixing: N = M^2)."""

from __future__ import annotations

import functools

import pytest
import torch
from optim_swarm import FAST_TRACKER, quiet_hivemind, run_swarm
from swarm import local_swarm

from hivemind_ext.optim.algorithms import DiLoCo

PEERS, GROUP = 8, 4
SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.5)


@pytest.fixture(scope="module")
def dhts():
    with quiet_hivemind(), local_swarm(PEERS) as swarm:
        yield swarm


def relative_spread(params: list[torch.Tensor]) -> float:
    """The largest distance of a peer's parameters from the peers' mean, relative to the mean's size."""
    mean = torch.stack(params).mean(0)
    return max(float((p - mean).abs().max()) for p in params) / float(mean.abs().max())


def mean_loss(run, epochs) -> float:
    losses = [s.loss for log in run.logs for s in log.steps if s.epoch_before in epochs]
    return sum(losses) / len(losses)


def small_groups(**kwargs) -> dict:
    """Optimizer settings of the 4-peer runs in rotating groups of 2 (``kwargs`` on top)."""
    return dict(
        matchmaking_time=2.0,
        averaging_timeout=15.0,
        tracker_opts=dict(FAST_TRACKER),
        shutdown_timeout=2.0,
        averager_opts=dict(target_group_size=2),
        target_batch_size=64,
        optimizer=SGD,
        **kwargs,
    )


def losses_at(run, steps: slice) -> float:
    losses = [s.loss for log in run.logs for s in log.steps[steps]]
    return sum(losses) / len(losses)


@pytest.mark.timeout(150)
def test_eight_peers_average_gradients_in_rotating_groups_of_four(dhts) -> None:
    # Before RoundDriver(in_groups=...), the first group to finish moved the swarm's epoch on and the
    # peers still matchmaking abandoned their round ("the swarm finished this epoch's round without
    # this peer") and stepped alone. (Local updates and DiLoCo in groups: see benchmarks/scale.py.)
    mode, target_epoch = "sync_gradients", 4
    run = run_swarm(
        dhts,
        run_id=f"large_swarm_{mode}",
        target_epoch=target_epoch,
        optimizer_kwargs=dict(
            matchmaking_time=2.0,
            averaging_timeout=15.0,
            tracker_opts=dict(FAST_TRACKER),
            shutdown_timeout=2.0,
            averager_opts=dict(target_group_size=GROUP),
            target_batch_size=128,
            optimizer=SGD,
        ),
        sleep=0.05,
        max_seconds=90.0,
    )
    errors = [f"peer {log.index}: {log.error!r}" for log in run.logs if log.error is not None]
    assert not errors, errors
    assert all(opt.local_epoch >= target_epoch for opt in run.optimizers), [o.local_epoch for o in run.optimizers]
    assert not run.warnings, run.warnings
    rounds = [r.report for log in run.logs for r in log.epochs.values() if r.report is not None]
    assert rounds and all(2 <= report.group_size <= GROUP for report in rounds), [r.group_size for r in rounds]
    # the groups rotate: over the epochs, most peers averaged with more peers than one group holds
    met = [set().union(*(r.samples_per_peer for r in log.epochs.values())) for log in run.logs]
    assert sum(len(peers) > GROUP for peers in met) >= PEERS // 2, [len(peers) for peers in met]
    first, last = mean_loss(run, {0}), mean_loss(run, {target_epoch - 1})
    assert last < 0.7 * first, f"loss {first:.4f} -> {last:.4f}"
    spread = relative_spread([run.final_params(i) for i in range(PEERS)])
    moved = relative_spread([run.final_params(0), run.initial_params[0]])
    print(f"{mode}: {run.seconds:.1f} s, loss {first:.3f} -> {last:.3f}, spread {spread:.4f} (moved {moved:.3f})")
    assert spread < 0.25 * moved, "peers' parameters drifted apart"


@pytest.mark.timeout(90)
def test_diloco_in_rotating_groups_keeps_peers_together(dhts) -> None:
    # Groups keep their own pace, so a group often holds peers of two round indices. Before the outer
    # state (anchor, momentum) was averaged with each round, each member applied its group's mean
    # pseudo-gradient to its own anchor: the groups' anchors parted for good, and a group of mixed round
    # indices sent its members into retries (no step) and state downloads.
    peers, inner_steps, target_epoch = PEERS, 4, 3
    run = run_swarm(
        dhts[:peers],
        run_id="large_swarm_diloco",
        target_epoch=target_epoch,
        optimizer_kwargs=dict(
            small_groups(algorithm=DiLoCo(inner_steps, outer_lr=0.7, outer_momentum=0.5)),
            averager_opts=dict(target_group_size=GROUP),
            target_batch_size=128,
        ),
        sleep=0.05,
        max_seconds=60.0,
    )
    errors = [f"peer {log.index}: {log.error!r}" for log in run.logs if log.error is not None]
    assert not errors, errors
    impls = [opt.algorithm_impl for opt in run.optimizers]
    histories = [[kind for _, kind, _, _ in impl.history] for impl in impls]
    loads = [impl.state_loads for impl in impls]
    params = [run.final_params(i) for i in range(peers)]
    spread, moved = relative_spread(params), relative_spread([params[0], run.initial_params[0]])
    first, last = losses_at(run, slice(0, inner_steps)), losses_at(run, slice(-inner_steps, None))
    print(f"diloco: {run.seconds:.1f} s, loss {first:.3f} -> {last:.3f}, spread {spread:.4f} (moved {moved:.3f})")
    # every round but a peer's last (whose partners may have stopped) stepped with a group; nobody downloaded
    assert all(len(h) >= 2 and all(kind == "swarm" for kind in h[:-1]) for h in histories), histories
    assert loads == [0] * peers, loads
    assert last < 0.3 * first, f"loss {first:.4f} -> {last:.4f}"
    # measured after: 0.03-0.06 of the distance moved in 5 runs on a quiet machine, 0.07-0.09 in 3 CI tries
    # (2 loaded cores: groups of uneven pace mix less within 3 rounds); before: 0.04-0.25 in 5 runs, with
    # retries or state downloads in 2. The history and loads checks above catch those; this bound catches
    # the anchors parting for good (it is not violated by every run of the old code)
    assert spread < 0.2 * moved, "peers' outer states drifted apart"


@pytest.mark.timeout(90)
def test_local_updates_in_rotating_groups_keep_peers_together(dhts) -> None:
    # parameters averaged in rotating groups of 2 at every epoch's end, applied before the next epoch
    peers, target_epoch = 4, 3
    run = run_swarm(
        dhts[:peers],
        run_id="large_swarm_local_updates",
        target_epoch=target_epoch,
        optimizer_kwargs=small_groups(use_local_updates=True, delay_state_averaging=False),
        sleep=0.05,
        max_seconds=60.0,
    )
    errors = [f"peer {log.index}: {log.error!r}" for log in run.logs if log.error is not None]
    assert not errors, errors
    params = [run.final_params(i) for i in range(peers)]
    spread, moved = relative_spread(params), relative_spread([params[0], run.initial_params[0]])
    first, last = mean_loss(run, {0}), mean_loss(run, {target_epoch - 1})
    print(f"local: {run.seconds:.1f} s, loss {first:.3f} -> {last:.3f}, spread {spread:.4f} (moved {moved:.3f})")
    assert last < 0.3 * first, f"loss {first:.4f} -> {last:.4f}"
    # measured: 0.05 of the distance moved (every peer ends on its last group's mean)
    assert spread < 0.15 * moved, "peers' parameters drifted apart"
