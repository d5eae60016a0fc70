"""PyTorch Lightning: train a ``LightningModule`` with :class:`hivemind_ext.Optimizer`.

``Trainer(strategy=HivemindExtStrategy(run_id=..., target_batch_size=..., initial_peers=...))``:
the strategy wraps the optimizer that ``configure_optimizers`` returns in a ``hivemind_ext.Optimizer``
(joining the swarm through a hivemind DHT that it starts, or one passed in) and leaves the swarm
when ``fit`` ends.

What changes for the Trainer:

- Lightning calls ``optimizer.step`` once per local batch (``accumulate_grad_batches`` must stay 1:
  the Optimizer accumulates toward ``target_batch_size`` itself) and ``zero_grad`` before every
  backward, as hivemind_ext's training loop does. Each step reports the batch's size, read from the
  batch (or ``batch_size_per_step`` when given).
- The Trainer's epochs and ``global_step`` count this peer's passes over its data and its local
  batches; the swarm's epoch is ``strategy.optimizer.local_epoch``. :class:`StopAtSwarmEpoch` ends
  ``fit`` when the swarm reaches a given epoch.
- An LR scheduler from ``configure_optimizers`` steps once per swarm epoch (whatever its
  ``interval``), driven by the Optimizer rather than by Lightning.

Requires ``lightning`` (``pip install "hivemind-ext[lightning]"``); ``import hivemind_ext`` does not
import this module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import hivemind
import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities.data import extract_batch_size

from hivemind_ext.errors import ConfigurationError
from hivemind_ext.optim.optimizer import Optimizer
from hivemind_ext.p2p.dht_calls import DEFAULT_DHT_START_TIMEOUT, check_timeout, start_dht

logger = logging.getLogger(__name__)

__all__ = ["HivemindExtStrategy", "StopAtSwarmEpoch"]

# Optimizer keywords the strategy fills in itself, from the LightningModule or its own arguments
_STRATEGY_OWNED = ("dht", "params", "optimizer", "scheduler")


class HivemindExtStrategy(SingleDeviceStrategy):
    """Trains on one device and averages with the swarm through :class:`hivemind_ext.Optimizer`.

    ``run_id``, ``target_batch_size`` and ``optimizer_kwargs`` (``matchmaking_time``,
    ``grad_compression``, ``use_local_updates``, ``verbose``, ...) go to the Optimizer unchanged.
    ``batch_size_per_step``: the samples each step reports; by default the size of each batch.
    ``dht``: a running ``hivemind.DHT`` to use (the caller shuts it down); otherwise the strategy
    starts one with ``initial_peers``, ``host_maddrs`` and ``dht_kwargs`` and stops it after ``fit``;
    ``dht_start_timeout``: seconds it waits for that DHT to start (its daemon, then the bootstrap through
    the initial peers) before ``fit`` fails with :class:`~hivemind_ext.errors.DeadlineExceededError`.
    ``device``: where the model trains; by default the accelerator's first device.

    The Optimizer wraps the torch optimizer object that the LightningModule configured, so the
    options that need an optimizer factory (``offload_optimizer``, ``delay_optimizer_step``) are not
    available here; nor is ``reuse_grad_buffers`` (Lightning zeroes the gradients itself), nor a
    precision plugin with a gradient scaler (use ``precision="32-true"`` or ``"bf16-mixed"``).
    """

    strategy_name = "hivemind_ext"

    def __init__(
        self,
        *,
        run_id: str,
        target_batch_size: int,
        batch_size_per_step: int | None = None,
        dht: hivemind.DHT | None = None,
        initial_peers: Sequence[str] = (),
        host_maddrs: Sequence[str] | None = None,
        dht_kwargs: dict[str, Any] | None = None,
        dht_start_timeout: float = DEFAULT_DHT_START_TIMEOUT,
        device: str | torch.device | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        owned = sorted(set(optimizer_kwargs) & set(_STRATEGY_OWNED))
        if owned:
            raise ConfigurationError(
                f"HivemindExtStrategy sets {owned} itself: the optimizer and scheduler come from the "
                "LightningModule's configure_optimizers, the DHT from dht= or initial_peers="
            )
        if optimizer_kwargs.get("reuse_grad_buffers"):
            raise ConfigurationError("reuse_grad_buffers=True cannot be used with Lightning, which zeroes .grad itself")
        if optimizer_kwargs.get("auxiliary"):
            raise ConfigurationError("an auxiliary peer does not train: run `hivemind-ext aux` instead of a Trainer")
        if dht is not None and (initial_peers or host_maddrs or dht_kwargs):
            raise ConfigurationError("pass either a running dht or initial_peers/host_maddrs/dht_kwargs, not both")
        self._dht_start_timeout = check_timeout(dht_start_timeout)
        super().__init__(device=device if device is not None else "cpu")
        # the Trainer's accelerator connector fills this in from accelerator= and devices= when None
        self.parallel_devices: list[torch.device] | None = [self._root_device] if device is not None else None
        self.run_id, self.target_batch_size = run_id, target_batch_size
        self.batch_size_per_step = batch_size_per_step
        self.optimizer_kwargs = optimizer_kwargs
        self._given_dht = dht
        self._dht_kwargs = {
            "initial_peers": list(initial_peers),
            **({"host_maddrs": list(host_maddrs)} if host_maddrs is not None else {}),
            **(dht_kwargs or {}),
        }
        self._dht: hivemind.DHT | None = dht
        self._hivemind_optimizer: Optimizer | None = None
        self._batch_size: int | None = None  # the size of the batch being trained on

    # ----- what users read

    @property
    def optimizer(self) -> Optimizer | None:
        """The :class:`hivemind_ext.Optimizer` of the latest ``fit`` (shut down once it ended)."""
        return self._hivemind_optimizer

    @property
    def dht(self) -> hivemind.DHT | None:
        """The DHT this peer joins the swarm through (None after ``fit`` when the strategy started it)."""
        return self._dht

    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[0] if self.parallel_devices else super().root_device

    def setup_environment(self) -> None:
        if self.parallel_devices and len(self.parallel_devices) > 1:
            raise ConfigurationError(
                f"HivemindExtStrategy trains on one device per peer, got devices={self.parallel_devices}: "
                "start one peer per device instead"
            )
        super().setup_environment()

    # ----- set-up and teardown

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        torch_optimizer, scheduler = self._check_trainer(trainer)
        starting = self._dht is None
        if starting:
            self._dht = hivemind.DHT(start=False, **self._dht_kwargs)
        try:
            if starting:  # with a deadline: DHT(start=True) waited for ever on a daemon or bootstrap that hangs
                start_dht(self._dht, timeout=self._dht_start_timeout)
            self._hivemind_optimizer = Optimizer(
                dht=self._dht,
                run_id=self.run_id,
                target_batch_size=self.target_batch_size,
                batch_size_per_step=self.batch_size_per_step,
                optimizer=torch_optimizer,
                scheduler=scheduler,
                **self.optimizer_kwargs,
            )
        except BaseException:
            self._stop_own_dht()
            raise
        self.optimizers = [self._hivemind_optimizer]
        self.lr_scheduler_configs = []  # the Optimizer steps the scheduler once per swarm epoch

    def _check_trainer(self, trainer: pl.Trainer) -> tuple[torch.optim.Optimizer, Any]:
        """The LightningModule's one optimizer and its scheduler (or None), after checking that the
        Trainer's settings leave the stepping to the Optimizer."""
        if len(self.optimizers) != 1:
            raise ConfigurationError(
                f"HivemindExtStrategy needs exactly one optimizer from configure_optimizers, got {len(self.optimizers)}"
            )
        if trainer.accumulate_grad_batches != 1:
            raise ConfigurationError(
                "leave accumulate_grad_batches at 1: hivemind_ext.Optimizer accumulates toward target_batch_size itself"
            )
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ConfigurationError(
                "HivemindExtStrategy does not support a gradient scaler (precision='16-mixed'): use '32-true' or "
                "'bf16-mixed'"
            )
        if len(self.lr_scheduler_configs) > 1:
            raise ConfigurationError("HivemindExtStrategy supports at most one LR scheduler")
        scheduler = None
        if self.lr_scheduler_configs:
            config = self.lr_scheduler_configs[0]
            if config.reduce_on_plateau:
                raise ConfigurationError("ReduceLROnPlateau needs a metric: the Optimizer steps schedulers per epoch")
            scheduler = config.scheduler
        return self.optimizers[0], scheduler

    def teardown(self) -> None:
        if self._hivemind_optimizer is not None:
            self._hivemind_optimizer.shutdown()
        self._stop_own_dht()
        super().teardown()

    def _stop_own_dht(self) -> None:
        if self._dht is not None and self._dht is not self._given_dht:
            self._dht.shutdown()
            self._dht = None

    # ----- training

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.batch_size_per_step is None:
            self._batch_size = extract_batch_size(batch)

    def optimizer_step(
        self,
        optimizer: Any,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        if isinstance(optimizer, Optimizer) and kwargs.get("batch_size") is None:
            kwargs["batch_size"] = self.batch_size_per_step or self._batch_size
        return super().optimizer_step(optimizer, closure, model, **kwargs)


class StopAtSwarmEpoch(pl.Callback):
    """Ends ``fit`` after the batch that brings the swarm to ``epoch`` (the Trainer's own
    ``max_epochs`` / ``max_steps`` count this peer's local passes and batches)."""

    def __init__(self, epoch: int) -> None:
        if epoch < 1:
            raise ConfigurationError(f"epoch must be at least 1, got {epoch}")
        self.epoch = epoch

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        optimizer = getattr(trainer.strategy, "optimizer", None)
        if isinstance(optimizer, Optimizer) and optimizer.local_epoch >= self.epoch:
            trainer.should_stop = True
