"""One parameter's operands for one step, as a value: built once per step by the router
(:func:`~wrapped_optim.optimizers.precision_adamw._step.step_group`) and read by every path
function, each of which takes ``(layout, operand, group)``, as torch's ``adam()`` hands its
implementations the lists its optimizer gathered once.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
from torch import Tensor

__all__ = ["Operand"]


@attrs.frozen(eq=False)
class Operand:
    """A parameter, its gradient, its state (state name -> storage, updated in place) and the
    per-tensor scales of its scaled states (state name -> scale; empty when none).

    Example:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> op = Operand(p, torch.ones(2), {"exp_avg": torch.zeros(2)}, {})
        >>> op.param is p, sorted(op.state)
        (True, ['exp_avg'])
    """

    param: Tensor
    grad: Tensor
    state: Mapping[str, Tensor]
    scales: Mapping[str, Tensor]
