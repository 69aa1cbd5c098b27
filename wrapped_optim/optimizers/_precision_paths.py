"""Which path :class:`~wrapped_optim.optimizers.PrecisionAwareAdamW`'s step gives each
parameter, and the step over its param groups.

Per parameter with a gradient, the first that applies: torch's fused AdamW kernel where its
state needs no conversion (one call per device and dtype, as ``torch.optim.AdamW(fused=True)``
does); the compiled CPU kernel (:mod:`~wrapped_optim.optimizers._kernel_step`, one call per
group); the fused GPU kernel; a packed call shared by small parameters; the per-parameter
conversion path (:mod:`~wrapped_optim.optimizers._torch_step`). The choice goes through the
optimizer's seams (``_direct_views``, ``_packable``, ``_update``...), which tests may replace
on an instance. :func:`kernel_would_update` is the one answer to "would the step hand this
parameter to the CPU kernel", which HybridOffloadOptimizer's fused host step asks too.

Internal: :class:`~wrapped_optim.optimizers.PrecisionAwareAdamW` calls these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from wrapped_optim._adapters.dtensor import local_tensor
from wrapped_optim.optimizers import _fused_gpu, _torch_step
from wrapped_optim.optimizers._kernel_step import KernelOperands, kernel_operands, kernel_update

if TYPE_CHECKING:
    from wrapped_optim.optimizers._precision_adam import PrecisionAwareAdamW

__all__ = ["kernel_would_update", "step_groups"]

_Views = tuple[Tensor, Tensor, Tensor, Tensor]


def _fast_path(
    opt: PrecisionAwareAdamW, param: Tensor, grad: Tensor, group: dict[str, Any]
) -> tuple[_Views | None, KernelOperands | None]:
    """torch's fused kernel views of ``param`` when its state needs no conversion, else the
    compiled CPU kernel's operands when the kernel reads its formats, else neither."""
    views = opt._direct_views(param, grad, group)
    if views is not None:
        return views, None
    return None, kernel_operands(opt, param, grad)


def kernel_would_update(
    opt: PrecisionAwareAdamW, param: Tensor, grad: Tensor, group: dict[str, Any]
) -> bool:
    """Whether ``opt``'s step hands ``param`` (whose state exists) with ``grad`` to the
    compiled CPU kernel: not to torch's fused kernel, and in formats the kernel reads.

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW, cpu_kernel
        >>> p = torch.nn.Parameter(torch.zeros(4))
        >>> opt = PrecisionAwareAdamW([p], exp_avg_dtype=torch.bfloat16)
        >>> opt.initialize_state(p)
        >>> kernel_would_update(opt, p, torch.ones(4), opt.param_groups[0]) == (
        ...     cpu_kernel.available())
        True
        >>> fp32 = PrecisionAwareAdamW([p])  # torch's fused kernel takes FP32 state
        >>> fp32.initialize_state(p)
        >>> kernel_would_update(fp32, p, torch.ones(4), fp32.param_groups[0])
        False
    """
    return _fast_path(opt, param, grad, group)[1] is not None


def step_groups(opt: PrecisionAwareAdamW) -> None:
    """One step of every param group: counts the step, creates missing state, and updates
    each parameter with a gradient along its path (see the module doc).

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
        >>> p, frozen = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
        >>> opt = PrecisionAwareAdamW([p, frozen], lr=0.5, weight_decay=0.0,
        ...                           exp_avg_dtype=torch.bfloat16)
        >>> p.grad = torch.ones(2)  # frozen has none: it gets no state and does not move
        >>> step_groups(opt)
        >>> p.data.tolist(), len(opt.state), opt.param_groups[0]["step"]
        ([0.5, 0.5], 1, 1)
    """
    for group in opt.param_groups:
        if not group["params"]:
            continue
        group["step"] = group.get("step", 0) + 1
        # Parameters whose state needs no conversion go to torch's fused kernel together,
        # one call per (device, dtype), as torch.optim.AdamW(fused=True) does.
        batches: dict[tuple[torch.device, torch.dtype], list[_Views]] = {}
        small: dict[torch.device, list[tuple[Tensor, Tensor]]] = {}
        kernel: list[KernelOperands] = []  # one call for all of them: threads share it
        fused_gpu: list[tuple[Tensor, Tensor]] = []  # one launch per format combination
        for p in group["params"]:
            grad = opt._grad_of(p)
            if grad is None:
                continue  # frozen or unused this step: no state, as torch's optimizers do
            if not opt.state[p]:
                opt.initialize_state(p)
            if grad.is_sparse:
                raise RuntimeError("PrecisionAwareAdamW does not support sparse gradients.")
            if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise RuntimeError(
                    f"PrecisionAwareAdamW supports fp32, fp16 and bf16 parameters, got {p.dtype}"
                )
            views, operands = _fast_path(opt, p, grad, group)
            if views is not None:
                batches.setdefault((views[0].device, views[0].dtype), []).append(views)
            elif operands is not None:
                kernel.append(operands)
            elif _fused_gpu.applicable(opt, p, grad, group):
                fused_gpu.append((p, grad))
            elif opt._packable(p, grad, group):
                small.setdefault(local_tensor(p).device, []).append((p, grad))
            else:
                opt._update(p, grad, group)
        for (device, _), items in batches.items():
            step = _torch_step.step_tensor(group["step"], device)
            ps, gs, ms, vs = (list(column) for column in zip(*items, strict=True))
            opt._fused_math(ps, gs, ms, vs, group, [step] * len(ps))
        for device, pairs in small.items():
            opt._update_packed(pairs, group, device)
        if kernel:
            kernel_update(opt, kernel, group)
        if fused_gpu:
            _fused_gpu.update_group(opt, fused_gpu, group)
