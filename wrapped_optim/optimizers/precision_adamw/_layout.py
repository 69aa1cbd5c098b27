"""The storage layout of a :class:`~wrapped_optim.optimizers.PrecisionAwareAdamW`.

:class:`PrecisionLayout` is the one value the step, state and loading functions read the
optimizer's options from: the stored dtype of each state, whether a bf16 parameter's master
is an int16 remainder, which kernels may run, the step's slice size.
"""

from __future__ import annotations

import functools

import attrs
import torch
from torch import Tensor

from wrapped_optim._formats import blocks, codecs

__all__ = ["STATE_NAMES", "PrecisionLayout"]

#: The per-parameter states, in the order they are created.
STATE_NAMES = ("exp_avg", "exp_avg_sq", "master_param")


@attrs.frozen
class PrecisionLayout:
    """How a PrecisionAwareAdamW stores its state and which step kernels it may use.

    Args:
        exp_avg_dtype: storage of the first moment (``torch.uint8`` is FP8 E4M3).
        exp_avg_sq_dtype: storage of the second moment.
        master_weights: whether low-precision parameters keep a master copy.
        master_weight_dtype: storage of the master copy (FP32 or fp16).
        store_param_remainders: an FP32 master of a bf16 parameter is kept as its int16
            remainder (already combined with ``master_weights`` and the master dtype).
        adam_w_mode: decoupled weight decay (AdamW) rather than L2.
        chunk_numel: elements the sliced step expands to FP32 at once.
        fused: torch's fused AdamW kernel: None where torch has one, True required.
        cpu_kernel: the compiled CPU kernel: None where it builds, True required.
        pack_small: small parameters share one fused call.
        block_format: both moments block-scaled in this format (``"int8"``, ``"fp8"`` or
            ``"int4"``, :mod:`wrapped_optim._formats.blocks`), stored as ``torch.uint8``
            codes; None for the moment dtypes' own formats (TE's).
        block_size: values per block of a block format.

    Example:
        >>> import torch
        >>> layout = PrecisionLayout(exp_avg_dtype=torch.uint8, master_weights=True,
        ...                          store_param_remainders=True)
        >>> p = torch.zeros(2, dtype=torch.bfloat16)
        >>> layout.storage_dtype(p, "master_param"), layout.is_scaled(p, "exp_avg")
        (torch.int16, True)
    """

    exp_avg_dtype: torch.dtype = torch.float32
    exp_avg_sq_dtype: torch.dtype = torch.float32
    master_weights: bool = False
    master_weight_dtype: torch.dtype = torch.float32
    store_param_remainders: bool = False
    adam_w_mode: bool = True
    chunk_numel: int = 1 << 16
    fused: bool | None = None
    cpu_kernel: bool | None = None
    pack_small: bool = True
    block_format: str | None = None
    block_size: int = 256

    @property
    def blocks(self) -> blocks.BlockFormat | None:
        """The moments' block format, or None (TE's formats)."""
        if self.block_format is None:
            return None
        return _block_format(self.block_format, self.block_size)

    def is_blocked(self, state_name: str) -> bool:
        """Whether a state is stored block-scaled (the moments, with a block format)."""
        return self.block_format is not None and state_name in ("exp_avg", "exp_avg_sq")

    def dtype_of(self, state_name: str) -> torch.dtype:
        """The configured dtype of a state (a remainder master is stored as int16 instead)."""
        if state_name == "exp_avg":
            return self.exp_avg_dtype
        if state_name == "exp_avg_sq":
            return self.exp_avg_sq_dtype
        return self.master_weight_dtype

    def uses_remainder(self, param: Tensor, state_name: str = "master_param") -> bool:
        """Whether ``param``'s state is an int16 remainder (TE's rule: bf16 params only)."""
        return (
            self.store_param_remainders
            and state_name == "master_param"
            and param.dtype == torch.bfloat16
        )

    def storage_dtype(self, param: Tensor, state_name: str) -> torch.dtype:
        """The dtype ``param``'s state is stored in."""
        if self.uses_remainder(param, state_name):
            return torch.int16
        return self.dtype_of(state_name)

    def expansion_dtype(self, param: Tensor, state_name: str) -> torch.dtype:
        """The dtype of the state's expansion: FP32, or int16 for a remainder master."""
        return torch.int16 if self.uses_remainder(param, state_name) else torch.float32

    def is_scaled(self, param: Tensor, state_name: str) -> bool:
        """Whether ``param``'s state is stored relative to a per-tensor scale (fp16, FP8)."""
        if self.is_blocked(state_name):
            return False
        return not self.uses_remainder(param, state_name) and codecs.is_scaled(
            self.dtype_of(state_name)
        )


@functools.lru_cache(maxsize=64)
def _block_format(name: str, size: int) -> blocks.BlockFormat:
    """One validated (frozen) format per name and size: a step asks for it for every param."""
    return blocks.BlockFormat(name, size)
