"""Portable, device-agnostic optimizers with the state formats of their CUDA-only originals."""

from wrapped_optim.optimizers.hybrid_offload import HybridOffloadOptimizer
from wrapped_optim.optimizers.precision_adam import PrecisionAwareAdamW

__all__ = ["HybridOffloadOptimizer", "PrecisionAwareAdamW"]
