"""The checks every step path runs on its operands before it writes anything.

A parameter whose ``.data`` was replaced between two steps (an embedding resize, a weight
swap of another shape) no longer matches the state, master copy or host copy the optimizer
made for it; torch's fused AdamW kernel and the compiled CPU kernel read and write by
element count, so such a step would write outside the tensors. Both optimizers call
:func:`check_operands` for every parameter they are about to step (PrecisionAwareAdamW for
its state, whichever path then updates it; HybridOffloadOptimizer for its copies, before the
grads are copied and the sub-optimizers or the fused host step run), and raise before the
first write.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from wrapped_optim._adapters.dtensor import local_tensor

__all__ = ["StepOperandError", "check_operands", "describe_param"]


class StepOperandError(RuntimeError):
    """A parameter, its gradient and the tensors an optimizer keeps for it disagree (shape,
    dtype or device) at a step; nothing was written.

    Example:
        >>> import torch
        >>> check_operands("param 0", torch.zeros(4), torch.zeros(3), {})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        wrapped_optim.optimizers._step_checks.StepOperandError: param 0: its gradient has 3 ...
    """


def describe_param(group_index: int, index: int, param: Tensor) -> str:
    """How an error names a parameter: its group, position and (local) shape.

    Example:
        >>> import torch
        >>> describe_param(0, 2, torch.zeros(3, 4))
        'param group 0 index 2 (shape (3, 4), torch.float32)'
    """
    local = local_tensor(param)
    return f"param group {group_index} index {index} (shape {tuple(local.shape)}, {local.dtype})"


def check_operands(
    name: str,
    param: Tensor,
    grad: Tensor | None,
    kept: Mapping[str, Tensor],
    dtypes: Mapping[str, torch.dtype] | None = None,
    *,
    same_device: bool = True,
    contiguous: bool = True,
) -> None:
    """Raises :class:`StepOperandError` naming ``name`` unless ``grad`` and every tensor in
    ``kept`` (state, master or host copy, by label) has ``param``'s element count (is
    on ``param``'s device with ``same_device``, contiguous with ``contiguous``), and each
    ``kept`` tensor whose label is in ``dtypes`` has that dtype.

    Example:
        >>> import torch
        >>> p = torch.zeros(4)
        >>> check_operands("p", p, torch.ones(4), {"exp_avg": torch.zeros(4)})
        >>> check_operands("p", p, None, {"exp_avg": torch.zeros(2)})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        wrapped_optim.optimizers._step_checks.StepOperandError: p: exp_avg has 2 elements ...
    """
    local = local_tensor(param)
    numel = local.numel()
    fix = (
        "; was the parameter's .data replaced or resized after the optimizer made its state? "
        "Build a new optimizer (or load a state dict made for the new shapes) after resizing"
    )
    if grad is not None:
        g = local_tensor(grad)
        if g.numel() != numel:
            raise StepOperandError(
                f"{name}: its gradient has {g.numel()} elements (shape {tuple(g.shape)}), the "
                f"parameter has {numel}; nothing was stepped"
            )
        if not g.is_floating_point():
            raise StepOperandError(f"{name}: its gradient is {g.dtype}, not a floating dtype")
    for label, tensor in kept.items():
        if not isinstance(tensor, Tensor):
            continue
        t = local_tensor(tensor)
        if t.numel() != numel:
            raise StepOperandError(
                f"{name}: {label} has {t.numel()} elements (shape {tuple(t.shape)}), the "
                f"parameter has {numel}{fix}; nothing was stepped"
            )
        if same_device and t.device != local.device:
            raise StepOperandError(
                f"{name}: {label} is on {t.device}, the parameter on {local.device}{fix}; "
                "nothing was stepped"
            )
        expected = None if dtypes is None else dtypes.get(label)
        if expected is not None and t.dtype != expected:
            raise StepOperandError(
                f"{name}: {label} is {t.dtype}, the optimizer keeps it as {expected}{fix}; "
                "nothing was stepped"
            )
        if contiguous and not t.is_contiguous():
            raise StepOperandError(f"{name}: {label} is not contiguous; nothing was stepped")
