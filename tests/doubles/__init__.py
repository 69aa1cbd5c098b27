"""Test doubles of megatron-core 0.16.1 classes, kept only where the real class cannot serve.

The real stacks that ``get_megatron_optimizer`` builds (FP32Optimizer,
Float16OptimizerWithFloat16Params, DistributedOptimizer, HybridDeviceOptimizer inside it,
ChainedOptimizer) run on CPU in ``tests/megatron_real/`` and are tested there through every
wrapper and compat helper. What remains here, and why:

- ``distributed_staged.DistributedOptimizerDouble`` — a DistributedOptimizer around a
  *precision-aware* holder (bf16/fp16/FP8 moments, ``get_unscaled_state`` /
  ``set_scaled_state``). The real class asserts its inner optimizer is ``Adam`` (TE's or
  Apex's FusedAdam, else torch's AdamW), ``torch.optim.AdamW`` or ``HybridDeviceOptimizer``, so
  it refuses the portable PrecisionAwareAdamW, and TE's FusedAdam does not install here. Also
  ``te_style`` / ``te_fp16_bug``: TE FusedAdam's surface.
- ``distributed_hybrid.DistributedOptimizerDouble`` — a DistributedOptimizer around the
  *portable* HybridOffloadOptimizer, including its precision-aware mode (16-bit shards
  stepped, masters in the hybrid optimizer): the real class refuses that inner optimizer for
  the same reason. Megatron's own HybridDeviceOptimizer inside the real class (FP32 main
  shards) is covered by ``tests/megatron_real``; its precision-aware mode
  (``use_precision_aware_optimizer`` with ``optimizer_cpu_offload``, which OptimizerConfig
  accepts without TE) has not been run here yet.
- ``chained.ChainedOptimizerDouble`` — chains the two doubles above (the real ChainedOptimizer
  reduces grad norms over Megatron's process groups in ``step``, which the doubles lack).
- ``megatron_cpu`` — not a double: the real FP32Optimizer with its loss scale on the CPU, for
  unit tests that need one without a process group.

The two DistributedOptimizer doubles model two different precision-aware payload paths and
are not merged yet.
"""
