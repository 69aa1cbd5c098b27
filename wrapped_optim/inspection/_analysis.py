"""Finding the optimizer state dicts in a checkpoint and telling their format."""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from wrapped_optim._formats.checkpoint_files import read_torch_save
from wrapped_optim._formats.errors import InspectError
from wrapped_optim.inspection._model import (
    _FLAT_MARK,
    _SEARCH_DEPTH,
    CheckpointReport,
    Fetch,
    OptimizerReport,
    ParamGroupReport,
    StateFormat,
    StateTensor,
    _by_name,
    _dtype_name,
    _no_fetch,
    _option_text,
    _Pending,
    _shape_text,
    _TensorInfo,
)
from wrapped_optim.inspection._readers import _dcp_fetcher, _read_dcp


def inspect_checkpoint(path: str | os.PathLike[str], *, trusted: bool = False) -> CheckpointReport:
    """Describes the optimizer state in a ``torch.save`` file or a DCP checkpoint directory.

    Every optimizer state dict in the checkpoint is reported — at the top level or inside
    containers such as ``{"model": ..., "optim": ...}`` — with its detected format, every
    per-parameter state tensor (dtype, shape, bytes), its step counters and its param groups.

    A DCP directory is described from its metadata and the few small values a report shows;
    a ``torch.save`` file is opened memory-mapped with ``weights_only=True``.

    Args:
        path: A ``torch.save`` file or a DCP checkpoint directory.
        trusted: Let torch unpickle other objects (Megatron's ``args``, RNG states) in a
            checkpoint you trust; by default nothing pickled is executed.

    Returns:
        One ``OptimizerReport`` per optimizer state dict found, with the file's kind and size.

    Raises:
        InspectError: the path does not exist, is neither a ``torch.save`` file nor a DCP
            directory, cannot be read with ``weights_only`` (and ``trusted`` is off), or holds
            no optimizer state dict (a mapping with ``state`` and ``param_groups``).

    Examples:
        >>> import tempfile, torch, warnings
        >>> import torch.distributed.checkpoint as dcp
        >>> from wrapped_optim.inspection import inspect_checkpoint
        >>> p = torch.nn.Parameter(torch.zeros(2, 3))
        >>> opt = torch.optim.AdamW([p])
        >>> p.grad = torch.ones(2, 3)
        >>> opt.step()
        >>> with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")  # DCP notes that it runs without a process group
        ...     _ = dcp.save(opt.state_dict(), checkpoint_id=tmp, no_dist=True)
        ...     report = inspect_checkpoint(tmp)
        >>> report.kind, report.optimizers[0].steps
        ('dcp', (1,))
        >>> sorted({t.name for t in report.optimizers[0].tensors})
        ['exp_avg', 'exp_avg_sq', 'step']
    """
    path = Path(path)
    if not path.exists():
        raise InspectError(f"{path}: no such file or directory")
    kind: Literal["torch.save", "dcp"]
    if path.is_dir():
        tree, fetch, kind = _read_dcp(path, trusted), _dcp_fetcher(path, trusted), "dcp"
        file_bytes = _regular_file_bytes(path)
    elif path.is_file():
        tree, fetch, kind = read_torch_save(path, trusted), _no_fetch, "torch.save"
        file_bytes = path.stat().st_size
    else:
        raise InspectError(f"{path}: neither a regular file nor a directory")

    found = list(_find_optimizer_state_dicts(tree, "", _SEARCH_DEPTH))
    if not found:
        raise InspectError(
            f"{path}: no optimizer state dict found (looked for a mapping with 'state' and "
            f"'param_groups' entries); {_describe_top_level(tree)}"
        )
    _resolve_needed_values(found, fetch)
    optimizers = tuple(_analyse(location, osd) for location, osd in found)
    return CheckpointReport(path=path, kind=kind, file_bytes=file_bytes, optimizers=optimizers)


def _regular_file_bytes(directory: Path) -> int:
    """The bytes of the regular files under ``directory`` (symlinks are not followed)."""
    total = 0
    for root, _, names in os.walk(directory):
        for name in names:
            st = os.lstat(os.path.join(root, name))
            total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


def _is_optimizer_state_dict(node: Any) -> bool:
    return (
        isinstance(node, Mapping)
        and isinstance(node.get("state"), Mapping)
        and isinstance(node.get("param_groups"), (list, tuple))
    )


def _is_flat_optimizer_state_dict(node: Any) -> bool:
    """torch's ``flatten_optimizer_state_dict`` layout: ``state.<fqn>.<name>`` and
    ``param_groups.<fqn>.<option>`` keys (what torchtitan-style DCP checkpoints hold)."""
    if not isinstance(node, Mapping):
        return False
    keys = [k for k in node if isinstance(k, str)]
    return any(k.startswith("state.") for k in keys) and any(
        k.startswith("param_groups.") for k in keys
    )


def _unflatten_optimizer_state_dict(node: Mapping[str, Any]) -> dict[str, Any]:
    state: dict[str, dict[str, Any]] = {}
    options: dict[str, dict[str, Any]] = {}
    for key, value in node.items():
        if not isinstance(key, str) or "." not in key:
            continue
        section, _, rest = key.partition(".")
        fqn, _, name = rest.rpartition(".")
        if section == "state" and fqn:
            state.setdefault(fqn, {})[name] = value
        elif section == "param_groups" and fqn:
            options.setdefault(fqn, {})[name] = value
    groups = [{"params": [fqn], **opts} for fqn, opts in options.items()]
    return {"state": state, "param_groups": groups, _FLAT_MARK: True}


def _find_optimizer_state_dicts(node: Any, location: str, depth: int) -> Iterator[tuple[str, Any]]:
    if _is_optimizer_state_dict(node):
        yield location, node
        return
    if _is_flat_optimizer_state_dict(node):
        yield location, _unflatten_optimizer_state_dict(node)
        return
    if depth == 0:
        return
    if isinstance(node, Mapping):
        for key, value in node.items():
            child = f"{location}.{key}" if location else str(key)
            yield from _find_optimizer_state_dicts(value, child, depth - 1)
    elif isinstance(node, (list, tuple)):
        for index, value in enumerate(node):
            yield from _find_optimizer_state_dicts(value, f"{location}[{index}]", depth - 1)


def _describe_top_level(tree: Any) -> str:
    if isinstance(tree, Mapping):
        keys = [str(k) for k in list(tree)[:8]]
        more = ", ..." if len(tree) > 8 else ""
        return f"top-level keys: {', '.join(keys)}{more}" if keys else "it is an empty mapping"
    if isinstance(tree, torch.Tensor):
        return f"it holds a single tensor ({_dtype_name(tree.dtype)}, {_shape_text(tree.shape)})"
    return f"it holds a {type(tree).__name__}"


def _state_entries(osd: Mapping[str, Any]) -> Iterator[tuple[str, str, Any]]:
    for param, states in osd["state"].items():
        if isinstance(states, Mapping):
            for name, value in states.items():
                yield str(param), str(name), value


def _resolve_needed_values(found: list[tuple[str, Any]], fetch: Fetch) -> None:
    """Reads the values a report shows (steps, param-group options) that are still pending."""
    wanted: list[str] = []
    for _, osd in found:
        for _, name, value in _state_entries(osd):
            if name == "step" and isinstance(value, _TensorInfo) and value.key is not None:
                if math.prod(value.shape) == 1:
                    wanted.append(value.key)
            elif isinstance(value, _Pending) and name == "step":
                wanted.append(value.key)
        wanted.extend(_pending_keys(osd["param_groups"]))
    values = fetch(wanted) if wanted else {}
    for _, osd in found:
        for states in osd["state"].values():
            if isinstance(states, dict):
                for name, value in list(states.items()):
                    key = value.key if isinstance(value, (_TensorInfo, _Pending)) else None
                    if key in values:
                        states[name] = values[key]
        osd["param_groups"] = _substitute(osd["param_groups"], values)


def _pending_keys(node: Any) -> Iterator[str]:
    if isinstance(node, _Pending):
        yield node.key
    elif isinstance(node, _TensorInfo) and node.key is not None and math.prod(node.shape) == 1:
        yield node.key  # a tensor lr or step inside a param group
    elif isinstance(node, Mapping):
        for value in node.values():
            yield from _pending_keys(value)
    elif isinstance(node, (list, tuple)):
        for value in node:
            yield from _pending_keys(value)


def _substitute(node: Any, values: Mapping[str, Any]) -> Any:
    if isinstance(node, (_Pending, _TensorInfo)) and node.key is not None and node.key in values:
        return values[node.key]
    if isinstance(node, Mapping):
        return {k: _substitute(v, values) for k, v in node.items()}
    if isinstance(node, list):
        return [_substitute(v, values) for v in node]
    return node


def _tensor_info(value: Any) -> _TensorInfo | None:
    if isinstance(value, _TensorInfo):
        return value
    if isinstance(value, torch.Tensor):
        return _TensorInfo(value.dtype, tuple(value.shape))
    return None


def _number(value: Any) -> int | float | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value) if float(value).is_integer() else float(value)


def _analyse(location: str, osd: Mapping[str, Any]) -> OptimizerReport:
    tensors: list[StateTensor] = []
    notes: list[str] = []
    per_param_steps: list[int | float] = []
    params_with_step: set[str] = set()
    for param, name, value in _state_entries(osd):
        info = _tensor_info(value)
        if name == "step":
            params_with_step.add(param)
            number = _number(value)
            if number is not None:
                per_param_steps.append(number)
        if info is not None:
            tensors.append(StateTensor(param, name, info.dtype, info.shape, info.nbytes))
        elif name != "step":
            notes.append(f"param {param}: state {name!r} is a {type(value).__name__}, not a tensor")

    group_options: list[tuple[int, tuple[tuple[str, str], ...]]] = []
    group_steps: list[int | float] = []
    for index, group in enumerate(osd["param_groups"]):
        if isinstance(group, Mapping):
            params = group.get("params", [])
            options = tuple((str(k), _option_text(v)) for k, v in group.items() if k != "params")
            group_options.append((len(params), options))
            step = _number(group.get("step"))
            if step is not None:
                group_steps.append(step)
        else:
            notes.append(f"param group {index} is a {type(group).__name__}, not a mapping")
    if osd.get(_FLAT_MARK):
        # The flattened layout repeats each group's options per parameter: params with equal
        # options are reported as one group, in first-seen order.
        merged: dict[tuple[tuple[str, str], ...], int] = {}
        for count, options in group_options:
            merged[options] = merged.get(options, 0) + count
        group_options = [(count, options) for options, count in merged.items()]
        notes.append("flattened optimizer state dict: groups rebuilt from per-parameter options")
    groups = [
        ParamGroupReport(index, count, options)
        for index, (count, options) in enumerate(group_options)
    ]

    if per_param_steps:
        steps, source = tuple(sorted(set(per_param_steps))), "per-parameter"
    elif group_steps:
        steps, source = tuple(sorted(set(group_steps))), "param_groups"
    else:
        steps, source = (), "none"
    if len(steps) > 1:
        notes.append(f"step counters differ across {source} entries: {list(steps)}")

    fmt = _detect_format(tensors, params_with_step, bool(group_steps), notes)
    return OptimizerReport(
        location=location,
        format=fmt,
        tensors=tuple(tensors),
        steps=steps,
        step_source=source,  # type: ignore[arg-type]
        param_groups=tuple(groups),
        notes=tuple(notes),
    )


def _detect_format(
    tensors: list[StateTensor], params_with_step: set[str], group_step: bool, notes: list[str]
) -> StateFormat:
    if not tensors and not params_with_step:
        return StateFormat.EMPTY
    by_name = _by_name(tensors)
    masters = by_name.get("master_param", [])
    moments = by_name.get("exp_avg", []) + by_name.get("exp_avg_sq", [])
    if any(t.dtype == torch.int16 for t in masters):
        if any(t.dtype != torch.int16 for t in masters):
            notes.append("master_param mixes int16 remainders and other dtypes")
        _note_non_fp32(moments, notes)
        return StateFormat.REMAINDER_MASTERS
    if moments and not params_with_step and group_step:
        _note_non_fp32(moments + masters, notes)
        return StateFormat.PRECISION_AWARE
    if moments and not params_with_step:
        notes.append("Adam moments without any step counter (neither per parameter nor in groups)")
    if masters:
        notes.append("master_param present beside per-parameter steps (e.g. a hybrid offload)")
    floating = {t.dtype for t in tensors if t.dtype.is_floating_point and t.name != "step"}
    if floating - {torch.float32}:
        kinds = ", ".join(sorted(_dtype_name(d) for d in floating))
        notes.append(f"state is not all FP32 (dtypes: {kinds})")
    return StateFormat.TORCH


def _note_non_fp32(entries: list[StateTensor], notes: list[str]) -> None:
    odd = sorted({f"{t.name}:{_dtype_name(t.dtype)}" for t in entries if t.dtype != torch.float32})
    if odd:
        notes.append(f"expected FP32 expansions, found {', '.join(odd)}")
