"""Robust aggregation at each part's owner: CenteredClip, TrimmedMean and the norm bound.

Property tests drive the pure aggregators; the reducer tests drive one part's owner; the swarm tests
run 4 real averagers on 127.0.0.1, one of which sends its values scaled by 1e6.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import hivemind
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from swarm import local_swarm

from hivemind_ext.averaging import AllreduceConfig, CenteredClip, DecentralizedAverager, TrimmedMean, WeightedMean
from hivemind_ext.averaging.allreduce.aggregators import centered_clip, norm_outliers
from hivemind_ext.averaging.allreduce.reducer import PartReducer
from hivemind_ext.compression import Float16Compression, NoCompression
from hivemind_ext.errors import ConfigurationError

# ----- the aggregators (pure)

sizes = st.integers(min_value=1, max_value=7)


@st.composite
def contributions(draw: Any, min_n: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    n, d = draw(st.integers(min_value=min_n, max_value=7)), draw(sizes)
    seed = draw(st.integers(min_value=0, max_value=2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(n, d, generator=generator, dtype=torch.float64) * draw(st.sampled_from([1e-3, 1.0, 1e3]))
    weights = torch.rand(n, generator=generator, dtype=torch.float64) * 9 + 0.5
    return values, weights


def weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (weights[:, None] * values).sum(0) / weights.sum()


aggregators = st.sampled_from(
    [
        WeightedMean(),
        CenteredClip(tau=1.0, iterations=10),
        CenteredClip(),
        CenteredClip(spread=0.5, iterations=7),
        TrimmedMean(trim=0.25),
        TrimmedMean(trim=0.0),
    ]
)


@settings(max_examples=60, deadline=None)
@given(contributions(), aggregators, st.randoms(use_true_random=False))
def test_aggregators_do_not_depend_on_the_order_of_senders(data, aggregator, random) -> None:
    values, weights = data
    order = list(range(values.shape[0]))
    random.shuffle(order)
    torch.testing.assert_close(
        aggregator.aggregate(values[order], weights[order]), aggregator.aggregate(values, weights), rtol=1e-9, atol=1e-9
    )


@settings(max_examples=60, deadline=None)
@given(contributions(), st.floats(min_value=0.1, max_value=10.0))
def test_centered_clip_is_the_weighted_mean_when_all_inputs_are_close(data, tau) -> None:
    values, weights = data
    n = values.shape[0]
    # pairwise distances <= tau / sqrt(n): every input is within tau of the coordinate-wise median
    # (and of any convex combination), so nothing is ever clipped
    spread = max(float(torch.cdist(values, values).max()), 1e-300)
    values = values * (tau / math.sqrt(n) / spread * 0.99)
    result = CenteredClip(tau=tau, iterations=5).aggregate(values, weights)
    torch.testing.assert_close(result, weighted_mean(values, weights), rtol=1e-9, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(contributions(), st.sampled_from([1.0, 1e6, 1e30]), st.integers(min_value=1, max_value=6))
def test_one_outlier_moves_centered_clip_by_at_most_tau_per_iteration(data, scale, iterations) -> None:
    values, weights = data
    tau = 0.5
    start = values.median(dim=0).values
    attacked = values.clone()
    attacked[0] = attacked[0] * scale + scale  # arbitrary values for sender 0
    honest_run = centered_clip(values, weights, tau, iterations, start)
    attacked_run = centered_clip(attacked, weights, tau, iterations, start)
    # each step's map is non-expansive (a mean of proximal maps), and sender 0's clipped offset
    # differs by at most 2 tau between the runs: at most 2 tau w_0 / sum(w) more per iteration
    bound = iterations * 2 * tau * float(weights[0] / weights.sum())
    assert float(torch.linalg.vector_norm(attacked_run - honest_run)) <= bound * (1 + 1e-9) + 1e-9


@settings(max_examples=60, deadline=None)
@given(
    contributions(min_n=3),
    st.sampled_from([1.0, 1e6, 1e30, -1e30]),
    st.sampled_from([0.5, 2.0, 4.0]),
    st.integers(min_value=1, max_value=20),
)
def test_one_outlier_at_any_scale_moves_adaptive_centered_clip_a_bounded_distance(data, scale, spread, iterations):
    values, weights = data
    attacked = values.clone()
    attacked[0] = attacked[0] * scale + scale  # arbitrary values for sender 0
    honest = values[1:]
    # with one outlier among n >= 3, the coordinate-wise median lies in the honest values' box, the
    # median distance to it is at most the box's diagonal, so tau <= spread * diagonal, and each
    # iteration moves the centre by at most tau: a bound that does not depend on the outlier
    diagonal = float(torch.linalg.vector_norm(honest.max(0).values - honest.min(0).values))
    clip = CenteredClip(spread=spread, iterations=iterations)
    assert clip.radius(attacked) <= spread * diagonal * (1 + 1e-9)
    result = clip.aggregate(attacked, weights)
    error = float(torch.linalg.vector_norm(result - weighted_mean(honest, weights[1:])))
    assert math.isfinite(error) and error <= diagonal * (1 + iterations * spread) * (1 + 1e-9) + 1e-12


@settings(max_examples=60, deadline=None)
@given(contributions(), st.sampled_from([1e-3, 0.5, 7.0, 1e4]), st.floats(min_value=-100, max_value=100))
def test_adaptive_centered_clip_follows_the_scale_and_offset_of_its_inputs(data, factor, shift) -> None:
    # tau comes from the inputs' own spread, so the rule has no units: scaling or shifting every
    # contribution scales or shifts the result (a fixed tau clips more at larger scales)
    values, weights = data
    clip = CenteredClip()
    base = clip.aggregate(values, weights)
    moved = clip.aggregate(values * factor + shift, weights)
    torch.testing.assert_close(moved, base * factor + shift, rtol=1e-7, atol=1e-7 * (abs(shift) + factor))


def test_adaptive_centered_clip_is_the_mean_of_a_normal_round_and_clips_an_outlier() -> None:
    generator = torch.Generator().manual_seed(0)
    honest = torch.randn(1, 500, generator=generator) + 0.3 * torch.randn(7, 500, generator=generator)
    weights = torch.arange(1.0, 8.0)
    # like honest gradients: equally noisy around one mean, so no one is 2x the median distance away
    torch.testing.assert_close(CenteredClip().aggregate(honest, weights), weighted_mean(honest, weights))
    flipped = torch.cat([honest, -10 * honest[:1]])  # a sign-flip attacker, within any norm bound
    all_weights = torch.cat([weights, torch.tensor([4.0])])
    tau = CenteredClip().radius(flipped)
    honest_mean = weighted_mean(honest, weights)
    error = float(torch.linalg.vector_norm(CenteredClip().aggregate(flipped, all_weights) - honest_mean))
    # at the fixed point the attacker pulls by tau * w_a / W_honest; the plain mean is ~10x further off
    plain_error = float(torch.linalg.vector_norm(weighted_mean(flipped, all_weights) - honest_mean))
    assert error <= 1.05 * tau * 4 / 28 and error < plain_error / 5


def test_adaptive_centered_clip_keeps_what_most_senders_agree_on() -> None:
    agreed = torch.tensor([1.0, -2.0, 3.0])
    values = torch.stack([agreed, agreed, agreed, torch.tensor([1e30, 0.0, 0.0]), torch.tensor([5.0, 5.0, 5.0])])
    clip = CenteredClip()
    assert clip.radius(values) == 0.0  # the median distance to the median is 0: no scale to clip with
    torch.testing.assert_close(clip.aggregate(values, torch.ones(5)), agreed)


def test_centered_clip_radius_is_fixed_when_tau_is_given() -> None:
    values = torch.randn(5, 9, generator=torch.Generator().manual_seed(2))
    assert CenteredClip(tau=0.25).radius(values) == 0.25
    assert CenteredClip(tau=0.25).radius(values * 1e6) == 0.25
    assert CenteredClip(spread=3.0).radius(values * 2) == pytest.approx(2 * CenteredClip(spread=3.0).radius(values))


@settings(max_examples=60, deadline=None)
@given(contributions())
def test_trimmed_mean_without_trimming_is_the_weighted_mean(data) -> None:
    values, weights = data
    torch.testing.assert_close(TrimmedMean(trim=0.0).aggregate(values, weights), weighted_mean(values, weights))


@settings(max_examples=60, deadline=None)
@given(contributions(min_n=3), st.sampled_from([1e6, -1e30, 0.0]))
def test_trimmed_mean_stays_within_the_honest_values_per_coordinate(data, outlier) -> None:
    values, weights = data
    n = values.shape[0]
    attacked = values.clone()
    attacked[0] = outlier
    result = TrimmedMean(trim=1 / n + 1e-9).aggregate(attacked, weights)  # trims one value per side
    assert torch.all(result >= attacked.min(0).values) and torch.all(result <= attacked.max(0).values)
    honest = values[1:]
    assert torch.all(result >= honest.min(0).values - 1e-9) and torch.all(result <= honest.max(0).values + 1e-9)


def test_norm_outliers_judges_by_the_median_only_when_it_can() -> None:
    assert norm_outliers([1.0, 2.0, 1.5, 1e6], 100) == [3]
    assert norm_outliers([1.0, 2.0, 1.5, 150.0], 100) == []  # within 100x of the median (1.75)
    assert norm_outliers([1.0, 1e6], 100) == []  # two contributions: no way to tell who is absurd
    assert norm_outliers([0.0, 0.0, 0.0, 5.0], 100) == []  # median zero: no scale to judge by
    assert norm_outliers([1.0, 1.0, math.inf, 1.0], 100) == [2]
    assert norm_outliers([1.0, 1.0, 1e6], None) == []


def test_bad_settings_are_refused() -> None:
    for make in (
        lambda: CenteredClip(tau=0.0),
        lambda: CenteredClip(tau=1.0, iterations=0),
        lambda: CenteredClip(tau=-1.0),
        lambda: CenteredClip(spread=0.0),
        lambda: CenteredClip(spread=math.inf),
        lambda: CenteredClip(tau=True),
        lambda: TrimmedMean(trim=0.5),
        lambda: AllreduceConfig(norm_bound=0.5),
        lambda: AllreduceConfig(aggregator="median"),
    ):
        with pytest.raises(ConfigurationError):
            make()


# ----- one part's owner (the reducer)

PART, CHUNK = 12, 5


def _feed(reducer: PartReducer, slices: dict[str, torch.Tensor], codec=None) -> None:
    codec = codec or NoCompression()
    for start, index in zip(range(0, PART, CHUNK), itertools.count(), strict=False):  # interleaved
        for sender, values in slices.items():
            reducer.accept(sender, index, codec.compress(values[start : start + CHUNK]))


def _slices(n: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(PART, generator=generator)
    return [base + 0.1 * torch.randn(PART, generator=generator) for _ in range(n)]


@pytest.mark.parametrize("codec", [NoCompression(), Float16Compression()])
def test_the_norm_bound_leaves_out_a_huge_contribution_exactly(codec) -> None:
    honest = _slices(3)
    weights = {"a": 1.0, "b": 2.0, "c": 3.0, "evil": 4.0}
    reducer = PartReducer(PART, CHUNK, weights)
    evil = honest[0] * 1e4 if isinstance(codec, Float16Compression) else honest[0] * 1e30  # float16: < 65504
    _feed(reducer, dict(zip(weights, [*honest, evil], strict=True)), codec)
    result = reducer.finalize()
    decoded = [codec.decompress(codec.compress(x)).float() for x in honest]
    expected = (1 * decoded[0] + 2 * decoded[1] + 3 * decoded[2]) / 6
    torch.testing.assert_close(result.values, expected)  # recomputed: no rounding left by the huge sum
    assert result.contributors == ("a", "b", "c") and set(result.rejected) == {"evil"}
    assert "median norm" in reducer.excluded["evil"]


def test_without_the_bound_the_huge_contribution_is_averaged_in() -> None:
    honest = _slices(3)
    reducer = PartReducer(PART, CHUNK, dict.fromkeys("abcd", 1.0), norm_bound=None)
    _feed(reducer, dict(zip("abcd", [*honest, honest[0] * 1e6], strict=True)))
    assert float(reducer.finalize().values.abs().max()) > 1e4


@pytest.mark.parametrize("aggregator", [CenteredClip(tau=1.0), CenteredClip(), TrimmedMean(trim=0.25)])
def test_robust_aggregators_in_the_reducer_match_the_pure_function(aggregator) -> None:
    data = _slices(4, seed=3)
    data[3] = data[3] * 50  # within the norm bound: only the aggregator deals with it
    weights = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 1.0, "idle": 0.0}
    reducer = PartReducer(PART, CHUNK, weights, aggregator=aggregator)
    _feed(reducer, dict(zip(weights, [*data, torch.full((PART,), 7.0)], strict=True)))
    result = reducer.finalize()
    weights_ = torch.tensor([1.0, 2.0, 3.0, 1.0])  # robust aggregation is per chunk (the owner streams each back)
    expected = torch.cat([aggregator.aggregate(block, weights_) for block in torch.stack(data).split(CHUNK, dim=1)])
    torch.testing.assert_close(result.values, expected)
    assert result.contributors == ("a", "b", "c", "d", "idle") and not result.rejected


def test_a_sender_retracted_mid_part_leaves_a_robust_aggregate_of_the_others() -> None:
    data = _slices(4, seed=5)
    weights = dict.fromkeys("abcd", 1.0)
    reducer = PartReducer(PART, CHUNK, weights, aggregator=CenteredClip(tau=0.5))
    for sender, values in zip("abc", data, strict=False):
        for index, start in enumerate(range(0, PART, CHUNK)):
            reducer.accept(sender, index, NoCompression().compress(values[start : start + CHUNK]))
    reducer.accept("d", 0, NoCompression().compress(data[3][:CHUNK]))
    reducer.exclude("d", "connection lost")
    result = reducer.finalize()
    blocks = torch.stack(data[:3]).split(CHUNK, dim=1)
    expected = torch.cat([CenteredClip(tau=0.5).aggregate(block, torch.ones(3)) for block in blocks])
    torch.testing.assert_close(result.values, expected)
    assert result.contributors == ("a", "b", "c")


# ----- four real averagers, one of them hostile

SIZE = 4000
ATTACKER = 3
WEIGHTS = (2.0, 3.0, 4.0, 1.0)  # sample counts; the attacker claims an ordinary one
_prefixes = itertools.count()


@pytest.fixture(scope="module")
def swarm() -> Iterator[list[hivemind.DHT]]:
    with local_swarm(4) as dhts:
        yield dhts


def _contributions() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    base = torch.randn(SIZE, generator=generator)
    honest = [base + 0.1 * torch.randn(SIZE, generator=generator) for _ in range(4)]
    honest[ATTACKER] = honest[ATTACKER] * 1e6  # finite, but absurd
    return honest


def _attacked_round(dhts: Sequence[hivemind.DHT], **options: Any) -> list[DecentralizedAverager]:
    prefix = f"robust-test-{next(_prefixes)}"
    contributions = _contributions()
    group = [
        DecentralizedAverager(
            [contributions[i].clone()],
            dht,
            prefix=prefix,
            target_group_size=4,
            min_matchmaking_time=30.0,
            request_timeout=2.0,
            start=True,
            **options,
        )
        for i, dht in enumerate(dhts)
    ]
    pool = concurrent.futures.ThreadPoolExecutor(4)
    futures = [
        pool.submit(averager.step, timeout=15 if i == ATTACKER else 45, weight=WEIGHTS[i])
        for i, averager in enumerate(group)
    ]
    for i, future in enumerate(futures):
        if i != ATTACKER:
            future.result(timeout=60)
    # the attacker's own values are left out of every part: its step may fail ("averaged nothing"), or wait
    # for results nobody sends until its timeout; the caller's shutdown of its averager ends it sooner
    pool.shutdown(wait=False)
    return group


def _honest_mean() -> torch.Tensor:
    contributions = _contributions()
    honest = [i for i in range(4) if i != ATTACKER]
    return sum(WEIGHTS[i] * contributions[i] for i in honest) / sum(WEIGHTS[i] for i in honest)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_plain_averaging_excludes_a_huge_contribution_by_default(swarm: list[hivemind.DHT]) -> None:
    group = _attacked_round(swarm)  # no robustness option: the default norm bound
    try:
        expected, attacker = _honest_mean(), str(group[ATTACKER].peer_id)
        for index, averager in enumerate(group):
            if index == ATTACKER:
                continue
            with averager.get_tensors() as tensors:
                torch.testing.assert_close(tensors[0], expected, rtol=1e-5, atol=1e-5)
            report = averager.last_round
            assert report is not None and "median norm" in report.excluded.get(attacker, "")
    finally:
        for averager in group:
            averager.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("tau", [3.0, None])
def test_centered_clip_keeps_the_average_close_to_the_honest_mean(swarm: list[hivemind.DHT], tau) -> None:
    # fixed: tau 3 per part (1000 values), where honest peers are ~4.5 apart; adaptive: twice the
    # median distance to the coordinate-wise median there (~2 x 2.7)
    group = _attacked_round(swarm, aggregator=CenteredClip(tau=tau, iterations=20), norm_bound=None)
    try:
        expected = _honest_mean()
        for index, averager in enumerate(group):
            if index == ATTACKER:
                continue
            with averager.get_tensors() as tensors:
                error = float(torch.linalg.vector_norm(tensors[0] - expected))
            # at the fixed point the attacker pulls each of the 4 parts by tau * w_a / W_honest = 1/3
            # (0.67 in all) with tau 3, ~0.6 (1.2 in all) adaptive; the plain mean is off by ~6e6
            assert error < (1.0 if tau else 2.0), error
            assert averager.last_round is not None and averager.last_round.excluded == {}
    finally:
        for averager in group:
            averager.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_the_optimizer_hands_the_aggregator_to_its_averagers(swarm: list[hivemind.DHT]) -> None:
    import hivemind_ext

    clip = CenteredClip(tau=0.5, iterations=5)
    model = torch.nn.Linear(4, 2)
    opt = hivemind_ext.Optimizer(
        dht=swarm[0],
        run_id=f"robust-opt-{next(_prefixes)}",
        batch_size_per_step=4,
        target_batch_size=16,
        params=model.parameters(),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        averager_opts=dict(aggregator=clip, norm_bound=30.0),
    )
    try:
        averagers = [opt.grad_averager, opt.state_averager]
        assert all(a is not None and a.allreduce_config.aggregator == clip for a in averagers)
        assert all(a.allreduce_config.norm_bound == 30.0 for a in averagers)
    finally:
        opt.shutdown()
