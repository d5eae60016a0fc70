"""What ``Optimizer`` refuses at construction, with an error that speaks of the user's arguments:
a model with every parameter frozen, and run ids that no peer could use as a name."""

from __future__ import annotations

import time
from collections.abc import Iterator

import hivemind
import pytest
import torch
from swarm import new_peer

from hivemind_ext import Optimizer
from hivemind_ext.errors import ConfigurationError, DeadlineExceededError
from hivemind_ext.optim.algorithms import AsyncModelAverage
from hivemind_ext.optim.keys import MAX_RUN_ID_LENGTH
from hivemind_ext.p2p import dht_calls
from hivemind_ext.p2p.framing import MAX_NAMESPACE_LENGTH


@pytest.fixture(scope="module")
def dht() -> Iterator[hivemind.DHT]:
    peer = new_peer()
    yield peer
    peer.shutdown()


def make(dht: hivemind.DHT, model: torch.nn.Module, run_id: str = "validation", **kwargs: object) -> Optimizer:
    return Optimizer(
        dht=dht,
        run_id=run_id,
        target_batch_size=64,
        batch_size_per_step=8,
        params=model.parameters(),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        **kwargs,
    )


def test_a_model_with_every_parameter_frozen_is_refused(dht: hivemind.DHT) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).requires_grad_(False)
    with pytest.raises(ValueError, match="none of the 4 parameters requires grad"):
        make(dht, model)


def test_a_model_with_some_parameters_frozen_trains(dht: hivemind.DHT) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[0].requires_grad_(False)  # a frozen backbone, a trained head
    opt = make(dht, model, run_id="partly_frozen")
    try:
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        assert model[0].weight.grad is None
    finally:
        opt.shutdown()


@pytest.mark.parametrize(
    "run_id",
    ["", "r" * (MAX_RUN_ID_LENGTH + 1), "r" * MAX_NAMESPACE_LENGTH, "my run", "tab\there", 42],
    ids=["empty", "one-too-long", "namespace-length", "space", "tab", "not-a-string"],
)
def test_a_bad_run_id_is_refused_in_terms_of_the_run_id(dht: hivemind.DHT, run_id: object) -> None:
    with pytest.raises(ConfigurationError) as refused:
        make(dht, torch.nn.Linear(4, 2), run_id=run_id)  # type: ignore[arg-type]
    message = str(refused.value)
    assert message.startswith(f"run_id must be 1-{MAX_RUN_ID_LENGTH} printable characters")
    assert "namespace" not in message


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm", [None, AsyncModelAverage(sync_interval_seconds=60)], ids=["default", "async"])
def test_the_longest_run_id_fits_every_name_built_from_it(dht: hivemind.DHT, algorithm: object) -> None:
    """The run id limit and the protocol id limit agree: a run id at the limit builds every component
    (async model averaging has the longest averager prefix)."""
    run_id = "r" * (MAX_RUN_ID_LENGTH - 1) + ("a" if algorithm is None else "b")
    opt = make(dht, torch.nn.Linear(4, 2), run_id=run_id, algorithm=algorithm)
    opt.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bandwidth", [1e308, float("inf"), float("nan"), -1.0, "fast"])
def test_a_bad_bandwidth_is_refused_at_construction(dht: hivemind.DHT, bandwidth: object) -> None:
    """1e308 used to pass, and then failed the first ``opt.step`` of every member of the peer's group with
    a bare ValueError (the chunk size overflowed); every such value is refused before anything runs."""
    with pytest.raises(ConfigurationError, match="bandwidth must be None or a number in"):
        make(dht, torch.nn.Linear(4, 2), averager_opts={"bandwidth": bandwidth})


@pytest.mark.timeout(60)
def test_a_hung_dht_fails_the_constructor_at_a_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """``dht.client_mode`` and ``dht.peer_id`` are round trips to the DHT process without a deadline (the
    constructor waited for ever on a hung one); asked with one, a process that never answers (here:
    never started, so nobody reads its pipe) is a DeadlineExceededError."""
    monkeypatch.setattr(dht_calls, "DEFAULT_DHT_TIMEOUT", 0.3)
    hung = hivemind.DHT(start=False)
    started = time.monotonic()
    with pytest.raises(DeadlineExceededError, match=r"no answer within 0\.3 s"):
        make(hung, torch.nn.Linear(4, 2))
    assert time.monotonic() - started < 5.0
