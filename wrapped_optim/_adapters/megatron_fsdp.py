"""The sharded-parameter protocol: what a grad's dtype is and how compute weights get
refreshed, duck-typed for Megatron-FSDP, FSDP2 and plain parameters (megatron-fsdp is never
imported here).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import torch

from wrapped_optim._adapters.dtensor import local_tensor
from wrapped_optim._adapters.walk import walk_leaves

__all__ = [
    "fsdp_parameter_group_of",
    "grad_dtype_attr",
    "grad_dtype_of",
    "iter_params",
    "local_tensor",
    "needs_grad_cast",
    "swap_grad",
]

_PARAMETER_GROUP_MODULE = "megatron_fsdp.experimental.parameter_group"


def grad_dtype_of(param: torch.Tensor) -> torch.dtype:
    """The dtype ``param``'s gradients have: its ``grad_dtype``, else its data dtype.

    ``grad_dtype = None`` means "any dtype"; then the current grad's dtype decides (the
    data dtype when there is no grad). Torch releases without ``grad_dtype`` always use the
    data dtype.

    Example:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> grad_dtype_of(p)
        torch.float32
        >>> p.grad_dtype = torch.bfloat16
        >>> grad_dtype_of(p)
        torch.bfloat16
    """
    # torch raises on ``grad_dtype`` of a tensor with a ``grad_fn``; Megatron's
    # DistributedOptimizer steps such tensors (views of FP32 params), whose grads are set by hand.
    dtype = grad_dtype_attr(param)
    if isinstance(dtype, torch.dtype):
        return dtype
    grad = param.grad
    return grad.dtype if grad is not None else param.dtype


def iter_params(stack: Any) -> Iterator[torch.Tensor]:
    """Every parameter of every leaf optimizer of ``stack``, once, in group order.

    Example:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> [q is p for q in iter_params(torch.optim.SGD([p], lr=0.1))]
        [True]
    """
    seen: set[int] = set()
    for leaf in walk_leaves(stack):
        if leaf.optimizer is None:
            continue
        for group in leaf.optimizer.param_groups:
            for param in group["params"]:
                if id(param) not in seen:
                    seen.add(id(param))
                    yield param


def needs_grad_cast(stack: Any) -> bool:
    """Whether some parameter of ``stack`` gets grads in a dtype other than its data dtype.

    Example:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> opt = torch.optim.AdamW([p])
        >>> needs_grad_cast(opt)
        False
        >>> p.grad_dtype = torch.bfloat16
        >>> needs_grad_cast(opt)
        True
    """
    return any(grad_dtype_of(param) != param.dtype for param in iter_params(stack))


def fsdp_parameter_group_of(param: torch.Tensor) -> Any | None:
    """The Megatron-FSDP parameter group that owns ``param``, or ``None``.

    Only a group offering ``sync_model_weight_from_main_weight()`` counts. megatron-fsdp is
    looked up among the already imported modules, never imported here.

    Example:
        >>> import torch
        >>> fsdp_parameter_group_of(torch.nn.Parameter(torch.zeros(1))) is None
        True
    """
    module = sys.modules.get(_PARAMETER_GROUP_MODULE)
    if module is None:
        return None
    group = module.get_containing_parameter_group(param)
    if group is None or not callable(getattr(group, "sync_model_weight_from_main_weight", None)):
        return None
    return group


def swap_grad(param: torch.Tensor, grad: torch.Tensor | None, grad_dtype: Any) -> None:
    """Installs ``grad`` on ``param`` together with the ``grad_dtype`` it needs.

    Torch refuses a grad whose dtype differs from ``param.grad_dtype`` and refuses to change
    ``grad_dtype`` while a grad of another dtype is attached, so the old grad is detached
    first. ``grad_dtype`` is a property of the tensor, not an instance attribute, so
    :func:`~wrapped_optim.patching.patch_attribute` cannot hold it: callers restore it in a
    ``try/finally`` by calling this function again with the saved values.

    Example:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> p.grad_dtype = torch.bfloat16
        >>> swap_grad(p, torch.ones(2), torch.float32)
        >>> p.grad.dtype, p.grad_dtype
        (torch.float32, torch.float32)
    """
    param.grad = None
    if param.is_leaf and hasattr(param, "grad_dtype"):  # torch raises on a view's
        param.grad_dtype = grad_dtype
    param.grad = grad


def grad_dtype_attr(param: torch.Tensor) -> Any:
    """``param.grad_dtype`` as set (``None``: unset, a non-leaf, or a torch without it).

    torch raises (not ``AttributeError``) on the ``grad_dtype`` of a tensor with a
    ``grad_fn``, and Megatron's DistributedOptimizer steps such views of FP32 params.

    Example:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.zeros(4))
        >>> grad_dtype_attr(p.view(2, 2)) is None
        True
    """
    return getattr(param, "grad_dtype", None) if param.is_leaf else None
