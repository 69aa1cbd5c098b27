"""The torch step of a :class:`~wrapped_optim.optimizers.PrecisionAwareAdamW` parameter whose
moments are block-scaled (``block_moments``), where the compiled CPU kernel does not take it
(another device, the kernel off or unavailable, a layout it does not read).

The arithmetic is :func:`wrapped_optim._formats.blocks.step_blocks`, bit for bit the
kernel's; this module finds the FP32 value to update (the parameter, its FP32 master, or a
bf16 parameter joined with its int16 remainder) and writes the parameter back from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from wrapped_optim._adapters.dtensor import local_tensor
from wrapped_optim._formats import blocks
from wrapped_optim._formats.remainders import join_master, split_master_into
from wrapped_optim.optimizers._precision_layout import PrecisionLayout

__all__ = ["group_hyper", "update"]


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
    state: Mapping[str, Tensor],
    scales: Mapping[str, Tensor],
    param: Tensor,
    grad: Tensor,
    group: Mapping[str, Any],
) -> None:
    """One step of ``param`` (its block-scaled moments, block scales and master updated in
    place) with ``group``'s options at its current step count.

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> opt = PrecisionAwareAdamW([p], lr=0.5, weight_decay=0.0, block_moments="fp8")
        >>> opt.initialize_state(p, False)
        >>> update(opt.layout, opt.state[p], opt.scales[p], p, torch.ones(2),
        ...        {**opt.param_groups[0], "step": 1})
        >>> p.data.tolist()
        [0.5, 0.5]
    """
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
