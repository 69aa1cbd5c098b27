"""How wrapped_optim sees inside foreign optimizers, without importing them eagerly."""

from wrapped_optim.adapters.megatron import config_flag, megatron_available
from wrapped_optim.adapters.walk import LeafContext, walk_leaves

__all__ = ["LeafContext", "config_flag", "megatron_available", "walk_leaves"]
