"""Portable, device-agnostic implementations of the foreign optimizers wrapped_optim decorates."""

from wrapped_optim.optimizers.hybrid_offload import HybridOffloadOptimizer

__all__ = ["HybridOffloadOptimizer"]
