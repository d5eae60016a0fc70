"""State rounds of two peers: rounds begun at the same epoch average the parameters; rounds begun at
different epochs (a peer whose previous round was still pending skipped one) are discarded by both,
because their average would mix parameters from before and after a step and pull the peers apart."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator

import hivemind
import pytest
import torch
from swarm import local_swarm

from hivemind_ext.optim.rounds import MAX_EPOCH_SPREAD_IN_GROUPS, epochs_mix_well, gathered_epochs
from hivemind_ext.optim.state_averager import TrainingStateAverager
from hivemind_ext.optim.training_state import TrainingState

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]
_prefixes = itertools.count()


def test_round_epochs_reads_only_plain_int_epochs() -> None:
    gathered = {"a": {"epoch": 3}, "b": None, "c": {"epoch": True}, "d": "x", "e": {"epoch": -1}, "f": {"epoch": 3}}
    assert gathered_epochs(gathered) == {3}
    assert gathered_epochs({"a": {"epoch": 3}, "b": {"epoch": 4}}) == {3, 4}
    assert gathered_epochs(None) == set() and gathered_epochs(["not", "a", "dict"]) == set()


def test_which_epochs_a_state_round_may_mix() -> None:
    assert epochs_mix_well(set(), in_groups=False) and epochs_mix_well({3}, in_groups=False)
    assert not epochs_mix_well({3, 4}, in_groups=False)
    assert epochs_mix_well({3, 4}, in_groups=True)
    assert epochs_mix_well({3, 3 + MAX_EPOCH_SPREAD_IN_GROUPS}, in_groups=True)
    assert not epochs_mix_well({3, 4 + MAX_EPOCH_SPREAD_IN_GROUPS}, in_groups=True)


@pytest.fixture(scope="module")
def pair() -> Iterator[list[hivemind.DHT]]:
    with local_swarm(2) as dhts:
        yield dhts


def _averagers(
    dhts: list[hivemind.DHT], values: tuple[float, float], in_groups: bool = False
) -> list[TrainingStateAverager]:
    prefix = f"state-rounds-{next(_prefixes)}"
    averagers = []
    for dht, value in zip(dhts, values, strict=True):
        model = torch.nn.Linear(3, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(value)
        state = TrainingState(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), params=model.parameters())
        averagers.append(
            TrainingStateAverager(
                state,
                dht=dht,
                prefix=prefix,
                state_lock=threading.RLock(),
                start=True,
                target_group_size=2,
                in_groups=in_groups,
            )
        )
    return averagers


def _round(averagers: list[TrainingStateAverager], epochs: tuple[int, int]) -> list[bool | None]:
    for averager, epoch in zip(averagers, epochs, strict=True):
        averager.begin_round(timeout=30, epoch=epoch)
    return [averager.apply_round(wait=40) for averager in averagers]


def _weights(averagers: list[TrainingStateAverager]) -> list[float]:
    return [float(a.training_state.main_params[0].detach()[0, 0]) for a in averagers]


@pytest.mark.parametrize(
    "in_groups, epochs, applied, expected",
    [
        (False, (4, 4), True, [2.0, 2.0]),
        (False, (4, 5), False, [1.0, 3.0]),
        # in groups smaller than the swarm, groups keep their own pace: discarding every round that mixed
        # neighbouring epochs left groups unmixed (before: (4, 5) was discarded as in one group)
        (True, (4, 5), True, [2.0, 2.0]),
        (True, (4, 7), False, [1.0, 3.0]),
    ],
)
def test_rounds_of_distant_epochs_are_discarded(pair, in_groups, epochs, applied, expected) -> None:
    """One group of everyone discards any round that mixed epochs; rotating groups accept neighbours."""
    averagers = _averagers(pair, (1.0, 3.0), in_groups=in_groups)
    try:
        assert _round(averagers, epochs) == [applied, applied]
        assert _weights(averagers) == pytest.approx(expected)
    finally:
        for averager in averagers:
            averager.shutdown()
