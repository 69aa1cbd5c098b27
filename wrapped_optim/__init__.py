"""wrapped_optim: composable wrappers that make optimizers cheap to checkpoint, offload and shard.

Public API only; see the README and docs/ for the concepts. Advanced and integration pieces
have their own modules: :mod:`wrapped_optim.integrations.bridge` (Megatron-Bridge's
``SchedulerConfig``), :mod:`wrapped_optim.patching` (the instance-patching utility),
:mod:`wrapped_optim.compat` (drop-in Megatron helpers).
"""

from wrapped_optim import _quiet_torch  # noqa: F401  (first: imports torch quietly)
from wrapped_optim._builder import BuildConfig, LRScheduleConfig, OptimizerSpec, build_optimizer
from wrapped_optim.checkpoint import OptimizerCheckpointError, load_optimizer, save_optimizer
from wrapped_optim.config import ConfigError, FSDPConfig, HybridConfig, StackConfig, StagedConfig
from wrapped_optim.fsdp import FSDPAwareOptimizer, init_optimizer_state
from wrapped_optim.hybrid import HybridSyncOptimizer, StaleMasterError
from wrapped_optim.integrations.bridge import setup_optimizer
from wrapped_optim.optimizers import HybridOffloadOptimizer, PrecisionAwareAdamW
from wrapped_optim.stack import find_layer, layers, unwrap, wrap
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
