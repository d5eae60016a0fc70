"""One trainer's local training state: parameters, optimizer, scheduler and epoch.

``TrainingState`` owns no network. It builds the wrapped torch optimizer (from a factory over the
model's parameters, or over host copies of them with ``offload``), applies gradients passed
explicitly through a functional optimizer (:mod:`.functional`), keeps the scheduler on the epoch,
and turns the whole state into ``(metadata, tensors)`` for newcomers and back.

Parameter sets::

    main_params   the model's parameters (what the user's forward pass reads)
    opt_params    what the optimizer updates: main_params, or host copies of them with offload

With offload, ``copy_to_model()`` publishes the optimizer's parameters to the model (after a step)
and ``copy_from_model()`` does the reverse (after the model's parameters changed, e.g. by local
updates). Metadata is msgpack-safe: the optimizer's ``state_dict`` with every tensor replaced by an
index into the tensor list, and integer keys turned into lists.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from hivemind_ext.errors import ConfigurationError, StateLoadError
from hivemind_ext.optim.functional import FunctionalOptimizer

TENSOR_MARK = "__tensor__"
SCALAR_MARK = "__scalar__"  # 0-d tensors (step counters) travel exactly, in the metadata, never through a lossy codec
STATE_FORMAT = 1


class TrainingState:
    def __init__(
        self,
        *,
        optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer],
        params: Iterable[Any] | None = None,
        scheduler: Any = None,
        offload: bool = False,
        extra_tensors: Sequence[torch.Tensor] = (),
        average_opt_statistics: Sequence[str] = (),
    ) -> None:
        if params is not None:
            if not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer):
                raise ConfigurationError("with params=..., optimizer must be a callable(params) -> torch optimizer")
            groups = _param_groups(params)
            self.main_params = [p for group in groups for p in group["params"]]
            if offload:
                self.opt_params = [_host_copy(p) for p in self.main_params]
                copies = iter(self.opt_params)
                groups = [{**group, "params": [next(copies) for _ in group["params"]]} for group in groups]
            else:
                self.opt_params = self.main_params
            self.optimizer = optimizer(groups)
            if not isinstance(self.optimizer, torch.optim.Optimizer):
                raise ConfigurationError(f"the optimizer factory returned {type(self.optimizer).__name__}")
        else:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise ConfigurationError(
                    "pass either optimizer=torch_optimizer, or params=... with optimizer=callable(params)"
                )
            if offload:
                raise ConfigurationError("offload_optimizer needs optimizer=callable(params) with params=...")
            self.optimizer = optimizer
            self.main_params = [p for group in optimizer.param_groups for p in group["params"]]
            self.opt_params = self.main_params
        if not self.main_params:
            raise ConfigurationError("the optimizer has no parameters")
        if len({id(p) for p in self.main_params}) != len(self.main_params):
            raise ConfigurationError("a parameter appears twice in the optimizer's param groups")
        self.offload = offload and self.opt_params is not self.main_params
        self.extra_tensors = list(extra_tensors)
        # (first index in extra_tensors, count, check): see add_extra_tensors
        self._extra_checks: list[tuple[int, int, Callable[[list[torch.Tensor]], None]]] = []
        self.average_opt_statistics = tuple(average_opt_statistics)
        self.functional = FunctionalOptimizer(self.optimizer)
        if callable(scheduler) and (isinstance(scheduler, type) or not hasattr(scheduler, "step")):
            scheduler = scheduler(self.optimizer)
        self.scheduler = scheduler
        self.epoch = 0

    # ----- stepping

    def apply_gradients(self, grads: Sequence[torch.Tensor | None]) -> None:
        """One optimizer step on ``opt_params`` with the given gradients (one per parameter)."""
        if len(grads) != len(self.opt_params):
            raise ConfigurationError(f"{len(grads)} gradients for {len(self.opt_params)} parameters")
        with torch.no_grad():
            self.functional.step(
                [
                    g if g is None else g.to(p.device, non_blocking=True)
                    for g, p in zip(grads, self.opt_params, strict=True)
                ]
            )

    def copy_to_model(self) -> None:
        if self.offload:
            with torch.no_grad():
                torch._foreach_copy_(self.main_params, self.opt_params, non_blocking=True)

    def copy_from_model(self) -> None:
        if self.offload:
            with torch.no_grad():
                torch._foreach_copy_(self.opt_params, self.main_params)

    def set_epoch(self, epoch: int) -> None:
        """Moves to ``epoch`` and steps the scheduler once per epoch passed."""
        self.epoch = max(int(epoch), 0)
        if self.scheduler is None:
            return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
            while getattr(self.scheduler, "last_epoch", self.epoch) < self.epoch:
                self.scheduler.step()

    def adopt_epoch(self, epoch: int) -> None:
        """Moves to ``epoch`` after loading an optimizer state whose param groups already hold that
        epoch's learning rates (a peer's snapshot, a checkpoint): the scheduler's counter jumps to the
        epoch without stepping, since stepping a chainable scheduler (StepLR, ExponentialLR, ...) would
        apply the schedule a second time on top of the loaded learning rate."""
        self.epoch = max(int(epoch), 0)
        if self.scheduler is None or not hasattr(self.scheduler, "last_epoch"):
            return
        self.scheduler.last_epoch = self.epoch
        if hasattr(self.scheduler, "_last_lr"):
            self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    # ----- what is averaged

    def ensure_statistics(self) -> None:
        """Creates the optimizer's state tensors (one zero-gradient step, parameters restored) when
        ``average_opt_statistics`` names statistics that do not exist yet."""
        if not self.average_opt_statistics or all(self.optimizer.state.get(p) for p in self.opt_params):
            return
        with torch.no_grad():
            saved = [p.detach().clone() for p in self.opt_params]
            self.functional.step([torch.zeros_like(p) for p in self.opt_params])
            torch._foreach_copy_(self.opt_params, saved)

    def statistics(self) -> list[torch.Tensor]:
        """The optimizer statistics named in ``average_opt_statistics``, in parameter order."""
        found = []
        for name in self.average_opt_statistics:
            for param in self.opt_params:
                value = self.optimizer.state.get(param, {}).get(name)
                if value is None:
                    raise ConfigurationError(f"the optimizer has no statistic {name!r} for every parameter")
                found.append(value)
        return found

    def averaged_tensors(self) -> list[torch.Tensor]:
        """What state averaging averages: the optimizer's parameters, chosen statistics, extra tensors."""
        return [*self.opt_params, *self.statistics(), *self.extra_tensors]

    # ----- state for newcomers

    def add_extra_tensors(
        self, tensors: Sequence[torch.Tensor], *, check: Callable[[list[torch.Tensor]], None] | None = None
    ) -> None:
        """Appends tensors that travel with the state (e.g. an algorithm's anchors and counters). ``check``
        receives the downloaded values of exactly these tensors (host copies, shapes already checked)
        before a state is adopted, and raises :class:`~hivemind_ext.errors.UntrustedStateError` to refuse
        it: values that are finite but cannot be (a round counter of 1e30) come from a hostile donor,
        and the loader then bans it and downloads from others."""
        if check is not None:
            self._extra_checks.append((len(self.extra_tensors), len(tensors), check))
        self.extra_tensors.extend(tensors)

    def check_extra_values(self, tensors: Sequence[torch.Tensor]) -> None:
        """Runs the checks of :meth:`add_extra_tensors` on a downloaded snapshot's tensors (after
        :meth:`check_snapshot`); raises UntrustedStateError."""
        first = len(self.opt_params)
        for start, count, check in self._extra_checks:
            check(list(tensors[first + start : first + start + count]))

    def snapshot(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """(metadata, tensors) of the whole state; tensors are detached clones on the host."""
        tensors: list[torch.Tensor] = [p.detach().cpu().clone() for p in self.opt_params]
        tensors += [t.detach().cpu().clone() for t in self.extra_tensors]
        state_dict = self.optimizer.state_dict()
        packed_state = [[int(key), _pack(value, tensors)] for key, value in state_dict["state"].items()]
        groups = [{k: _pack(v, tensors) for k, v in g.items() if k != "params"} for g in state_dict["param_groups"]]
        metadata = {
            "format": STATE_FORMAT,
            "epoch": self.epoch,
            "num_params": len(self.opt_params),
            "num_extra": len(self.extra_tensors),
            "group_sizes": [len(g["params"]) for g in state_dict["param_groups"]],
            "state": packed_state,
            "param_groups": groups,
        }
        return metadata, tensors

    def load(self, metadata: Any, tensors: Sequence[torch.Tensor]) -> None:
        """Applies a snapshot from a peer; raises StateLoadError (changing nothing) if it does not fit."""
        self.check_snapshot(metadata, tensors)
        n_params, n_extra = metadata["num_params"], metadata["num_extra"]
        try:
            local = self.optimizer.state_dict()
            state = {int(key): _unpack(value, tensors) for key, value in metadata["state"]}
            groups = []
            for mine, theirs in zip(local["param_groups"], metadata["param_groups"], strict=True):
                merged = {**mine, **{k: _unpack(v, tensors) for k, v in theirs.items()}}
                merged = {
                    k: tuple(v) if isinstance(mine.get(k), tuple) and isinstance(v, list) else v
                    for k, v in merged.items()
                }
                merged["params"] = mine["params"]
                groups.append(merged)
            self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
            raise StateLoadError(f"the downloaded optimizer state does not fit this optimizer: {e}") from e
        with torch.no_grad():
            for target, value in zip(self.opt_params, tensors[:n_params], strict=True):
                target.copy_(value)
            for target, value in zip(self.extra_tensors, tensors[n_params : n_params + n_extra], strict=True):
                target.copy_(value)
        self.copy_to_model()
        self.functional = FunctionalOptimizer(self.optimizer)
        self.adopt_epoch(metadata["epoch"])

    def check_snapshot(self, metadata: Any, tensors: Sequence[torch.Tensor]) -> None:
        """Raises StateLoadError if a downloaded snapshot does not fit this optimizer (or holds NaN/Inf)."""
        if not isinstance(metadata, dict) or metadata.get("format") != STATE_FORMAT:
            raise StateLoadError("the downloaded state is not a training state of this version")
        epoch = metadata.get("epoch")
        if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch < 2**62:
            raise StateLoadError(f"the downloaded state has an invalid epoch {epoch!r}")
        if metadata.get("num_params") != len(self.opt_params) or metadata.get("num_extra") != len(self.extra_tensors):
            raise StateLoadError(
                f"the downloaded state has {metadata.get('num_params')} parameters and {metadata.get('num_extra')} "
                f"extra tensors; this model has {len(self.opt_params)} and {len(self.extra_tensors)}"
            )
        if metadata.get("group_sizes") != [len(g["params"]) for g in self.optimizer.param_groups]:
            raise StateLoadError("the downloaded state's parameter groups differ from this optimizer's")
        expected = [*self.opt_params, *self.extra_tensors]
        if len(tensors) < len(expected):
            raise StateLoadError(f"the downloaded state has {len(tensors)} tensors, expected at least {len(expected)}")
        for index, (mine, theirs) in enumerate(zip(expected, tensors, strict=False)):
            if tuple(mine.shape) != tuple(theirs.shape) or not theirs.dtype.is_floating_point:
                raise StateLoadError(
                    f"downloaded tensor {index} has shape {tuple(theirs.shape)} {theirs.dtype}, "
                    f"expected {tuple(mine.shape)} {mine.dtype}"
                )
            if not torch.isfinite(theirs).all():
                raise StateLoadError(f"downloaded tensor {index} holds NaN or Inf")
        for index, tensor in enumerate(tensors[len(expected) :], start=len(expected)):
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise StateLoadError(f"downloaded optimizer state tensor {index} holds NaN or Inf")
        if not isinstance(metadata.get("state"), list) or not isinstance(metadata.get("param_groups"), list):
            raise StateLoadError("the downloaded optimizer state is malformed")


def _param_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    items = list(params)
    if not items:
        raise ConfigurationError("params is empty")
    if all(isinstance(item, dict) for item in items):
        groups = [dict(item) for item in items]
        for group in groups:
            if "params" not in group:
                raise ConfigurationError("every param group needs a 'params' entry")
            group["params"] = [group["params"]] if isinstance(group["params"], torch.Tensor) else list(group["params"])
        return groups
    if all(isinstance(item, torch.Tensor) for item in items):
        return [{"params": items}]
    raise ConfigurationError("params must be tensors or param-group dicts, not a mix")


def _host_copy(param: torch.Tensor) -> torch.Tensor:
    copy = torch.empty_like(param, device="cpu", pin_memory=param.is_cuda and torch.cuda.is_available())
    copy.copy_(param.detach())
    return copy.requires_grad_(param.requires_grad)


def _pack(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return {
            SCALAR_MARK: value.item(),
            "dtype": str(value.dtype).removeprefix("torch."),
            "device": str(value.device),
        }
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach().cpu().clone())
        return {TENSOR_MARK: len(tensors) - 1}
    if isinstance(value, dict):
        return {str(k): _pack(v, tensors) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_pack(v, tensors) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise ConfigurationError(f"cannot share optimizer state of type {type(value).__name__}")


def _unpack(value: Any, tensors: Sequence[torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if set(value) == {TENSOR_MARK}:
            index = value[TENSOR_MARK]
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(tensors):
                raise ValueError(f"tensor index {index!r} out of range")
            return tensors[index]
        if set(value) == {SCALAR_MARK, "dtype", "device"}:
            dtype = getattr(torch, str(value["dtype"]), None)
            if not isinstance(dtype, torch.dtype) or not isinstance(value[SCALAR_MARK], int | float):
                raise ValueError(f"invalid scalar {value!r}")
            device = "cpu" if value["device"] == "cpu" else None
            return torch.tensor(value[SCALAR_MARK], dtype=dtype, device=device)
        return {k: _unpack(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_unpack(v, tensors) for v in value]
    return value
