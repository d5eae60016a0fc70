"""PyTorch Lightning: a real ``lightning.Trainer`` trains on the digits with HivemindExtStrategy.

1. One peer: the strategy matches the same LightningModule trained by a plain Trainer with the same
   effective batch size (target_batch_size = accumulate_grad_batches * batch size), step for step,
   scheduler included, and learns (held-out accuracy).
2. Two peers under one run_id, each a Trainer on its half of the data: both finish at the same swarm
   epoch with the same parameters, which took the samples of both.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import hivemind
import lightning.pytorch as pl
import pytest
import torch
from fake_dht import StuckDHT
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from swarm import LOOPBACK, addresses, new_peer, wait_for, wait_until_connected
from torch.utils.data import DataLoader, TensorDataset

from hivemind_ext.errors import ConfigurationError, DeadlineExceededError
from hivemind_ext.integrations.lightning import HivemindExtStrategy, StopAtSwarmEpoch

FAST_TRACKER = dict(min_refresh_period=0.05, max_refresh_period=0.5, default_refresh_period=0.2)
SWARM_KWARGS = dict(matchmaking_time=2.0, averaging_timeout=30.0, tracker_opts=FAST_TRACKER, shutdown_timeout=2.0)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """A 64-64-10 MLP: on a loaded 2-core machine torch's intra-op threads made each fit ~10x slower
    (spinning workers). Restored for the other modules."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class DigitsClassifier(pl.LightningModule):
    def __init__(self, lr: float = 0.1, gamma: float = 0.97) -> None:
        super().__init__()
        self.lr, self.gamma = lr, gamma
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        # "step": Lightning steps it per optimizer step; with the strategy it steps per swarm epoch
        scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=self.gamma)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def digits() -> tuple[TensorDataset, TensorDataset]:
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.2, random_state=0, stratify=y)

    def as_dataset(x, y) -> TensorDataset:
        return TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.long))

    return as_dataset(x_train, y_train), as_dataset(x_test, y_test)


def loader(dataset: TensorDataset, batch_size: int, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, generator=generator)


def accuracy(model: DigitsClassifier, dataset: TensorDataset) -> float:
    x, y = dataset.tensors
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean())


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def trainer(**kwargs) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def quiet_fit(trainer: pl.Trainer, model: pl.LightningModule, data: DataLoader) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*number of training batches.*")
        trainer.fit(model, data)


def run_id(name: str) -> str:
    return f"lightning_{name}_{secrets.token_hex(4)}"


# ----- 1. one peer against a plain Trainer


@pytest.mark.timeout(120)
def test_one_peer_trains_exactly_like_a_plain_trainer_with_the_same_effective_batch() -> None:
    train, test = digits()
    batch_size, accumulate, local_epochs = 32, 4, 4
    batches_per_epoch = len(train) // batch_size  # 44 = 11 accumulated steps per pass
    assert batches_per_epoch % accumulate == 0
    torch.manual_seed(0)
    reference = DigitsClassifier()
    swarm_model = DigitsClassifier()
    swarm_model.load_state_dict(reference.state_dict())

    quiet_fit(
        trainer(max_epochs=local_epochs, accumulate_grad_batches=accumulate), reference, loader(train, batch_size)
    )
    strategy = HivemindExtStrategy(
        run_id=run_id("single"),
        target_batch_size=accumulate * batch_size,
        host_maddrs=LOOPBACK,
        **SWARM_KWARGS,
    )
    fit = trainer(max_epochs=local_epochs, strategy=strategy)
    quiet_fit(fit, swarm_model, loader(train, batch_size))

    # the Trainer counts local batches and passes; the swarm's epoch is one per target_batch_size samples
    assert fit.global_step == local_epochs * batches_per_epoch
    assert fit.current_epoch == local_epochs
    assert strategy.optimizer.local_epoch == local_epochs * batches_per_epoch // accumulate == 44
    # the scheduler stepped once per swarm epoch, as the reference's once per accumulated step
    lr = strategy.optimizer.param_groups[0]["lr"]
    assert lr == pytest.approx(0.1 * 0.97**44, rel=1e-6)
    # the same updates, up to float32 sums in another order
    gap = (flat_params(swarm_model) - flat_params(reference)).abs().max() / flat_params(reference).abs().max()
    assert gap < 1e-4, gap
    assert accuracy(reference, test) > 0.85
    assert accuracy(swarm_model, test) > 0.85
    assert abs(accuracy(swarm_model, test) - accuracy(reference, test)) <= 0.01
    # fit left the swarm: the optimizer is shut down and the DHT the strategy started is stopped
    assert strategy.dht is None
    with pytest.raises(Exception, match="shut down"):
        strategy.optimizer.step(batch_size=1)


# ----- 2. two peers under one run_id


class RoundRecorder(pl.Callback):
    """Per swarm epoch this peer entered: the samples of each member of the round that ended the last one."""

    def __init__(self) -> None:
        self.rounds: dict[int, dict[str, int]] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args, **kwargs) -> None:
        optimizer = trainer.strategy.optimizer
        if optimizer.local_epoch not in self.rounds:
            self.rounds[optimizer.local_epoch] = dict(optimizer.last_round_samples)


class StartTogether(pl.Callback):
    """Holds each Trainer at the start of training until every peer's tracker sees the whole swarm (else
    the first to start takes its first swarm epoch alone, as a peer alone in a swarm does)."""

    def __init__(self, barrier: threading.Barrier) -> None:
        self.barrier = barrier

    def on_train_start(self, trainer: pl.Trainer, *args, **kwargs) -> None:
        self.barrier.wait(timeout=60)
        tracker = trainer.strategy.optimizer.tracker
        wait_for(lambda: tracker.global_progress.num_peers == self.barrier.parties, 30, message="both peers")


def train_pair(train: TensorDataset, batch_size: int, target: int, swarm_epochs: int):
    """Two Trainers in two threads, each with its own DHT and half of the data, until the swarm epoch."""
    halves = torch.utils.data.random_split(train, [0.5, 0.5], generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    models = [DigitsClassifier(lr=0.2, gamma=1.0) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    dhts = [new_peer()]
    dhts.append(new_peer(addresses(dhts[0])))
    try:
        wait_until_connected(dhts)
        name = run_id("pair")
        strategies = [
            HivemindExtStrategy(run_id=name, target_batch_size=target, dht=dht, **SWARM_KWARGS) for dht in dhts
        ]
        recorders = [RoundRecorder() for _ in dhts]
        barrier = threading.Barrier(len(dhts))
        trainers = [
            trainer(
                strategy=strategy,
                max_epochs=100,
                max_time="00:00:02:00",
                callbacks=[StartTogether(barrier), StopAtSwarmEpoch(swarm_epochs), recorder],
            )
            for strategy, recorder in zip(strategies, recorders, strict=True)
        ]
        errors: list[BaseException] = []

        def fit(index: int) -> None:
            try:
                quiet_fit(trainers[index], models[index], loader(halves[index], batch_size, seed=index))
            except BaseException as e:  # reported by the test's thread below
                errors.append(e)

        threads = [threading.Thread(target=fit, args=(i,), daemon=True) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=140)
        assert not any(thread.is_alive() for thread in threads), "a Trainer did not finish"
        assert not errors, errors
        peer_ids = [dht.peer_id.to_base58() for dht in dhts]
    finally:
        for dht in dhts:
            dht.shutdown()
    return models, strategies, trainers, recorders, peer_ids


def every_round_had_both(recorders, peer_ids, swarm_epochs: int) -> bool:
    return all(
        set(recorder.rounds.get(epoch, {})) == set(peer_ids)
        for recorder in recorders
        for epoch in range(1, swarm_epochs + 1)
    )


@pytest.mark.slow
@pytest.mark.timeout(330)
def test_two_trainers_average_into_the_same_model() -> None:
    train, test = digits()
    batch_size, target, swarm_epochs = 16, 128, 12
    run = train_pair(train, batch_size, target, swarm_epochs)
    if not every_round_had_both(run[3], run[4], swarm_epochs):
        # on a loaded 2-core machine a peer now and then reaches a round a moment too late (it then
        # downloads the state and goes on); that is the library's tested recovery, not this strategy's
        # concern, so run once more before checking the rounds one by one. A real bug fails both runs.
        run = train_pair(train, batch_size, target, swarm_epochs)
    models, strategies, trainers, recorders, peer_ids = run

    # both stopped at the swarm epoch, with the same parameters (synchronous averaging)
    assert [s.optimizer.local_epoch for s in strategies] == [swarm_epochs, swarm_epochs]
    final = [flat_params(model) for model in models]
    assert (final[0] - final[1]).abs().max() / final[0].abs().max() < 1e-5
    assert accuracy(models[0], test) > 0.7  # an untrained model scores about 0.1
    # every swarm epoch averaged the samples of both peers, and every local sample went into a round
    for epoch in range(1, swarm_epochs + 1):
        seen = [recorder.rounds[epoch] for recorder in recorders]
        assert seen[0] == seen[1], (epoch, seen)
        assert set(seen[0]) == set(peer_ids) and min(seen[0].values()) > 0, (epoch, seen)
        assert sum(seen[0].values()) >= target, (epoch, seen)
    for t, peer_id in zip(trainers, peer_ids, strict=True):
        averaged = sum(recorders[0].rounds[epoch][peer_id] for epoch in range(1, swarm_epochs + 1))
        assert t.global_step * batch_size == averaged


# ----- the settings the strategy refuses


def test_settings_that_would_step_twice_or_zero_the_accumulator_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="reuse_grad_buffers"):
        HivemindExtStrategy(run_id="r", target_batch_size=64, reuse_grad_buffers=True)
    with pytest.raises(ConfigurationError, match="optimizer"):
        HivemindExtStrategy(run_id="r", target_batch_size=64, optimizer=torch.optim.SGD)
    with pytest.raises(ConfigurationError, match="not both"):
        HivemindExtStrategy(run_id="r", target_batch_size=64, dht=object(), initial_peers=["/ip4/127.0.0.1/tcp/1"])

    strategy = HivemindExtStrategy(run_id=run_id("accumulate"), target_batch_size=64, host_maddrs=LOOPBACK)
    train, _ = digits()
    with pytest.raises(ConfigurationError, match="accumulate_grad_batches"):
        quiet_fit(
            trainer(max_epochs=1, strategy=strategy, accumulate_grad_batches=2), DigitsClassifier(), loader(train, 32)
        )
    assert strategy.dht is None  # no swarm was joined


@pytest.mark.timeout(60)
def test_a_dht_that_never_starts_fails_fit_after_its_deadline_and_is_stopped(monkeypatch) -> None:
    """Before, the strategy called ``hivemind.DHT(start=True)``, which waits for ever on a hung bootstrap."""
    monkeypatch.setattr(hivemind, "DHT", StuckDHT)
    StuckDHT.made.clear()
    with pytest.raises(ConfigurationError, match="timeout"):
        HivemindExtStrategy(run_id="r", target_batch_size=64, dht_start_timeout=0)
    strategy = HivemindExtStrategy(run_id=run_id("hung"), target_batch_size=64, dht_start_timeout=0.5)
    train, _ = digits()
    started = time.monotonic()
    with pytest.raises(DeadlineExceededError, match=r"did not start within 0\.5 s"):
        quiet_fit(trainer(max_epochs=1, strategy=strategy), DigitsClassifier(), loader(train, 32))
    assert time.monotonic() - started < 30
    assert [dht.shut_down for dht in StuckDHT.made] == [True]  # the half-started DHT is shut down
    assert strategy.dht is None


def test_importing_hivemind_ext_does_not_import_lightning() -> None:
    code = "import sys, hivemind_ext; assert 'lightning' not in sys.modules and 'pytorch_lightning' not in sys.modules"
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
