"""How wrapped_optim sees inside foreign optimizers, without importing them eagerly."""

from wrapped_optim._adapters.megatron import config_flag, megatron_available
from wrapped_optim._adapters.precision import (
    ChunkedStateHolder,
    PrecisionAwareStateHolder,
    has_compressed_state,
    is_precision_aware_holder,
    supports_chunked_state,
)
from wrapped_optim._adapters.walk import LeafContext, walk_leaves

__all__ = [
    "ChunkedStateHolder",
    "LeafContext",
    "PrecisionAwareStateHolder",
    "config_flag",
    "has_compressed_state",
    "is_precision_aware_holder",
    "megatron_available",
    "supports_chunked_state",
    "walk_leaves",
]
