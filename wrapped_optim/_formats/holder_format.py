"""The portable state format's rules for precision-aware holders (FusedAdam's conventions).

A holder (:class:`~wrapped_optim.optimizers.PrecisionAwareAdamW`, TE's ``FusedAdam``, a
HybridOffloadOptimizer's host copy) saves every state as an FP32 expansion and loads it into
its own storage formats: :func:`holder_rule` says what one param accepts and in which formats
its states are stored, and the checks below apply :mod:`~wrapped_optim._formats.state_format`'s
generic
checks with that rule, so every loader rejects a fault with one wording.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch

from wrapped_optim._formats.state_format import (
    Saved,
    TensorMeta,
    _meta,
    _state_fault,
    check_entry,
    check_floating,
    check_groups,
    check_hyper_parameters,
    check_index,
    check_names,
    check_shape,
    check_step,
    check_structure,
    check_tensor,
    check_values,
)

__all__ = [
    "HolderRule",
    "check_holder_entry",
    "check_holder_state_dict",
    "check_holder_tensor",
    "holder_rule",
]


@attrs.frozen
class HolderRule:
    """What a precision-aware holder accepts for one param in the portable format.

    ``keeps``: the state names; ``required``: those that must be present; ``remainder``:
    ``master_param`` is an int16 remainder (a bf16 param with ``store_param_remainders``);
    ``formats``: the storage dtype each state is loaded into (its values must fit it).
    Built by :func:`holder_rule`.

    Example:
        >>> rule = HolderRule("AdamW", frozenset({"exp_avg"}), frozenset({"exp_avg"}), False)
        >>> rule.owner, sorted(rule.required)
        ('AdamW', ['exp_avg'])
    """

    owner: str
    keeps: frozenset[str]
    required: frozenset[str]
    remainder: bool
    note: str = ""
    formats: Mapping[str, torch.dtype] = attrs.field(factory=dict, eq=False)


def holder_rule(holder: Any, param: torch.Tensor, *, master_copy: bool = False) -> HolderRule:
    """The :class:`HolderRule` of ``holder`` (FusedAdam, PrecisionAwareAdamW) for ``param``.

    ``master_copy``: the caller keeps a master of its own under ``master_param`` (the hybrid
    offload optimizer's FP32 copy), accepted even when the holder keeps none.

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
        >>> p = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
        >>> opt = PrecisionAwareAdamW([p], master_weights=True, store_param_remainders=True)
        >>> rule = holder_rule(opt, p)
        >>> sorted(rule.required), rule.remainder
        (['exp_avg', 'exp_avg_sq', 'master_param'], True)
    """
    masters = bool(getattr(holder, "master_weights", False))
    names = {name for name in holder.name_to_dtype_map if name != "master_param"}
    required = frozenset(names | ({"master_param"} if masters else set()))
    keeps = required | ({"master_param"} if master_copy else set())
    remainder = (
        masters
        and bool(getattr(holder, "store_param_remainders", False))
        and holder.name_to_dtype_map.get("master_param") == torch.float32
        and param.dtype == torch.bfloat16
    )
    note = "" if masters or master_copy else " (master_weights is off)"
    formats = {n: holder.name_to_dtype_map[n] for n in names}
    if masters or master_copy:  # the caller's own master copy is FP32
        formats["master_param"] = (
            holder.name_to_dtype_map.get("master_param", torch.float32)
            if masters
            else torch.float32
        )
    return HolderRule(type(holder).__name__, frozenset(keeps), required, remainder, note, formats)


def check_holder_tensor(index: Any, name: str, value: Any, rule: HolderRule, shape: Any) -> Saved:
    """One state of a holder's param: a tensor of the param's shape, FP32-expandable (an
    int16 remainder for a remainder master); with its data, finite and in range.

    Example:
        >>> from wrapped_optim._formats.errors import OptimizerCheckpointError
        >>> rule = HolderRule("AdamW", frozenset({"exp_avg_sq"}), frozenset(), False)
        >>> try:
        ...     check_holder_tensor(0, "exp_avg_sq", torch.tensor([-1.0]), rule, (1,))
        ... except OptimizerCheckpointError as error:
        ...     print(error)  # doctest: +ELLIPSIS
        param 0: state 'exp_avg_sq' has negative values...
    """
    saved = check_tensor(index, name, value)
    check_shape(index, name, saved, shape)
    dtype = _meta(saved).dtype
    if name == "master_param" and rule.remainder:
        if dtype != torch.int16:
            raise _state_fault(
                index,
                name,
                f"is {dtype}, but {rule.owner} stores int16 remainders of its bf16 params "
                "(store_param_remainders mismatch)",
            )
        return saved
    if name == "master_param" and dtype == torch.int16:
        raise _state_fault(
            index,
            name,
            f"is an int16 parameter remainder, but {rule.owner} keeps full master weights "
            "(store_param_remainders mismatch)",
        )
    check_floating(index, name, saved)
    if isinstance(saved, torch.Tensor):
        check_values(index, name, saved, rule.formats.get(name), scaled=True)
    return saved


def check_holder_entry(
    index: Any, entry: Any, rule: HolderRule, shape: Any, *, extra: Iterable[str] = ()
) -> dict[str, Saved]:
    """One param's saved state for a holder: names, then every state; ``extra`` names (a
    per-param ``step``) are left to the caller. Returns the states by name.

    Example:
        >>> rule = HolderRule("AdamW", frozenset({"exp_avg"}), frozenset({"exp_avg"}), False)
        >>> sorted(check_holder_entry(0, {"exp_avg": torch.zeros(2)}, rule, (2,)))
        ['exp_avg']
    """
    entry = check_entry(index, entry)
    extra = set(extra)
    names = [name for name in entry if name not in extra]
    check_names(index, names, rule.keeps, rule.owner, required=rule.required, note=rule.note)
    return {name: check_holder_tensor(index, name, entry[name], rule, shape) for name in names}


def _local_shape(param: torch.Tensor) -> tuple[int, ...]:
    return TensorMeta.of(param).shape


def check_holder_state_dict(
    holder: Any, state_dict: Any
) -> tuple[dict[Any, torch.Tensor], Sequence[Mapping[str, Any]]]:
    """The whole portable state dict of a holder; returns (saved index -> param, groups).

    Structure, group and param counts, group steps, every param's states
    (:func:`check_holder_entry`), then the groups' hyper-parameters: the states first, so a
    checkpoint of another optimizer class is named by its state.

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> opt = PrecisionAwareAdamW([p])
        >>> sd = {"state": {0: {"exp_avg": torch.zeros(2), "exp_avg_sq": -torch.ones(2)}},
        ...       "param_groups": [{**opt.param_groups[0], "params": [0]}]}
        >>> check_holder_state_dict(opt, sd)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        wrapped_optim._formats.errors.OptimizerCheckpointError: param 0: state 'exp_avg_sq' has ...
    """
    state, saved_groups = check_structure(state_dict)
    id_map = check_groups(saved_groups, holder.param_groups)
    for group_index, saved in enumerate(saved_groups):
        if "step" in saved:
            check_step(f"param group {group_index}", saved["step"])
    resolved: dict[Any, torch.Tensor] = {}
    for index, entry in state.items():
        check_index(index, id_map)
        param = id_map[index][0]
        check_holder_entry(index, entry, holder_rule(holder, param), _local_shape(param))
        resolved[index] = param
    for group_index, (saved, group) in enumerate(
        zip(saved_groups, holder.param_groups, strict=True)
    ):
        check_hyper_parameters(group_index, saved, group)
    return resolved, saved_groups
