"""Reading checkpoint files that may be hostile, without running what they pickle:
``torch.save`` files through ``weights_only``, DCP metadata through an unpickler that builds
only DCP's own classes, and data files confined to the checkpoint's directory. Inspection and
the converter both read through it.
"""

from __future__ import annotations

import os
import pickle
import re
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from wrapped_optim._formats.errors import InspectError

__all__ = [
    "MAX_DEPTH",
    "check_depth",
    "check_storage_files",
    "read_torch_save",
    "require_regular",
    "safe_dcp_reader",
]

MAX_DEPTH = 200
"""The deepest nesting inspection follows (containers in a file, parts of a DCP route)."""


def check_depth(node: Any, where: str, limit: int = MAX_DEPTH) -> None:
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


def require_regular(path: Path, *, confine_to: Path | None = None) -> None:
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


def read_torch_save(path: Path, trusted: bool) -> Any:
    def load(mmap: bool) -> Any:
        return torch.load(path, map_location="cpu", weights_only=not trusted, mmap=mmap)

    require_regular(path)
    tree = _load_torch_save(path, load)
    check_depth(tree, str(path))
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


def check_storage_files(path: Path, metadata: Any, keys: Sequence[str], trusted: bool) -> None:
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
        require_regular(path / relative, confine_to=None if trusted else path)


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


def safe_dcp_reader(path: Path, trusted: bool) -> Any:
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
