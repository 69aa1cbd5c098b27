"""What is inside an optimizer checkpoint, without an optimizer to load it into.

Questions like "did this run save bf16 or FP32 moments?", "is this TE's portable format or
torch's?", "which step was it saved at?" come up whenever a checkpoint moves between stacks.
:func:`inspect_checkpoint` answers them for ``torch.save`` files and for
``torch.distributed.checkpoint`` (DCP) directories; :func:`format_report` renders the answer.

A DCP directory is described from its metadata alone (dtypes and shapes are recorded there);
only the few small values a report shows — scalar step counters and param-group options — are
read from its data files. A ``torch.save`` file is opened memory-mapped with
``weights_only=True``: nothing in it is executed and tensor data is paged in only when read.
Checkpoints that pickle other objects (Megatron's ``args`` namespace, RNG states) need
``trusted=True`` (``--trust`` on the command line), which lets torch unpickle them.

Detected formats (see :class:`StateFormat`):

- torch optimizer state: per-parameter ``step`` tensors beside the moments (``torch.optim``);
- precision-aware FP32-expanded state: TE FusedAdam's portable format (and
  ``PrecisionAwareAdamW``'s): FP32 ``exp_avg`` / ``exp_avg_sq`` (and FP32 ``master_param``
  with master weights), the step counter in ``param_groups``;
- remainder masters: the same with an int16 ``master_param`` holding the low 16 bits of each
  FP32 master beside bf16 params (``store_param_remainders``).
"""

from __future__ import annotations

import enum
import math
import os
import pickle
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import torch

__all__ = [
    "CheckpointReport",
    "InspectError",
    "OptimizerReport",
    "ParamGroupReport",
    "StateFormat",
    "StateTensor",
    "format_report",
    "inspect_checkpoint",
]

# Marks a state dict rebuilt from the flattened layout, whose groups are one per parameter.
_FLAT_MARK = "__wrapped_optim_flattened__"

# How deep to look for optimizer state dicts inside a checkpoint's containers
# ({"optim": ...}, {"optimizer": {"optimizer": ...}}, a ChainedOptimizer's list, ...).
_SEARCH_DEPTH = 4


class InspectError(ValueError):
    """The path is not something :func:`inspect_checkpoint` can describe.

    Raised for a path that does not exist, a file that is not a ``torch.save`` file, a
    directory that is not a DCP checkpoint, and a checkpoint without an optimizer state dict.

    Example:
        >>> from wrapped_optim.inspection import InspectError, inspect_checkpoint
        >>> try:
        ...     inspect_checkpoint("/no/such/checkpoint.pt")
        ... except InspectError as error:
        ...     print(error)
        /no/such/checkpoint.pt: no such file or directory
    """


class StateFormat(enum.Enum):
    """The layout an optimizer state dict was written in.

    Example:
        >>> from wrapped_optim.inspection import StateFormat
        >>> StateFormat.PRECISION_AWARE.value
        'precision-aware FP32-expanded state (TE FusedAdam portable format)'
    """

    TORCH = "torch optimizer state"
    PRECISION_AWARE = "precision-aware FP32-expanded state (TE FusedAdam portable format)"
    REMAINDER_MASTERS = "precision-aware state with remainder masters (int16 master_param)"
    EMPTY = "no per-parameter state (the optimizer has not stepped yet)"


@attrs.frozen
class StateTensor:
    """One tensor of per-parameter optimizer state.

    Attributes:
        param: the parameter's key in ``state`` (an index, or a name in DCP checkpoints).
        name: the state's name (``exp_avg``, ``step``, ``master_param``, ...).
        dtype: its dtype as saved.
        shape: its shape as saved (the global shape for a sharded DCP tensor).
        nbytes: its size in bytes.

    Example:
        >>> import torch
        >>> from wrapped_optim.inspection import StateTensor
        >>> StateTensor("0", "exp_avg", torch.bfloat16, (4, 8), 64).nbytes
        64
    """

    param: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


@attrs.frozen
class ParamGroupReport:
    """One parameter group: how many params it holds and its options.

    Attributes:
        index: the group's position in ``param_groups``.
        num_params: the length of its ``params`` list.
        options: every other entry as ``(name, repr(value))``, in saved order.

    Example:
        >>> from wrapped_optim.inspection import ParamGroupReport
        >>> group = ParamGroupReport(0, 2, (("lr", "0.001"),))
        >>> group.option("lr")
        '0.001'
    """

    index: int
    num_params: int
    options: tuple[tuple[str, str], ...]

    def option(self, name: str) -> str | None:
        """The repr of option ``name``, or None when the group has no such option.

        Example:
            >>> from wrapped_optim.inspection import ParamGroupReport
            >>> print(ParamGroupReport(0, 1, (("lr", "0.1"),)).option("eps"))
            None
        """
        return dict(self.options).get(name)


@attrs.frozen
class OptimizerReport:
    """One optimizer state dict found in a checkpoint.

    Attributes:
        location: where it sits in the checkpoint (``""`` for the top level, else a path such
            as ``optim`` or ``[1]``).
        format: the detected :class:`StateFormat`.
        tensors: every per-parameter state tensor, in saved order.
        steps: the distinct step counters found (per-parameter ``step`` states, else the
            ``step`` option of the param groups), ascending.
        step_source: ``"per-parameter"``, ``"param_groups"`` or ``"none"``.
        param_groups: one report per group.
        notes: anything unusual worth a reader's attention.

    Example:
        >>> import torch
        >>> from wrapped_optim.inspection import OptimizerReport, StateFormat, StateTensor
        >>> report = OptimizerReport(
        ...     location="", format=StateFormat.TORCH,
        ...     tensors=(StateTensor("0", "exp_avg", torch.float32, (2,), 8),),
        ...     steps=(1,), step_source="per-parameter", param_groups=(), notes=())
        >>> report.total_bytes, report.num_params
        (8, 1)
    """

    location: str
    format: StateFormat
    tensors: tuple[StateTensor, ...]
    steps: tuple[int | float, ...]
    step_source: Literal["per-parameter", "param_groups", "none"]
    param_groups: tuple[ParamGroupReport, ...]
    notes: tuple[str, ...]

    @property
    def total_bytes(self) -> int:
        """Bytes of all per-parameter state tensors together, as saved (not FP32-expanded).

        Example:
            >>> import torch
            >>> from wrapped_optim.inspection import OptimizerReport, StateFormat, StateTensor
            >>> OptimizerReport("", StateFormat.TORCH, (
            ...     StateTensor("0", "exp_avg", torch.bfloat16, (4,), 8),
            ...     StateTensor("0", "exp_avg_sq", torch.float32, (4,), 16),
            ... ), (), "none", (), ()).total_bytes
            24
        """
        return sum(t.nbytes for t in self.tensors)

    @property
    def num_params(self) -> int:
        """How many parameters have state; a parameter never stepped has none and is not counted.

        Example:
            >>> import torch
            >>> from wrapped_optim.inspection import OptimizerReport, StateFormat, StateTensor
            >>> OptimizerReport("", StateFormat.TORCH, (
            ...     StateTensor("0", "exp_avg", torch.float32, (2,), 8),
            ...     StateTensor("0", "exp_avg_sq", torch.float32, (2,), 8),
            ...     StateTensor("1", "exp_avg", torch.float32, (3,), 12),
            ... ), (), "none", (), ()).num_params
            2
        """
        return len({t.param for t in self.tensors})

    @property
    def description(self) -> str:
        """The format with the floating dtypes of its state (steps excluded).

        Example:
            >>> import torch
            >>> from wrapped_optim.inspection import OptimizerReport, StateFormat, StateTensor
            >>> OptimizerReport("", StateFormat.TORCH,
            ...     (StateTensor("0", "exp_avg", torch.float32, (2,), 8),),
            ...     (), "none", (), ()).description
            'torch optimizer state; floating state FP32'
        """
        floating = {t.dtype for t in self.tensors if t.dtype.is_floating_point and t.name != "step"}
        if not floating:
            return self.format.value
        if floating == {torch.float32}:
            return f"{self.format.value}; floating state FP32"
        kinds = ", ".join(sorted(map(_dtype_name, floating)))
        return f"{self.format.value}; floating state {kinds}"


@attrs.frozen
class CheckpointReport:
    """Everything :func:`inspect_checkpoint` found in one checkpoint.

    Attributes:
        path: the inspected file or directory.
        kind: ``"torch.save"`` or ``"dcp"``.
        file_bytes: its size on disk (all files, for a DCP directory).
        optimizers: one report per optimizer state dict found (at least one).

    Example:
        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> from wrapped_optim.inspection import inspect_checkpoint
        >>> p = torch.nn.Parameter(torch.zeros(3))
        >>> opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
        >>> p.grad = torch.ones(3)
        >>> opt.step()
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     torch.save({"optim": opt.state_dict()}, Path(tmp) / "ckpt.pt")
        ...     report = inspect_checkpoint(Path(tmp) / "ckpt.pt")
        >>> report.kind, report.formats
        ('torch.save', ('torch optimizer state',))
        >>> [(t.name, t.dtype, t.shape) for t in report.optimizers[0].tensors]
        [('momentum_buffer', torch.float32, (3,))]
    """

    path: Path
    kind: Literal["torch.save", "dcp"]
    file_bytes: int
    optimizers: tuple[OptimizerReport, ...]

    @property
    def formats(self) -> tuple[str, ...]:
        """The detected format of each optimizer state dict, as text (for printing or matching).

        Example:
            >>> from pathlib import Path
            >>> from wrapped_optim.inspection import CheckpointReport, OptimizerReport, StateFormat
            >>> empty = OptimizerReport("optim", StateFormat.EMPTY, (), (), "none", (), ())
            >>> CheckpointReport(Path("ckpt.pt"), "torch.save", 0, (empty,)).formats
            ('no per-parameter state (the optimizer has not stepped yet)',)
        """
        return tuple(o.format.value for o in self.optimizers)


# --------------------------------------------------------------------------- value model
# Both sources are turned into one nested structure of dicts and lists whose leaves are
# _TensorInfo (a tensor's dtype and shape) or values. DCP leaves that a report needs are read
# through `fetch`; a torch.save file provides every value directly.


@attrs.frozen
class _TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    key: str | None = None  # the DCP key, to read its value when needed

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


@attrs.frozen
class _Pending:
    """A non-tensor DCP entry whose value has not been read yet."""

    key: str


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


Fetch = Callable[[Sequence[str]], dict[str, Any]]


def _no_fetch(keys: Sequence[str]) -> dict[str, Any]:
    raise AssertionError(f"nothing to fetch from a loaded file (asked for {list(keys)})")


# --------------------------------------------------------------------------- public API


def inspect_checkpoint(path: str | os.PathLike[str], *, trusted: bool = False) -> CheckpointReport:
    """Describes the optimizer state in a ``torch.save`` file or a DCP checkpoint directory.

    Every optimizer state dict in the checkpoint is reported — at the top level or inside
    containers such as ``{"model": ..., "optim": ...}`` — with its detected format, every
    per-parameter state tensor (dtype, shape, bytes), its step counters and its param groups.

    By default nothing pickled in the checkpoint is executed (``weights_only=True``); pass
    ``trusted=True`` for a checkpoint you trust that pickles other objects.

    Raises:
        InspectError: the path does not exist, is neither a ``torch.save`` file nor a DCP
            directory, cannot be read with ``weights_only`` (and ``trusted`` is off), or holds
            no optimizer state
            dict (a mapping with ``state`` and ``param_groups``).

    Example:
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
        tree, fetch, kind = _read_dcp(path), _dcp_fetcher(path, trusted), "dcp"
        file_bytes = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    elif path.is_file():
        tree, fetch, kind = _read_torch_save(path, trusted), _no_fetch, "torch.save"
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


def format_report(report: CheckpointReport, *, per_param: bool = True) -> str:
    """Renders a :class:`CheckpointReport` as plain text for a terminal.

    With ``per_param=False`` only the per-state summary is shown (one line per state name),
    which keeps the output short for models with thousands of parameters.

    Example:
        >>> import torch
        >>> from pathlib import Path
        >>> from wrapped_optim.inspection import (CheckpointReport, OptimizerReport,
        ...     ParamGroupReport, StateFormat, StateTensor, format_report)
        >>> opt = OptimizerReport(
        ...     location="", format=StateFormat.PRECISION_AWARE,
        ...     tensors=(StateTensor("0", "exp_avg", torch.float32, (2, 2), 16),
        ...              StateTensor("0", "exp_avg_sq", torch.float32, (2, 2), 16)),
        ...     steps=(7,), step_source="param_groups",
        ...     param_groups=(ParamGroupReport(0, 1, (("lr", "0.001"), ("step", "7"))),),
        ...     notes=())
        >>> text = format_report(CheckpointReport(Path("ckpt.pt"), "torch.save", 900, (opt,)))
        >>> print(text.splitlines()[0])
        ckpt.pt: torch.save file, 900 B on disk, 1 optimizer state dict
        >>> "steps: 7 (param_groups)" in text
        True
    """
    count = len(report.optimizers)
    kind = "torch.save file" if report.kind == "torch.save" else "DCP checkpoint directory"
    lines = [
        f"{report.path}: {kind}, {_human_bytes(report.file_bytes)} on disk, "
        f"{count} optimizer state dict{'' if count == 1 else 's'}"
    ]
    for opt in report.optimizers:
        lines.append("")
        where = opt.location or "(top level)"
        lines.append(f"optimizer state at {where}")
        lines.append(f"  format: {opt.description}")
        lines.append(
            f"  state: {opt.num_params} params, {len(opt.tensors)} tensors, "
            f"{_human_bytes(opt.total_bytes)}"
        )
        if opt.steps:
            lines.append(f"  steps: {', '.join(map(str, opt.steps))} ({opt.step_source})")
        else:
            lines.append("  steps: none recorded")
        lines.extend(f"  note: {note}" for note in opt.notes)
        if opt.tensors:
            lines.append("  per state name:")
            rows: list[tuple[str, ...]] = [("name", "count", "dtypes", "bytes")]
            for name, entries in _by_name(opt.tensors).items():
                dtypes = ", ".join(sorted({_dtype_name(t.dtype) for t in entries}))
                rows.append(
                    (name, str(len(entries)), dtypes, _human_bytes(sum(t.nbytes for t in entries)))
                )
            lines.extend("    " + line for line in _table(rows))
        if per_param and opt.tensors:
            lines.append("  per parameter:")
            rows = [("param", "state", "dtype", "shape", "bytes")]
            rows += [
                (t.param, t.name, _dtype_name(t.dtype), _shape_text(t.shape), str(t.nbytes))
                for t in opt.tensors
            ]
            lines.extend("    " + line for line in _table(rows))
        lines.append(f"  param groups: {len(opt.param_groups)}")
        for group in opt.param_groups:
            options = ", ".join(f"{k}={v}" for k, v in group.options)
            lines.append(f"    [{group.index}] {group.num_params} params; {options}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- readers


def _read_torch_save(path: Path, trusted: bool) -> Any:
    def load(mmap: bool) -> Any:
        return torch.load(path, map_location="cpu", weights_only=not trusted, mmap=mmap)

    try:
        try:
            return load(mmap=True)
        except RuntimeError as error:
            # mmap needs the zip format; files written with _use_new_zipfile_serialization=False
            # (or truncated ones, which then fail again below) are read without it.
            if "mmap" not in str(error) and "zip" not in str(error).lower():
                raise
            return load(mmap=False)
    except pickle.UnpicklingError as error:
        text = str(error)
        found = re.search(r"Unsupported global: (?:GLOBAL )?(\S+)", text)
        if found:
            raise InspectError(
                f"{path}: holds a {found.group(1)} object, which cannot be loaded with "
                "weights_only=True; inspection runs no pickled code unless told the file is "
                "trusted (--trust, or trusted=True)"
            ) from error
        detail = re.search(r"WeightsUnpickler error:\s*(.+)", text)
        reason = detail.group(1).strip() if detail else text.strip().splitlines()[0]
        raise InspectError(f"{path}: not a torch.save file ({reason})") from error
    except Exception as error:  # torch.load fails in many ways on non-checkpoints
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise InspectError(
            f"{path}: not a readable torch.save file ({type(error).__name__}: {first})"
        ) from error


def _read_dcp(path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not (path / ".metadata").is_file():
        raise InspectError(
            f"{path}: a directory but not a torch.distributed.checkpoint checkpoint "
            "(no .metadata file)"
        )
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as error:  # any failure to parse is a bad checkpoint, not a bug here
        raise InspectError(f"{path}: unreadable DCP metadata ({error})") from error

    planner_data = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    tree: dict[Any, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        route = planner_data.get(key)
        route = tuple(route) if isinstance(route, (tuple, list)) and route else (key,)
        if isinstance(entry, TensorStorageMetadata):
            leaf: Any = _TensorInfo(entry.properties.dtype, tuple(entry.size), key)
        else:
            leaf = _Pending(key)
        _insert(tree, route, leaf)
    return _lists_from_int_keys(tree)


def _insert(tree: dict[Any, Any], route: tuple[Any, ...], leaf: Any) -> None:
    node = tree
    for part in route[:-1]:
        node = node.setdefault(part, {})
    node[route[-1]] = leaf


def _lists_from_int_keys(node: Any) -> Any:
    """DCP records list positions as int route parts; turn such dicts back into lists."""
    if not isinstance(node, dict):
        return node
    converted = {k: _lists_from_int_keys(v) for k, v in node.items()}
    keys = list(converted)
    if keys and all(isinstance(k, int) for k in keys) and sorted(keys) == list(range(len(keys))):
        return [converted[i] for i in range(len(keys))]
    return converted


def _dcp_fetcher(path: Path, trusted: bool) -> Fetch:
    def fetch(keys: Sequence[str]) -> dict[str, Any]:
        if not keys:
            return {}
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        read_objects: dict[str, Any] = {}

        class _SafeBytesPlanner(DefaultLoadPlanner):
            # DCP unpickles non-tensor entries with weights_only=False; inspection does not
            # execute code from a checkpoint. (dcp.load hands the planner a copy of the dict,
            # so objects are collected here; tensors are filled in place.)
            def load_bytes(self, read_item: Any, value: Any) -> None:
                read_objects[read_item.dest_index.fqn] = torch.load(value, weights_only=not trusted)

        reader = FileSystemReader(str(path))
        metadata = reader.read_metadata()
        target: dict[str, Any] = {}
        for key in keys:
            entry = metadata.state_dict_metadata[key]
            if isinstance(entry, TensorStorageMetadata):
                target[key] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
            else:
                target[key] = None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(
                    target,
                    storage_reader=reader,
                    planner=_SafeBytesPlanner(flatten_state_dict=False),
                    no_dist=True,
                )
        except Exception as error:
            raise InspectError(
                f"{path}: could not read values {list(keys)[:3]}: {error}"
            ) from error
        target.update(read_objects)
        return target

    return fetch


# --------------------------------------------------------------------------- analysis


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


# --------------------------------------------------------------------------- formatting


def _by_name(tensors: Sequence[StateTensor]) -> dict[str, list[StateTensor]]:
    grouped: dict[str, list[StateTensor]] = {}
    for t in tensors:
        grouped.setdefault(t.name, []).append(t)
    return grouped


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _shape_text(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _option_text(value: Any) -> str:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return f"tensor({value.item()!r})"
    if isinstance(value, _TensorInfo):
        return f"tensor({_dtype_name(value.dtype)}, {_shape_text(value.shape)})"
    if isinstance(value, _Pending):
        return "<not read>"
    return repr(value)


def _human_bytes(count: int) -> str:
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{count} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
