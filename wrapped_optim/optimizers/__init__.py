"""Portable, device-agnostic optimizers with the state formats of their CUDA-only originals."""

from wrapped_optim.optimizers._hybrid_offload import HybridOffloadOptimizer
from wrapped_optim.optimizers._precision_adam import PrecisionAwareAdamW
from wrapped_optim.optimizers._torch_adam_format import (
    TorchAdamFormatError,
    from_torch_adam,
    to_torch_adam,
)

__all__ = [
    "HybridOffloadOptimizer",
    "PrecisionAwareAdamW",
    "TorchAdamFormatError",
    "from_torch_adam",
    "to_torch_adam",
]
