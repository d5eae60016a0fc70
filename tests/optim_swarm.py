"""A harness for multi-peer hivemind_ext.Optimizer tests: N trainer threads in one process, each
with its own DHT (from :func:`swarm.local_swarm`), a deterministic data stream and a log of what
it did, so tests can replay exactly what the swarm averaged on a single-process reference.

Per peer the log keeps, for every ``step()``: the epoch before and after it, the batch tensors and
the loss; at every epoch it ended: the samples each group member averaged (the Optimizer's
``last_round_samples``, from the data gathered in the round), the group total
(``last_epoch_samples``) and the round's report (group size, contributors per part, exclusions);
and the learning rate seen at each epoch. Warnings that the library logs are collected too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import hivemind
import torch
from hivemind.utils.crypto import RSAPrivateKey

from hivemind_ext import Optimizer
from hivemind_ext.averaging.averager import RoundReport
from hivemind_ext.optim.progress import default_signing_key

LOSS = torch.nn.functional.mse_loss
FAST_TRACKER = dict(min_refresh_period=0.05, max_refresh_period=0.5, default_refresh_period=0.2)


def signing_key(dht: hivemind.DHT) -> RSAPrivateKey:
    """The key that signs ``dht``'s progress records (the library's own per-DHT default, named here for
    tests that pass ``tracker_opts={"private_key": ...}`` explicitly, as hivemind users do)."""
    return default_signing_key(dht)


def regression_model(seed: int = 0, in_features: int = 8) -> torch.nn.Module:
    """A small two-layer regression model; the same seed gives the same initial parameters."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(in_features, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


class RegressionStream:
    """Deterministic batches for one peer: ``y = x @ w_true + 0.1 * noise``, same ``w_true`` for all peers."""

    def __init__(self, peer_index: int, *, seed: int = 0, in_features: int = 8, batch_sizes: Sequence[int] = (4,)):
        self.generator = torch.Generator().manual_seed(1000 * seed + peer_index + 1)
        self.sizes = random.Random(7919 * seed + peer_index)
        self.batch_sizes = tuple(batch_sizes)
        self.w_true = torch.linspace(-1.0, 1.0, in_features, dtype=torch.float32).unsqueeze(1)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.sizes.choice(self.batch_sizes)
        x = torch.randn(size, self.w_true.shape[0], generator=self.generator)
        y = x @ self.w_true + 0.1 * torch.randn(size, 1, generator=self.generator)
        return x, y


@dataclasses.dataclass
class StepRecord:
    epoch_before: int
    epoch_after: int
    inputs: torch.Tensor
    targets: torch.Tensor
    loss: float

    @property
    def batch_size(self) -> int:
        return int(self.inputs.shape[0])


@dataclasses.dataclass
class EpochRecord:
    """What one peer saw when it ended ``epoch`` (with delay_grad_averaging the round finishes later)."""

    epoch: int
    samples_per_peer: dict[str, int]  # opt.last_round_samples: who averaged how many samples
    total_samples: int  # opt.last_epoch_samples
    report: RoundReport | None  # opt.grad_averager.last_round


@dataclasses.dataclass
class PeerLog:
    index: int
    peer_id: str
    steps: list[StepRecord] = dataclasses.field(default_factory=list)
    epochs: dict[int, EpochRecord] = dataclasses.field(default_factory=dict)
    lr_at_epoch: dict[int, float] = dataclasses.field(default_factory=dict)
    error: BaseException | None = None

    def batches_in_epoch(self, epoch: int) -> list[StepRecord]:
        """The steps this peer accumulated toward ``epoch`` (called while its local epoch was ``epoch``)."""
        return [step for step in self.steps if step.epoch_before == epoch]


class WarningCollector(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @property
    def messages(self) -> list[str]:
        return [f"{r.name}: {r.getMessage()}" for r in self.records]


@dataclasses.dataclass
class SwarmRun:
    logs: list[PeerLog]
    models: list[torch.nn.Module]
    optimizers: list[Optimizer]
    initial_params: list[torch.Tensor]
    warnings: list[str]
    seconds: float

    def final_params(self, index: int) -> torch.Tensor:
        return torch.cat([p.detach().flatten().clone() for p in self.models[index].parameters()])

    def epochs_ended(self) -> list[int]:
        """Epochs that every peer ended (and logged a round for)."""
        common = set.intersection(*(set(log.epochs) for log in self.logs))
        return sorted(common)

    def averaged_batches(self, epoch: int) -> tuple[list[StepRecord], dict[str, int]]:
        """The union of the batches that went into the gradient round of ``epoch``, and the samples
        per member that the round's gathered data reports. A peer's batches count only if the round
        says it averaged exactly as many samples as the harness saw it accumulate; the caller asserts
        that this held for every member (else the round cannot be replayed)."""
        by_id = {log.peer_id: log for log in self.logs}
        gathered = self.logs[0].epochs[epoch].samples_per_peer
        batches: list[StepRecord] = []
        for peer_id, samples in gathered.items():
            if peer_id in by_id:
                steps = by_id[peer_id].batches_in_epoch(epoch)
                if sum(step.batch_size for step in steps) == samples:
                    batches.extend(steps)
        return batches, gathered


def run_swarm(
    dhts: Sequence[hivemind.DHT],
    *,
    run_id: str,
    target_epoch: int,
    optimizer_kwargs: dict[str, Any],
    make_model: Callable[[], torch.nn.Module] = regression_model,
    batch_sizes: Sequence[int] = (4,),
    data_seed: int = 0,
    sleep: float | Callable[[int], float] = 0.01,
    max_seconds: float = 60.0,
    drain: bool = True,
) -> SwarmRun:
    """Trains one model per DHT in its own thread until every peer reaches ``target_epoch``.

    Each peer builds ``make_model()`` (same seed: same initial parameters) and an Optimizer with
    ``optimizer_kwargs`` (``dht``, ``run_id``, ``params`` and ``batch_size_per_step`` are filled in),
    feeds it batches from its :class:`RegressionStream` and sleeps ``sleep`` (or ``sleep(peer)``)
    seconds between steps. With ``drain``, once all threads are done each peer applies its last
    state averaging round, so that peers that average their state end on the same parameters.
    Optimizers are shut down in ``finally``.
    """
    collector = WarningCollector()
    library_logger = logging.getLogger("hivemind_ext")
    library_logger.addHandler(collector)
    models = [make_model() for _ in dhts]
    initial_params = [torch.cat([p.detach().flatten().clone() for p in m.parameters()]) for m in models]
    optimizers: list[Optimizer] = []
    logs: list[PeerLog] = []
    stop = threading.Event()
    started = time.monotonic()
    try:
        for index, (dht, model) in enumerate(zip(dhts, models, strict=True)):
            kwargs = dict(optimizer_kwargs)
            kwargs.setdefault("batch_size_per_step", max(batch_sizes))
            kwargs["tracker_opts"] = {"private_key": signing_key(dht), **kwargs.get("tracker_opts", {})}
            optimizers.append(Optimizer(dht=dht, run_id=run_id, params=model.parameters(), **kwargs))
            logs.append(PeerLog(index=index, peer_id=str(dht.peer_id)))

        def train(index: int) -> None:
            log, opt, model = logs[index], optimizers[index], models[index]
            stream = RegressionStream(index, seed=data_seed, batch_sizes=batch_sizes)
            pause = sleep if callable(sleep) else (lambda _peer: sleep)
            try:
                while opt.local_epoch < target_epoch and not stop.is_set():
                    epoch = opt.local_epoch
                    log.lr_at_epoch.setdefault(epoch, float(opt.param_groups[0]["lr"]))
                    x, y = stream.next_batch()
                    loss = LOSS(model(x), y)
                    loss.backward()
                    opt.step(batch_size=x.shape[0])
                    if not opt.reuse_grad_buffers:
                        opt.zero_grad()
                    log.steps.append(StepRecord(epoch, opt.local_epoch, x, y, loss.item()))
                    if opt.local_epoch > epoch:
                        report = opt.grad_averager.last_round if opt.grad_averager is not None else None
                        log.epochs[epoch] = EpochRecord(
                            epoch, dict(opt.last_round_samples), opt.last_epoch_samples, report
                        )
                    time.sleep(pause(index))
                log.lr_at_epoch.setdefault(opt.local_epoch, float(opt.param_groups[0]["lr"]))
            except BaseException as e:  # reported by the test, which asserts no peer failed
                log.error = e
                stop.set()

        threads = [threading.Thread(target=train, args=(i,), daemon=True) for i in range(len(dhts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(0.0, started + max_seconds - time.monotonic()))
        stop.set()
        for thread in threads:
            thread.join(10)
        seconds = time.monotonic() - started
        if drain:
            for opt in optimizers:
                # a delayed optimizer step is published at the next step() call, which a stopped
                # trainer never makes: publish it here, then apply the last state averaging round
                opt.collect_background_work(wait=True)
                opt.state_averager.apply_round(wait=opt.config.averaging_timeout + opt.config.matchmaking_time)
        return SwarmRun(logs, models, optimizers, initial_params, collector.messages, seconds)
    finally:
        stop.set()
        for opt in optimizers:
            with contextlib.suppress(Exception):
                opt.shutdown()
        library_logger.removeHandler(collector)


def reference_training(
    run: SwarmRun,
    make_model: Callable[[], torch.nn.Module],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    epochs: Sequence[int],
) -> tuple[torch.nn.Module, dict[int, float]]:
    """Single-process replay: for each epoch, the gradient of the sample-weighted mean loss over the
    union of the batches that the swarm averaged, then one step of the same torch optimizer.
    Returns the model and, per epoch, the largest |peer loss - reference loss| over that epoch's batches."""
    model = make_model()
    optimizer = make_optimizer(model.parameters())
    loss_gaps: dict[int, float] = {}
    for epoch in epochs:
        batches, _ = run.averaged_batches(epoch)
        x = torch.cat([b.inputs for b in batches])
        y = torch.cat([b.targets for b in batches])
        with torch.no_grad():
            loss_gaps[epoch] = max(abs(float(LOSS(model(b.inputs), b.targets)) - b.loss) for b in batches)
        optimizer.zero_grad()
        LOSS(model(x), y).backward()  # mean over the union = sample-weighted mean of the batch means
        optimizer.step()
    return model, loss_gaps


@contextlib.contextmanager
def quiet_hivemind() -> Iterator[None]:
    """hivemind's own loggers are chatty at INFO; tests keep them at WARNING."""
    hivemind_logger = logging.getLogger("hivemind")
    level = hivemind_logger.level
    hivemind_logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        hivemind_logger.setLevel(level)
