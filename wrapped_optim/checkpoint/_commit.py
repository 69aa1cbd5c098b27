"""Atomic commit of a checkpoint directory: write aside, then rename into place, so a save
that fails half-way never destroys the checkpoint it replaces. The protocol and its crash
states are in docs/checkpoint.md ("Commit protocol").
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = [
    "CheckpointCommit",
    "SaveInProgressError",
    "committed_directory",
    "resolve_checkpoint_path",
]

_STAGING = ".{}.saving"
_OLD = ".{}.old"
_LOCK = ".{}.lock"


class SaveInProgressError(RuntimeError):
    """Another save into the same checkpoint directory is running (another process or thread
    holds its lock); nothing of this save was written.

    Example:
        >>> str(SaveInProgressError("ckpt: another save is in progress")).split(":")[0]
        'ckpt'
    """


def _cwd() -> Path | None:
    try:
        return Path(os.getcwd())
    except OSError:  # already removed by someone else
        return None


def _within(path: Path | None, directory: Path) -> bool:
    return path is not None and (path == directory or directory in path.parents)


class _SaveLock:
    """An exclusive ``flock`` on ``.<name>.lock`` beside the target, held from the start of
    a save's staging to its commit or abort; a second saver fails at once instead of
    clearing the first one's staging directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def acquire(self, target: Path) -> None:
        # POSIX only (fcntl): O_NOFOLLOW and O_CLOEXEC exist on every system this runs on.
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError as error:
            raise FileExistsError(
                f"{self.path}: cannot open the save lock ({error.strerror}); it is a name "
                "save_optimizer reserves: remove what is there"
            ) from error
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # The lock file may have been removed and made anew by a save that just ended:
            # the lock counts only on the file the name holds now.
            if os.fstat(fd).st_ino != os.stat(self.path, follow_symlinks=False).st_ino:
                raise BlockingIOError
        except OSError as error:
            os.close(fd)
            raise SaveInProgressError(
                f"{target}: another save into this checkpoint is in progress (it holds "
                f"{self.path.name}); wait for it to finish, or save to another directory"
            ) from error
        self.fd = fd

    @property
    def held(self) -> bool:
        return self.fd is not None

    def release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            os.close(fd)


def resolve_checkpoint_path(path: str | os.PathLike[str]) -> Path:
    """``path`` made absolute with every symlink resolved, as the save and load use it.

    Resolved once, at the call: an ``os.chdir`` or a symlink changed afterwards does not move
    the checkpoint, and ``link/..`` is the parent of the link's target, as the kernel sees it.

    Example:
        >>> import os, tempfile
        >>> from pathlib import Path
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     (Path(tmp) / "step_100").mkdir()
        ...     os.symlink("step_100", Path(tmp) / "latest")
        ...     resolve_checkpoint_path(Path(tmp) / "latest").name
        'step_100'
    """
    return Path(os.path.realpath(os.fspath(path)))


def committed_directory(path: str | os.PathLike[str]) -> Path:
    """The directory holding the committed checkpoint of ``path`` (resolved), for a load.

    That is ``path`` itself, except after a save killed between the two renames of its
    commit: then the target is missing and the old checkpoint is whole under ``.<name>.old``,
    which is read (and not moved: the next save puts it back).

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     (Path(tmp) / ".ckpt.old").mkdir()
        ...     committed_directory(Path(tmp) / "ckpt").name
        '.ckpt.old'
    """
    target = resolve_checkpoint_path(path)
    old = target.parent / _OLD.format(target.name)
    if not os.path.lexists(target) and old.is_dir() and not old.is_symlink():
        return old
    return target


def _is_dcp_file(path: Path) -> bool:
    return path.name in (".metadata", ".metadata.tmp") or path.suffix == ".distcp"


def _distributed() -> bool:
    """Whether a process group is initialized (any group's ranks and barriers need one)."""
    return dist.is_available() and dist.is_initialized()


def _is_coordinator(process_group: Any) -> bool:
    if not _distributed():
        return True
    return dist.get_rank(process_group) == 0


def _barrier(process_group: Any) -> None:
    if _distributed():
        dist.barrier(group=process_group)


def _refuse_planted(path: Path) -> None:
    """A reserved name that is a symlink or not a directory is refused, never followed."""
    if path.is_symlink() or (os.path.lexists(path) and not path.is_dir()):
        kind = "a symlink" if path.is_symlink() else "not a directory"
        raise FileExistsError(
            f"{path}: is {kind}, at a name save_optimizer reserves for its own staging "
            "directories; remove it (the save never follows, moves or deletes it)"
        )


def _link_or_copy(source: str, destination: str) -> None:
    """A file linked (or copied); never a symlink, which ``_link_side_files`` recreates."""
    try:
        os.link(source, destination)
    except OSError:  # a filesystem without hard links
        shutil.copy2(source, destination)


def _link_side_files(target: Path, staging: Path) -> None:
    """Step 1: every non-DCP entry of ``target`` linked (or copied) into ``staging``."""
    for entry in target.iterdir():
        destination = staging / entry.name
        if _is_dcp_file(entry) or os.path.lexists(destination):
            continue
        if entry.is_symlink():
            os.symlink(os.readlink(entry), destination)
        elif entry.is_dir():
            shutil.copytree(entry, destination, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(entry), str(destination))


def _rename(source: Path, destination: Path) -> None:
    """Steps 2a and 2b (one ``rename`` each)."""
    source.rename(destination)


def _rescue_side_files(old: Path, target: Path) -> None:
    """Step 3a: non-DCP entries of ``old`` that ``target`` lacks are moved into it."""
    for entry in old.iterdir():
        if not _is_dcp_file(entry) and not os.path.lexists(target / entry.name):
            entry.rename(target / entry.name)


def _remove(directory: Path) -> None:
    """Step 3b, and clearing a stale staging directory: only real directories of ours."""
    if directory.is_dir() and not directory.is_symlink():
        shutil.rmtree(directory, ignore_errors=True)


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
        self.target = resolve_checkpoint_path(target)
        self.staging = self.target.parent / _STAGING.format(self.target.name)
        self.old = self.target.parent / _OLD.format(self.target.name)
        self.process_group = process_group
        self._lock = _SaveLock(self.target.parent / _LOCK.format(self.target.name))

    def prepare(self) -> None:
        """Takes the save lock (``SaveInProgressError`` if another save holds it), recovers
        an interrupted commit, clears stale staging files; all ranks wait for it."""
        if _is_coordinator(self.process_group):
            self.target.parent.mkdir(parents=True, exist_ok=True)
            self._lock.acquire(self.target)
            _refuse_planted(self.old)
            _refuse_planted(self.staging)
            if self.old.is_dir():
                if not os.path.lexists(self.target):
                    _rename(self.old, self.target)  # killed between the renames: roll back
                else:  # killed after them: the new checkpoint is in place
                    _rescue_side_files(self.old, self.target)
                    _remove(self.old)
            _remove(self.staging)
            self.staging.mkdir()  # beside the target, whose parent was just made
        _barrier(self.process_group)

    def commit(self) -> None:
        """Puts the staged checkpoint in place of the target (coordinator), then all ranks wait.

        A process whose working directory is the target (``save_optimizer(opt, ".")``) or
        inside it is moved to the same path in the new checkpoint: the replaced directory is
        removed, and a working directory must not vanish under the caller."""
        cwd = _cwd()
        try:
            self._commit()
        finally:
            self._lock.release()
        if _within(cwd, self.target) and cwd is not None and cwd.is_dir():
            os.chdir(cwd)

    def _commit(self) -> None:
        if _is_coordinator(self.process_group):
            if os.path.lexists(self.target):
                if self.target.is_symlink() or not self.target.is_dir():
                    raise NotADirectoryError(
                        f"{self.target}: not a directory (or replaced by a symlink during the "
                        "save); the checkpoint stays in the staging directory "
                        f"{self.staging.name} until the next save"
                    )
                _link_side_files(self.target, self.staging)
                _rename(self.target, self.old)
                _rename(self.staging, self.target)
                _rescue_side_files(self.old, self.target)
                _remove(self.old)
            else:
                _rename(self.staging, self.target)
        _barrier(self.process_group)

    def abort(self) -> None:
        """Removes the staging directory (after a failed save); the target is untouched."""
        if _is_coordinator(self.process_group) and self._lock.held:
            _remove(self.staging)  # never another saver's: only under this save's lock
            self._lock.release()
