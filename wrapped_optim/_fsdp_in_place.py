"""``compat.fully_shard_optimizer``'s in-place adaptation of an optimizer instance.

Megatron-FSDP's callers ignore the function's return value, so the instance they pass must
step FSDP-aware afterwards. Its ``step`` attribute becomes a method that runs an
``FSDPAwareOptimizer`` around the ``step`` it had: the grads are put back when the step
raises, and a subclass calling ``super().step()`` is cast once, which step hooks do not give.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from types import MethodType
from typing import Any

from wrapped_optim.fsdp import FSDPAwareOptimizer
from wrapped_optim.wrapper import find_layer

__all__ = ["adapt_in_place", "in_place_adapter"]


class _StepBelowAdapter(FSDPAwareOptimizer):
    """FSDPAwareOptimizer around the ``step`` the instance had before it was adapted."""

    def __init__(self, inner: Any, below: Callable[..., Any], *, precision_aware: bool) -> None:
        super().__init__(inner, precision_aware=precision_aware)
        # The class's step, or whatever already wraps it on the instance (an LR scheduler's
        # step counter): the instance's own step now leads back here.
        self.step_below = below

    def _inner_step(self, closure: Callable[[], Any] | None) -> Any:
        return self.step_below() if closure is None else self.step_below(closure)


# Adapted instance -> its adapter (weakly both ways: the instance's step keeps it alive).
_ADAPTERS: weakref.WeakKeyDictionary[Any, weakref.ref[_StepBelowAdapter]] = (
    weakref.WeakKeyDictionary()
)


def in_place_adapter(optimizer: Any) -> FSDPAwareOptimizer | None:
    """The FSDP-aware step ``optimizer`` has: a layer of its stack, or an in-place adapter.

    Example:
        >>> import torch
        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> in_place_adapter(sgd) is None
        True
    """
    layer = find_layer(optimizer, FSDPAwareOptimizer)
    if layer is not None:
        return layer
    try:
        ref = _ADAPTERS.get(optimizer)
    except TypeError:  # not weak-referenceable: never adapted here
        return None
    return None if ref is None else ref()


def adapt_in_place(optimizer: Any, *, precision_aware: bool) -> None:
    """Makes ``optimizer.step()`` FSDP-aware, or sets ``precision_aware`` where it already is.

    Example:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> p.grad_dtype = torch.bfloat16
        >>> sgd = torch.optim.SGD([p], lr=0.5)
        >>> adapt_in_place(sgd, precision_aware=False)
        >>> (p * 2).sum().backward()
        >>> sgd.step()
        >>> p.tolist(), p.grad.dtype
        ([0.0, 0.0], torch.bfloat16)
    """
    existing = in_place_adapter(optimizer)
    if existing is not None:
        existing.precision_aware = precision_aware
        return
    adapter = _StepBelowAdapter(optimizer, optimizer.step, precision_aware=precision_aware)

    # A function bound to the instance (not to the adapter), so a scheduler that rebinds the
    # step's __func__ to the optimizer, as torch's LRScheduler does, still reaches the adapter.
    def step(bound: Any, closure: Callable[[], Any] | None = None) -> Any:
        return adapter.step(closure)

    # torch's LRScheduler marks the step it wrapped to count calls; the wrapped one is still
    # called (below), so the mark carries over and the scheduler does not warn of a new step.
    if getattr(adapter.step_below, "_wrapped_by_lr_sched", False):
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    _ADAPTERS[optimizer] = weakref.ref(adapter)
    optimizer.step = MethodType(step, optimizer)
