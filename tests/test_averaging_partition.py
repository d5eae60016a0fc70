import math

import pytest
import scipy.optimize
from hypothesis import given, settings
from hypothesis import strategies as st

from hivemind_ext.averaging.allreduce.partition import (
    MemberRole,
    chunk_bounds,
    optimal_fractions,
    part_bounds,
    part_sizes,
    planned_fractions,
    predicted_time,
)
from hivemind_ext.errors import ConfigurationError

roles_strategy = st.lists(
    st.builds(MemberRole, st.floats(0, 1e10, allow_nan=False), st.booleans(), st.booleans()), min_size=1, max_size=64
)


def lp_optimum(roles: list[MemberRole]) -> float:
    """The minimal predicted time, by a linear program (scipy) over the fractions and the time t:
    min t s.t. load_i(f) <= t B_i, sum f = 1, f >= 0, f_i = 0 for client-mode members."""
    n, contributors = len(roles), sum(not r.auxiliary for r in roles)
    rows, bounds = [], []
    for i, role in enumerate(roles):
        own = 0 if role.auxiliary else 1
        row = [0.0] * (n + 1)
        row[i], row[n] = (contributors - own) - own, -role.bandwidth
        rows.append((row, -own))
        bounds.append((0, 0) if role.client_mode else (0, None))
    result = scipy.optimize.linprog(
        c=[0.0] * n + [1.0],
        A_ub=[row for row, _ in rows],
        b_ub=[rhs for _, rhs in rows],
        A_eq=[[1.0] * n + [0.0]],
        b_eq=[1.0],
        bounds=[*bounds, (0, None)],
    )
    assert result.status == 0, result.message
    return result.x[n]


def test_a_slow_peer_gets_no_part_when_that_is_optimal() -> None:
    # the case: one peer at 20 Mbit/s, three at 100; the slow one still sends and receives
    # its whole vector once (1 x S / 20), which is more than the fast ones need with a third each
    roles = [MemberRole(20.0), MemberRole(100.0), MemberRole(100.0), MemberRole(100.0)]
    fractions = optimal_fractions(roles)
    assert fractions[0] == 0 and fractions[1:] == pytest.approx([1 / 3] * 3)
    assert predicted_time(fractions, roles) == pytest.approx(1 / 20)  # t_opt: 6.71 s for 16 MiB at 20 Mbit/s
    assert predicted_time([0.25] * 4, roles) == pytest.approx(1.5 / 20)  # the even split: 10.07 s
    assert part_sizes(1000, roles) == [0, 334, 333, 333]


def test_the_optimum_gives_a_slightly_slower_peer_a_smaller_part() -> None:
    roles = [MemberRole(80.0), MemberRole(100.0), MemberRole(100.0), MemberRole(100.0)]
    fractions = optimal_fractions(roles)
    assert 0 < fractions[0] < 0.25 < fractions[1] == fractions[2] == fractions[3]
    times = [(1 + 2 * f) / role.bandwidth for f, role in zip(fractions, roles, strict=True)]
    assert times == pytest.approx([times[0]] * 4)  # water-filled: everyone finishes together
    assert part_sizes(1000, [MemberRole(5.0)] * 4) == [250] * 4
    # what part_sizes plans with: within a factor 2 of the median counts as noise, a clearly slower peer does not
    assert part_sizes(1000, roles) == [250] * 4
    assert part_sizes(1000, [MemberRole(40.0)] + [MemberRole(100.0)] * 3) == [0, 334, 333, 333]


def test_client_mode_owns_nothing_and_auxiliary_peers_own_parts() -> None:
    roles = [MemberRole(100.0), MemberRole(100.0), MemberRole(1000.0, client_mode=True), MemberRole(100.0)]
    assert part_sizes(999, roles) == [333, 333, 0, 333]
    # an auxiliary member sends no slices of its own: at 3x the bandwidth it can take everything (3 x 1 / 3 = 1)
    assert part_sizes(10, [MemberRole(1.0)] * 3 + [MemberRole(3.0, auxiliary=True)]) == [0, 0, 0, 10]
    # a lone contributor owns everything: then nothing crosses the network
    assert part_sizes(10, [MemberRole(1.0), MemberRole(1.0, auxiliary=True)]) == [10, 0]
    # with two contributors every split costs them one vector each: parts follow bandwidth
    assert part_sizes(1000, [MemberRole(100.0), MemberRole(300.0), MemberRole(100.0, auxiliary=True)]) == [
        200,
        600,
        200,
    ]


def test_noisy_equal_bandwidths_keep_the_even_split() -> None:
    # measured within a few percent: water-filling would give 0.22..0.27, promising < 10% less time
    roles = [MemberRole(100.0), MemberRole(104.0), MemberRole(97.0), MemberRole(102.0)]
    assert min(optimal_fractions(roles)) < 0.23 and max(optimal_fractions(roles)) > 0.27
    assert planned_fractions(roles) == [0.25] * 4
    assert part_sizes(100, roles) == [25] * 4
    # within a factor 2 of the median (a busy CPU, a late start): the same link, as far as we can tell
    noisy = [MemberRole(60.0), MemberRole(100.0), MemberRole(130.0), MemberRole(180.0), MemberRole(90.0)]
    assert planned_fractions(noisy) == [0.2] * 5


def test_zero_bandwidths_split_evenly_and_all_clients_is_an_error() -> None:
    assert part_sizes(7, [MemberRole(0.0), MemberRole(0.0)]) == [4, 3]
    with pytest.raises(ConfigurationError):
        part_sizes(7, [MemberRole(1.0, client_mode=True)])
    for bad in (float("nan"), math.inf, -1.0):
        with pytest.raises(ConfigurationError):
            part_sizes(7, [MemberRole(bad), MemberRole(1.0)])


@settings(max_examples=120, deadline=None, derandomize=True)
@given(total=st.integers(0, 10**9), roles=roles_strategy)
def test_sizes_are_exact_deterministic_and_never_worse_than_the_even_split(total: int, roles: list[MemberRole]) -> None:
    if all(r.client_mode for r in roles):
        return
    sizes = part_sizes(total, roles)
    assert sum(sizes) == total and all(s >= 0 for s in sizes)
    assert all(size == 0 for size, role in zip(sizes, roles, strict=True) if role.client_mode)
    assert part_sizes(total, roles) == sizes
    fractions = planned_fractions(roles)
    owners = sum(not r.client_mode for r in roles)
    even = [0.0 if r.client_mode else 1 / owners for r in roles]
    optimum, even_time = predicted_time(fractions, roles), predicted_time(even, roles)
    assert optimum <= even_time * (1 + 1e-9) or math.isinf(even_time)
    if total >= 10**6 and math.isfinite(optimum):  # integer sizes cost at most one value per member
        assert predicted_time([s / total for s in sizes], roles) <= optimum * (1 + 1e-4) + 1e-12


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    roles=st.lists(st.builds(MemberRole, st.floats(0.01, 1000), st.booleans(), st.booleans()), min_size=3, max_size=12)
)
def test_fractions_reach_the_linear_programs_optimum(roles: list[MemberRole]) -> None:
    if all(r.client_mode for r in roles) or sum(not r.auxiliary for r in roles) <= 2:
        return
    assert predicted_time(optimal_fractions(roles), roles) == pytest.approx(lp_optimum(roles), rel=1e-6)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(roles=roles_strategy, scale=st.sampled_from([1e-300, 1e-20, 1.0, 1e20, 1e290]))
def test_fractions_do_not_depend_on_the_unit(roles: list[MemberRole], scale: float) -> None:
    if all(r.client_mode for r in roles):
        return
    scaled = [MemberRole(r.bandwidth * scale, r.client_mode, r.auxiliary) for r in roles]
    if any(0 < s.bandwidth < 1e-290 for s in scaled):  # subnormal bandwidths lose their ratios
        return
    assert optimal_fractions(scaled) == pytest.approx(optimal_fractions(roles), abs=1e-9)


def test_bounds() -> None:
    assert part_bounds([3, 0, 2]) == [(0, 3), (3, 3), (3, 5)]
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(0, 4) == []
