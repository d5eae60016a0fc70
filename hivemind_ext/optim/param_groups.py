"""Param groups as user code sees them: the wrapped optimizer's hyperparameters, the model's parameters.

With ``offload_optimizer`` the wrapped torch optimizer steps host copies of the parameters, but
code written for a plain optimizer reads ``opt.param_groups`` for the model's own parameters (for
example ``torch.amp.GradScaler.unscale_(opt)`` unscales their ``.grad``) and writes
hyperparameters into them (LR schedulers set ``group["lr"]``). A :class:`ParamGroupView` gives both:
``"params"`` is the model's parameters, every other key reads and writes the wrapped optimizer's group.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

import torch

from hivemind_ext.errors import ConfigurationError


class ParamGroupView(MutableMapping):
    def __init__(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        self._group, self._params = group, params

    def __getitem__(self, key: str) -> Any:
        return self._params if key == "params" else self._group[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "params":
            raise TypeError("the parameters of a hivemind_ext.Optimizer param group cannot be replaced")
        self._group[key] = value

    def __delitem__(self, key: str) -> None:
        if key == "params":
            raise TypeError("the parameters of a hivemind_ext.Optimizer param group cannot be removed")
        del self._group[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._group)

    def __len__(self) -> int:
        return len(self._group)

    def __repr__(self) -> str:
        hyper = {k: v for k, v in self._group.items() if k != "params"}
        return f"ParamGroupView({len(self._params)} params, {hyper})"


def group_views(optimizer: torch.optim.Optimizer, main_params: list[torch.Tensor]) -> list[ParamGroupView]:
    views, start = [], 0
    for group in optimizer.param_groups:
        count = len(group["params"])
        views.append(ParamGroupView(group, main_params[start : start + count]))
        start += count
    return views


def require_trainable(params: list[torch.Tensor]) -> None:
    """A trainer whose parameters are all frozen would average and step nothing, silently: refuse it."""
    if not any(param.requires_grad for param in params):
        raise ConfigurationError(
            f"none of the {len(params)} parameters requires grad (is the whole model frozen?): pass the "
            "parameters to train, or set requires_grad=True on at least one"
        )
