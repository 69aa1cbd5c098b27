"""PrecisionAwareAdamW: TE FusedAdam's precision-aware state format and API in plain torch.

The rooms: ``_optimizer`` (the class), ``_layout`` (its storage layout value), ``_state`` and
``_loading`` (state creation, state_dict and loading), ``_step`` (the router that gives each
parameter its path) and one module per path (``_torch_step``, ``_kernel_step``,
``_block_step``, ``_fused_gpu``), and ``_host_copies``: what HybridOffloadOptimizer's fused
host step asks of it, the one door it comes through.
"""

from wrapped_optim.optimizers.precision_adamw._host_copies import (
    kernel_step_copies,
    kernel_steps_copy,
)
from wrapped_optim.optimizers.precision_adamw._optimizer import PrecisionAwareAdamW

__all__ = ["PrecisionAwareAdamW", "kernel_step_copies", "kernel_steps_copy"]
