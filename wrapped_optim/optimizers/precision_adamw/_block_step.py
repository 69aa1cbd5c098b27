"""The step of a :class:`~wrapped_optim.optimizers.PrecisionAwareAdamW` parameter whose
moments are block-scaled (``block_moments``), where the compiled CPU kernel does not take it:
on CUDA the Triton kernel (``adamw_block_kernel`` of
:mod:`~wrapped_optim.optimizers.kernels._triton_adamw`, one launch per parameter, one program
per block) where triton is installed and the layout is
one it reads, else torch (:func:`wrapped_optim._formats.blocks.step_blocks`). All three give
the CPU kernel's bits.

The torch step finds the FP32 value to update (the parameter, its FP32 master, or a bf16
parameter joined with its int16 remainder) and writes the parameter back from it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Mapping
from typing import Any

import torch
from torch.autograd.graph import increment_version

from wrapped_optim._adapters.dtensor import local_tensor
from wrapped_optim._formats import blocks
from wrapped_optim._formats.remainders import join_master, split_master_into
from wrapped_optim.optimizers.precision_adamw._layout import PrecisionLayout
from wrapped_optim.optimizers.precision_adamw._operand import Operand

__all__ = ["group_hyper", "triton_update", "update"]

_KERNEL_MODULE = "wrapped_optim.optimizers.kernels._triton_adamw"  # the fused step's, too
# Devices the Triton kernel is launched on. Tests add "cpu" (with TRITON_INTERPRET=1,
# Triton's interpreter runs the same kernel on host tensors).
_DEVICE_TYPES = {"cuda"}
_FORMAT_CODES = {"int8": 0, "fp8": 1, "int4": 2}
# The int4 tables on each device the kernel has run on (54 floats: made once, not per launch).
_int4_tables = functools.cache(blocks.int4_tables)


def group_hyper(group: Mapping[str, Any]) -> tuple[float, float, float, float, float, float, float]:
    """(lr, beta1, beta2, eps, weight_decay, 1/bias_correction1, 1/bias_correction2) of a
    group at its current step, as the kernel takes them.

    Example:
        >>> group_hyper({"lr": 0.1, "betas": (0.5, 0.75), "eps": 1e-8, "weight_decay": 0.0,
        ...              "bias_correction": True, "step": 1})
        (0.1, 0.5, 0.75, 1e-08, 0.0, 2.0, 4.0)
    """
    beta1, beta2 = group["betas"]
    step = group["step"]
    correct = group["bias_correction"]
    bc1 = 1.0 - beta1**step if correct else 1.0
    bc2 = 1.0 - beta2**step if correct else 1.0
    return (float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
            float(group["weight_decay"]), 1.0 / float(bc1), 1.0 / float(bc2))  # fmt: skip


def update(
    layout: PrecisionLayout,
    operand: Operand,
    group: Mapping[str, Any],
) -> None:
    """One step of ``operand``'s parameter (its block-scaled moments, block scales and master
    updated in place) with ``group``'s options at its current step count.

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> opt = PrecisionAwareAdamW([p], lr=0.5, weight_decay=0.0, block_moments="fp8")
        >>> opt.initialize_state(p, False)
        >>> from wrapped_optim.optimizers.precision_adamw._operand import Operand
        >>> operand = Operand(p, torch.ones(2), opt.state[p], opt.scales[p])
        >>> update(opt.layout, operand, {**opt.param_groups[0], "step": 1})
        >>> p.data.tolist()
        [0.5, 0.5]
    """
    if triton_update(layout, operand, group):
        return
    param, grad, state, scales = operand.param, operand.grad, operand.state, operand.scales
    fmt = layout.blocks
    assert fmt is not None
    p = local_tensor(param).detach()
    master = state.get("master_param")
    remainder = master is not None and layout.uses_remainder(param)
    if remainder:
        assert master is not None
        value = join_master(p.reshape(-1), master.view(-1))
    elif master is not None:
        value = master.view(-1)
    elif p.dtype == torch.float32 and p.is_contiguous():
        value = p.view(-1)
    else:
        value = p.reshape(-1).float()
    g = local_tensor(grad).reshape(-1).to(device=value.device, dtype=torch.float32)
    blocks.step_blocks(
        value, g, (state["exp_avg"], state["exp_avg_sq"]),
        (scales["exp_avg"], scales["exp_avg_sq"]), fmt, group_hyper(group),
        adam_w_mode=layout.adam_w_mode,
    )  # fmt: skip
    if remainder:
        assert master is not None
        flat_p = p.view(-1) if p.is_contiguous() else p.reshape(-1).clone()
        split_master_into(value, flat_p, master.view(-1))
        if flat_p.data_ptr() != p.data_ptr():
            p.copy_(flat_p.view(p.shape))
    elif value.data_ptr() != p.data_ptr():
        p.copy_(value.view(p.shape))  # round to nearest even into a bf16/fp16 parameter


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def triton_update(
    layout: PrecisionLayout,
    operand: Operand,
    group: Mapping[str, Any],
) -> bool:
    """One launch of the Triton block kernel for ``operand``'s parameter where it applies (a
    device in ``_DEVICE_TYPES``, triton installed, contiguous operands, an FP32 parameter without a
    master, an FP32 master or a remainder, an FP32 or bf16 gradient); False (nothing done)
    elsewhere.

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> opt = PrecisionAwareAdamW([p], block_moments="int8")
        >>> opt.initialize_state(p, False)
        >>> from wrapped_optim.optimizers.precision_adamw._operand import Operand
        >>> operand = Operand(p, torch.ones(2), opt.state[p], opt.scales[p])
        >>> triton_update(opt.layout, operand, {**opt.param_groups[0], "step": 1})  # CPU: no
        False
    """
    param, state, scales = operand.param, operand.state, operand.scales
    fmt = layout.blocks
    p = local_tensor(param).detach()
    g = local_tensor(operand.grad)
    if fmt is None or p.device.type not in _DEVICE_TYPES or g.device != p.device:
        return False
    if importlib.util.find_spec("triton") is None:
        return False
    master = state.get("master_param")
    if master is None:
        kind, ok = 0, p.dtype == torch.float32
    elif layout.uses_remainder(param):
        kind, ok = 2, True
    else:
        kind, ok = 1, master.dtype == torch.float32 and p.dtype in (torch.float32, torch.bfloat16)
    stored = [p, g, state["exp_avg"], state["exp_avg_sq"], scales["exp_avg"], scales["exp_avg_sq"]]
    if master is not None:
        stored.append(master)
    if not ok or g.dtype not in (torch.float32, torch.bfloat16):
        return False
    if not all(t.is_contiguous() for t in stored):
        return False
    kernels = importlib.import_module(_KERNEL_MODULE)
    lr, beta1, beta2, eps, wd, inv_bc1, inv_bc2 = group_hyper(group)
    n = p.numel()
    options: dict[str, Any] = {}
    if p.device.type == "cuda":  # no contraction into FMA, no flush-to-zero: the CPU bits
        options = {"num_warps": 4, "enable_fp_fusion": False, "enable_reflect_ftz": False}
    args = (p, p if master is None else master, g, state["exp_avg"], state["exp_avg_sq"],
            scales["exp_avg"], scales["exp_avg_sq"], _int4_tables(p.device), n,
            *(_f32(x) for x in (lr, beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps, wd,
                                inv_bc1, inv_bc2)))  # fmt: skip
    constexprs = {"FMT": _FORMAT_CODES[fmt.name], "HALF": fmt.block_size // 2,
                  "ADAM_W": layout.adam_w_mode, "MASTER": kind,
                  "P_BF16": p.dtype == torch.bfloat16, **options}  # fmt: skip
    launch = kernels.adamw_block_kernel[(fmt.blocks(n),)]
    if p.device.type == "cuda":
        with torch.cuda.device(p.device):
            launch(*args, **constexprs)
    else:
        launch(*args, **constexprs)
    increment_version(stored[:1] + stored[2:])  # written by a kernel: as in-place ops would
    return True
