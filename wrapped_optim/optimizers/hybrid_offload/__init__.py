"""HybridOffloadOptimizer: Megatron's HybridDeviceOptimizer structure on any device.

The rooms, named as in :mod:`~wrapped_optim.optimizers.precision_adamw`: ``_optimizer`` (the
class), ``_layout`` (where each parameter lives), ``_state`` and ``_state_rules`` (the state
it exposes and the rules a loaded one must follow), ``_loading``, ``_step`` (syncs and
copies around the sub-optimizers' steps), ``_host_step`` (the fused host step), ``_grads``
and ``_transfers``.
"""

from wrapped_optim.optimizers.hybrid_offload._optimizer import HybridOffloadOptimizer

__all__ = ["HybridOffloadOptimizer"]
