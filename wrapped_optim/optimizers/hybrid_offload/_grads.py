"""Which gradient each stepped copy of a HybridOffloadOptimizer gets before the host step.

A host copy gets a copy of its param's grad (in the copy's dtype, into a buffer kept between
steps: pinned when the param is on CUDA), the param's own grad where a copy would change
nothing (:func:`can_share_grad`), or None: the param has no grad, or the fused host step
(:mod:`~wrapped_optim.optimizers.hybrid_offload._host_step`) reads the param's grad itself.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from wrapped_optim.optimizers.hybrid_offload._host_step import grad_of
from wrapped_optim.optimizers.hybrid_offload._layout import OffloadLayout
from wrapped_optim.optimizers.hybrid_offload._transfers import copy_all

__all__ = ["can_share_grad", "give_grads"]

# Host optimizers whose step never writes a grad (without a grad scale), so an offloaded copy
# may step with its param's grad itself when the formats match.
_GRAD_READING_HOST_OPTIMIZERS = (torch.optim.AdamW, torch.optim.Adam)


@torch.no_grad()
def give_grads(
    layout: OffloadLayout, fused: Collection[torch.Tensor] = (), *, pin_cpu_grads: bool = True
) -> None:
    """Sets the ``grad`` of every distinct copy of ``layout``; a copy in ``fused`` gets None.
    The copies between a CUDA device and the host are issued together (:func:`copy_all`),
    into host buffers pinned when ``pin_cpu_grads``.

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import HybridOffloadOptimizer
        >>> p = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
        >>> opt = HybridOffloadOptimizer([p], offload_fraction=1.0)
        >>> p.grad = torch.full((2,), 0.5, dtype=torch.bfloat16)
        >>> give_grads(opt.layout)
        >>> opt.gpu_params_map_cpu_copy[p].grad
        tensor([0.5000, 0.5000])
        >>> give_grads(opt.layout, fused={opt.gpu_params_map_cpu_copy[p]})
        >>> opt.gpu_params_map_cpu_copy[p].grad is None
        True
    """
    pairs = []
    shared = layout.borrowed_grads
    for param, inner in layout.param_to_inner_param.items():
        if inner is param:
            continue
        grad = grad_of(param)
        if grad is None or inner in fused:
            inner.grad = None
            shared.discard(inner)
            continue
        if can_share_grad(layout, inner, grad):
            inner.grad = grad  # the host step only reads it: no copy needed
            shared.add(inner)
            continue
        if inner in shared:  # its grad is a param's: never copy into that one
            inner.grad = None
            shared.discard(inner)
        if inner.grad is None or inner.grad.shape != inner.shape:
            pin = inner.device.type == "cpu" and param.is_cuda and pin_cpu_grads
            inner.grad = torch.empty(
                inner.shape, dtype=inner.dtype, device=inner.device, pin_memory=pin
            )
        pairs.append((inner.grad, grad))
    copy_all(pairs)


def can_share_grad(layout: OffloadLayout, inner: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether the host copy may step with the param's own grad instead of a copy of it:
    the same dtype, device and layout (a CPU-only run with FP32 params), and a host
    optimizer known to only read grads (torch's Adam and AdamW write a grad only when
    given a grad scale, which HybridOffloadOptimizer never passes).

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import HybridOffloadOptimizer
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> opt = HybridOffloadOptimizer([p], offload_fraction=1.0)
        >>> can_share_grad(opt.layout, opt.gpu_params_map_cpu_copy[p], torch.zeros(2))
        True
    """
    return (
        inner in layout.cpu_copys_map_gpu_param
        and all(type(sub) in _GRAD_READING_HOST_OPTIMIZERS for sub in layout.cpu_optimizers)
        and grad.dtype == inner.dtype
        and grad.device == inner.device
        and grad.shape == inner.shape
        and grad.stride() == inner.stride()
        and not grad.is_sparse
    )
