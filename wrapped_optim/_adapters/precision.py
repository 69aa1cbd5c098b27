"""What a precision-aware optimizer offers, as protocols the wrappers can check at runtime.

TE's FusedAdam and :class:`wrapped_optim.optimizers.PrecisionAwareAdamW` both keep Adam state
in narrow dtypes and expose it through ``get_unscaled_state`` / ``set_scaled_state``. Only
our optimizer also offers the chunk-by-chunk capability; code that stages state asks
:func:`supports_chunked_state` and falls back to whole tensors otherwise.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = [
    "ChunkedStateHolder",
    "PrecisionAwareStateHolder",
    "has_compressed_state",
    "is_precision_aware_holder",
    "supports_chunked_state",
]


@runtime_checkable
class PrecisionAwareStateHolder(Protocol):
    """An optimizer whose per-parameter state is stored scaled and read back unscaled (FP32).

    Example:
        >>> import torch
        >>> from wrapped_optim._adapters.precision import PrecisionAwareStateHolder
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> isinstance(PrecisionAwareAdamW([p]), PrecisionAwareStateHolder)
        True
        >>> isinstance(torch.optim.AdamW([p]), PrecisionAwareStateHolder)
        False
    """

    name_to_dtype_map: dict[str, torch.dtype]

    def get_unscaled_state(self, param: Tensor, state_name: str) -> Tensor:
        """The FP32 expansion of one state (int16 for a remainder master)."""
        ...

    def set_scaled_state(self, param: Tensor, state_name: str, unscaled_state: Tensor) -> None:
        """Quantize FP32 values into one state's storage."""
        ...


@runtime_checkable
class ChunkedStateHolder(Protocol):
    """A holder that expands or quantizes one flat slice of a state at a time.

    Example:
        >>> import torch
        >>> from wrapped_optim._adapters.precision import ChunkedStateHolder
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> isinstance(PrecisionAwareAdamW([p]), ChunkedStateHolder)
        True
    """

    def read_unscaled_state_chunk(
        self, param: Tensor, state_name: str, start: int, out: Tensor
    ) -> None:
        """Fill ``out`` with flat elements ``[start, start + out.numel())`` of the expansion."""
        ...

    def write_scaled_state_chunked(
        self, param: Tensor, state_name: str, source: Tensor, chunk_numel: int
    ) -> None:
        """Quantize ``source`` into the state, moving ``chunk_numel`` elements at a time."""
        ...


def is_precision_aware_holder(obj: Any) -> bool:
    """Whether ``obj`` offers TE's precision-aware state API.

    Example:
        >>> import torch
        >>> from wrapped_optim._adapters.precision import is_precision_aware_holder
        >>> is_precision_aware_holder(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]))
        False
    """
    return isinstance(obj, PrecisionAwareStateHolder) and isinstance(
        getattr(obj, "name_to_dtype_map", None), dict
    )


def supports_chunked_state(obj: Any) -> bool:
    """Whether ``obj`` is a precision-aware holder that can also work chunk by chunk.

    Example:
        >>> import torch
        >>> from wrapped_optim._adapters.precision import supports_chunked_state
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
        >>> supports_chunked_state(PrecisionAwareAdamW([torch.nn.Parameter(torch.zeros(1))]))
        True
    """
    return is_precision_aware_holder(obj) and isinstance(obj, ChunkedStateHolder)


def has_compressed_state(obj: Any) -> bool:
    """Whether some state of a precision-aware holder is stored in a dtype other than FP32.

    Example:
        >>> import torch
        >>> from wrapped_optim._adapters.precision import has_compressed_state
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
        >>> p = torch.nn.Parameter(torch.zeros(1))
        >>> has_compressed_state(PrecisionAwareAdamW([p], exp_avg_dtype=torch.bfloat16))
        True
        >>> has_compressed_state(PrecisionAwareAdamW([p]))
        False
    """
    if not is_precision_aware_holder(obj):
        return False
    return any(dtype != torch.float32 for dtype in obj.name_to_dtype_map.values())
