import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hivemind_ext.averaging.allreduce.partition import MemberRole, chunk_bounds, part_bounds, part_sizes
from hivemind_ext.errors import ConfigurationError


def test_sizes_follow_bandwidth_and_client_mode_owns_nothing() -> None:
    roles = [MemberRole(100.0), MemberRole(300.0), MemberRole(1000.0, client_mode=True), MemberRole(100.0)]
    assert part_sizes(1000, roles) == [200, 600, 0, 200]


def test_auxiliary_peers_own_parts() -> None:
    assert part_sizes(10, [MemberRole(1.0), MemberRole(1.0, auxiliary=True)]) == [5, 5]


def test_zero_bandwidths_split_evenly_and_all_clients_is_an_error() -> None:
    assert part_sizes(7, [MemberRole(0.0), MemberRole(0.0)]) == [4, 3]
    with pytest.raises(ConfigurationError):
        part_sizes(7, [MemberRole(1.0, client_mode=True)])
    with pytest.raises(ConfigurationError):
        part_sizes(7, [MemberRole(float("nan"))])


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    total=st.integers(0, 10**9),
    roles=st.lists(
        st.builds(MemberRole, st.floats(0, 1e10, allow_nan=False), st.booleans(), st.booleans()),
        min_size=1,
        max_size=64,
    ),
)
def test_sizes_are_exact_proportional_and_deterministic(total: int, roles: list[MemberRole]) -> None:
    if all(r.client_mode for r in roles):
        return
    sizes = part_sizes(total, roles)
    assert sum(sizes) == total and all(s >= 0 for s in sizes)
    assert all(size == 0 for size, role in zip(sizes, roles, strict=True) if role.client_mode)
    weights = [0.0 if r.client_mode else r.bandwidth for r in roles]
    if sum(weights) > 0:
        for size, w in zip(sizes, weights, strict=True):
            assert abs(size - total * w / sum(weights)) < 1 + 1e-6 * total
    assert part_sizes(total, roles) == sizes


def test_bounds() -> None:
    assert part_bounds([3, 0, 2]) == [(0, 3), (3, 3), (3, 5)]
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(0, 4) == []
