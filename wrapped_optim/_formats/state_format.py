"""The portable optimizer state format, specified once: every loader checks against it.

torch's ``state_dict`` layout (``{"state": {index: {name: value}}, "param_groups": [...]}``)
with FusedAdam's portable conventions for precision-aware optimizers (every state an FP32
expansion, an int16 remainder for a remainder master, the step count in the param group).
``load_state_dict`` of :class:`~wrapped_optim.optimizers.PrecisionAwareAdamW` and of
:class:`~wrapped_optim.optimizers.HybridOffloadOptimizer` (for both kinds of sub-optimizer)
and the streaming :func:`wrapped_optim.checkpoint.load_optimizer` call these checks (the
rules of precision-aware holders are in :mod:`wrapped_optim._formats.holder_format`), so a
fault is rejected by all of them with one :class:`OptimizerCheckpointError` and one wording.
A streaming loader sees a tensor's shape and dtype (a :class:`TensorMeta`) before its data:
every check takes either, and the value checks run when the data arrives.

It imports nothing of the package but the error type and the load limits.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch

from wrapped_optim._formats.errors import OptimizerCheckpointError
from wrapped_optim._formats.load_limits import overflow_problem

__all__ = [
    "SECOND_MOMENTS",
    "OptimizerCheckpointError",
    "TensorMeta",
    "check_entry",
    "check_groups",
    "check_hyper_parameters",
    "check_index",
    "check_names",
    "check_shape",
    "check_step",
    "check_structure",
    "check_tensor",
    "check_values",
    "hyper_parameter_problem",
]

SECOND_MOMENTS = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "acc_delta"})
"""States that are running means of squares: a negative value makes the next update NaN."""

# A step counter in these dtypes counts exactly (a bf16 counter stops at 256, fp16 at 2048).
_STEP_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64)
_NON_NEGATIVE = ("lr", "eps", "weight_decay")


@attrs.frozen
class TensorMeta:
    """A saved tensor seen before its data is read: its shape and dtype.

    Example:
        >>> import torch
        >>> TensorMeta.of(torch.zeros(2, 3, dtype=torch.bfloat16))
        TensorMeta(shape=(2, 3), dtype=torch.bfloat16)
    """

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, value: torch.Tensor) -> TensorMeta:
        """The shape (of the local shard, for a DTensor) and dtype of ``value``."""
        local = value.to_local() if hasattr(value, "to_local") else value
        return cls(tuple(local.shape), local.dtype)


Saved = torch.Tensor | TensorMeta


def _fault(where: str, problem: str) -> OptimizerCheckpointError:
    return OptimizerCheckpointError(f"{where}: {problem}")


def _state_fault(index: Any, name: str, problem: str) -> OptimizerCheckpointError:
    return OptimizerCheckpointError(f"param {index!r}: state {name!r} {problem}")


def _meta(value: Saved) -> TensorMeta:
    return value if isinstance(value, TensorMeta) else TensorMeta.of(value)


# ------------------------------------------------------------------------------------------
# Structure
# ------------------------------------------------------------------------------------------
def check_structure(state_dict: Any) -> tuple[Mapping[Any, Any], Sequence[Any]]:
    """The top level: a dict with a ``state`` dict and ``param_groups``; returns both.

    Example:
        >>> check_structure({"state": {}})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        wrapped_optim._formats.errors.OptimizerCheckpointError: the optimizer state dict has no ...
    """
    if not isinstance(state_dict, Mapping):
        raise OptimizerCheckpointError(
            "an optimizer state dict must be a dict with 'state' and 'param_groups', got "
            f"{type(state_dict).__name__}"
        )
    for key in ("param_groups", "state"):
        if key not in state_dict:
            raise OptimizerCheckpointError(f"the optimizer state dict has no {key!r} entry")
    state = state_dict["state"]
    if not isinstance(state, Mapping):
        raise OptimizerCheckpointError(
            f"the optimizer state dict's 'state' must be a dict, got {type(state).__name__}"
        )
    return state, state_dict["param_groups"]


def check_groups(
    saved_groups: Any, groups: Sequence[Mapping[str, Any]]
) -> dict[Any, tuple[torch.Tensor, int]]:
    """Group and param counts; returns saved param id -> (this optimizer's param, group).

    Example:
        >>> import torch
        >>> p = torch.zeros(1)
        >>> check_groups([{"params": [0, 1]}], [{"params": [p]}])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        wrapped_optim._formats.errors.OptimizerCheckpointError: param group 0: the checkpoint ...
    """
    if not isinstance(saved_groups, list | tuple) or len(saved_groups) != len(groups):
        count = len(saved_groups) if isinstance(saved_groups, list | tuple) else "no list of"
        raise OptimizerCheckpointError(
            f"the checkpoint has {count} param groups, this optimizer has {len(groups)}"
        )
    id_map: dict[Any, tuple[torch.Tensor, int]] = {}
    for group_index, (saved, group) in enumerate(zip(saved_groups, groups, strict=True)):
        where = f"param group {group_index}"
        if not isinstance(saved, Mapping) or not isinstance(saved.get("params"), list | tuple):
            raise _fault(where, "the checkpoint lists no params")
        if len(saved["params"]) != len(group["params"]):
            raise _fault(
                where,
                f"the checkpoint has {len(saved['params'])} params, this optimizer has "
                f"{len(group['params'])}",
            )
        for key, param in zip(saved["params"], group["params"], strict=True):
            if key in id_map:
                raise _fault(where, f"the checkpoint lists param id {key!r} twice")
            id_map[key] = (param, group_index)
    return id_map


def check_index(index: Any, id_map: Mapping[Any, Any]) -> None:
    """A state entry must belong to a param some group lists.

    Example:
        >>> try:
        ...     check_index(7, {0: "param 0"})
        ... except OptimizerCheckpointError as error:
        ...     print(error)
        param 7: the checkpoint has state for a param that no param group lists
    """
    if index not in id_map:
        raise _fault(
            f"param {index!r}", "the checkpoint has state for a param that no param group lists"
        )


def check_entry(index: Any, entry: Any) -> Mapping[str, Any]:
    """One param's state must be a dict.

    Example:
        >>> try:
        ...     check_entry(0, ["exp_avg"])
        ... except OptimizerCheckpointError as error:
        ...     print(error)
        param 0: state must be a dict, got list
    """
    if not isinstance(entry, Mapping):
        raise _fault(f"param {index!r}", f"state must be a dict, got {type(entry).__name__}")
    return entry


# ------------------------------------------------------------------------------------------
# Hyper-parameters and steps
# ------------------------------------------------------------------------------------------
def _as_number(value: Any) -> float | None:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            return None
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def hyper_parameter_problem(name: str, value: Any) -> str | None:
    """What is wrong with one Adam-family hyper-parameter value, or ``None``.

    ``lr``, ``eps`` and ``weight_decay`` must be finite and non-negative, each of ``betas`` in
    ``[0, 1)`` (a one-element floating tensor counts as a number). The constructors of this
    package and every loader apply this same rule.

    Example:
        >>> hyper_parameter_problem("betas", (0.9, 1.0))
        'betas must be two numbers in [0, 1), got (0.9, 1.0)'
        >>> hyper_parameter_problem("lr", float("nan"))
        'lr must be a finite number >= 0, got nan'
    """
    if name in _NON_NEGATIVE:
        number = _as_number(value)
        if number is None or not math.isfinite(number) or number < 0:
            return f"{name} must be a finite number >= 0, got {value!r}"
    elif name == "betas":
        numbers = [_as_number(b) for b in value] if isinstance(value, tuple | list) else []
        if len(numbers) != 2 or not all(b is not None and 0.0 <= b < 1.0 for b in numbers):
            return f"betas must be two numbers in [0, 1), got {value!r}"
    return None


def _is_number(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and value.dtype != torch.bool
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_hyper_parameters(
    group_index: int, saved: Mapping[str, Any], current: Mapping[str, Any]
) -> None:
    """The saved group has every numeric hyper-parameter of this optimizer's group, each of
    its kind, finite and (``lr``, ``eps``, ``weight_decay``, ``betas``) in range.

    A missing switch (a bool or ``None`` option, such as ``foreach`` or a flag a newer torch
    added) keeps this optimizer's value, as torch's ``__setstate__`` fills such keys in.

    Example:
        >>> group = {"params": [], "lr": 0.1}
        >>> check_hyper_parameters(0, {"params": [0]}, group)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        wrapped_optim._formats.errors.OptimizerCheckpointError: param group 0: missing ...
    """
    where = f"param group {group_index}"
    for key in (*_NON_NEGATIVE, "betas"):
        # A wrapper's group may lack an option its sub-optimizers take (the hybrid offload
        # optimizer passes its groups' options on): the checkpoint's is held to the range.
        if key in saved and key not in current:
            problem = hyper_parameter_problem(key, saved[key])
            if problem is not None:
                raise _fault(where, problem)
    for key, mine in current.items():
        if key in ("params", "param_names", "step"):
            continue
        if key not in saved:
            if _is_numeric(mine):
                raise _fault(where, f"missing hyper-parameter {key!r}")
            continue
        problem = _saved_value_problem(key, mine, saved[key])
        if problem is not None:
            raise _fault(where, problem)


def _is_numeric(option: Any) -> bool:
    """A number, or a non-empty tuple/list of numbers (such as ``betas``)."""
    return _is_number(option) or (
        isinstance(option, tuple | list) and len(option) > 0 and all(_is_number(v) for v in option)
    )


def _saved_value_problem(key: str, mine: Any, value: Any) -> str | None:
    """What is wrong with the saved ``value`` of the option ``key`` whose value here is
    ``mine`` (it must be of the same kind), or None."""
    if isinstance(value, TensorMeta):
        # A tensor hyper-parameter seen before its data (a streaming load): its kind only.
        if _is_number(mine) and math.prod(value.shape) == 1 and value.dtype.is_floating_point:
            return None
        return (
            f"hyper-parameter {key!r} must be a finite number like {mine!r}, got a "
            f"{value.dtype} tensor of shape {value.shape}"
        )
    # The Adam-family ranges, where this optimizer's option has their form (Adafactor's eps,
    # for one, is a pair).
    if key in _NON_NEGATIVE:
        adam_form = _is_number(mine)
    else:
        adam_form = key == "betas" and isinstance(mine, tuple | list) and len(mine) == 2
    if adam_form:
        return hyper_parameter_problem(key, value)
    if _is_number(mine):
        number = _as_number(value)
        if number is None or not math.isfinite(number):
            return f"hyper-parameter {key!r} must be a finite number like {mine!r}, got {value!r}"
    elif _is_numeric(mine):
        if (
            not isinstance(value, tuple | list)
            or len(value) != len(mine)
            or not all(_as_number(v) is not None and math.isfinite(_as_number(v) or 0.0)
                       for v in value)
        ):  # fmt: skip
            return (
                f"hyper-parameter {key!r} must be {len(mine)} finite numbers like {mine!r}, "
                f"got {value!r}"
            )
    elif isinstance(mine, bool | str) and not isinstance(value, type(mine)):
        return (
            f"hyper-parameter {key!r} must be a {type(mine).__name__} like {mine!r}, got {value!r}"
        )
    return None


def check_step(where: str, value: Any) -> int:
    """A saved step count (a group's or a param's) as an int.

    Accepted: a non-negative integral number, or a 0-d float32/float64/int32/int64 tensor
    holding one (torch keeps Adam's step as a 0-d float32 tensor). Rejected with a clear
    error: anything else, notably a 16-bit float tensor (it cannot count past 256 or 2048, so
    the bias correction drifts) and a tensor of more than one element (torch's step crashes).

    Example:
        >>> import torch
        >>> check_step("param group 0", torch.tensor(3.0))
        3
        >>> bf16 = torch.tensor(3.0, dtype=torch.bfloat16)
        >>> check_step("param group 0", bf16)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        wrapped_optim._formats.errors.OptimizerCheckpointError: param group 0: invalid step ...
    """
    if isinstance(value, torch.Tensor | TensorMeta):
        _check_step_meta(where, value, _meta(value))
        if isinstance(value, TensorMeta):
            return 0
        number: Any = value.item()
    else:
        number = value
    if (
        isinstance(number, bool)
        or not isinstance(number, int | float)
        or not math.isfinite(number)
        or number < 0
        or not float(number).is_integer()
    ):
        raise _fault(where, f"invalid step {value!r} (expected a non-negative count)")
    return int(number)


def _check_step_meta(where: str, value: Any, meta: TensorMeta) -> None:
    if meta.shape != ():
        raise _fault(
            where,
            f"invalid step: a tensor of shape {meta.shape} (expected a number or a 0-d tensor)",
        )
    if meta.dtype not in _STEP_DTYPES:
        name = str(meta.dtype).removeprefix("torch.")
        raise _fault(
            where,
            f"invalid step {value!r} (a {name} step cannot count every step exactly; save it "
            "as a number or a float32 tensor)",
        )


# ------------------------------------------------------------------------------------------
# Per-parameter state
# ------------------------------------------------------------------------------------------
def check_names(
    index: Any,
    names: Iterable[str],
    keeps: Iterable[str],
    owner: str,
    *,
    required: Iterable[str] | None = None,
    note: str = "",
) -> None:
    """Every name is one ``owner`` keeps; every ``required`` one (default: all) is present.

    Example:
        >>> check_names(0, ["exp_avg", "bogus"], ["exp_avg"], "AdamW")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        wrapped_optim._formats.errors.OptimizerCheckpointError: param 0: unknown state ...
    """
    keeps = sorted(keeps)
    names = list(names)
    for name in names:
        if name not in keeps:
            raise _fault(f"param {index!r}", f"unknown state {name!r}; {owner} keeps {keeps}{note}")
    for name in sorted(set(keeps if required is None else required) - set(names)):
        raise _fault(f"param {index!r}", f"missing state {name!r}; {owner} keeps {keeps}{note}")


def check_tensor(index: Any, name: str, value: Any) -> Saved:
    """A state that must be a tensor (or, streaming, a tensor's metadata).

    Example:
        >>> try:
        ...     check_tensor(0, "exp_avg", [0.0, 1.0])
        ... except OptimizerCheckpointError as error:
        ...     print(error)
        param 0: state 'exp_avg' must be a tensor, got list
    """
    if not isinstance(value, torch.Tensor | TensorMeta):
        raise _state_fault(index, name, f"must be a tensor, got {type(value).__name__}")
    return value


def check_shape(
    index: Any, name: str, value: Saved, want: Sequence[int], whose: str = "the param has"
) -> None:
    """A state has the shape ``want`` (its param's, unless ``whose`` says otherwise).

    Example:
        >>> try:
        ...     check_shape(0, "exp_avg", torch.zeros(3), (2,))
        ... except OptimizerCheckpointError as error:
        ...     print(error)
        param 0: state 'exp_avg' has shape (3,), the param has (2,)
    """
    got = _meta(value).shape
    if got != tuple(want):
        raise _state_fault(index, name, f"has shape {got}, {whose} {tuple(want)}")


def check_floating(index: Any, name: str, value: Saved) -> None:
    """A state stored as floating point values (a moment, a master)."""
    dtype = _meta(value).dtype
    if not dtype.is_floating_point:
        raise _state_fault(index, name, f"is {dtype}, not floating")


def check_values(
    index: Any,
    name: str,
    value: torch.Tensor,
    stored: torch.dtype | None = None,
    *,
    scaled: bool = False,
    allow_non_finite: bool = False,
) -> None:
    """Finite values (unless ``allow_non_finite``: inf and NaN pass, as torch's loader lets
    them; with ``scaled`` the refusal says why a holder cannot take them); no negative
    value in a second moment (:data:`SECOND_MOMENTS`); with ``stored`` (a holder's storage
    with ``scaled``), none too large for the format they are loaded into
    (:func:`wrapped_optim._formats.load_limits.loads_as_inf`).

    Example:
        >>> import torch
        >>> check_values(0, "exp_avg_sq", torch.tensor([1.0, -1.0]))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        wrapped_optim._formats.errors.OptimizerCheckpointError: param 0: state 'exp_avg_sq' has ...
    """
    local = value.to_local() if hasattr(value, "to_local") else value
    if not (local.is_floating_point() or local.is_complex()):
        return
    if local.dtype in _MIN_MAX_DTYPES:
        # One reduction, no temporary of the tensor's size (isfinite + all and a comparison
        # held masks and copies of up to 7 bytes per element): min and max are NaN if any
        # value is, and +-inf if any value is infinite.
        if local.numel() == 0:
            return
        lo, hi = torch.stack(torch.aminmax(local)).tolist()
        finite = math.isfinite(lo) and math.isfinite(hi)
        if not finite and not allow_non_finite:
            raise _state_fault(index, name, _non_finite(scaled))
        negative = lo < 0
        problem = overflow_problem(max(-lo, hi), stored, scaled=scaled) if finite else None
        if problem is not None:
            raise _state_fault(index, name, problem)
    else:
        if not allow_non_finite and not bool(torch.isfinite(local).all()):
            raise _state_fault(index, name, _non_finite(scaled))
        negative = local.is_floating_point() and bool((local < 0).any())
    if name in SECOND_MOMENTS and negative:
        raise _state_fault(
            index, name, "has negative values (a second moment is a mean of squares)"
        )


_MIN_MAX_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _non_finite(scaled: bool) -> str:
    """Why inf/NaN is refused: by the caller's choice, or because a holder cannot keep it."""
    if not scaled:
        return "has non-finite values"
    return (
        "has non-finite values, which a precision-aware optimizer's state cannot take "
        "(its fp16 and FP8 formats scale a whole tensor by its largest magnitude, which "
        "inf or NaN poisons)"
    )
