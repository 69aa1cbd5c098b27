"""Portable, device-agnostic optimizers with the state formats of their CUDA-only originals.

Three packages, each behind its face: :mod:`~wrapped_optim.optimizers.precision_adamw` (TE
FusedAdam's precision-aware state, in plain torch), :mod:`~wrapped_optim.optimizers.hybrid_offload`
(Megatron's HybridDeviceOptimizer, on any device) and :mod:`~wrapped_optim.optimizers.kernels`
(the compiled CPU and Triton AdamW kernels, which know storage formats, not optimizers).
"""

from wrapped_optim.optimizers._torch_adam_format import (
    TorchAdamFormatError,
    from_torch_adam,
    to_torch_adam,
)
from wrapped_optim.optimizers.hybrid_offload import HybridOffloadOptimizer

# Its path before the kernels had a package of their own; `from wrapped_optim.optimizers
# import cpu_kernel` keeps working.
from wrapped_optim.optimizers.kernels import cpu_kernel as cpu_kernel
from wrapped_optim.optimizers.precision_adamw import PrecisionAwareAdamW

__all__ = [
    "HybridOffloadOptimizer",
    "PrecisionAwareAdamW",
    "TorchAdamFormatError",
    "from_torch_adam",
    "to_torch_adam",
]
