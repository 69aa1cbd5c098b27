"""Which path :class:`~wrapped_optim.optimizers.PrecisionAwareAdamW`'s step gives each
parameter, and the step of one param group.

Per parameter with a gradient, the first that applies: torch's fused AdamW kernel where its
state needs no conversion (one call per device and dtype, as ``torch.optim.AdamW(fused=True)``
does); the compiled CPU kernel
(:mod:`~wrapped_optim.optimizers.precision_adamw._kernel_step`, one call per group); the fused
GPU kernel (:mod:`~wrapped_optim.optimizers.precision_adamw._fused_gpu`); a packed call shared
by small parameters; the per-parameter sliced path
(:mod:`~wrapped_optim.optimizers.precision_adamw._torch_step`). :func:`kernel_would_update` is
the one answer to "would the step hand this parameter to the CPU kernel", which
HybridOffloadOptimizer's fused host step asks too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from wrapped_optim._adapters.dtensor import local_tensor
from wrapped_optim.optimizers.precision_adamw import _block_step, _fused_gpu, _torch_step
from wrapped_optim.optimizers.precision_adamw._kernel_step import (
    KernelOperands,
    kernel_operands,
    kernel_update,
)
from wrapped_optim.optimizers.precision_adamw._layout import PrecisionLayout
from wrapped_optim.optimizers.precision_adamw._operand import Operand

__all__ = ["kernel_would_update", "step_group"]

_Views = tuple[Tensor, Tensor, Tensor, Tensor]
_State = Mapping[str, Tensor]
_Group = Mapping[str, Any]


def _fast_path(
    layout: PrecisionLayout, operand: Operand, group: _Group
) -> tuple[_Views | None, KernelOperands | None]:
    """torch's fused kernel views of ``operand`` when its state needs no conversion, else the
    compiled CPU kernel's operands when the kernel reads its formats, else neither."""
    views = _torch_step.direct_views(layout, operand, group)
    if views is not None:
        return views, None
    return None, kernel_operands(layout, operand)


def kernel_would_update(layout: PrecisionLayout, operand: Operand, group: _Group) -> bool:
    """Whether a step of ``layout`` hands ``operand`` to the compiled CPU kernel: not to
    torch's fused kernel, and in formats the kernel reads.

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW, cpu_kernel
        >>> p = torch.nn.Parameter(torch.zeros(4))
        >>> opt = PrecisionAwareAdamW([p], exp_avg_dtype=torch.bfloat16)
        >>> opt.initialize_state(p, False)
        >>> g, group = torch.ones(4), opt.param_groups[0]
        >>> op = Operand(p, g, opt.state[p], {})
        >>> kernel_would_update(opt.layout, op, group) == cpu_kernel.available()
        True
        >>> fp32 = PrecisionAwareAdamW([p])  # torch's fused kernel takes FP32 state
        >>> fp32.initialize_state(p, False)
        >>> kernel_would_update(fp32.layout, Operand(p, g, fp32.state[p], {}), group)
        False
    """
    return _fast_path(layout, operand, group)[1] is not None


class _Routes:
    """One group's parameters by path, for the calls made after routing."""

    def __init__(self) -> None:
        # Parameters whose state needs no conversion go to torch's fused kernel together,
        # one call per (device, dtype), as torch.optim.AdamW(fused=True) does.
        self.batches: dict[tuple[torch.device, torch.dtype], list[_Views]] = {}
        self.small: dict[torch.device, list[tuple[Tensor, Tensor]]] = {}
        self.kernel: list[KernelOperands] = []  # one call for all of them: threads share it
        self.fused_gpu: list[Operand] = []  # one launch per format combination


def step_group(
    layout: PrecisionLayout,
    group: _Group,
    pairs: list[tuple[Tensor, Tensor]],
    *,
    states: Mapping[Tensor, _State],
    scales: Mapping[Tensor, _State],
    scratch: _torch_step.StepScratch,
    group_index: int,
) -> None:
    """One step of ``group``'s ``(param, grad)`` pairs (their state exists; ``group["step"]``
    already counts this step), each along its path (see the module doc).

    Args:
        layout: the optimizer's storage layout.
        group: the param group's options and step count.
        pairs: the parameters to update and their gradients.
        states: each parameter's state (updated in place).
        scales: each parameter's per-tensor scales (updated in place).
        scratch: the step's FP32 workspace and the fused GPU kernel's launch tables.
        group_index: the group's index among the optimizer's groups.

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> opt = PrecisionAwareAdamW([p], lr=0.5, weight_decay=0.0,
        ...                           exp_avg_dtype=torch.bfloat16)
        >>> opt.initialize_state(p, False)
        >>> group = {**opt.param_groups[0], "step": 1}
        >>> step_group(opt.layout, group, [(p, torch.ones(2))], states=opt.state, scales={},
        ...            scratch=_torch_step.StepScratch(), group_index=0)
        >>> p.data.tolist()
        [0.5, 0.5]
    """
    routes = _Routes()
    for param, grad in pairs:  # each parameter's operand, built once this step
        operand = Operand(param, grad, states[param], scales.get(param, {}))
        _route(routes, layout, operand, group, scratch)
    for (device, _), items in routes.batches.items():
        step = _torch_step.step_tensor(group["step"], device)
        ps, gs, ms, vs = (list(column) for column in zip(*items, strict=True))
        _torch_step.fused_math(
            ps, gs, ms, vs, group, [step] * len(ps), adam_w_mode=layout.adam_w_mode
        )
    for device, small in routes.small.items():
        _torch_step.update_packed(layout, states, small, group, device, scratch)
    if routes.kernel:
        kernel_update(
            routes.kernel, group, adam_w_mode=layout.adam_w_mode, block_format=layout.blocks
        )
    if routes.fused_gpu:
        _fused_gpu.update_group(
            layout, routes.fused_gpu, group, tables=scratch.launch_tables, group_index=group_index
        )


def _route(
    routes: _Routes,
    layout: PrecisionLayout,
    operand: Operand,
    group: _Group,
    scratch: _torch_step.StepScratch,
) -> None:
    """Files ``operand`` under its path; the sliced paths update it at once."""
    param, grad = operand.param, operand.grad
    views, kernel = _fast_path(layout, operand, group)
    if views is not None:
        routes.batches.setdefault((views[0].device, views[0].dtype), []).append(views)
    elif kernel is not None:
        routes.kernel.append(kernel)
    elif layout.block_format is not None:
        _block_step.update(layout, operand, group)
    elif _fused_gpu.applicable(layout, operand):
        routes.fused_gpu.append(operand)
    elif _torch_step.packable(layout, operand, group):
        routes.small.setdefault(local_tensor(param).device, []).append((param, grad))
    else:
        _torch_step.update(layout, operand, group, scratch)
