"""torch.distributed.checkpoint (DCP) directories of optimizer state, without a process group.

Three layouts are read and written:

* ``dcp``: what ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` returns
  (FSDP2, plain models): ``state.<fqn>.<key>`` tensors and a ``param_groups`` list naming
  parameters by fully qualified name, at the top level or under a key (``{"optim": ...}``);
* ``dcp-flat``: the same flattened by ``StateDictOptions(flatten_optimizer_state_dict=True)``
  (torchtitan): ``param_groups.<fqn>.<option>`` entries instead of a list;
* ``dcp-streaming``: ``optimizer.state_dict()`` as ``wrapped_optim.checkpoint.save_optimizer``
  writes it, keyed by parameter index (names come from a model or a names file).

Reading takes one tensor (of any chunking or sharding) at a time through DCP's own storage
reader, with the metadata unpickled safely and non-tensor values loaded ``weights_only``.
Writing plans every tensor as one write item and asks the reader for it only when DCP's
file writer reaches it.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import attrs
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem, WriteItem, WriteItemType
from torch.utils.serialization import config as serialization_config

from wrapped_optim._formats.checkpoint_files import check_storage_files, safe_dcp_reader
from wrapped_optim.checkpoint._convert._canonical import (
    ParamRecord,
    StateIndex,
    StateReader,
    TensorSpec,
)
from wrapped_optim.checkpoint._convert._dcp_direct import WholeTensors
from wrapped_optim.checkpoint._convert._errors import ConversionError
from wrapped_optim.checkpoint._convert._layout import (
    NOTE_FLAVOUR,
    index_from_state_dict,
    state_dict_from_index,
)
from wrapped_optim.checkpoint._convert._options import FormatOptions
from wrapped_optim.inspection import InspectError

__all__ = ["DcpReader", "DcpWriter", "Layout", "looks_like"]

Layout = Literal["dcp", "dcp-flat", "dcp-streaming"]


@attrs.frozen
class _Stored:
    """A value in the checkpoint, by its flattened DCP key; ``spec`` for tensors."""

    key: str
    spec: TensorSpec | None


def looks_like(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file()


class _DcpFile:
    """A DCP directory whose values are read a few keys at a time."""

    def __init__(self, path: Path, trusted: bool) -> None:
        self.path, self.trusted = path, trusted
        try:
            self.reader = safe_dcp_reader(path, trusted)
            self.metadata = self.reader.read_metadata()
        except InspectError as error:
            raise ConversionError(str(error)) from error
        self.reader.set_up_storage_reader(self.metadata, True)
        self.whole = WholeTensors(path, self.metadata)

    def load(self, keys: Mapping[str, TensorSpec | None]) -> dict[str, Any]:
        """Each key's value: a fresh tensor of its spec, or the unpickled object."""
        if not keys:
            return {}
        try:
            check_storage_files(self.path, self.metadata, list(keys), self.trusted)
        except InspectError as error:
            raise ConversionError(str(error)) from error
        direct = {key: self._direct(key, spec) for key, spec in keys.items() if spec is not None}
        done = {key: tensor for key, tensor in direct.items() if tensor is not None}
        if len(done) == len(keys):
            return dict(done)
        targets: dict[str, Any] = {
            key: None if spec is None else torch.empty(spec.shape, dtype=spec.dtype)
            for key, spec in keys.items()
            if key not in done
        }
        planner = _ObjectPlanner(not self.trusted)
        planner.set_up_planner(targets, self.metadata, True)
        try:
            plan = self.reader.prepare_local_plan(planner.create_local_plan())
            (plan,) = self.reader.prepare_global_plan([plan])
            self.reader.read_data(planner.finish_plan(plan), planner).wait()
        except Exception as error:
            first = (str(error).strip().splitlines() or [""])[0][:300]
            raise ConversionError(
                f"{self.path}: cannot read {sorted(keys)[:3]} ({type(error).__name__}: {first})"
            ) from error
        targets.update(planner.objects)
        targets.update(done)
        return targets

    def _direct(self, key: str, spec: TensorSpec) -> torch.Tensor | None:
        """``key`` read straight into a fresh tensor, when it is stored whole."""
        try:
            return self.whole.read(key, spec)
        except ConversionError:
            raise
        except Exception as error:
            first = (str(error).strip().splitlines() or [""])[0][:300]
            raise ConversionError(
                f"{self.path}: cannot read {key!r} ({type(error).__name__}: {first})"
            ) from error


class _ObjectPlanner(DefaultLoadPlanner):
    """Loads non-tensor values with ``weights_only`` (DCP's default runs pickled code)."""

    def __init__(self, weights_only: bool) -> None:
        super().__init__(flatten_state_dict=False, allow_partial_load=False)
        self.weights_only = weights_only
        self.objects: dict[str, Any] = {}

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=self.weights_only)
        except Exception as error:
            raise ConversionError(
                f"value {read_item.dest_index.fqn!r}: cannot be read with weights_only "
                f"({type(error).__name__}); pass trusted=True (CLI: --trust) for a checkpoint "
                "you trust"
            ) from error
        self.objects[read_item.dest_index.fqn] = loaded


def _tree(metadata: Any) -> dict[Any, Any]:
    """The nested mapping DCP's routes describe, stored values as ``_Stored``."""
    routes = metadata.planner_data if isinstance(metadata.planner_data, Mapping) else {}
    tree: dict[Any, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        route = routes.get(key)
        route = tuple(route) if isinstance(route, (tuple, list)) and route else (key,)
        spec = None
        if isinstance(entry, TensorStorageMetadata):
            spec = TensorSpec(entry.size, entry.properties.dtype)
        node = tree
        for part in route[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConversionError(f"key {key!r}: its route crosses a value")
            node = child
        node[route[-1]] = _Stored(key, spec)
    return tree


def _is_nested(node: Any) -> bool:
    """``state`` and ``param_groups`` (an optimizer with no state yet saves no ``state``)."""
    return (
        isinstance(node, Mapping)
        and isinstance(node.get("state", {}), Mapping)
        and ("param_groups" in node)
    )


def _is_flat(node: Any) -> bool:
    if not isinstance(node, Mapping):
        return False
    keys = [k for k in node if isinstance(k, str)]
    return any(k.startswith("param_groups.") for k in keys) and all(
        k.startswith(("state.", "param_groups.")) for k in keys
    )


def _find(tree: Mapping[Any, Any], where: str, location: str | None) -> tuple[str, Any, bool]:
    found: list[tuple[str, Any, bool]] = []

    def walk(node: Any, at: str, depth: int) -> None:
        if _is_nested(node):
            found.append((at, node, False))
        elif _is_flat(node):
            found.append((at, node, True))
        elif isinstance(node, Mapping) and depth:
            for key, value in node.items():
                walk(value, f"{at}.{key}" if at else str(key), depth - 1)

    walk(tree, "", 4)
    if location is not None:
        found = [entry for entry in found if entry[0] == location]
    if len(found) == 1:
        return found[0]
    if not found:
        raise ConversionError(f"{where}: no optimizer state in this DCP checkpoint")
    places = ", ".join(repr(at or "<top level>") for at, _, _ in found)
    raise ConversionError(f"{where}: holds several optimizer states ({places}); pass location=")


def _as_list(node: Any) -> Any:
    """A mapping keyed 0..n-1 (a list DCP flattened) back into a list."""
    if isinstance(node, Mapping) and node and all(isinstance(k, int) for k in node):
        return [node[i] for i in sorted(node)]
    return node


class DcpReader:
    """Optimizer state in a DCP directory, read one tensor at a time."""

    def __init__(self, path: str | os.PathLike[str], options: FormatOptions) -> None:
        self.path = Path(path)
        self.file = _DcpFile(self.path, options.trusted)
        location, node, flat = _find(_tree(self.file.metadata), str(self.path), options.location)
        self.location = location
        self.layout: Layout = "dcp-flat" if flat else "dcp"
        osd = (
            _unflatten(node)
            if flat
            else {"state": node.get("state", {}), "param_groups": node["param_groups"]}
        )
        osd = self._resolved(osd)
        if flat:
            osd["param_groups"] = _merged(osd["param_groups"])
        if any(isinstance(k, int) for k in osd["state"]) or any(
            isinstance(k, int) for g in osd["param_groups"] for k in g.get("params", [])
        ):
            self.layout = "dcp-streaming"
        self._index, self._stored = index_from_state_dict(
            osd, source=f"{self.path} ({self.layout})", options=options, spec_of=_spec_of
        )

    def _resolved(self, osd: dict[str, Any]) -> dict[str, Any]:
        """Param groups and steps read (small values); state tensors left as ``_Stored``."""
        wanted: dict[str, TensorSpec | None] = {}
        groups = _as_list(osd["param_groups"])
        for stored in _stored_in(groups):
            wanted[stored.key] = stored.spec
        for entries in osd["state"].values():
            step = entries.get("step") if isinstance(entries, Mapping) else None
            if isinstance(step, _Stored):
                wanted[step.key] = step.spec
        values = self.file.load(wanted)
        groups = _substitute(groups, values)
        if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
            raise ConversionError(f"{self.path}: param_groups is not a list of mappings")
        by_index = any(isinstance(k, int) for g in groups for k in g.get("params", []))
        state = {
            _index_key(key) if by_index else key: {
                name: values[v.key] if name == "step" and isinstance(v, _Stored) else v
                for name, v in entries.items()
            }
            for key, entries in osd["state"].items()
        }
        return {"state": state, "param_groups": groups}

    def index(self) -> StateIndex:
        return self._index

    def read(self, name: str, key: str) -> torch.Tensor:
        stored = self._stored.get((name, key))
        if stored is None or stored.spec is None:
            raise ConversionError(f"{self.path}: no state {key!r} for parameter {name!r}")
        tensor = self.file.load({stored.key: stored.spec})[stored.key]
        assert isinstance(tensor, torch.Tensor)
        return tensor

    def close(self) -> None:
        self._stored = {}
        self.file.whole.close()


def _index_key(key: Any) -> Any:
    """DCP routes keep a mapping's int keys as strings: parameter indices back to ints."""
    return int(key) if isinstance(key, str) and key.isdigit() else key


def _spec_of(value: Any) -> TensorSpec | None:
    return value.spec if isinstance(value, _Stored) else None


def _stored_in(node: Any) -> list[_Stored]:
    if isinstance(node, _Stored):
        return [node]
    if isinstance(node, Mapping):
        return [stored for value in node.values() for stored in _stored_in(value)]
    if isinstance(node, list):
        return [stored for value in node for stored in _stored_in(value)]
    return []


def _substitute(node: Any, values: Mapping[str, Any]) -> Any:
    if isinstance(node, _Stored):
        return values[node.key]
    if isinstance(node, Mapping):
        return {k: _substitute(v, values) for k, v in node.items()}
    if isinstance(node, list):
        return [_substitute(v, values) for v in node]
    return node


def _unflatten(node: Mapping[str, Any]) -> dict[str, Any]:
    """``state.<fqn>.<key>`` / ``param_groups.<fqn>.<option>`` back into the nested layout,
    one group per parameter until their options are read (``_merged``)."""
    state: dict[str, dict[str, Any]] = {}
    options: dict[str, dict[str, Any]] = {}
    for key, value in node.items():
        section, _, rest = str(key).partition(".")
        fqn, _, name = rest.rpartition(".")
        if section == "state" and fqn:
            state.setdefault(fqn, {})[name] = value
        elif section == "param_groups" and fqn:
            options.setdefault(fqn, {})[name] = value
    groups = [{**opts, "params": [fqn]} for fqn, opts in options.items()]
    return {"state": state, "param_groups": groups}


# ----------------------------------------------------------------------------------------
# writing
# ----------------------------------------------------------------------------------------
class _PullingPlanner(DefaultSavePlanner):
    """Plans meta placeholders as whole tensors; each is read from ``reader`` only when DCP's
    file writer asks for it."""

    def __init__(self, reader: StateReader, sources: dict[int, tuple[str, str]]) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=True)
        self.reader = reader
        self.sources = sources
        self.previous: torch.Tensor | None = None

    def release_previous(self) -> None:
        """Frees the last tensor handed to DCP (written by now: its serial loader asks for
        the next item only after writing this one), which DCP's file writer would otherwise
        keep referenced until the file ends. Only a whole tensor the reader handed over is
        freed; a view (of a reader's cache, of a file mapping) is left alone."""
        previous, self.previous = self.previous, None
        if previous is not None and previous._base is None:
            storage = previous.untyped_storage()
            if storage.resizable():
                storage.resize_(0)

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        obj = self.lookup_object(write_item.index)
        source = self.sources.get(id(obj))
        if source is None:
            return super().resolve_data(write_item)
        self.release_previous()
        tensor = self.reader.read(*source)
        if tensor.dtype != obj.dtype or tensor.shape != obj.shape:
            raise ConversionError(
                f"parameter {source[0]!r}: state {source[1]!r} came as {tensor.dtype} "
                f"{tuple(tensor.shape)}, its index says {obj.dtype} {tuple(obj.shape)}"
            )
        tensor = tensor.contiguous()
        self.previous = tensor
        return tensor


class DcpWriter:
    """Writes ``layout`` into a DCP directory (which must not exist yet)."""

    def __init__(self, path: str | os.PathLike[str], options: FormatOptions, layout: Layout):
        self.path = Path(path)
        self.options = options
        self.layout = layout

    def write(self, index: StateIndex, reader: StateReader) -> None:
        sources: dict[int, tuple[str, str]] = {}

        def placeholder(param: ParamRecord, key: str, spec: TensorSpec) -> torch.Tensor:
            tensor = torch.empty(spec.shape, dtype=spec.dtype, device="meta")
            sources[id(tensor)] = (param.name, key)
            return tensor

        osd: dict[str, Any] = state_dict_from_index(
            index,
            flavour=self.options.flavour or index.notes.get(NOTE_FLAVOUR, "torch"),
            keyed_by_name=self.layout != "dcp-streaming",
            value_of=placeholder,
            names=self.options.names if self.layout == "dcp-streaming" else None,
        )
        if self.layout == "dcp-flat":
            osd = _flatten(osd)
        tree = {self.options.location: osd} if self.options.location else osd
        writer = FileSystemWriter(self.path, thread_count=1, per_thread_copy_ahead=0)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            planner = _PullingPlanner(reader, sources)
            try:
                # DCP torch.saves each item; without the zip CRC32 (torch.load does not check
                # it) as the torch.save writer does: the checksum is a full pass per tensor.
                with serialization_config.patch({"save.compute_crc32": False}):  # type: ignore[attr-defined]
                    dcp.save(tree, storage_writer=writer, planner=planner, no_dist=True)
            except CheckpointException as error:
                raise _first_failure(error) from error
            finally:
                planner.release_previous()


def _first_failure(error: CheckpointException) -> BaseException:
    """The failure itself (a reader's ConversionError, an OSError) rather than DCP's wrapper."""
    for failure in error.failures.values():
        cause = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(cause, BaseException):
            return cause
    return error


def _flatten(osd: Mapping[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for fqn, entries in osd["state"].items():
        for key, value in entries.items():
            flat[f"state.{fqn}.{key}"] = value
    for group in osd["param_groups"]:
        for fqn in group["params"]:
            for option, value in group.items():
                if option != "params":
                    flat[f"param_groups.{fqn}.{option}"] = value
    return flat


def _merged(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive one-parameter groups with equal options as one group: the flattened
    layout keeps no group boundaries (two groups with equal options become one)."""
    out: list[dict[str, Any]] = []
    for group in groups:
        options = {k: v for k, v in group.items() if k != "params"}
        if out and {k: v for k, v in out[-1].items() if k != "params"} == options:
            out[-1]["params"] = [*out[-1]["params"], *group["params"]]
        else:
            out.append(dict(group))
    return out
