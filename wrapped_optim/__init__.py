"""wrapped_optim: composable wrappers that make optimizers cheap to checkpoint, offload and shard.

Public API only; see the README and docs/ for the concepts. Advanced and integration pieces
have their own modules: :mod:`wrapped_optim.integrations.bridge` (Megatron-Bridge's
``SchedulerConfig``), :mod:`wrapped_optim.patching` (the instance-patching utility),
:mod:`wrapped_optim.compat` (drop-in Megatron helpers).

The names are imported on first use (PEP 562), so ``import wrapped_optim`` and
``wrapped-optim --version`` do not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from wrapped_optim._builder import (
        BuildConfig,
        LRScheduleConfig,
        OptimizerSpec,
        build_optimizer,
    )
    from wrapped_optim.checkpoint import OptimizerCheckpointError, load_optimizer, save_optimizer
    from wrapped_optim.config import (
        ConfigError,
        FSDPConfig,
        HybridConfig,
        StackConfig,
        StagedConfig,
    )
    from wrapped_optim.fsdp import FSDPAwareOptimizer, init_optimizer_state
    from wrapped_optim.hybrid import HybridSyncOptimizer, StaleMasterError
    from wrapped_optim.integrations.bridge import setup_optimizer
    from wrapped_optim.optimizers import HybridOffloadOptimizer, PrecisionAwareAdamW
    from wrapped_optim.stack import find_layer, layers, unwrap, wrap
    from wrapped_optim.staged import StagedCheckpointOptimizer
    from wrapped_optim.wrapper import OptimizerWrapper

__version__ = "0.1.0"

# Each public name and the module it comes from.
_SOURCES = {
    "BuildConfig": "_builder",
    "LRScheduleConfig": "_builder",
    "OptimizerSpec": "_builder",
    "build_optimizer": "_builder",
    "OptimizerCheckpointError": "checkpoint",
    "load_optimizer": "checkpoint",
    "save_optimizer": "checkpoint",
    "ConfigError": "config",
    "FSDPConfig": "config",
    "HybridConfig": "config",
    "StackConfig": "config",
    "StagedConfig": "config",
    "FSDPAwareOptimizer": "fsdp",
    "init_optimizer_state": "fsdp",
    "HybridSyncOptimizer": "hybrid",
    "StaleMasterError": "hybrid",
    "setup_optimizer": "integrations.bridge",
    "HybridOffloadOptimizer": "optimizers",
    "PrecisionAwareAdamW": "optimizers",
    "find_layer": "stack",
    "layers": "stack",
    "unwrap": "stack",
    "wrap": "stack",
    "StagedCheckpointOptimizer": "staged",
    "OptimizerWrapper": "wrapper",
}


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module 'wrapped_optim' has no attribute {name!r}")
    importlib.import_module("wrapped_optim._quiet_torch")  # first: imports torch quietly
    value = getattr(importlib.import_module(f"wrapped_optim.{source}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_SOURCES})


__all__ = [
    "BuildConfig",
    "ConfigError",
    "FSDPAwareOptimizer",
    "FSDPConfig",
    "HybridConfig",
    "HybridOffloadOptimizer",
    "HybridSyncOptimizer",
    "LRScheduleConfig",
    "OptimizerCheckpointError",
    "OptimizerSpec",
    "OptimizerWrapper",
    "PrecisionAwareAdamW",
    "StackConfig",
    "StagedCheckpointOptimizer",
    "StagedConfig",
    "StaleMasterError",
    "__version__",
    "build_optimizer",
    "find_layer",
    "init_optimizer_state",
    "layers",
    "load_optimizer",
    "save_optimizer",
    "setup_optimizer",
    "unwrap",
    "wrap",
]
