"""The former home of the entry points, kept so existing imports work.

Each now lives with its job:

* :func:`~wrapped_optim.stack.wrap` in :mod:`wrapped_optim.stack` (the layer table);
* :func:`~wrapped_optim._builder.build_optimizer` and
  :func:`~wrapped_optim._builder.resolve_optimizer_class` in :mod:`wrapped_optim._builder`
  (plain PyTorch);
* :func:`~wrapped_optim.integrations.bridge.setup_optimizer` and its override providers in
  :mod:`wrapped_optim.integrations.bridge` (Megatron-Bridge).

Example:
    >>> from wrapped_optim import factory, stack
    >>> factory.wrap is stack.wrap
    True
"""

from __future__ import annotations

from wrapped_optim._builder import build_optimizer, resolve_optimizer_class
from wrapped_optim.integrations.bridge import (
    OptimizerConfigOverrideProvider,
    OptimizerConfigOverrideProviderContext,
    setup_optimizer,
)
from wrapped_optim.stack import wrap

__all__ = [
    "OptimizerConfigOverrideProvider",
    "OptimizerConfigOverrideProviderContext",
    "build_optimizer",
    "resolve_optimizer_class",
    "setup_optimizer",
    "wrap",
]
