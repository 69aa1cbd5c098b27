"""Checkpoints between torch's Adam/AdamW and PrecisionAwareAdamW.

The two layouts differ in two places. torch keeps the step count per parameter (a tensor
``state[i]["step"]``) and its own group flags (``amsgrad``, ``maximize``, ``foreach``,
``capturable``, ``differentiable``, ``fused``, ``decoupled_weight_decay``);
PrecisionAwareAdamW (like Transformer Engine's FusedAdam) keeps one ``step`` per param group
and ``bias_correction``. The moments (``exp_avg``, ``exp_avg_sq``) are the same FP32 values.

``PrecisionAwareAdamW.load_state_dict
<wrapped_optim.optimizers.PrecisionAwareAdamW.load_state_dict>`` recognises torch's layout and
converts it with ``from_torch_adam``; a PrecisionAwareAdamW checkpoint goes into
``torch.optim.AdamW`` (or ``Adam``) through ``to_torch_adam``. Both check everything
first and raise ``ValueError`` saying what cannot be carried over; the input is never
modified.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from wrapped_optim._formats.errors import OptimizerCheckpointError

__all__ = ["TorchAdamFormatError", "from_torch_adam", "is_torch_adam_layout", "to_torch_adam"]

#: Group keys torch's Adam/AdamW keep that PrecisionAwareAdamW has no use for.
_TORCH_GROUP_FLAGS = (
    "amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused",
    "decoupled_weight_decay",
)  # fmt: skip
_MOMENTS = ("exp_avg", "exp_avg_sq")


class TorchAdamFormatError(OptimizerCheckpointError):
    """A checkpoint that cannot be carried between torch's Adam/AdamW and PrecisionAwareAdamW.

    Raised by ``from_torch_adam`` and ``to_torch_adam``; the message names the group or
    parameter and what to change. An ``OptimizerCheckpointError`` (a ``ValueError``).

    Examples:
        >>> import torch
        >>> from wrapped_optim.optimizers import TorchAdamFormatError, from_torch_adam
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> amsgrad = torch.optim.AdamW([p], lr=0.1, amsgrad=True)
        >>> try:
        ...     from_torch_adam(amsgrad.state_dict())
        ... except TorchAdamFormatError as error:
        ...     print(str(error).split(",")[0])
        param_groups[0] has amsgrad=True
    """


def is_torch_adam_layout(state_dict: Any) -> bool:
    """Whether ``state_dict`` has torch's Adam/AdamW layout (a ``step`` per parameter).

    Examples:
        >>> import torch
        >>> from wrapped_optim.optimizers._torch_adam_format import is_torch_adam_layout
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.AdamW([p])
        >>> p.grad = torch.ones(2)
        >>> opt.step()
        >>> is_torch_adam_layout(opt.state_dict())
        True
    """
    state = state_dict.get("state") if isinstance(state_dict, Mapping) else None
    return isinstance(state, Mapping) and any(
        isinstance(entry, Mapping) and "step" in entry for entry in state.values()
    )


def _step_value(value: Any, where: str) -> int:
    number = float(value.item() if isinstance(value, torch.Tensor) else value)
    if not math.isfinite(number) or number < 0 or number != int(number):
        raise TorchAdamFormatError(f"{where}: step {number} is not a whole number of steps")
    return int(number)


def _state_and_groups(state_dict: Mapping[str, Any]) -> tuple[Mapping[Any, Any], list[Any]]:
    state = state_dict.get("state", {})
    groups = state_dict.get("param_groups")
    if not isinstance(state, Mapping) or not isinstance(groups, list):
        raise TorchAdamFormatError(
            "not an optimizer state dict: need 'state' and 'param_groups' "
            "(pass optimizer.state_dict() or what torch.load returned for it)"
        )
    return state, groups


def from_torch_adam(state_dict: Mapping[str, Any], *, adam_w_mode: bool = True) -> dict[str, Any]:
    """Converts a torch Adam/AdamW state dict to PrecisionAwareAdamW's layout.

    Each group's ``step`` is the step of its parameters (they must agree); torch's group flags
    are dropped after checking that nothing they turn on is lost.

    Args:
        state_dict: ``torch.optim.Adam``'s or ``AdamW``'s ``state_dict()``.
        adam_w_mode: The ``adam_w_mode`` of the PrecisionAwareAdamW that loads the result:
            ``True`` for torch's AdamW (decoupled weight decay), ``False`` for Adam (L2).

    Returns:
        A new state dict that ``PrecisionAwareAdamW.load_state_dict`` loads.

    Raises:
        TorchAdamFormatError: ``amsgrad`` or ``maximize`` is on, the weight decay is of the
            other kind than ``adam_w_mode``, a group's parameters disagree on the step, or
            ``state_dict`` is not an optimizer state dict.

    Examples:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
        >>> from wrapped_optim.optimizers import from_torch_adam
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> torch_opt = torch.optim.AdamW([p], lr=0.1)
        >>> p.grad = torch.ones(2)
        >>> torch_opt.step()
        >>> sd = from_torch_adam(torch_opt.state_dict())
        >>> sorted(sd["state"][0]), sd["param_groups"][0]["step"]
        (['exp_avg', 'exp_avg_sq'], 1)
    """
    state, groups = _state_and_groups(state_dict)
    new_state: dict[Any, dict[str, Any]] = {}
    new_groups = []
    for g, group in enumerate(groups):
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise TorchAdamFormatError(
                    f"param_groups[{g}] has {flag}=True, which PrecisionAwareAdamW (like TE's "
                    f"FusedAdam) does not do; train with {flag}=False to switch"
                )
        decoupled = group.get("decoupled_weight_decay")
        if decoupled is not None and bool(decoupled) != adam_w_mode and group.get("weight_decay"):
            kind, torch_cls = ("decoupled", "AdamW") if decoupled else ("L2", "Adam")
            raise TorchAdamFormatError(
                f"param_groups[{g}] comes from torch.optim.{torch_cls} ({kind} weight decay "
                f"{group['weight_decay']}), but this PrecisionAwareAdamW has "
                f"adam_w_mode={adam_w_mode}; construct it with adam_w_mode={not adam_w_mode}"
            )
        steps = set()
        for index in group["params"]:
            entry = state.get(index)
            if entry is None:
                continue
            if "max_exp_avg_sq" in entry:
                raise TorchAdamFormatError(f"state[{index}] holds AMSGrad's max_exp_avg_sq")
            if "step" not in entry:
                raise TorchAdamFormatError(f"state[{index}] has no 'step'")
            steps.add(_step_value(entry["step"], f"state[{index}]"))
            new_state[index] = {k: v for k, v in entry.items() if k != "step"}
        if len(steps) > 1:
            raise TorchAdamFormatError(
                f"the parameters of param_groups[{g}] have taken different numbers of steps "
                f"({sorted(steps)}); PrecisionAwareAdamW keeps one step per group. Load the "
                "groups' parameters separately, or step every parameter before saving"
            )
        packed = {k: v for k, v in group.items() if k not in _TORCH_GROUP_FLAGS}
        packed.setdefault("bias_correction", True)
        packed["step"] = steps.pop() if steps else 0
        new_groups.append(packed)
    return {"state": new_state, "param_groups": new_groups}


def to_torch_adam(state_dict: Mapping[str, Any], *, drop_masters: bool = False) -> dict[str, Any]:
    """Converts a PrecisionAwareAdamW state dict to the layout torch's AdamW (or Adam) loads.

    Each parameter's state gets its group's ``step`` as torch's float32 step tensor. Load the
    result into ``AdamW`` for ``adam_w_mode=True`` (the default), ``Adam`` otherwise.

    Args:
        state_dict: ``PrecisionAwareAdamW.state_dict()``.
        drop_masters: Drop FP32 masters (``master_param``), which torch has nowhere to keep;
            copy them into the model's parameters first (e.g. from
            ``opt.get_unscaled_state(p, "master_param")``) or their precision is lost.

    Returns:
        A new state dict that ``torch.optim.AdamW.load_state_dict`` loads.

    Raises:
        TorchAdamFormatError: a group has ``bias_correction=False`` (torch always corrects
            the bias), a state holds masters without ``drop_masters=True``, or
            ``state_dict`` is not an optimizer state dict.

    Examples:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
        >>> from wrapped_optim.optimizers import to_torch_adam
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> opt = PrecisionAwareAdamW([p], lr=0.1, exp_avg_dtype=torch.bfloat16)
        >>> p.grad = torch.ones(2)
        >>> opt.step()
        >>> torch_opt = torch.optim.AdamW([p], lr=0.1)
        >>> torch_opt.load_state_dict(to_torch_adam(opt.state_dict()))
        >>> torch_opt.step()  # continues at step 2
        >>> torch_opt.state[p]["step"]
        tensor(2.)
    """
    state, groups = _state_and_groups(state_dict)
    new_state: dict[Any, dict[str, Any]] = {}
    new_groups = []
    for g, group in enumerate(groups):
        if not group.get("bias_correction", True):
            raise TorchAdamFormatError(
                f"param_groups[{g}] has bias_correction=False; torch's Adam/AdamW always "
                "correct the bias, so their steps would differ"
            )
        step = _step_value(group.get("step", 0), f"param_groups[{g}]")
        for index in group["params"]:
            entry = state.get(index)
            if entry is None:
                continue
            extra = sorted(set(entry) - set(_MOMENTS))
            if extra and not (drop_masters and extra == ["master_param"]):
                hint = (
                    "; pass drop_masters=True after copying the masters into the parameters"
                    if extra == ["master_param"]
                    else ""
                )
                raise TorchAdamFormatError(
                    f"state[{index}] holds {', '.join(extra)}, which torch's AdamW has no "
                    f"place for{hint}"
                )
            moments = {k: v for k, v in entry.items() if k in _MOMENTS}
            new_state[index] = {"step": torch.tensor(float(step)), **moments}
        packed = {k: v for k, v in group.items() if k not in ("step", "bias_correction")}
        new_groups.append(packed)
    return {"state": new_state, "param_groups": new_groups}
