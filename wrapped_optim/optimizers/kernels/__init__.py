"""The AdamW kernels: the compiled CPU kernel (C sources in ``csrc/``, loaded with ctypes)
and the Triton GPU kernels. They know storage formats (bf16/fp16/FP8 moments, remainders,
scales), not optimizers: nothing here imports an optimizer family.
"""

from wrapped_optim.optimizers.kernels import cpu_kernel

__all__ = ["cpu_kernel"]
