"""Optional megatron-core integration: imported lazily, absent is a normal state."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import torch

__all__ = ["config_flag", "megatron_available", "megatron_optimizer_module", "unshare_steps"]


def megatron_available() -> bool:
    """Whether megatron-core can be imported here (without importing it).

    Example:
        >>> isinstance(megatron_available(), bool)
        True
    """
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


def megatron_optimizer_module() -> ModuleType:
    """``megatron.core.optimizer``, or an ImportError that says how to get it.

    Example:
        >>> megatron_optimizer_module().__name__  # with megatron-core installed
        'megatron.core.optimizer'
    """
    try:
        return importlib.import_module("megatron.core.optimizer")
    except ImportError as error:
        raise ImportError(
            "this feature needs megatron-core: pip install 'wrapped-optim[megatron]'"
        ) from error


def config_flag(config: Any, name: str) -> bool:
    """A boolean option of a Megatron config, ``False`` when the config or option is absent.

    Any object with the attribute works, so tests and users can pass a plain namespace
    (megatron-core's own OptimizerConfig refuses some combinations without TE installed).

    Example:
        >>> from types import SimpleNamespace
        >>> config_flag(SimpleNamespace(optimizer_cpu_offload=True), "optimizer_cpu_offload")
        True
        >>> config_flag(None, "optimizer_cpu_offload")
        False
    """
    return bool(getattr(config, name, False)) if config is not None else False


def unshare_steps(stack: Any) -> int:
    """Gives every parameter of every leaf its own ``step`` tensor; returns how many it split.

    megatron-core 0.16.1's ``DistributedOptimizer.load_state_dict`` (torch optimizer inside, no
    TE/Apex) writes *one* step tensor into every parameter's state; torch's Adam then
    increments it once per parameter per step, so a resumed run diverges from the
    uninterrupted one. torch's own loader gives each parameter a copy, which this restores.

    Example:
        >>> import torch
        >>> a, b = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
        >>> adam = torch.optim.AdamW([a, b])
        >>> step = torch.tensor(3.0)
        >>> adam.state[a]["step"] = adam.state[b]["step"] = step
        >>> unshare_steps(adam), adam.state[a]["step"] is adam.state[b]["step"]
        (1, False)
    """
    from wrapped_optim._adapters.walk import walk_leaves

    split = 0
    for leaf in walk_leaves(stack):
        state = getattr(leaf.optimizer, "state", None)
        if not isinstance(state, Mapping):
            continue
        seen: set[int] = set()
        for entry in state.values():
            step = entry.get("step") if isinstance(entry, Mapping) else None
            if not isinstance(step, torch.Tensor):
                continue
            if id(step) in seen:
                entry["step"] = step.clone()
                split += 1
            seen.add(id(step))
    return split
