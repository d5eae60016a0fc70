"""The "snapshot, average, apply the delta" routine against a reference computation in float64."""

from __future__ import annotations

import pytest
import torch

from hivemind_ext.averaging.delta import apply_average, apply_delta, average_delta, take_snapshot


def live_tensors() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 4, generator=generator),
        torch.randn(7, generator=generator).half(),
        torch.randn(2, 2, generator=generator, dtype=torch.float64),
    ]


def test_snapshot_is_a_detached_float32_copy() -> None:
    live = live_tensors()
    live[0].requires_grad_(True)
    snapshot = take_snapshot(live)
    assert all(s.dtype == torch.float32 and not s.requires_grad for s in snapshot)
    assert all(torch.equal(s, t.detach().float()) for s, t in zip(snapshot, live, strict=True))
    with torch.no_grad():
        live[1].add_(1)
    assert not torch.equal(snapshot[1], live[1].float())  # a copy, not a view


@pytest.mark.parametrize("alpha", [1.0, 0.5])
@pytest.mark.parametrize("in_place", [False, True])
def test_apply_average_keeps_local_progress(alpha: float, in_place: bool) -> None:
    live = live_tensors()
    snapshot = take_snapshot(live)
    averages = [s * 0.5 + 1.0 for s in snapshot]  # what the peers agreed on
    progress = [torch.full_like(t, 0.25) for t in live]  # local steps taken while the round ran
    with torch.no_grad():
        for tensor, step in zip(live, progress, strict=True):
            tensor.add_(step)
    expected = [
        (t.double() + alpha * (a.double() - s.double())).to(t.dtype)
        for t, a, s in zip(live, averages, snapshot, strict=True)
    ]
    originals = [a.clone() for a in averages]
    apply_average(live, averages, snapshot, alpha=alpha, in_place=in_place)
    for got, want in zip(live, expected, strict=True):
        tolerance = 1e-2 if got.dtype == torch.float16 else 1e-6
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    untouched = all(torch.equal(a, o) for a, o in zip(averages, originals, strict=True))
    assert untouched != in_place  # in place, the averages hold the deltas afterwards


def test_without_concurrent_updates_the_targets_become_the_average_exactly() -> None:
    live = [torch.randn(5), torch.randn(5)]
    snapshot = [t.clone() for t in live]
    averages = [torch.randn(5), torch.randn(5)]
    apply_average(live, averages, snapshot, keep_concurrent_updates=False)
    assert all(torch.equal(t, a) for t, a in zip(live, averages, strict=True))
    live2, averages2 = [torch.zeros(3)], [torch.ones(3)]
    apply_average(live2, averages2, [torch.zeros(3)], alpha=0.5, keep_concurrent_updates=False)
    assert torch.equal(live2[0], torch.full((3,), 0.5))  # alpha != 1 still moves by the delta


def test_deferred_delta_equals_direct_application() -> None:
    """Async averaging computes the delta on one thread and applies it later on another."""
    direct, deferred = live_tensors(), live_tensors()
    snapshot = take_snapshot(direct)
    averages = [s + 0.125 for s in snapshot]
    apply_average(direct, averages, snapshot)
    deltas = average_delta(averages, snapshot)
    apply_delta(deferred, deltas)
    assert all(torch.equal(a, b) for a, b in zip(direct, deferred, strict=True))


def test_parameters_that_require_grad_are_updated_outside_autograd() -> None:
    parameter = torch.nn.Parameter(torch.zeros(4))
    apply_delta([parameter], [torch.ones(4)], alpha=2.0)
    assert torch.equal(parameter.detach(), torch.full((4,), 2.0)) and parameter.grad_fn is None


def test_mismatched_lengths_are_refused() -> None:
    with pytest.raises(ValueError):
        apply_average([torch.zeros(1)], [torch.zeros(1), torch.zeros(1)], [torch.zeros(1)])
