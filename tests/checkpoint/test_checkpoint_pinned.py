"""One checkpoint per load (``wrapped_optim.checkpoint._pinned``): the metadata is read
once, data files must stay inside the directory and be the ones the snapshot named, and a
caller's own storage reader keeps its first metadata for the whole load."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from wrapped_optim.checkpoint import OptimizerCheckpointError
from wrapped_optim.checkpoint._pinned import PinnedReader, _relative_paths, pinned_reader


def _saved(path: Path) -> Path:
    dcp.save({"w": torch.arange(4.0), "b": torch.ones(2)}, checkpoint_id=path, no_dist=True)
    return path


def _data_files(path: Path) -> list[str]:
    return sorted(name for name in os.listdir(path) if name.endswith(".distcp"))


def _with_files(*names: str) -> Metadata:
    storage = {
        MetadataIndex(f"t{i}"): _StorageInfo(relative_path=name, offset=0, length=1)
        for i, name in enumerate(names)
    }
    return Metadata(state_dict_metadata={}, storage_data=storage)


def test_a_load_through_the_snapshot_reads_the_checkpoint(tmp_path: Path) -> None:
    path = _saved(tmp_path / "ckpt")
    out = {"w": torch.zeros(4), "b": torch.zeros(2)}
    with pinned_reader(path, None) as reader:
        assert isinstance(reader, PinnedReader)
        assert str(reader.path).startswith("/proc/self/fd/")
        assert Path(reader.directory) == path.resolve()
        dcp.load(out, storage_reader=reader, no_dist=True)
        dcp.load(out, storage_reader=reader, no_dist=True)  # DCP resets the reader each time
    assert torch.equal(out["w"], torch.arange(4.0)) and torch.equal(out["b"], torch.ones(2))
    fd = int(str(reader.path).rsplit("/", 1)[1])
    with pytest.raises(OSError):
        os.fstat(fd)  # the pinned descriptor is closed with the load


def _per_rank_metadata(path: Path, rank: int) -> None:
    """A copy of ``.metadata`` under the name DCP reads for ``rank`` alone."""
    (path / f"__{rank}.metadata").write_bytes((path / ".metadata").read_bytes())


def test_the_metadata_is_read_once_per_rank(tmp_path: Path) -> None:
    path = _saved(tmp_path / "ckpt")
    dcp.save({"rank1": torch.ones(1)}, checkpoint_id=tmp_path / "other", no_dist=True)
    (path / "__1.metadata").write_bytes((tmp_path / "other" / ".metadata").read_bytes())
    with pinned_reader(path, None) as reader:
        first = reader.read_metadata()
        assert reader.read_metadata() is first
        other = reader.read_metadata(rank=1)
        assert set(other.state_dict_metadata) == {"rank1"}  # the rank's own file
        assert reader.read_metadata(rank=1) is other
        reader.set_up_storage_reader(first, True, rank=1, use_collectives=False)
        assert (reader.rank, reader.use_collectives) == (1, False)  # passed on to DCP's reader
        reader.storage_data = {"x": 1}
        reader.reset("/elsewhere")
        assert reader.storage_data == {} and reader.read_metadata() is first
        assert str(reader.path).startswith("/proc/self/fd/")


def test_a_missing_checkpoint_is_left_to_dcp_under_its_own_name(tmp_path: Path) -> None:
    with pinned_reader(tmp_path / "missing", None) as reader:
        assert isinstance(reader, PinnedReader)
        assert reader.path == (tmp_path / "missing").resolve()
        with pytest.raises(FileNotFoundError):
            reader.read_metadata()


def test_a_checkpoint_whose_commit_was_cut_between_renames_is_read_from_old(
    tmp_path: Path,
) -> None:
    _saved(tmp_path / ".ckpt.old")
    with pinned_reader(tmp_path / "ckpt", None) as reader:
        assert isinstance(reader, PinnedReader)
        assert Path(reader.directory) == (tmp_path / ".ckpt.old").resolve()


@pytest.mark.parametrize("name", ["../x.distcp", "/etc/passwd", "", "a/../b.distcp", ".."])
def test_data_files_outside_the_directory_are_refused(name: str, tmp_path: Path) -> None:
    path = _saved(tmp_path / "ckpt")
    with pinned_reader(path, None) as reader, pytest.raises(OptimizerCheckpointError) as raised:
        reader.set_up_storage_reader(_with_files("ok.distcp", name), True)
    assert str(raised.value) == (
        f"{path.resolve()}: .metadata names the data file {name!r}, outside the checkpoint "
        "directory; this is not a checkpoint save_optimizer or dcp.save wrote"
    )


def test_metadata_without_storage_data_names_no_file() -> None:
    assert _relative_paths(Metadata(state_dict_metadata={})) == set()


def test_data_files_inside_the_directory_are_accepted(tmp_path: Path) -> None:
    path = _saved(tmp_path / "ckpt")
    with pinned_reader(path, None) as reader:
        reader.set_up_storage_reader(_with_files("sub/a.distcp", "b.distcp"), True)
        assert len(reader.storage_data) == 2  # DCP's own set-up ran


@pytest.mark.parametrize("change", ["rewritten", "removed"])
def test_a_data_file_changed_after_the_snapshot_stops_the_load(change: str, tmp_path: Path) -> None:
    path = _saved(tmp_path / "ckpt")
    (name,) = _data_files(path)
    out = {"w": torch.zeros(4), "b": torch.zeros(2)}
    with pinned_reader(path, None) as reader:
        reader.set_up_storage_reader(reader.read_metadata(), True)
        if change == "removed":
            os.unlink(path / name)
        else:  # a new file under the same name, as a concurrent save's commit leaves it
            data = (path / name).read_bytes()
            os.unlink(path / name)
            (path / name).write_bytes(data + b"\0")
        with pytest.raises(BaseException) as raised:
            dcp.load(out, storage_reader=reader, no_dist=True)
    error = raised.value
    failures = getattr(error, "failures", None)
    if failures:
        error = next(iter(failures.values()))[0]
    what = "is gone" if change == "removed" else "changed"
    assert isinstance(error, OptimizerCheckpointError)
    assert str(error) == (
        f"{path.resolve()}: data file {name!r} {what} since this load read .metadata (a save "
        "into the same directory during the load?); nothing was loaded: load again once the "
        "save has finished"
    )
    assert torch.equal(out["w"], torch.zeros(4))


def test_a_file_the_snapshot_did_not_note_is_not_compared(tmp_path: Path) -> None:
    path = _saved(tmp_path / "ckpt")
    (name,) = _data_files(path)
    with pinned_reader(path, None) as reader:
        reader._check({name})  # never noted: nothing to compare it with
        reader.set_up_storage_reader(_with_files("later.distcp"), True)
        (path / "later.distcp").write_bytes(b"new")  # noted as missing, then written
        reader._check({"later.distcp"})
        with pytest.raises(OptimizerCheckpointError) as raised:
            reader._check({"../x"})
    assert str(raised.value).startswith(f"{path.resolve()}: .metadata names the data file '../x'")


class _Recording(FileSystemReader):
    """A caller's reader that records what the load asks of it."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.calls: list[tuple[str, Any]] = []
        self.reads = 0

    def reset(self, checkpoint_id: Any = None) -> None:
        self.calls.append(("reset", checkpoint_id))
        super().reset(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self.reads += 1
        self.calls.append(("read_metadata", (args, kwargs)))
        return super().read_metadata(*args, **kwargs)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.calls.append(("set_up_storage_reader", (is_coordinator, args, kwargs)))
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)


def test_a_callers_reader_keeps_its_first_metadata_and_does_the_reading(tmp_path: Path) -> None:
    path = _saved(tmp_path / "ckpt")
    _per_rank_metadata(path, 2)
    _per_rank_metadata(path, 3)
    inner = _Recording(str(path))
    out = {"w": torch.zeros(4), "b": torch.zeros(2)}
    with pinned_reader(None, inner) as reader:
        assert inner.calls == []  # no checkpoint_id: the reader is used as it was given
        first = reader.read_metadata()
        assert reader.read_metadata() is first and inner.reads == 1
        assert reader.read_metadata(rank=2) is not first and inner.reads == 2
        assert inner.calls == [("read_metadata", ((), {})), ("read_metadata", ((), {"rank": 2}))]
        reader.read_metadata("positional", rank=3)  # passed on as given
        assert inner.calls[-1] == ("read_metadata", (("positional",), {"rank": 3}))
        reader.set_up_storage_reader(first, False, "extra", key="value")
        assert inner.calls[-1] == ("set_up_storage_reader", (False, ("extra",), {"key": "value"}))
        dcp.load(out, storage_reader=reader, no_dist=True)
        assert inner.reads == 3  # the load saw the first metadata again
        assert type(reader).validate_checkpoint_id(path) is False
        plan = object()
        assert reader.prepare_local_plan(plan) is plan  # type: ignore[arg-type]
        plans = [object()]
        assert reader.prepare_global_plan(plans) is plans  # type: ignore[arg-type]
    assert torch.equal(out["w"], torch.arange(4.0)) and torch.equal(out["b"], torch.ones(2))
    assert inner.storage_data  # its own set-up ran
    with pinned_reader(path, _Recording(str(tmp_path))) as reader:
        assert reader.inner.calls == [("reset", path)]  # type: ignore[attr-defined]
        reader.reset("again")
        assert reader.inner.calls[-1] == ("reset", "again")  # type: ignore[attr-defined]
