"""Reading a ``torch.save`` file or a DCP directory without executing what it pickles."""

from __future__ import annotations

import os
import pickle
import re
import stat
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from wrapped_optim.inspection._model import Fetch, InspectError, _Pending, _TensorInfo

MAX_DEPTH = 200
"""The deepest nesting inspection follows (containers in a file, parts of a DCP route)."""


def _check_depth(node: Any, where: str, limit: int = MAX_DEPTH) -> None:
    """Refuses containers nested deeper than ``limit`` (walked without recursion)."""
    stack: list[tuple[Any, int]] = [(node, 0)]
    seen: set[int] = set()
    while stack:
        value, depth = stack.pop()
        if not isinstance(value, (dict, list, tuple)) or id(value) in seen:
            continue
        if depth >= limit:
            raise InspectError(
                f"{where}: holds containers nested more than {limit} levels deep; no "
                "optimizer checkpoint does (a crafted file?)"
            )
        seen.add(id(value))
        children = value.values() if isinstance(value, dict) else value
        stack.extend((child, depth + 1) for child in children)


def _require_regular(path: Path, *, confine_to: Path | None = None) -> None:
    """``path`` must be a regular file (never a FIFO, device or socket, which could block or
    never end), inside ``confine_to`` when given; checked with a non-blocking open."""
    if confine_to is not None:
        inside = os.path.realpath(path)
        if os.path.commonpath([inside, os.path.realpath(confine_to)]) != os.path.realpath(
            confine_to
        ):
            raise InspectError(
                f"{path}: outside the checkpoint directory {confine_to}; inspection reads no "
                "file outside it unless told the checkpoint is trusted (--trust)"
            )
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return  # not hostile, only missing: the reader says which values it could not read
    except OSError as error:
        raise InspectError(f"{path}: cannot be opened ({error.strerror})") from error
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
    if not regular:
        raise InspectError(f"{path}: not a regular file (a FIFO, device or socket?)")


def _read_torch_save(path: Path, trusted: bool) -> Any:
    def load(mmap: bool) -> Any:
        return torch.load(path, map_location="cpu", weights_only=not trusted, mmap=mmap)

    _require_regular(path)
    tree = _load_torch_save(path, load)
    _check_depth(tree, str(path))
    return tree


def _load_torch_save(path: Path, load: Any) -> Any:
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


def _read_dcp(path: Path, trusted: bool = False) -> Any:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not (path / ".metadata").is_file():
        raise InspectError(
            f"{path}: a directory but not a torch.distributed.checkpoint checkpoint "
            "(no .metadata file)"
        )
    _require_regular(path / ".metadata", confine_to=None if trusted else path)
    metadata = _reader(path, trusted).read_metadata()

    planner_data = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    tree: dict[Any, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        route = planner_data.get(key)
        route = tuple(route) if isinstance(route, (tuple, list)) and route else (key,)
        if len(route) > MAX_DEPTH:
            raise InspectError(
                f"{path}: .metadata routes {str(key)[:60]!r} through {len(route)} levels (more "
                f"than {MAX_DEPTH}); no optimizer checkpoint does (a crafted file?)"
            )
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
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        read_objects: dict[str, Any] = {}

        class _SafeBytesPlanner(DefaultLoadPlanner):
            # DCP unpickles non-tensor entries with weights_only=False; inspection does not
            # execute code from a checkpoint. (dcp.load hands the planner a copy of the dict,
            # so objects are collected here; tensors are filled in place.)
            def load_bytes(self, read_item: Any, value: Any) -> None:
                read_objects[read_item.dest_index.fqn] = torch.load(value, weights_only=not trusted)

        reader = _reader(path, trusted)
        metadata = reader.read_metadata()
        _check_storage_files(path, metadata, keys, trusted)
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
        except (Exception, CheckpointException) as error:
            # CheckpointException (a missing or truncated data file) is a BaseException.
            raise InspectError(
                f"{path}: could not read values {list(keys)[:3]}: {_one_line(error)}"
            ) from error
        for key, value in read_objects.items():
            _check_depth(value, f"{path}: value {key!r}")
        target.update(read_objects)
        return target

    return fetch


def _check_storage_files(path: Path, metadata: Any, keys: Sequence[str], trusted: bool) -> None:
    """The data files that hold ``keys``: regular files, inside ``path`` unless trusted."""
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    wanted = set(keys)
    files = {
        str(getattr(info, "relative_path", ""))
        for index, info in storage.items()
        if getattr(index, "fqn", None) in wanted
    }
    for relative in sorted(files):
        if not trusted and (Path(relative).is_absolute() or ".." in Path(relative).parts):
            raise InspectError(
                f"{path}: .metadata names the data file {relative!r}, outside the checkpoint "
                "directory; inspection reads no file outside it unless told the checkpoint is "
                "trusted (--trust)"
            )
        _require_regular(path / relative, confine_to=None if trusted else path)


# DCP pickles its .metadata (FileSystemReader.read_metadata is a plain pickle.load): without
# --trust it is read by an unpickler that builds only these globals, so a crafted .metadata
# cannot run code.
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata objects, torch dtypes and a few plain containers; nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == _METADATA_MODULE:
            found = super().find_class(module, name)
            if isinstance(found, type) and found.__module__ == _METADATA_MODULE:
                return found
        raise pickle.UnpicklingError(f"Unsupported global: {module}.{name}")


def _reader(path: Path, trusted: bool) -> Any:
    """A DCP FileSystemReader whose metadata is unpickled safely unless ``trusted``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class _Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            file = path / ".metadata"
            try:
                if trusted:
                    metadata = super().read_metadata(*args, **kwargs)
                else:
                    with file.open("rb") as stream:
                        metadata = _MetadataUnpickler(stream).load()
            except pickle.UnpicklingError as error:
                found = re.search(r"Unsupported global: (\S+)", str(error))
                if found:
                    raise InspectError(
                        f"{file}: pickles a {found.group(1)} object, which DCP metadata never "
                        "holds; inspection runs no pickled code unless told the checkpoint is "
                        "trusted (--trust, or trusted=True)"
                    ) from error
                raise InspectError(f"{path}: unreadable DCP metadata ({error})") from error
            except Exception as error:  # any failure to parse is a bad checkpoint
                raise InspectError(f"{path}: unreadable DCP metadata ({error})") from error
            if not isinstance(metadata, Metadata):
                raise InspectError(f"{file}: holds a {type(metadata).__name__}, not DCP metadata")
            storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
            storage_meta.load_id = self.load_id
            metadata.storage_meta = storage_meta
            return metadata

    return _Reader(str(path))


def _one_line(error: BaseException) -> str:
    """The root cause of ``error`` on one line (DCP wraps each rank's failure)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        failure = next(iter(failures.values()))
        error = failure[0] if isinstance(failure, tuple) else failure
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"
