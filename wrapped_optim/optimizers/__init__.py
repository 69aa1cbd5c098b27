"""Portable, device-agnostic optimizers with the state formats of their CUDA-only originals."""

from wrapped_optim.optimizers.precision_adam import PrecisionAwareAdamW

__all__ = ["PrecisionAwareAdamW"]
