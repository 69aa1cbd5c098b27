"""What another optimizer that owns the parameters (HybridOffloadOptimizer's fused host step)
may ask of a :class:`~wrapped_optim.optimizers.PrecisionAwareAdamW` holding their FP32 host
copies: would its own step hand a copy to the compiled CPU kernel, and that kernel call made
for many copies at once, writing each compute parameter in the same pass.

The answers come from the optimizer's own router (:mod:`._step`) and kernel path
(:mod:`._kernel_step`), so a fused update is bitwise the one the optimizer's step would make.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from wrapped_optim.optimizers.precision_adamw import _step
from wrapped_optim.optimizers.precision_adamw._kernel_step import (
    KernelOperands,
    kernel_enabled,
    kernel_operands,
    kernel_update,
)
from wrapped_optim.optimizers.precision_adamw._operand import Operand
from wrapped_optim.optimizers.precision_adamw._optimizer import PrecisionAwareAdamW

__all__ = ["kernel_step_copies", "kernel_steps_copy"]


def kernel_steps_copy(
    optimizer: PrecisionAwareAdamW, copy: Tensor, group: Mapping[str, Any]
) -> bool:
    """Whether ``optimizer``'s own step, given an FP32 grad, would hand its parameter ``copy``
    (in ``group``, its state created) to the compiled CPU kernel.

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW, cpu_kernel
        >>> copy = torch.zeros(4)
        >>> opt = PrecisionAwareAdamW([copy], exp_avg_dtype=torch.bfloat16)
        >>> kernel_steps_copy(opt, copy, opt.param_groups[0])  # no state yet
        False
        >>> opt.initialize_state(copy, False)
        >>> kernel_steps_copy(opt, copy, opt.param_groups[0]) == cpu_kernel.available()
        True
    """
    if optimizer.use_decoupled_grad or not kernel_enabled(optimizer.layout):
        return False  # its step would read the copy's decoupled_grad, or not use the kernel
    state = optimizer.state.get(copy)
    if not state:
        return False
    operand = Operand(copy, copy, state, optimizer.scales.get(copy, {}))
    # Through the module, so that the router's answer is the one asked, whoever replaced it.
    return _step.kernel_would_update(optimizer.layout, operand, group)


def kernel_step_copies(
    optimizer: PrecisionAwareAdamW,
    group: Mapping[str, Any],
    updates: Sequence[tuple[Tensor, Tensor, Tensor]],
) -> None:
    """One kernel call updating each ``(param, copy, grad)`` of ``updates``: ``copy`` (a
    parameter of ``optimizer`` in ``group``, whose ``step`` the optimizer's own step already
    advanced) is the FP32 master, ``param`` the compute weight the kernel writes too.

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW, cpu_kernel
        >>> param, copy = torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4)
        >>> opt = PrecisionAwareAdamW([copy], lr=0.5, weight_decay=0.0)
        >>> opt.initialize_state(copy, False)
        >>> group = {**opt.param_groups[0], "step": 1}
        >>> if cpu_kernel.available():
        ...     kernel_step_copies(opt, group, [(param, copy, torch.ones(4))])
        ...     assert param.tolist() == copy.tolist() == [-0.5] * 4
    """
    calls: list[KernelOperands] = []
    for param, copy, grad in updates:
        operand = Operand(copy, grad, optimizer.state[copy], optimizer.scales.get(copy, {}))
        operands = kernel_operands(optimizer.layout, operand)
        if operands is None:  # the caller asked kernel_steps_copy: the optimizer changed since
            raise RuntimeError(
                "the fused host step lost a parameter the kernel reads: the host "
                "optimizer's options or state changed between plan() and run(); pass "
                "fused_host_step=False to HybridOffloadOptimizer to step it unfused"
            )
        _, flat_grad, m, v, _, m_scale, v_scale = operands
        calls.append((param.view(-1), flat_grad, m, v, copy.view(-1), m_scale, v_scale))
    kernel_update(
        calls, group, adam_w_mode=bool(optimizer.adam_w_mode), block_format=optimizer.layout.blocks
    )
