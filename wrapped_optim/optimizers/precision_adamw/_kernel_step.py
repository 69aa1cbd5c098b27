"""Which parameters of a :class:`~wrapped_optim.optimizers.PrecisionAwareAdamW` step the
compiled CPU kernel updates, and the call that updates them.

The kernel (:mod:`wrapped_optim.optimizers.kernels.cpu_kernel`) reads every operand in its stored
format, so it takes CPU parameters whose state would otherwise need conversion passes: FP32,
bf16, fp16 or FP8 moments (the scaled ones with their per-tensor scales) beside an FP32
parameter, or beside a bf16 parameter with an FP32 master or int16 remainder. Everything else
(fp16 parameters or masters, an FP32 parameter with a master copy, non-contiguous storage,
other devices) stays on the optimizer's torch paths. One call per parameter group: its
threads share all the group's elements.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from wrapped_optim._adapters.dtensor import local_tensor
from wrapped_optim._formats import blocks, codecs
from wrapped_optim.optimizers.kernels import cpu_kernel
from wrapped_optim.optimizers.precision_adamw._layout import PrecisionLayout
from wrapped_optim.optimizers.precision_adamw._operand import Operand

__all__ = ["KernelOperands", "kernel_enabled", "kernel_operands", "kernel_update"]

#: (param, grad, exp_avg, exp_avg_sq, master or None, exp_avg scale or None, exp_avg_sq
#: scale or None), flat, as :func:`cpu_kernel.adamw_step_` takes them.
KernelOperands = tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]

_MOMENTS = (torch.float32, torch.bfloat16, torch.float16, codecs.FP8_E4M3)


def kernel_enabled(layout: PrecisionLayout) -> bool:
    """Whether an optimizer of ``layout`` hands suitable parameters to the compiled kernel:
    its ``cpu_kernel`` setting allows it and the kernel could be built.

    Example:
        >>> from wrapped_optim.optimizers.precision_adamw._layout import PrecisionLayout
        >>> kernel_enabled(PrecisionLayout(cpu_kernel=False))
        False
    """
    if layout.cpu_kernel is False or (layout.cpu_kernel is None and layout.fused is True):
        return False
    return cpu_kernel.available()


def kernel_operands(layout: PrecisionLayout, operand: Operand) -> KernelOperands | None:
    """The flat operands of ``operand`` (its state and the scales of its scaled states) for
    the kernel, or None when its formats or layout are not ones the kernel reads
    (the optimizer's torch paths update it then).

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
        >>> from wrapped_optim.optimizers.kernels import cpu_kernel
        >>> p = torch.nn.Parameter(torch.zeros(2, 3))
        >>> opt = PrecisionAwareAdamW([p], exp_avg_sq_dtype=torch.uint8)
        >>> opt.initialize_state(p, False)
        >>> op = Operand(p, torch.ones(2, 3), opt.state[p], opt.scales[p])
        >>> ops = kernel_operands(opt.layout, op)
        >>> ops is None if not cpu_kernel.available() else (ops[0].shape, ops[6].item())
        (torch.Size([6]), 1.0)
    """
    if not kernel_enabled(layout):
        return None
    state, scales, param = operand.state, operand.scales, operand.param
    p, g = local_tensor(param), local_tensor(operand.grad)
    if p.device.type != "cpu" or g.device != p.device or g.numel() != p.numel():
        return None
    stored = [state["exp_avg"], state["exp_avg_sq"]]
    if layout.block_format is None and any(t.dtype not in _MOMENTS for t in stored):
        return None
    if g.dtype not in (torch.float32, torch.bfloat16):
        return None
    master: Tensor | None = state.get("master_param")
    if p.dtype == torch.float32:
        if master is not None:  # synced after the update; the general path does that
            return None
    elif p.dtype != torch.bfloat16 or master is None:
        return None  # fp16 params, or bf16 params updated in place without a master
    elif master.dtype != torch.float32 and not layout.uses_remainder(param):
        return None  # an fp16 master
    if master is not None:
        stored.append(master)
    if not p.is_contiguous() or not all(t.is_contiguous() for t in stored):
        return None
    flat = [t.view(-1) for t in stored]
    return (
        p.view(-1),
        g.reshape(-1).contiguous(),
        flat[0],
        flat[1],
        flat[2] if master is not None else None,
        scales["exp_avg"] if _has_scale(layout, param, "exp_avg") else None,
        scales["exp_avg_sq"] if _has_scale(layout, param, "exp_avg_sq") else None,
    )


def _has_scale(layout: PrecisionLayout, param: Tensor, state_name: str) -> bool:
    return layout.is_blocked(state_name) or layout.is_scaled(param, state_name)


def kernel_update(
    operands: list[KernelOperands],
    group: Mapping[str, Any],
    *,
    adam_w_mode: bool,
    block_format: blocks.BlockFormat | None = None,
) -> None:
    """One kernel call updating every parameter of ``operands`` (one group's) in place, its
    scales included, with ``group``'s options and step count (``block_format``: the
    moments' block format, None for TE's formats).

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
        >>> from wrapped_optim.optimizers.kernels import cpu_kernel
        >>> p = torch.nn.Parameter(torch.zeros(4))
        >>> opt = PrecisionAwareAdamW([p], lr=0.5, exp_avg_dtype=torch.bfloat16)
        >>> opt.initialize_state(p, False)
        >>> group = {**opt.param_groups[0], "step": 1}
        >>> if cpu_kernel.available():
        ...     ops = kernel_operands(opt.layout, Operand(p, torch.ones(4), opt.state[p], {}))
        ...     kernel_update([ops], group, adam_w_mode=True)
        ... else:
        ...     _ = p.data.fill_(-0.5)
        >>> p.data
        tensor([-0.5000, -0.5000, -0.5000, -0.5000])
    """
    ps, gs, ms, vs, masters, m_scales, v_scales = (
        list(column) for column in zip(*operands, strict=True)
    )
    beta1, beta2 = group["betas"]
    step = group["step"]
    correct = group["bias_correction"]
    cpu_kernel.adamw_step_(
        ps, gs, ms, vs, masters,
        lr=float(group["lr"]), betas=(beta1, beta2), eps=group["eps"],
        weight_decay=group["weight_decay"],
        bias_correction1=1.0 - beta1**step if correct else 1.0,
        bias_correction2=1.0 - beta2**step if correct else 1.0,
        adam_w_mode=adam_w_mode,
        exp_avg_scales=m_scales, exp_avg_sq_scales=v_scales, block_format=block_format,
    )  # fmt: skip
