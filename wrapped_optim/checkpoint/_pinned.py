"""One checkpoint per load: the metadata read once over a pinned directory, and data files
checked to belong to it, so a save committed during a load is never mixed into it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from wrapped_optim._formats.errors import OptimizerCheckpointError
from wrapped_optim.checkpoint._commit import committed_directory

__all__ = ["PinnedReader", "pinned_reader"]

_Stamp = tuple[int, int, int, int]  # device, inode, size, mtime_ns


def _stamp(path: str) -> _Stamp | None:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _relative_paths(metadata: Metadata) -> set[str]:
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    return {str(info.relative_path) for info in storage.values() if hasattr(info, "relative_path")}


def _confined(relative: str, where: Path) -> None:
    parts = Path(relative).parts
    if Path(relative).is_absolute() or not parts or ".." in parts:
        raise OptimizerCheckpointError(
            f"{where}: .metadata names the data file {relative!r}, outside the checkpoint "
            "directory; this is not a checkpoint save_optimizer or dcp.save wrote"
        )


class PinnedReader(FileSystemReader):
    """A ``FileSystemReader`` over one pinned directory that reads ``.metadata`` once.

    ``directory`` is what the user named (for messages); ``path`` is where to read (the
    pinned descriptor's path). See the module doc.

    Example:
        >>> import tempfile, torch, torch.distributed.checkpoint as dcp
        >>> with tempfile.TemporaryDirectory() as path:
        ...     _ = dcp.save({"w": torch.ones(2)}, checkpoint_id=path, no_dist=True)
        ...     with pinned_reader(path, None) as reader:
        ...         first = reader.read_metadata()
        ...         reader.read_metadata() is first
        True
    """

    def __init__(self, path: str, directory: Path) -> None:
        super().__init__(path)
        self.directory = directory
        self._metadata: dict[Any, Metadata] = {}
        self._stamps: dict[str, _Stamp | None] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Keeps the pinned path and the pinned metadata (DCP resets its reader on every load)."""
        self.storage_data = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The pinned metadata: ``.metadata`` as it was the first time this reader read it."""
        rank = kwargs.get("rank")
        if rank not in self._metadata:
            self._metadata[rank] = super().read_metadata(*args, **kwargs)
        return self._metadata[rank]

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Checks that the pinned metadata names only files inside the directory; notes each one."""
        for relative in sorted(_relative_paths(metadata)):
            _confined(relative, self.directory)
            self._stamps.setdefault(relative, _stamp(os.path.join(self.path, relative)))
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Reads ``plan``, after and before checking that its files are the pinned metadata's."""
        files = {str(self.storage_data[item.storage_index].relative_path) for item in plan.items}
        self._check(files)
        future = super().read_data(plan, planner)
        self._check(files)
        return future

    def _check(self, files: set[str]) -> None:
        for relative in sorted(files):
            _confined(relative, self.directory)
            expected = self._stamps.get(relative)
            now = _stamp(os.path.join(self.path, relative))
            if expected is not None and now != expected:
                raise OptimizerCheckpointError(
                    f"{self.directory}: data file {relative!r} "
                    f"{'is gone' if now is None else 'changed'} since this load read "
                    ".metadata (a save into the same directory during the load?); nothing was "
                    "loaded: load again once the save has finished"
                )


class _SameMetadata(StorageReader):
    """A caller's storage reader whose ``read_metadata`` answers the first read again."""

    def __init__(self, inner: StorageReader) -> None:
        self.inner = inner
        self._metadata: dict[Any, Metadata] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.inner.reset(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank not in self._metadata:
            self._metadata[rank] = self.inner.read_metadata(*args, **kwargs)
        return self._metadata[rank]

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.inner.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return self.inner.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return self.inner.prepare_global_plan(plans)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        return self.inner.read_data(plan, planner)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False


@contextmanager
def pinned_reader(
    checkpoint_id: str | os.PathLike[str] | None, storage_reader: StorageReader | None
) -> Iterator[StorageReader]:
    """The reader of one load: a :class:`PinnedReader` over the pinned checkpoint directory,
    or the caller's ``storage_reader`` with its first metadata kept for the whole load.

    Pass the yielded reader to every ``dcp.load`` of the load, with ``checkpoint_id=None``.
    """
    if storage_reader is not None:
        if checkpoint_id is not None:
            storage_reader.reset(checkpoint_id)
        yield _SameMetadata(storage_reader)
        return
    assert checkpoint_id is not None
    directory = committed_directory(checkpoint_id)
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # missing or not a directory: DCP's own error, as before
        yield PinnedReader(str(directory), directory)
        return
    try:
        pinned = f"/proc/self/fd/{fd}"
        path = pinned if os.path.isdir(pinned) else str(directory)
        yield PinnedReader(path, directory)
    finally:
        os.close(fd)
