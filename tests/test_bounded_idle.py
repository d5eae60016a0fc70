"""BoundedIdle: idle values kept per key and in all, oldest dropped first beyond either bound."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hivemind_ext.p2p.bounded_idle import BoundedIdle


def pool(max_per_key: int, max_total: int) -> tuple[BoundedIdle[str, int], list[tuple[str, int]]]:
    dropped: list[tuple[str, int]] = []
    return BoundedIdle(max_per_key, max_total, lambda key, value: dropped.append((key, value))), dropped


def test_the_per_key_bound_drops_that_keys_oldest() -> None:
    idle, dropped = pool(2, 10)
    for value, key in enumerate("aabbab"):
        assert idle.add(key, value)
    assert dropped == [("a", 0), ("b", 2)]
    assert (len(idle), idle.count("a"), idle.count("b"), idle.count("c")) == (4, 2, 2, 0)
    assert idle.take("a") == 4 and idle.take("a") == 1 and idle.take("a") is None  # newest first


def test_the_total_bound_drops_the_oldest_of_anyone() -> None:
    idle, dropped = pool(5, 3)
    for value, key in enumerate("abca"):
        idle.add(key, value)
    assert dropped == [("a", 0)]
    idle.add("d", 4)
    assert dropped == [("a", 0), ("b", 1)]
    assert [idle.take(key) for key in "abcd"] == [3, None, 2, 4]
    assert len(idle) == 0 and dropped == [("a", 0), ("b", 1)]  # taken values are not dropped


def test_a_zero_bound_drops_at_once() -> None:
    for bounds in ((0, 5), (5, 0)):
        idle, dropped = pool(*bounds)
        assert not idle.add("a", 1)
        assert dropped == [("a", 1)] and len(idle) == 0 and 1 not in idle


def test_discard_keeps_drop_drops_and_drop_all() -> None:
    idle, dropped = pool(3, 3)
    for value, key in enumerate("aab"):
        idle.add(key, value)
    assert idle.discard(1) and not idle.discard(1) and 1 not in idle
    assert dropped == [] and idle.count("a") == 1
    idle.drop(0)
    idle.drop(0)  # no longer kept: nothing happens
    assert dropped == [("a", 0)] and idle.count("a") == 0 and idle.take("a") is None
    idle.add("c", 3)
    idle.drop_all()
    assert dropped == [("a", 0), ("b", 2), ("c", 3)] and len(idle) == 0


@given(st.integers(1, 4), st.integers(1, 6), st.lists(st.sampled_from("abc"), max_size=40))
def test_bounds_hold_and_every_value_is_kept_or_dropped_once(per_key: int, total: int, keys: list[str]) -> None:
    idle, dropped = pool(per_key, total)
    for value, key in enumerate(keys):
        idle.add(key, value)
        assert len(idle) <= total and all(idle.count(k) <= per_key for k in "abc")
    kept: dict[str, list[int]] = {key: [] for key in "abc"}
    for key in "abc":
        while (value := idle.take(key)) is not None:
            kept[key].append(value)
        assert kept[key] == sorted(kept[key], reverse=True)  # newest first
    values = sorted([v for _, v in dropped] + [v for vs in kept.values() for v in vs])
    assert values == list(range(len(keys)))
    assert all(keys[value] == key for key, value in dropped)  # dropped with their own key
