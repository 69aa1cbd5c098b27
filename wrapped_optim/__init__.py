"""wrapped_optim: composable wrappers that make optimizers cheap to checkpoint, offload and shard.

Public API only; see the README and docs/ for the concepts.
"""

from wrapped_optim.checkpoint import OptimizerCheckpointError, load_optimizer, save_optimizer
from wrapped_optim.config import (
    BuildConfig,
    ConfigError,
    FSDPConfig,
    HybridConfig,
    LRScheduleConfig,
    OptimizerSpec,
    SchedulerConfig,
    StackConfig,
    StagedConfig,
)
from wrapped_optim.factory import build_optimizer, setup_optimizer, wrap
from wrapped_optim.fsdp import FSDPAwareOptimizer, init_optimizer_state
from wrapped_optim.hybrid import HybridSyncOptimizer, StaleMasterError
from wrapped_optim.optimizers import HybridOffloadOptimizer, PrecisionAwareAdamW
from wrapped_optim.patching import patch_attribute
from wrapped_optim.staged import StagedCheckpointOptimizer
from wrapped_optim.wrapper import OptimizerWrapper

__version__ = "0.1.0"

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
    "SchedulerConfig",
    "StackConfig",
    "StagedCheckpointOptimizer",
    "StagedConfig",
    "StaleMasterError",
    "__version__",
    "build_optimizer",
    "init_optimizer_state",
    "load_optimizer",
    "patch_attribute",
    "save_optimizer",
    "setup_optimizer",
    "wrap",
]
