"""Atomic commit of a checkpoint directory: write aside, then rename into place.

DCP's file writer writes its data files into the checkpoint directory itself and the
``.metadata`` last; saving into a directory that holds a good checkpoint overwrites that
checkpoint's files one by one, so a save that fails half-way destroys it. Here every rank
writes into a staging directory beside the target (``.<name>.saving``, the same path on every
rank of a shared filesystem) and, once DCP has finished (all ranks wrote, the coordinator wrote
``.metadata``), the coordinator commits:

1. files in the target that are not part of a DCP checkpoint (``.metadata``, ``*.distcp``)
   are moved into the staging directory, so nothing saved beside the checkpoint is lost;
2. the target is renamed aside (``.<name>.old``), the staging directory renamed to the
   target, and the old one removed.

A save that raises removes the staging directory and leaves the target as it was. A process
killed between the two renames of step 2 (two ``rename`` calls, no I/O between them) leaves
the old checkpoint complete under ``.<name>.old``; the next save restores it before it starts.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = ["CheckpointCommit"]

_STAGING = ".{}.saving"
_OLD = ".{}.old"


def _is_dcp_file(path: Path) -> bool:
    return path.name in (".metadata", ".metadata.tmp") or path.suffix == ".distcp"


def _group_active(process_group: Any) -> bool:
    return dist.is_available() and dist.is_initialized()


def _is_coordinator(process_group: Any) -> bool:
    if not _group_active(process_group):
        return True
    return dist.get_rank(process_group) == 0


def _barrier(process_group: Any) -> None:
    if _group_active(process_group):
        dist.barrier(group=process_group)


class CheckpointCommit:
    """The staging directory of one save into ``target`` and its commit.

    Example:
        >>> import os, tempfile
        >>> from pathlib import Path
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     commit = CheckpointCommit(Path(tmp) / "ckpt", process_group=None)
        ...     commit.prepare()
        ...     _ = (commit.staging / ".metadata").write_text("new")
        ...     commit.commit()
        ...     print((Path(tmp) / "ckpt" / ".metadata").read_text(), os.listdir(tmp))
        new ['ckpt']
    """

    def __init__(self, target: str | os.PathLike[str], process_group: Any) -> None:
        self.target = Path(os.path.abspath(target))  # "ckpt/" and "./ckpt" name "ckpt"
        self.staging = self.target.parent / _STAGING.format(self.target.name)
        self.old = self.target.parent / _OLD.format(self.target.name)
        self.process_group = process_group

    def prepare(self) -> None:
        """Recovers an interrupted commit, clears stale staging files; all ranks wait for it."""
        if _is_coordinator(self.process_group):
            if self.old.exists() and not self.target.exists():
                self.old.rename(self.target)  # killed between the renames: the old one is whole
            shutil.rmtree(self.old, ignore_errors=True)
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging.mkdir(parents=True)
        _barrier(self.process_group)

    def commit(self) -> None:
        """Puts the staged checkpoint in place of the target (coordinator), then all ranks wait."""
        if _is_coordinator(self.process_group):
            if self.target.exists():
                if not self.target.is_dir():
                    raise NotADirectoryError(f"{self.target}: not a directory")
                for entry in self.target.iterdir():
                    if not _is_dcp_file(entry) and not (self.staging / entry.name).exists():
                        entry.rename(self.staging / entry.name)
                self.target.rename(self.old)
                self.staging.rename(self.target)
                shutil.rmtree(self.old, ignore_errors=True)
            else:
                self.staging.rename(self.target)
        _barrier(self.process_group)

    def abort(self) -> None:
        """Removes the staging directory (after a failed save); the target is untouched."""
        if _is_coordinator(self.process_group):
            shutil.rmtree(self.staging, ignore_errors=True)
