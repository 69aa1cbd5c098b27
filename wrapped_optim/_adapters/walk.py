"""One walk from any optimizer stack down to its leaf torch optimizers.

Training stacks nest optimizers: our wrappers around Megatron's ChainedOptimizer around
DistributedOptimizers around a FusedAdam or a HybridDeviceOptimizer. Every wrapper needs the
leaves *and* the Megatron container each leaf lives in (its config decides eligibility), so
the walk is written once, here, by structure rather than by class: it needs no optional
package to be importable.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import torch

from wrapped_optim.wrapper import unwrap

__all__ = ["LeafContext", "walk_leaves"]


@attrs.frozen
class LeafContext:
    """A leaf optimizer with the context of the Megatron container holding it.

    Attributes:
        optimizer: the leaf torch optimizer; ``None`` for a Megatron stub (a rank without
            parameters).
        container: the Megatron optimizer whose ``.optimizer`` is the leaf, or ``None`` when
            the leaf was reached directly.
        config: the container's ``config`` (Megatron's OptimizerConfig), or ``None``.
        ddp_config: the container's ``ddp_config``, or ``None``.
        is_stub: the container's ``is_stub_optimizer`` flag.
        index: position of the leaf in walk order (stubs included).

    Example:
        >>> from types import SimpleNamespace
        >>> leaf = LeafContext(optimizer=None, config=SimpleNamespace(lr=0.1), is_stub=True)
        >>> leaf.is_stub, leaf.config.lr
        (True, 0.1)
    """

    optimizer: Any
    container: Any = None
    config: Any = None
    ddp_config: Any = None
    is_stub: bool = False
    index: int = 0


def _walk(obj: Any) -> Iterator[tuple[Any, Any]]:
    obj = unwrap(obj)
    if isinstance(obj, torch.optim.Optimizer):
        yield obj, None
        return
    chained = getattr(obj, "chained_optimizers", None)
    if chained is not None:
        for child in chained:
            yield from _walk(child)
        return
    if "optimizer" in getattr(obj, "__dict__", {}) or hasattr(type(obj), "optimizer"):
        # A Megatron optimizer: the leaf is its ``.optimizer`` (None on a stub rank).
        inner = unwrap(obj.optimizer)
        if inner is None or isinstance(inner, torch.optim.Optimizer):
            yield inner, obj
            return
        yield from _walk(inner)
        return
    raise TypeError(
        f"cannot find the torch optimizer inside a {type(obj).__name__}: expected a "
        "torch.optim.Optimizer, a wrapped_optim wrapper, or a Megatron optimizer "
        "(with .optimizer or .chained_optimizers)"
    )


def walk_leaves(stack: Any) -> Iterator[LeafContext]:
    """Yields every leaf optimizer of ``stack`` with its container's context, in order.

    Example:
        >>> import torch
        >>> from wrapped_optim import OptimizerWrapper
        >>> from wrapped_optim._adapters import walk_leaves
        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> [leaf.optimizer is sgd for leaf in walk_leaves(OptimizerWrapper(sgd))]
        [True]
    """
    for index, (leaf, container) in enumerate(_walk(stack)):
        if container is None:
            yield LeafContext(optimizer=leaf, index=index)
            continue
        yield LeafContext(
            optimizer=leaf,
            container=container,
            config=getattr(container, "config", None),
            ddp_config=getattr(container, "ddp_config", None),
            is_stub=bool(getattr(container, "is_stub_optimizer", False)) or leaf is None,
            index=index,
        )
