"""The torch ``state_dict()`` shape (``state`` + ``param_groups``) read into a StateIndex and
built back from one: shared by the torch.save and DCP formats, whose trees differ only in
their values (tensors or tensor metadata) and keys (indices or names).

Two flavours of that shape exist: torch.optim's, with a ``step`` per parameter, and the
precision-aware one (TE FusedAdam's portable format, ``PrecisionAwareAdamW``'s), with the
step in each param group and the master under ``master_param``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch

from wrapped_optim.checkpoint._convert._canonical import (
    MASTER,
    GroupRecord,
    ParamRecord,
    StateIndex,
    TensorSpec,
)
from wrapped_optim.checkpoint._convert._errors import ConversionError
from wrapped_optim.checkpoint._convert._options import FormatOptions

__all__ = ["Flavour", "index_from_state_dict", "state_dict_from_index"]

Flavour = Literal["torch", "precision-aware"]

#: The state-dict name of the canonical MASTER key.
MASTER_PARAM = "master_param"

#: notes keys a StateIndex built here carries.
NOTE_FLAVOUR = "flavour"
NOTE_GROUP_STEPS = "group_steps"
NOTE_STEP_DTYPE = "step_dtype"
NOTE_NONE_STATES = "none_states"
NOTE_INDEX_NAMES = "index_names"

SpecOf = Callable[[Any], TensorSpec | None]


def _step_number(value: Any, where: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConversionError(f"{where}: 'step' holds {value.numel()} values, not one")
        return float(value.reshape(()).item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConversionError(f"{where}: 'step' is a {type(value).__name__}, not a number")
    return float(value)


def _param_names(
    keys: list[Any], options: FormatOptions, source: str
) -> tuple[dict[Any, str], bool]:
    """Each state-dict key's canonical name, and whether names stand for indices."""
    if all(isinstance(k, str) for k in keys):
        return {k: k for k in keys}, False
    if not all(isinstance(k, int) and not isinstance(k, bool) for k in keys):
        raise ConversionError(f"{source}: param_groups mix index and name keys")
    if options.names is None:
        return {k: str(k) for k in keys}, True
    if len(options.names) != len(keys):
        raise ConversionError(
            f"{source}: the optimizer holds {len(keys)} parameters, the names list "
            f"{len(options.names)}; the names must be the optimizer's parameters in its order"
        )
    return {k: options.names[position] for position, k in enumerate(sorted(keys))}, False


def _param_record(
    key: Any,
    name: str,
    group: int,
    entries: Mapping[str, Any],
    spec_of: SpecOf,
    source: str,
) -> tuple[ParamRecord, dict[str, Any], list[str], torch.dtype | None]:
    where = f"{source}: parameter {name!r}"
    state: dict[str, TensorSpec] = {}
    values: dict[str, Any] = {}
    nones: list[str] = []
    step: float | None = None
    step_dtype: torch.dtype | None = None
    for state_name, value in entries.items():
        if state_name == "step":
            step = _step_number(value, where)
            step_dtype = value.dtype if isinstance(value, torch.Tensor) else None
            continue
        if value is None:
            nones.append(state_name)
            continue
        spec = spec_of(value)
        if spec is None:
            raise ConversionError(
                f"{where}: state {state_name!r} is a {type(value).__name__}, not a tensor; "
                "the converter carries tensors and steps only"
            )
        canonical = MASTER if state_name == MASTER_PARAM else state_name
        if canonical == MASTER and spec.dtype == torch.int16:
            raise ConversionError(
                f"{where}: state 'master_param' is an int16 remainder (store_param_remainders); "
                "it is only a master together with the bf16 parameter, which an optimizer "
                "checkpoint does not hold. Save with FP32 masters (store_param_remainders=False) "
                "to convert"
            )
        state[canonical] = spec
        values[canonical] = value
    shapes = [spec.shape for spec in state.values() if spec.numel]
    shape = shapes[0] if shapes else next((s.shape for s in state.values()), ())
    try:
        record = ParamRecord(name=name, group=group, shape=shape, state=state, step=step)
    except ValueError as error:
        raise ConversionError(f"{source}: {error}") from error
    return record, values, nones, step_dtype


def index_from_state_dict(
    osd: Mapping[str, Any], *, source: str, options: FormatOptions, spec_of: SpecOf
) -> tuple[StateIndex, dict[tuple[str, str], Any]]:
    """The index of a ``state``/``param_groups`` mapping, and each state value by
    ``(name, key)``. Step values must be concrete (tensors or numbers) in ``osd``."""
    groups_raw = osd.get("param_groups")
    state_raw = osd.get("state")
    if not isinstance(groups_raw, (list, tuple)) or not isinstance(state_raw, Mapping):
        raise ConversionError(f"{source}: not an optimizer state dict (state, param_groups)")
    keys = [key for group in groups_raw for key in group.get("params", [])]
    names, index_names = _param_names(keys, options, source)
    unknown = [key for key in state_raw if key not in names]
    if unknown:
        raise ConversionError(
            f"{source}: state for parameter {unknown[0]!r}, which no param group lists"
        )
    params: list[ParamRecord] = []
    groups: list[GroupRecord] = []
    values: dict[tuple[str, str], Any] = {}
    nones: dict[str, list[str]] = {}
    group_steps: list[float | None] = []
    step_dtypes: set[torch.dtype] = set()
    for number, group in enumerate(groups_raw):
        group_step = group.get("step")
        group_steps.append(None if group_step is None else _step_number(group_step, source))
        members = [names[key] for key in group.get("params", [])]
        for key in group.get("params", []):
            record, found, none_keys, step_dtype = _param_record(
                key, names[key], number, state_raw.get(key, {}), spec_of, source
            )
            if record.step is None and record.state and group_steps[-1] is not None:
                record = ParamRecord(
                    record.name, number, record.shape, record.state, group_steps[-1]
                )
            params.append(_checked_shape(record, options, names, key, source))
            values.update({(record.name, k): v for k, v in found.items()})
            if none_keys:
                nones[record.name] = none_keys
            if step_dtype is not None:
                step_dtypes.add(step_dtype)
        options_out = {k: v for k, v in group.items() if k not in ("params", "step")}
        groups.append(GroupRecord(options=options_out, names=members))
    flavour: Flavour = "precision-aware" if any(s is not None for s in group_steps) else "torch"
    notes: dict[str, Any] = {NOTE_FLAVOUR: flavour, NOTE_INDEX_NAMES: index_names}
    if flavour == "precision-aware":
        notes[NOTE_GROUP_STEPS] = tuple(group_steps)
    if len(step_dtypes) == 1:
        notes[NOTE_STEP_DTYPE] = step_dtypes.pop()
    if nones:
        notes[NOTE_NONE_STATES] = nones
    try:
        index = StateIndex(params=params, groups=groups, source=source, notes=notes)
    except ValueError as error:
        raise ConversionError(f"{source}: {error}") from error
    return index, values


def _checked_shape(
    record: ParamRecord, options: FormatOptions, names: Mapping[Any, str], key: Any, source: str
) -> ParamRecord:
    if options.shapes is None or options.names is None:
        return record
    expected = options.shapes[list(options.names).index(record.name)]
    if record.state and record.shape != expected:
        raise ConversionError(
            f"{source}: parameter {record.name!r} (index {key}) has state of shape "
            f"{record.shape}, the named parameter {expected}: the names are not this "
            "optimizer's parameters in its order"
        )
    if not record.state:
        return ParamRecord(record.name, record.group, expected, record.state, record.step)
    return record


def _destination_order(index: StateIndex, names: Sequence[str] | None) -> list[list[str]]:
    """Each group's members, ordered as ``names`` orders them (the destination optimizer's
    parameter order, which must run through the groups in their order)."""
    groups = [list(group.names) for group in index.groups]
    if names is None:
        return groups
    position = {name: i for i, name in enumerate(names)}
    held = {name for group in groups for name in group}
    missing = [name for name in held if name not in position]
    if missing or len(held) != len(position):
        absent = missing[0] if missing else next(n for n in names if n not in held)
        where = "the names list" if missing else "the optimizer state"
        raise ConversionError(
            f"{index.source}: parameter {absent!r} is missing from {where}; the names must "
            "be the checkpoint's parameters, once each"
        )
    ordered = [sorted(group, key=position.__getitem__) for group in groups]
    flat = [name for group in ordered for name in group]
    if flat != list(names):
        raise ConversionError(
            f"{index.source}: the names list interleaves the param groups' members; list "
            "them group by group, as the destination optimizer holds them"
        )
    return ordered


def _common_step(index: StateIndex, number: int, members: Sequence[str]) -> float | None:
    steps = {index.param(name).step for name in members} - {None}
    if len(steps) > 1:
        raise ConversionError(
            f"{index.source}: param group {number} holds parameters at different steps "
            f"({sorted(s for s in steps if s is not None)}); the precision-aware layout keeps "
            "one step per group"
        )
    if steps:
        return steps.pop()
    recorded = index.notes.get(NOTE_GROUP_STEPS)
    if isinstance(recorded, tuple) and number < len(recorded):
        return recorded[number]
    return None


def _group_step_value(step: float) -> int | float:
    return int(step) if float(step).is_integer() else step


def state_dict_from_index(
    index: StateIndex,
    *,
    flavour: Flavour,
    keyed_by_name: bool,
    value_of: Callable[[ParamRecord, str, TensorSpec], Any],
    names: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The ``state``/``param_groups`` mapping of ``index`` with ``value_of(param, key, spec)``
    for every state tensor, keyed by names or by index (in the destination's order)."""
    if keyed_by_name and index.notes.get(NOTE_INDEX_NAMES):
        raise ConversionError(
            f"{index.source}: keeps its parameters by index; a name-keyed format needs their "
            "names: pass names= or model= (CLI: --names FILE or --model MODULE:CALLABLE)"
        )
    order = _destination_order(index, names)
    flat = [name for group in order for name in group]
    key_of = {name: (name if keyed_by_name else i) for i, name in enumerate(flat)}
    step_dtype = index.notes.get(NOTE_STEP_DTYPE, torch.float32)
    nones = index.notes.get(NOTE_NONE_STATES, {})
    state: dict[Any, dict[str, Any]] = {}
    for name in flat:
        param = index.param(name)
        entries: dict[str, Any] = {}
        if flavour == "torch" and param.step is not None:
            entries["step"] = torch.tensor(param.step, dtype=step_dtype)
        for key, spec in param.state.items():
            entries[MASTER_PARAM if key == MASTER else key] = value_of(param, key, spec)
        for key in nones.get(name, ()):
            entries[key] = None
        if entries:
            state[key_of[name]] = entries
    groups: list[dict[str, Any]] = []
    for number, (group, members) in enumerate(zip(index.groups, order, strict=True)):
        options = dict(group.options)
        if flavour == "precision-aware":
            step = _common_step(index, number, members)
            if step is not None:
                options["step"] = _group_step_value(step)
        options["params"] = [key_of[name] for name in members]
        groups.append(options)
    return {"state": state, "param_groups": groups}


def nbytes(spec: TensorSpec) -> int:
    """Bytes of a tensor of ``spec``."""
    return math.prod(spec.shape) * torch.empty((), dtype=spec.dtype).element_size()
