"""wrapped_optim: composable wrappers that make optimizers cheap to checkpoint, offload and shard.

Public API only; see the README and docs/ for the concepts.
"""

from wrapped_optim.hybrid import HybridSyncOptimizer, StaleMasterError
from wrapped_optim.patching import patch_attribute
from wrapped_optim.wrapper import OptimizerWrapper

__version__ = "0.1.0"

__all__ = [
    "HybridSyncOptimizer",
    "OptimizerWrapper",
    "StaleMasterError",
    "__version__",
    "patch_attribute",
]
