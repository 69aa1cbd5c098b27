"""Test doubles of megatron-core (0.16.1-0.19.2) / TE classes, kept where no real class serves.

The real stacks that ``get_megatron_optimizer`` builds (FP32Optimizer,
Float16OptimizerWithFloat16Params, DistributedOptimizer around torch's AdamW,
HybridDeviceOptimizer inside it, ChainedOptimizer) run on CPU in ``tests/megatron_real/`` and
are tested there through every wrapper and compat helper; the unit tests chain with the real
``megatron.core.optimizer.ChainedOptimizer``. What remains here, and why:

- ``distributed.DistributedOptimizerDouble`` -- the one double of DistributedOptimizer, for
  the portable inner optimizers (PrecisionAwareAdamW, HybridOffloadOptimizer) that the real
  class refuses (it asserts Adam/AdamW/HybridDeviceOptimizer, distrib_optimizer.py:514).
- ``te_fused_adam`` -- TE FusedAdam's surface (``te_style``, ``te_fp16_bug``): TE does not
  install here.
- ``megatron_cpu`` -- not a double: the real FP32Optimizer with its loss scale on the CPU, for
  unit tests that need one without a process group.
"""
