"""Optional megatron-core integration: imported lazily, absent is a normal state."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Any

__all__ = ["config_flag", "megatron_available", "megatron_optimizer_module"]


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
