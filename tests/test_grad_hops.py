"""Gradient averaging in hops (``Optimizer(grad_averaging_hops=...)``), as pure functions: the setting's
validation and the combinations it is refused with, the hop schedule (how many hops, when a hop gives
up its search), and the model of hops over the rotation (after ``d`` hops of groups of ``M``, ``M**d``
peers hold the global weighted mean). The real peers: ``test_grad_hops_peers.py``."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import pytest

from hivemind_ext.averaging.matchmaking.rotation import (
    grid_digits,
    initial_digits,
    next_digits,
    rotation_groups,
    shard_depth,
)
from hivemind_ext.errors import ConfigurationError
from hivemind_ext.optim.config import OptimizerConfig
from hivemind_ext.optim.hops import MAX_HOPS, check_hops, hop_count, hop_plan, hop_prefix, weighted_mean_after_hops


def config(**changes: Any) -> OptimizerConfig:
    settings: dict[str, Any] = dict(
        dht_client_mode=False,
        optimizer_from_factory=True,
        custom_grad_averager=False,
        client_mode=None,
        delay_optimizer_step=None,
        delay_grad_averaging=False,
        offload_optimizer=None,
        use_local_updates=False,
        matchmaking_time=None,
        averaging_timeout=None,
        allreduce_timeout=None,
        next_chunk_timeout=None,
        run_id="run",
        target_batch_size=64,
        batch_size_per_step=None,
        load_state_timeout=60.0,
        reuse_grad_buffers=False,
        delay_state_averaging=True,
        average_state_every=1,
        auxiliary=False,
        performance_ema_alpha=0.1,
        shutdown_timeout=5.0,
        verbose=False,
    )
    settings.update(changes)
    return OptimizerConfig.resolve(**settings)


# ----- the setting


def test_the_default_is_one_hop_as_before() -> None:
    assert config().grad_averaging_hops == 1


@pytest.mark.parametrize("hops", [1, 2, MAX_HOPS, "auto"])
def test_valid_hops_are_kept(hops: Any) -> None:
    assert config(grad_averaging_hops=hops).grad_averaging_hops == hops
    assert check_hops(hops) == hops


@pytest.mark.parametrize("hops", [0, -1, MAX_HOPS + 1, True, False, 2.0, "2", "AUTO", None, [2]])
def test_bad_hops_are_refused_with_a_configuration_error(hops: Any) -> None:
    with pytest.raises(ConfigurationError, match="grad_averaging_hops must be an integer"):
        config(grad_averaging_hops=hops)


@pytest.mark.parametrize("hops", [2, "auto"])
def test_hops_are_refused_with_local_updates_and_with_custom_algorithms(hops: Any) -> None:
    with pytest.raises(ConfigurationError, match="use_local_updates"):
        config(grad_averaging_hops=hops, use_local_updates=True)
    with pytest.raises(ConfigurationError, match="custom algorithm"):
        config(grad_averaging_hops=hops, custom_algorithm=True, offload_optimizer=False)
    # one hop is what those modes do anyway
    assert config(grad_averaging_hops=1, use_local_updates=True).use_local_updates
    assert config(grad_averaging_hops=1, custom_algorithm=True, offload_optimizer=False).custom_algorithm


# ----- the schedule


@pytest.mark.parametrize(
    ("setting", "swarm", "group", "hops"),
    [
        (1, 16, 4, 1),
        (3, 16, 4, 3),  # an explicit number is kept, whatever the swarm
        ("auto", 16, 4, 2),
        ("auto", 17, 4, 3),
        ("auto", 64, 4, 3),
        ("auto", 65, 4, 4),
        ("auto", 4, 4, 1),  # one group holds the whole swarm
        ("auto", 3, 4, 1),
        ("auto", 1, 4, 1),
        ("auto", 4, 2, 2),
        ("auto", 1000, 8, 4),
        ("auto", 10**9, 2, MAX_HOPS),  # capped
        ("auto", 16, None, 1),  # one group of everyone: one round gives the global mean
        ("auto", 16, 1, 1),
    ],
)
def test_hop_count(setting: Any, swarm: int, group: int | None, hops: int) -> None:
    assert hop_count(setting, swarm_size=swarm, group_size=group) == hops


def test_each_hop_has_its_own_board_and_a_search_cut_off() -> None:
    prefixes = [hop_prefix("run_grad_averager", hop) for hop in range(MAX_HOPS)]
    assert prefixes[0] == "run_grad_averager"  # the first round is today's gradient round
    assert len(set(prefixes)) == MAX_HOPS
    scheduled, deadline = hop_plan(100.0, matchmaking_time=3.0, averaging_timeout=30.0)
    assert (scheduled, deadline) == (106.0, 136.0)  # two matchmaking times, as a round that expects peers


# ----- the model: hops over the rotation


def simulate_hops(coordinates: dict[str, tuple[int, ...]], *, base: int, hops: int) -> list[list[list[str]]]:
    """The groups of each hop when every peer looks at once (rotation_groups), the digits dealt as the
    averagers deal them."""
    rounds = []
    depth = shard_depth(len(coordinates), base)
    for _ in range(hops):
        groups = rotation_groups(coordinates, base=base, depth=depth)
        for members in groups:
            group_id = hashlib.sha256("/".join(members).encode()).digest()
            for index, peer in enumerate(members):
                coordinates[peer] = next_digits(coordinates[peer], group_id, index, len(members), base)
        rounds.append(groups)
    return rounds


def spread_after(coordinates: dict[str, tuple[int, ...]], *, base: int, hops: int, seed: int = 0) -> float:
    rng = random.Random(seed)
    values = {peer: rng.uniform(-1, 1) for peer in coordinates}
    weights = {peer: float(rng.randint(1, 9)) for peer in coordinates}
    target = sum(values[p] * weights[p] for p in values) / sum(weights.values())
    state = weighted_mean_after_hops(values, weights, simulate_hops(dict(coordinates), base=base, hops=hops))
    return max(abs(value - target) for value, _ in state.values())


@pytest.mark.parametrize(("base", "dims"), [(2, 2), (4, 2), (2, 3), (4, 3)])
def test_on_a_grid_d_hops_give_every_peer_the_global_weighted_mean(base: int, dims: int) -> None:
    peers = {f"peer{i}": grid_digits(i, base, dims) for i in range(base**dims)}
    assert spread_after(peers, base=base, hops=dims) < 1e-12
    assert spread_after(peers, base=base, hops=dims - 1) > 1e-3  # one hop fewer: only groups' means


@pytest.mark.parametrize("seed", range(5))
def test_with_hashed_coordinates_m_squared_peers_reach_the_global_mean_in_two_hops(seed: int) -> None:
    # the first hop forms full groups (shards, then fallbacks); its deal gives their members distinct
    # last digits, so each shard of the second hop holds one member of each group
    peers = {f"p{seed}-{i}": initial_digits(f"p{seed}-{i}", 4) for i in range(16)}
    assert spread_after(peers, base=4, hops=2, seed=seed) < 1e-12
    assert spread_after(peers, base=4, hops=1, seed=seed) > 1e-3


def test_the_covered_weight_is_what_the_next_hop_weighs_a_mean_by() -> None:
    values, weights = {"a": 1.0, "b": 3.0, "c": 10.0}, {"a": 1.0, "b": 1.0, "c": 2.0}
    state = weighted_mean_after_hops(values, weights, [[["a", "b"]], [["a", "c"]]])
    assert state["a"][0] == pytest.approx(((1 + 3) + 10 * 2) / 4)
    assert state["a"][1] == 4 and state["b"] == (2.0, 2.0) and state["c"] == state["a"]
