"""Reading a ``torch.save`` file or a DCP directory without executing what it pickles."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from wrapped_optim._formats.checkpoint_files import (
    MAX_DEPTH,
    check_depth,
    check_storage_files,
    require_regular,
    safe_dcp_reader,
)
from wrapped_optim._formats.errors import InspectError
from wrapped_optim.inspection._model import Fetch, _Pending, _TensorInfo


def _read_dcp(path: Path, trusted: bool = False) -> Any:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not (path / ".metadata").is_file():
        raise InspectError(
            f"{path}: a directory but not a torch.distributed.checkpoint checkpoint "
            "(no .metadata file)"
        )
    require_regular(path / ".metadata", confine_to=None if trusted else path)
    metadata = safe_dcp_reader(path, trusted).read_metadata()

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

        reader = safe_dcp_reader(path, trusted)
        metadata = reader.read_metadata()
        check_storage_files(path, metadata, keys, trusted)
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
            check_depth(value, f"{path}: value {key!r}")
        target.update(read_objects)
        return target

    return fetch


def _one_line(error: BaseException) -> str:
    """The root cause of ``error`` on one line (DCP wraps each rank's failure)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        failure = next(iter(failures.values()))
        error = failure[0] if isinstance(failure, tuple) else failure
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"
