"""What every Megatron-Core optimizer checkpoint has on disk, read without Megatron.

A ``dist_checkpointing`` directory (Core's default ``torch_dist`` backend) is a DCP directory
plus ``metadata.json`` (the backends) and ``common.pt`` (everything that is not a sharded
tensor: the optimizer's param groups, the sharding type, the grad scaler). The legacy
``save_parameter_state`` files are plain ``torch.save`` files. Nothing here needs a GPU, a
process group or megatron-core.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from wrapped_optim._formats.pickled_classes import optimizer_classes_named_in
from wrapped_optim.checkpoint._convert._errors import ConversionError

__all__ = [
    "COMMON_FILE",
    "METADATA_FILE",
    "DcpTensors",
    "MegatronFormatError",
    "load_common",
    "optimizer_commons",
    "read_backends",
]

COMMON_FILE = "common.pt"  # Core's COMMON_STATE_FNAME (0.16.1, 0.19.2)
METADATA_FILE = "metadata.json"  # Core's CONFIG_FNAME


class MegatronFormatError(ConversionError):
    """A Megatron checkpoint that cannot be read or written as asked; names what is wrong
    (a ``ConversionError``: ``convert`` and the command line report it as one).

    Example:
        >>> isinstance(MegatronFormatError("ckpt/: no metadata.json"), ValueError)
        True
    """


def read_backends(path: Path) -> dict[str, Any] | None:
    """``metadata.json`` of a ``dist_checkpointing`` directory, or None if it is not one.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     read_backends(Path(d)) is None
        True
    """
    file = path / METADATA_FILE
    if not file.is_file():
        return None
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) and "sharded_backend" in config else None


def load_common(file: Path) -> Any:
    """A ``torch.save`` file of Megatron's: weights-only, allowed the optimizer classes it
    names (the only non-tensor objects Megatron's optimizer state pickles).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     torch.save({"cls": torch.optim.AdamW}, f"{d}/common.pt")
        ...     load_common(Path(d, "common.pt"))["cls"].__name__
        'AdamW'
    """
    if not file.is_file():
        raise MegatronFormatError(f"{file}: no such file")
    try:
        with torch.serialization.safe_globals(list[Any](optimizer_classes_named_in(file))):
            return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:
        raise MegatronFormatError(
            f"{file}: not readable as Megatron optimizer state ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''})"
        ) from error


def optimizer_commons(common: Any, key: str) -> list[dict[str, Any]]:
    """The common state of each DistributedOptimizer under ``common[key]``: one entry for a
    single optimizer, one per sub-optimizer (in index order) for a ChainedOptimizer."""
    if not isinstance(common, Mapping) or key not in common:
        found = sorted(map(str, common)) if isinstance(common, Mapping) else type(common).__name__
        raise MegatronFormatError(f"no optimizer state under {key!r} (found {found})")
    state = common[key]
    if isinstance(state, Mapping) and "optimizer" in state:
        return [dict(state)]
    if isinstance(state, Mapping) and state and all(isinstance(k, int) for k in state):
        subs = [state[index] for index in sorted(state)]
        if all(isinstance(sub, Mapping) and "optimizer" in sub for sub in subs):
            return [dict(sub) for sub in subs]
    raise MegatronFormatError(
        f"the state under {key!r} is not a Megatron DistributedOptimizer's (no 'optimizer' "
        "entry with param groups)"
    )


class DcpTensors:
    """One DCP directory, read one tensor at a time on the CPU, without a process group."""

    def __init__(self, path: Path) -> None:
        from wrapped_optim.checkpoint._pinned import pinned_reader

        self.path = path
        self._scopes = ExitStack()
        try:
            self._reader = self._scopes.enter_context(pinned_reader(str(path), None))
            metadata = self._reader.read_metadata()
        except Exception as error:
            self._scopes.close()
            raise MegatronFormatError(f"{path}: unreadable DCP metadata ({error})") from error
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.objects = [
            name
            for name, entry in metadata.state_dict_metadata.items()
            if not isinstance(entry, TensorStorageMetadata)
        ]
        self.specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self.chunks: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
        for name, entry in metadata.state_dict_metadata.items():
            if isinstance(entry, TensorStorageMetadata):
                self.specs[name] = (tuple(entry.size), entry.properties.dtype)
                self.chunks[name] = [
                    (tuple(chunk.offsets), tuple(chunk.sizes)) for chunk in entry.chunks
                ]

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name``, whole."""
        import warnings

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        if name not in self.specs:
            raise MegatronFormatError(f"{self.path}: no tensor {name!r} in the checkpoint")
        shape, dtype = self.specs[name]
        target = {name: torch.empty(shape, dtype=dtype)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no_dist's "no process group" notice
            dcp.load(
                target,
                storage_reader=self._reader,
                planner=DefaultLoadPlanner(flatten_state_dict=False),
                no_dist=True,
            )
        return target[name]

    def read_slice(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of the 1-D tensor ``name``, reading only the stored chunks
        that overlap them."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import (
            create_read_items_for_chunk_list,
        )

        if name not in self.specs or len(self.specs[name][0]) != 1:
            raise MegatronFormatError(f"{self.path}: no flat tensor {name!r} in the checkpoint")
        (size,), dtype = self.specs[name]
        if not 0 <= start <= end <= size:
            raise MegatronFormatError(
                f"{self.path}: elements [{start}, {end}) are outside {name!r} ({size} elements)"
            )
        target = torch.empty(end - start, dtype=dtype)
        if end == start:
            return target
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        entry = self._reader.read_metadata().state_dict_metadata[name]
        assert isinstance(entry, TensorStorageMetadata)
        chunk = ChunkStorageMetadata(offsets=torch.Size([start]), sizes=torch.Size([end - start]))
        items = create_read_items_for_chunk_list(name, entry, [chunk])

        class _Slice(DefaultLoadPlanner):
            def create_local_plan(self) -> LoadPlan:
                return LoadPlan(items)

            def lookup_tensor(self, index: Any) -> torch.Tensor:
                return target

        dcp.load({name: target}, storage_reader=self._reader, planner=_Slice(), no_dist=True)
        return target

    def read_object(self, name: str) -> Any:
        """The object (a Megatron ``ShardedObject``) stored under ``name``, weights-only."""
        import io
        import warnings

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        found: dict[str, Any] = {}

        class _Objects(DefaultLoadPlanner):
            def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
                data = value.read()
                with torch.serialization.safe_globals(list[Any](_optimizer_classes_in(data))):
                    found[name] = torch.load(io.BytesIO(data), weights_only=True)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(
                {name: None},
                storage_reader=self._reader,
                planner=_Objects(flatten_state_dict=False),
                no_dist=True,
            )
        if name not in found:
            raise MegatronFormatError(f"{self.path}: no object {name!r} in the checkpoint")
        return found[name]

    def close(self) -> None:
        self._scopes.close()


COMMON_OBJECT = "common_state"
"""Where Core 0.19 keeps the common state: a ``ShardedObject`` inside the DCP checkpoint
(``common_state/shard_0_1``), in place of 0.16's ``common.pt``."""


def read_common(path: Path) -> Any:
    """The common (non-sharded) state of Megatron's ``dist_checkpointing`` directory
    ``path``: ``common.pt`` where Core wrote one (0.16), else the ``common_state`` object in
    the DCP checkpoint (0.19).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     torch.save({"optimizer": {}}, f"{d}/common.pt")
        ...     read_common(Path(d))
        {'optimizer': {}}
    """
    if (path / COMMON_FILE).is_file():
        return load_common(path / COMMON_FILE)
    if not (path / ".metadata").is_file():
        raise MegatronFormatError(f"{path}: no {COMMON_FILE} and no DCP checkpoint")
    tensors = DcpTensors(path)
    try:
        names = [
            name
            for name in tensors.objects
            if name == COMMON_OBJECT or name.startswith(COMMON_OBJECT + "/")
        ]
        if not names:
            raise MegatronFormatError(
                f"{path}: no common state ({COMMON_FILE} or a {COMMON_OBJECT!r} object)"
            )
        stored = tensors.read_object(names[0])
    finally:
        tensors.close()
    # Core saves the common dict as the one element of the object's data (a list of one).
    if isinstance(stored, list | tuple) and len(stored) == 1:
        return stored[0]
    return stored


def _optimizer_classes_in(data: bytes) -> list[type]:
    """Imported optimizer classes a pickled blob names (see :func:`load_common`)."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".pt") as file:
        file.write(data)
        file.flush()
        return optimizer_classes_named_in(file.name)
