"""The atomic commit of a checkpoint directory (``wrapped_optim.checkpoint._commit``): the
save lock, the recovery of a cut commit, files kept beside the checkpoint, and what is
refused. The crash states themselves are driven through whole saves in
``tests/test_checkpoint_hostile.py``; these check each step directly and quickly."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from wrapped_optim.checkpoint._commit import (
    CheckpointCommit,
    SaveInProgressError,
    _link_side_files,
    committed_directory,
    resolve_checkpoint_path,
)


def _tree(path: Path) -> dict[str, str]:
    """Every file under ``path`` (links shown as ``-> target``) with its text."""
    out = {}
    for root, dirs, files in os.walk(path):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            full = Path(root) / name
            key = str(full.relative_to(path))
            out[key] = f"-> {os.readlink(full)}" if full.is_symlink() else full.read_text()
    return out


def _checkpoint(path: Path, data: str, **side: str) -> None:
    path.mkdir(parents=True)
    (path / ".metadata").write_text(f"meta {data}")
    (path / "__0_0.distcp").write_text(f"data {data}")
    for name, text in side.items():
        (path / name).write_text(text)


def _staged(commit: CheckpointCommit, data: str) -> None:
    (commit.staging / ".metadata").write_text(f"meta {data}")
    (commit.staging / "__0_0.distcp").write_text(f"data {data}")


def test_the_names_beside_the_target(tmp_path: Path) -> None:
    commit = CheckpointCommit(tmp_path / "a" / "ckpt", process_group=None)
    assert commit.target == (tmp_path / "a" / "ckpt").resolve()
    assert commit.staging == commit.target.parent / ".ckpt.saving"
    assert commit.old == commit.target.parent / ".ckpt.old"
    assert commit.process_group is None


def test_a_first_save_commits_into_a_new_directory_and_leaves_nothing_else(
    tmp_path: Path,
) -> None:
    commit = CheckpointCommit(tmp_path / "runs" / "a" / "ckpt", process_group=None)
    commit.prepare()  # the parents are made too
    lock = tmp_path / "runs" / "a" / ".ckpt.lock"
    assert commit.staging.is_dir() and lock.is_file()
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600
    _staged(commit, "new")
    commit.commit()
    assert os.listdir(tmp_path / "runs" / "a") == ["ckpt"]
    assert _tree(commit.target) == {".metadata": "meta new", "__0_0.distcp": "data new"}


def test_a_save_replaces_the_checkpoint_and_keeps_what_lies_beside_it(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    _checkpoint(target, "old", **{"config.json": "cfg", "notes.txt": "old notes"})
    (target / ".metadata.tmp").write_text("torn")
    (target / "extra").mkdir()
    (target / "extra" / "a.txt").write_text("a")
    os.symlink("config.json", target / "link")
    commit = CheckpointCommit(target, process_group=None)
    commit.prepare()
    _staged(commit, "new")
    (commit.staging / "notes.txt").write_text("new notes")  # the new save's own file wins
    commit.commit()
    assert _tree(target) == {
        ".metadata": "meta new",
        "__0_0.distcp": "data new",
        "config.json": "cfg",
        "notes.txt": "new notes",
        "extra/a.txt": "a",
        "link": "-> config.json",
    }
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_side_files_are_copied_where_hard_links_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "ckpt"
    _checkpoint(target, "old", **{"config.json": "cfg"})
    (target / "extra").mkdir()
    (target / "extra" / "a.txt").write_text("a")
    commit = CheckpointCommit(target, process_group=None)
    commit.prepare()
    _staged(commit, "new")

    def no_links(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EPERM, "hard links not supported")

    monkeypatch.setattr(os, "link", no_links)
    commit.commit()
    assert _tree(target)["config.json"] == "cfg" and _tree(target)["extra/a.txt"] == "a"


def test_side_files_are_hard_linked_not_copied(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    _checkpoint(target, "old", **{"config.json": "cfg"})
    inode = (target / "config.json").stat().st_ino
    commit = CheckpointCommit(target, process_group=None)
    commit.prepare()
    _staged(commit, "new")
    commit.commit()
    assert (target / "config.json").stat().st_ino == inode


@pytest.mark.parametrize("cut", ["between the renames", "after the renames"])
def test_a_cut_commit_is_recovered_by_the_next_save(cut: str, tmp_path: Path) -> None:
    _checkpoint(tmp_path / ".ckpt.old", "old", **{"config.json": "cfg", "notes.txt": "old"})
    expected = {".metadata": "meta old", "__0_0.distcp": "data old", "notes.txt": "old"}
    read_from = tmp_path / ".ckpt.old"
    if cut == "after the renames":  # finished: the old side files join the new checkpoint
        _checkpoint(tmp_path / "ckpt", "new", **{"notes.txt": "new"})
        expected = {".metadata": "meta new", "__0_0.distcp": "data new", "notes.txt": "new"}
        read_from = tmp_path / "ckpt"
    assert committed_directory(tmp_path / "ckpt") == read_from.resolve()
    commit = CheckpointCommit(tmp_path / "ckpt", process_group=None)
    commit.prepare()
    assert _tree(tmp_path / "ckpt") == {**expected, "config.json": "cfg"}
    assert not commit.old.exists()
    commit.abort()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_stale_staging_directory_is_cleared(tmp_path: Path) -> None:
    (tmp_path / ".ckpt.saving").mkdir()
    (tmp_path / ".ckpt.saving" / "__9_9.distcp").write_text("stale")
    commit = CheckpointCommit(tmp_path / "ckpt", process_group=None)
    commit.prepare()
    assert os.listdir(commit.staging) == []
    commit.abort()
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize("name", [".ckpt.old", ".ckpt.saving"])
@pytest.mark.parametrize("kind", ["symlink", "file"])
def test_a_planted_reserved_name_is_refused_and_left_alone(
    name: str, kind: str, tmp_path: Path
) -> None:
    (tmp_path / "elsewhere").mkdir()
    planted = tmp_path / name
    if kind == "symlink":
        planted.symlink_to(tmp_path / "elsewhere")
    else:
        planted.write_text("mine")
    commit = CheckpointCommit(tmp_path / "ckpt", process_group=None)
    with pytest.raises(FileExistsError) as raised:
        commit.prepare()
    what = "a symlink" if kind == "symlink" else "not a directory"
    assert str(raised.value) == (
        f"{tmp_path.resolve() / name}: is {what}, at a name save_optimizer reserves for its "
        "own staging directories; remove it (the save never follows, moves or deletes it)"
    )
    assert planted.is_symlink() == (kind == "symlink")
    commit.abort()  # the lock was taken: abort gives it back
    assert not (tmp_path / ".ckpt.lock").exists()
    assert committed_directory(tmp_path / "ckpt") == (tmp_path / "ckpt").resolve()


def test_a_second_saver_is_refused_while_the_first_holds_the_lock(tmp_path: Path) -> None:
    first = CheckpointCommit(tmp_path / "ckpt", process_group=None)
    first.prepare()
    (first.staging / "__0_0.distcp").write_text("first")
    second = CheckpointCommit(tmp_path / "ckpt", process_group=None)
    with pytest.raises(SaveInProgressError) as raised:
        second.prepare()
    assert str(raised.value) == (
        f"{first.target}: another save into this checkpoint is in progress (it holds "
        ".ckpt.lock); wait for it to finish, or save to another directory"
    )
    assert isinstance(raised.value.__cause__, OSError)
    second.abort()  # holds no lock: the first saver's staging stays
    assert (first.staging / "__0_0.distcp").read_text() == "first"
    first.commit()
    assert not (tmp_path / ".ckpt.lock").exists()
    third = CheckpointCommit(tmp_path / "ckpt", process_group=None)
    third.prepare()  # free again once the first has committed
    third.abort()


@pytest.mark.parametrize("replacement", ["new file", "symlink to the locked file"])
def test_a_lock_file_replaced_while_locking_does_not_count(
    replacement: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commit = CheckpointCommit(tmp_path / "ckpt", process_group=None)
    lock = tmp_path / ".ckpt.lock"
    real_flock = fcntl.flock

    def flock_then_replace(fd: int, operation: int) -> None:
        real_flock(fd, operation)
        if replacement == "new file":  # a save that just ended removed it, another made it
            os.unlink(lock)
            lock.write_text("")
        else:  # the name no longer holds the locked file, though a link leads to it
            os.link(lock, tmp_path / "elsewhere")
            os.unlink(lock)
            lock.symlink_to(tmp_path / "elsewhere")

    monkeypatch.setattr(fcntl, "flock", flock_then_replace)
    with pytest.raises(SaveInProgressError, match="another save into this checkpoint"):
        commit.prepare()
    assert not commit.staging.exists()


def test_a_lock_name_that_cannot_be_opened_is_named(tmp_path: Path) -> None:
    os.symlink(tmp_path / "nowhere", tmp_path / ".ckpt.lock")
    commit = CheckpointCommit(tmp_path / "ckpt", process_group=None)
    with pytest.raises(FileExistsError) as raised:
        commit.prepare()
    assert str(raised.value) == (
        f"{tmp_path.resolve() / '.ckpt.lock'}: cannot open the save lock (Too many levels of "
        "symbolic links); it is a name save_optimizer reserves: remove what is there"
    )
    assert not (tmp_path / "nowhere").exists()  # never followed


def test_a_target_that_is_no_longer_a_directory_keeps_the_staged_checkpoint(
    tmp_path: Path,
) -> None:
    commit = CheckpointCommit(tmp_path / "ckpt", process_group=None)
    commit.prepare()
    _staged(commit, "new")
    (tmp_path / "ckpt").write_text("a file")
    with pytest.raises(NotADirectoryError) as raised:
        commit.commit()
    assert str(raised.value) == (
        f"{commit.target}: not a directory (or replaced by a symlink during the save); the "
        "checkpoint stays in the staging directory .ckpt.saving until the next save"
    )
    assert (commit.staging / ".metadata").read_text() == "meta new"
    assert not (tmp_path / ".ckpt.lock").exists()  # released all the same


def test_a_target_replaced_by_a_symlink_is_refused(tmp_path: Path) -> None:
    commit = CheckpointCommit(tmp_path / "ckpt", process_group=None)
    commit.prepare()
    (tmp_path / "other").mkdir()
    (tmp_path / "ckpt").symlink_to(tmp_path / "other")
    with pytest.raises(NotADirectoryError, match="replaced by a symlink"):
        commit.commit()
    assert os.listdir(tmp_path / "other") == []


@pytest.mark.parametrize("inside", [False, True])
def test_a_working_directory_in_the_target_moves_to_the_new_checkpoint(
    inside: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "ckpt"
    _checkpoint(target, "old")
    (target / "sub").mkdir()
    where = target / "sub" if inside else target
    monkeypatch.chdir(where)
    commit = CheckpointCommit(target if inside else ".", process_group=None)
    commit.prepare()
    _staged(commit, "new")
    commit.commit()
    assert Path(os.getcwd()) == where.resolve()
    assert Path(".").resolve() == where.resolve() and Path(os.getcwd()).is_dir()
    assert (target / ".metadata").read_text() == "meta new"
    assert os.stat(".").st_ino == os.stat(where).st_ino  # the new directory, not a ghost


def test_a_working_directory_elsewhere_is_left_where_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "ckpt"
    _checkpoint(target, "old")
    (tmp_path / "ckpt2").mkdir()
    monkeypatch.chdir(tmp_path / "ckpt2")  # a sibling whose name starts the same
    commit = CheckpointCommit(target, process_group=None)
    commit.prepare()
    _staged(commit, "new")
    (tmp_path / "ckpt2").rmdir()  # gone under the caller: not ours to recreate
    commit.commit()
    with pytest.raises(FileNotFoundError):
        os.getcwd()


@pytest.mark.parametrize("old", ["file", "symlink"])
def test_only_a_real_old_directory_is_read_in_place_of_a_missing_target(
    old: str, tmp_path: Path
) -> None:
    (tmp_path / "real").mkdir()
    if old == "file":
        (tmp_path / ".ckpt.old").write_text("x")
    else:
        (tmp_path / ".ckpt.old").symlink_to(tmp_path / "real")
    assert committed_directory(tmp_path / "ckpt") == (tmp_path / "ckpt").resolve()


def test_a_path_is_resolved_once_through_its_symlinks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "step_1").mkdir()
    (tmp_path / "latest").symlink_to("step_1")
    monkeypatch.chdir(tmp_path)
    assert resolve_checkpoint_path("latest") == (tmp_path / "step_1").resolve()
    assert resolve_checkpoint_path(Path("latest") / "..") == tmp_path.resolve()


def test_step_one_links_every_side_file_and_no_dcp_file(tmp_path: Path) -> None:
    target, staging = tmp_path / "ckpt", tmp_path / ".ckpt.saving"
    _checkpoint(target, "old", **{"a.json": "a", "z.json": "z"})
    for name in (".metadata.tmp", "__1_0.distcp", "__2_0.distcp"):
        (target / name).write_text("old rank data")  # a larger world's save
    (target / "extra").mkdir()
    (target / "extra" / "f.txt").write_text("f")
    os.symlink("f.txt", target / "extra" / "link")
    os.symlink("a.json", target / "top_link")
    staging.mkdir()
    (staging / "z.json").write_text("new z")
    _link_side_files(target, staging)
    assert _tree(staging) == {
        "a.json": "a",
        "z.json": "new z",
        "extra/f.txt": "f",
        "extra/link": "-> f.txt",
        "top_link": "-> a.json",
    }
    assert (staging / "a.json").stat().st_ino == (target / "a.json").stat().st_ino
    assert (staging / "extra" / "f.txt").stat().st_ino == (target / "extra" / "f.txt").stat().st_ino


def test_a_commit_never_carries_the_old_checkpoints_data_files(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    _checkpoint(target, "old", **{"config.json": "cfg"})
    for name in (".metadata.tmp", "__1_0.distcp"):
        (target / name).write_text("old rank data")
    commit = CheckpointCommit(target, process_group=None)
    commit.prepare()
    (commit.staging / "__0_0.distcp").write_text("data new")  # no .metadata staged
    commit.commit()
    assert _tree(target) == {"__0_0.distcp": "data new", "config.json": "cfg"}


def test_a_lock_file_removed_during_the_save_does_not_fail_it(tmp_path: Path) -> None:
    commit = CheckpointCommit(tmp_path / "ckpt", process_group=None)
    commit.prepare()
    _staged(commit, "new")
    os.unlink(tmp_path / ".ckpt.lock")
    commit.commit()
    assert (tmp_path / "ckpt" / ".metadata").read_text() == "meta new"


def test_an_old_directory_that_cannot_all_be_removed_does_not_fail_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "ckpt"
    _checkpoint(target, "old", **{"stuck.txt": "s"})
    commit = CheckpointCommit(target, process_group=None)
    commit.prepare()
    _staged(commit, "new")
    real_unlink = os.unlink

    def stuck(path: str, *args: object, **kwargs: object) -> None:
        if os.fspath(path) == "stuck.txt":
            raise PermissionError(errno.EACCES, "Permission denied", path)
        real_unlink(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "unlink", stuck)
    commit.commit()  # the new checkpoint is in place: what is left of the old one waits
    assert _tree(target) == {".metadata": "meta new", "__0_0.distcp": "data new", "stuck.txt": "s"}
    assert _tree(commit.old) == {"stuck.txt": "s"}
    monkeypatch.undo()
    again = CheckpointCommit(target, process_group=None)
    again.prepare()  # the next save clears it
    assert not commit.old.exists()
    again.abort()


def test_a_child_process_started_during_a_save_does_not_inherit_the_lock(
    tmp_path: Path,
) -> None:
    commit = CheckpointCommit(tmp_path / "ckpt", process_group=None)
    commit.prepare()
    child = subprocess.run(
        ["ls", "-l", "/proc/self/fd/"], close_fds=False, capture_output=True, text=True, check=True
    )
    assert ".ckpt.lock" not in child.stdout
    commit.abort()


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A real one-process gloo group, torn down after the test."""
    assert not dist.is_initialized()
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("subgroup", [False, True])
def test_rank_zero_of_a_process_group_commits(subgroup: bool, tmp_path: Path) -> None:
    group = dist.new_group([0]) if subgroup else None
    commit = CheckpointCommit(tmp_path / "ckpt", process_group=group)
    assert commit.process_group is group
    commit.prepare()
    assert commit.staging.is_dir()
    _staged(commit, "new")
    commit.commit()
    assert _tree(tmp_path / "ckpt") == {".metadata": "meta new", "__0_0.distcp": "data new"}
    again = CheckpointCommit(tmp_path / "ckpt", process_group=group)
    again.prepare()
    again.abort()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
