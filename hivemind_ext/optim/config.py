"""The Optimizer's settings: hivemind's keyword arguments, their defaults resolved, their rules checked.

``OptimizerConfig.resolve`` applies hivemind.Optimizer's defaults (``delay_optimizer_step`` follows
``delay_grad_averaging``, ``offload_optimizer`` is on when the optimizer is built from ``params``
without local updates, ``allreduce_timeout`` follows ``averaging_timeout``, ``next_chunk_timeout``
follows ``matchmaking_time``); one difference: ``client_mode=True`` is honoured even when the DHT is
not in client mode (hivemind 1.1.12 ignores the argument). ``__post_init__`` rejects every
combination that cannot work, with a message that says what to change.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from hivemind_ext.errors import ConfigurationError
from hivemind_ext.optim.hops import check_hops
from hivemind_ext.optim.keys import check_run_id


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    run_id: str
    target_batch_size: int
    batch_size_per_step: int | None
    matchmaking_time: float
    averaging_timeout: float
    allreduce_timeout: float
    next_chunk_timeout: float
    load_state_timeout: float
    reuse_grad_buffers: bool
    offload_optimizer: bool
    delay_optimizer_step: bool
    delay_grad_averaging: bool
    delay_state_averaging: bool
    average_state_every: int
    use_local_updates: bool
    client_mode: bool
    auxiliary: bool
    performance_ema_alpha: float
    shutdown_timeout: float
    verbose: bool
    optimizer_from_factory: bool  # optimizer=callable(params) with params=..., rather than an instance
    custom_grad_averager: bool  # grad_averager_factory was given
    grad_averaging_hops: int | str = 1  # gradient rounds per epoch (see hivemind_ext.optim.hops)
    custom_algorithm: bool = False  # an algorithm other than the default GradientAllReduce was given

    @classmethod
    def resolve(
        cls,
        *,
        dht_client_mode: bool,
        optimizer_from_factory: bool,
        custom_grad_averager: bool,
        client_mode: bool | None,
        delay_optimizer_step: bool | None,
        delay_grad_averaging: bool,
        offload_optimizer: bool | None,
        use_local_updates: bool,
        matchmaking_time: float | None,
        averaging_timeout: float | None,
        allreduce_timeout: float | None,
        next_chunk_timeout: float | None,
        **rest: Any,
    ) -> OptimizerConfig:
        """Fills in the defaults that depend on other arguments (see the module docstring)."""
        matchmaking_time = 15.0 if matchmaking_time is None else matchmaking_time
        averaging_timeout = 60.0 if averaging_timeout is None else averaging_timeout
        return cls(
            client_mode=bool(dht_client_mode) if client_mode is None else client_mode,
            delay_optimizer_step=delay_grad_averaging if delay_optimizer_step is None else delay_optimizer_step,
            delay_grad_averaging=delay_grad_averaging,
            offload_optimizer=(
                (optimizer_from_factory and not use_local_updates) if offload_optimizer is None else offload_optimizer
            ),
            use_local_updates=use_local_updates,
            matchmaking_time=matchmaking_time,
            averaging_timeout=averaging_timeout,
            allreduce_timeout=averaging_timeout if allreduce_timeout is None else allreduce_timeout,
            next_chunk_timeout=matchmaking_time if next_chunk_timeout is None else next_chunk_timeout,
            optimizer_from_factory=optimizer_from_factory,
            custom_grad_averager=custom_grad_averager,
            **rest,
        )

    def __post_init__(self) -> None:
        self._check_types()
        self._check_combinations()

    def _check_types(self) -> None:
        check_run_id(self.run_id)
        _positive_int("target_batch_size", self.target_batch_size)
        if self.batch_size_per_step is not None:
            _positive_int("batch_size_per_step", self.batch_size_per_step)
        _positive_int("average_state_every", self.average_state_every)
        check_hops(self.grad_averaging_hops)
        for name in (
            "matchmaking_time",
            "averaging_timeout",
            "allreduce_timeout",
            "next_chunk_timeout",
            "load_state_timeout",
            "shutdown_timeout",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
                raise ConfigurationError(f"{name} must be a positive finite number of seconds, got {value!r}")
            object.__setattr__(self, name, float(value))
        alpha = self.performance_ema_alpha
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha <= 1:
            raise ConfigurationError(f"performance_ema_alpha must be in (0, 1], got {alpha!r}")
        for field in dataclasses.fields(self):
            if field.type == "bool" and not isinstance(getattr(self, field.name), bool):
                raise ConfigurationError(f"{field.name} must be True or False, got {getattr(self, field.name)!r}")

    def _check_combinations(self) -> None:
        if self.delay_grad_averaging and not self.delay_optimizer_step:
            raise ConfigurationError("delay_grad_averaging=True requires delay_optimizer_step=True")
        if self.delay_optimizer_step and not self.offload_optimizer:
            raise ConfigurationError(
                "delay_optimizer_step=True requires offload_optimizer=True: the background step works on "
                "host copies of the parameters while the model keeps training"
            )
        if self.client_mode and self.auxiliary:
            raise ConfigurationError(
                "an auxiliary peer must accept incoming connections: pass client_mode=False (or drop auxiliary=True)"
            )
        if self.auxiliary and self.batch_size_per_step is not None:
            raise ConfigurationError("auxiliary peers do not train: drop batch_size_per_step")
        if (self.offload_optimizer or self.delay_optimizer_step) and not self.optimizer_from_factory:
            raise ConfigurationError(
                "offload_optimizer and delayed optimizer steps need the optimizer as a factory: "
                "Optimizer(..., params=model.parameters(), optimizer=lambda params: torch.optim.Adam(params))"
            )
        if self.grad_averaging_hops != 1 and (self.use_local_updates or self.custom_algorithm):
            raise ConfigurationError(
                "grad_averaging_hops applies to the default synchronous gradient averaging only: drop it with "
                + ("use_local_updates=True (no gradient rounds)" if self.use_local_updates else "a custom algorithm")
            )
        if self.use_local_updates:
            if self.reuse_grad_buffers:
                raise ConfigurationError(
                    "use_local_updates=True does not accumulate gradients: drop reuse_grad_buffers"
                )
            if self.delay_grad_averaging:
                raise ConfigurationError("use_local_updates=True does not average gradients: drop delay_grad_averaging")
            if self.custom_grad_averager:
                raise ConfigurationError(
                    "use_local_updates=True does not average gradients: drop grad_averager_factory"
                )

    @property
    def averages_gradients(self) -> bool:
        return not self.use_local_updates and not self.auxiliary

    def averager_options(self, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """The keywords of every averager this peer starts (gradients, state, an algorithm's rounds)."""
        return averager_options(
            matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            shutdown_timeout=self.shutdown_timeout,
            overrides=overrides,
        )


def averager_options(
    *,
    matchmaking_time: float,
    allreduce_timeout: float,
    next_chunk_timeout: float | None = None,
    client_mode: bool | None = None,
    shutdown_timeout: float | None = None,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``DecentralizedAverager`` keywords from a run's settings; the user's ``averager_opts``
    (``overrides``) win. The one place where averager options are assembled."""
    options: dict[str, Any] = dict(min_matchmaking_time=matchmaking_time, allreduce_timeout=allreduce_timeout)
    for name, value in (
        ("next_chunk_timeout", next_chunk_timeout),
        ("client_mode", client_mode),
        ("shutdown_timeout", shutdown_timeout),
    ):
        if value is not None:
            options[name] = value
    options.update(overrides or {})
    return options


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name} must be a positive integer, got {value!r}")
