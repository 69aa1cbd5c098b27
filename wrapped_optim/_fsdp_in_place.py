"""``compat.fully_shard_optimizer``'s in-place adaptation: step hooks on the given instance.

Megatron-FSDP's callers ignore the function's return value, so the instance they pass must
step FSDP-aware afterwards. As upstream does, this registers a step pre-hook (cast grads of
another dtype into the parameter's) and a step post-hook (put the original grads back,
refresh the compute weights) through torch's own hook API: nothing on the instance is
replaced. The casting and refreshing are ``FSDPAwareOptimizer``'s, held by a hidden
instance of it that never steps.
"""

from __future__ import annotations

import weakref
from contextlib import ExitStack
from typing import Any

from wrapped_optim._adapters.megatron_fsdp import iter_params
from wrapped_optim.fsdp import FSDPAwareOptimizer, _CastBuffers, _grads_in_data_dtype
from wrapped_optim.wrapper import find_layer

__all__ = ["adapt_in_place", "in_place_adapter"]


class _StepHooks:
    """The pre- and post-step hooks of one adapted instance, and what they share."""

    def __init__(self, optimizer: Any, *, precision_aware: bool) -> None:
        # Used for its flag and its refresh only; it is never stepped.
        self.adapter = FSDPAwareOptimizer(optimizer, precision_aware=precision_aware)
        self._buffers = _CastBuffers()
        self._casting: ExitStack | None = None

    def _put_grads_back(self) -> None:
        casting, self._casting = self._casting, None
        if casting is not None:
            casting.close()

    def before_step(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # A step that raised skipped the post-hook: its cast grads are put back first.
        self._put_grads_back()
        if args and args[0] is optimizer:  # torch's hooks see step's self among the args
            args = args[1:]
        closure = kwargs.get("closure", args[0] if args else None)
        if closure is not None and not self.adapter.precision_aware:
            raise NotImplementedError(
                "fully_shard_optimizer does not support optimizer.step closures (the closure "
                "makes grads inside the step, where a step hook cannot cast them); wrap the "
                "optimizer in wrapped_optim.FSDPAwareOptimizer instead, which casts them"
            )
        if self.adapter.precision_aware:
            return
        casting = ExitStack()
        casting.enter_context(_grads_in_data_dtype(list(iter_params(optimizer)), self._buffers))
        self._casting = casting

    def after_step(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._put_grads_back()
        self.adapter.refresh_compute_weights()


# Adapted instance -> its hooks, weakly both ways: the instance's own hook registries keep the
# hooks alive, and the hooks reach the instance.
_ADAPTED: weakref.WeakKeyDictionary[Any, weakref.ref[_StepHooks]] = weakref.WeakKeyDictionary()


def in_place_adapter(optimizer: Any) -> FSDPAwareOptimizer | None:
    """The FSDP-aware stepping ``optimizer`` has: a layer of its stack, or its step hooks'.

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
        ref = _ADAPTED.get(optimizer)
    except TypeError:  # not weak-referenceable: never adapted here
        return None
    hooks = None if ref is None else ref()
    return None if hooks is None else hooks.adapter


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
    hooks = _StepHooks(optimizer, precision_aware=precision_aware)
    _ADAPTED[optimizer] = weakref.ref(hooks)
    optimizer.register_step_pre_hook(hooks.before_step)
    optimizer.register_step_post_hook(hooks.after_step)
