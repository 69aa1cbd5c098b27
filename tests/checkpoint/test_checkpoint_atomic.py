"""Checkpoints that never lose data: atomic save, atomic load, async save (real files).

Every failure — a full disk (ENOSPC), a writer error, a missing, truncated or corrupted file,
an I/O error between two reads, KeyboardInterrupt — must leave the previous checkpoint
loadable and the optimizer bitwise as it was, and a retry must recover exactly.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import filesystem as dcp_fs

from tests.param_builders import train_on_random_grads
from wrapped_optim.checkpoint import load_optimizer, save_optimizer
from wrapped_optim.optimizers import PrecisionAwareAdamW
from wrapped_optim.optimizers.hybrid_offload._optimizer import HybridOffloadOptimizer
from wrapped_optim.testing import assert_state_dict_equal, checkpoint_roundtrip

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

CHUNK = 256  # bytes: many write/read items per tensor


def _params(seed: int, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in [(24, 8), (8,)]]


def _adamw(seed: int) -> tuple[Any, list[torch.nn.Parameter]]:
    params = _params(seed, torch.float32)
    return torch.optim.AdamW(params, lr=1e-2), params


def _precision(seed: int) -> tuple[Any, list[torch.nn.Parameter]]:
    params = _params(seed, torch.bfloat16)
    opt = PrecisionAwareAdamW(
        params,
        lr=1e-2,
        exp_avg_dtype=torch.float16,
        exp_avg_sq_dtype=torch.uint8,
        master_weights=True,
        store_param_remainders=True,
    )
    return opt, params


def _hybrid(moments: torch.dtype) -> Callable[[int], tuple[Any, list[torch.nn.Parameter]]]:
    def build(seed: int) -> tuple[Any, list[torch.nn.Parameter]]:
        params = _params(seed, torch.bfloat16)
        opt = HybridOffloadOptimizer(
            params,
            offload_fraction=1.0,
            cpu_optimizer_cls=PrecisionAwareAdamW,
            lr=1e-2,
            exp_avg_dtype=moments,
            exp_avg_sq_dtype=torch.float16 if moments == torch.uint8 else moments,
        )
        return opt, params

    return build


def _hybrid_adamw(seed: int) -> tuple[Any, list[torch.nn.Parameter]]:
    params = _params(seed, torch.bfloat16)
    return HybridOffloadOptimizer(params, offload_fraction=0.5, lr=1e-2), params


BUILDERS = {
    "adamw": _adamw,
    "precision(fp16,fp8)": _precision,
    "hybrid(precision fp16)": _hybrid(torch.float16),
    "hybrid(adamw)": _hybrid_adamw,
}


def _snapshot(opt: Any) -> Any:
    return checkpoint_roundtrip(opt.state_dict())


def _writer(path: Path) -> FileSystemWriter:
    return FileSystemWriter(path, single_file_per_rank=False)  # one file per item


class Planted(OSError):
    """The failure planted in DCP's file I/O."""


def _failing(original: Callable[..., Any], at: int, error: BaseException) -> Callable[..., Any]:
    calls = [0]

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == at:
            raise error
        return original(*args, **kwargs)

    return failing


# ------------------------------------------------------------------------------------------
# Atomic save
# ------------------------------------------------------------------------------------------
SAVE_FAULTS = {
    "enospc": lambda: Planted(errno.ENOSPC, "No space left on device"),
    "writer-error": lambda: RuntimeError("the storage writer failed"),
    "keyboard-interrupt": lambda: KeyboardInterrupt(),
}


@pytest.mark.parametrize("fault", sorted(SAVE_FAULTS))
@pytest.mark.parametrize("name", ["adamw", "precision(fp16,fp8)"])
@pytest.mark.parametrize("at", [1, 3])
def test_failed_save_keeps_the_old_checkpoint(
    name: str, fault: str, at: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 20 item 2: on main a failed save overwrote the good checkpoint's files."""
    build = BUILDERS[name]
    opt, params = build(0)
    train_on_random_grads(opt, params, 2, seed=1)
    good = _snapshot(opt)
    target = tmp_path / "ckpt"
    save_optimizer(opt, storage_writer=_writer(target), chunk_bytes=CHUNK)
    files_before = sorted(os.listdir(target))
    train_on_random_grads(opt, params, 2, seed=2)  # the state the failing save tries to write

    monkeypatch.setattr(
        dcp_fs, "_write_item", _failing(dcp_fs._write_item, at, SAVE_FAULTS[fault]())
    )
    with pytest.raises(BaseException) as raised:
        save_optimizer(opt, storage_writer=_writer(target), chunk_bytes=CHUNK)
    monkeypatch.undo()
    if fault == "keyboard-interrupt":
        assert raised.type is KeyboardInterrupt  # not hidden inside a CheckpointException

    assert sorted(os.listdir(target)) == files_before
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no staging directory left behind
    fresh, _ = build(9)
    load_optimizer(fresh, target)
    assert_state_dict_equal(good, _snapshot(fresh), names=("saved", "loaded"))


def test_failed_first_save_leaves_nothing_loadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opt, params = _adamw(0)
    train_on_random_grads(opt, params, 1, seed=1)
    monkeypatch.setattr(
        dcp_fs, "_write_item", _failing(dcp_fs._write_item, 2, Planted(errno.ENOSPC, "full"))
    )
    with pytest.raises(BaseException):  # noqa: B017 - DCP wraps it in a CheckpointException
        save_optimizer(opt, tmp_path / "ckpt", chunk_bytes=CHUNK)
    assert os.listdir(tmp_path) == []


def test_save_replaces_a_checkpoint_and_keeps_files_beside_it(tmp_path: Path) -> None:
    opt, params = _precision(0)
    train_on_random_grads(opt, params, 1, seed=1)
    target = tmp_path / "ckpt"
    save_optimizer(opt, storage_writer=_writer(target), chunk_bytes=CHUNK)  # many files
    (target / "config.json").write_text("{}")
    train_on_random_grads(opt, params, 1, seed=2)
    save_optimizer(opt, target)  # one file
    assert sorted(os.listdir(target)) == [".metadata", "__0_0.distcp", "config.json"]
    fresh, _ = _precision(5)
    load_optimizer(fresh, target)
    assert_state_dict_equal(_snapshot(opt), _snapshot(fresh), names=("saved", "loaded"))


def test_an_interrupted_commit_is_recovered_by_the_next_save(tmp_path: Path) -> None:
    """Killed between the two renames: the old checkpoint is whole under .<name>.old."""
    opt, params = _adamw(0)
    train_on_random_grads(opt, params, 1, seed=1)
    target = tmp_path / "ckpt"
    save_optimizer(opt, target)
    good = _snapshot(opt)
    target.rename(tmp_path / ".ckpt.old")
    train_on_random_grads(opt, params, 1, seed=2)
    with pytest.MonkeyPatch.context() as patch, pytest.raises(BaseException):  # noqa: B017
        patch.setattr(dcp_fs, "_write_item", _failing(dcp_fs._write_item, 1, Planted(5, "")))
        save_optimizer(opt, target)
    fresh, _ = _adamw(3)
    load_optimizer(fresh, target)
    assert_state_dict_equal(good, _snapshot(fresh), names=("saved", "loaded"))


# ------------------------------------------------------------------------------------------
# Atomic load
# ------------------------------------------------------------------------------------------
def _saved(name: str, path: Path) -> tuple[Any, Callable[[int], Any]]:
    """A good checkpoint in ``path`` (one file per item) and the state it holds."""
    build = BUILDERS[name]
    opt, params = build(0)
    train_on_random_grads(opt, params, 3, seed=1)
    save_optimizer(opt, storage_writer=_writer(path), chunk_bytes=CHUNK)
    return _snapshot(opt), build


def _victim(build: Callable[[int], Any]) -> tuple[Any, Any]:
    opt, params = build(7)
    train_on_random_grads(opt, params, 1, seed=4)
    return opt, _snapshot(opt)


def _reads(name: str, path: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    calls = [0]
    original = FileSystemReader._slice_file

    def counting(self: Any, *args: Any) -> Any:
        calls[0] += 1
        return original(self, *args)

    opt, _ = _victim(BUILDERS[name])
    with monkeypatch.context() as patch:
        patch.setattr(FileSystemReader, "_slice_file", counting)
        load_optimizer(opt, path, chunk_bytes=CHUNK)
    return calls[0]


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_load_failing_at_every_read_leaves_the_optimizer_unchanged(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An I/O error or KeyboardInterrupt before any read: bitwise unchanged, retry exact."""
    good, build = _saved(name, tmp_path)
    reads = _reads(name, tmp_path, monkeypatch)
    assert reads > 4
    original = FileSystemReader._slice_file
    for at in range(1, reads + 1):
        error: BaseException = KeyboardInterrupt() if at % 2 else Planted(errno.EIO, "I/O error")
        opt, before = _victim(build)
        with monkeypatch.context() as patch:
            patch.setattr(FileSystemReader, "_slice_file", _failing(original, at, error))
            with pytest.raises(BaseException) as raised:
                load_optimizer(opt, tmp_path, chunk_bytes=CHUNK)
        if isinstance(error, KeyboardInterrupt):
            assert raised.type is KeyboardInterrupt
        assert_state_dict_equal(before, _snapshot(opt), names=(f"before read {at}", "after"))
        load_optimizer(opt, tmp_path, chunk_bytes=CHUNK)  # the retry
        assert_state_dict_equal(good, _snapshot(opt), names=("saved", f"retried {at}"))


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_non_atomic_load_loads_the_same_and_keeps_no_undo(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``atomic=False``: the same state as the atomic load, with no undo copy taken; a failure
    mid-read is then not undone, and a retry from the good checkpoint recovers exactly."""
    from wrapped_optim.checkpoint import _load as load_module

    good, build = _saved(name, tmp_path)
    taken: list[Any] = []
    original_take = load_module._Undo.take

    def spying(*args: Any, **kwargs: Any) -> Any:
        taken.append(args)
        return original_take(*args, **kwargs)

    opt, _ = _victim(build)
    with monkeypatch.context() as patch:
        patch.setattr(load_module._Undo, "take", spying)
        load_optimizer(opt, tmp_path, chunk_bytes=CHUNK, atomic=False)
    assert taken == []
    assert_state_dict_equal(good, _snapshot(opt), names=("saved", "loaded, atomic=False"))

    opt, _ = _victim(build)
    original = FileSystemReader._slice_file
    reads = _reads(name, tmp_path, monkeypatch)
    with monkeypatch.context() as patch:
        patch.setattr(
            FileSystemReader,
            "_slice_file",
            _failing(original, reads, Planted(errno.EIO, "I/O error")),
        )
        with pytest.raises(BaseException):  # noqa: B017 - DCP's CheckpointException, or ours
            load_optimizer(opt, tmp_path, chunk_bytes=CHUNK, atomic=False)
    load_optimizer(opt, tmp_path, chunk_bytes=CHUNK, atomic=False)
    assert_state_dict_equal(good, _snapshot(opt), names=("saved", "retried"))


def _truncate_largest(path: Path) -> None:
    largest = max(path.glob("*.distcp"), key=lambda f: f.stat().st_size)
    with largest.open("r+b") as f:
        f.truncate(largest.stat().st_size // 2)


def _remove_last(path: Path) -> None:
    sorted(path.glob("*.distcp"), key=lambda f: f.stat().st_mtime_ns)[-1].unlink()


def _corrupt_metadata(path: Path) -> None:
    data = (path / ".metadata").read_bytes()
    (path / ".metadata").write_bytes(data[: len(data) // 2])


DAMAGE = {"truncated": _truncate_largest, "missing": _remove_last, "metadata": _corrupt_metadata}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_damaged_checkpoint_leaves_the_optimizer_unchanged(
    name: str, damage: str, tmp_path: Path
) -> None:
    good, build = _saved(name, tmp_path / "good")
    _saved(name, tmp_path / "bad")
    DAMAGE[damage](tmp_path / "bad")
    opt, before = _victim(build)
    with pytest.raises(BaseException):  # noqa: B017 - DCP's CheckpointException, or ours
        load_optimizer(opt, tmp_path / "bad", chunk_bytes=CHUNK)
    assert_state_dict_equal(before, _snapshot(opt), names=("before", "after"))
    load_optimizer(opt, tmp_path / "good", chunk_bytes=CHUNK)
    assert_state_dict_equal(good, _snapshot(opt), names=("saved", "recovered"))


# ------------------------------------------------------------------------------------------
# Issue 20 item 3: hybrid with precision-aware sub-optimizers
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("moments", [torch.float16, torch.uint8, torch.bfloat16])
def test_hybrid_with_precision_sub_optimizers_round_trips(
    moments: torch.dtype, tmp_path: Path
) -> None:
    """On main fp16 moments loaded as wrong values and FP8 refused its own checkpoint."""
    opt, params = _hybrid(moments)(0)
    train_on_random_grads(opt, params, 3, seed=1)
    save_optimizer(opt, tmp_path, chunk_bytes=CHUNK)
    twin, twin_params = _hybrid(moments)(5)
    train_on_random_grads(twin, twin_params, 1, seed=7)  # state of its own, to be overwritten
    load_optimizer(twin, tmp_path, chunk_bytes=CHUNK)
    assert_state_dict_equal(_snapshot(opt), _snapshot(twin), names=("saved", "loaded"))
    train_on_random_grads(opt, params, 1, seed=3)
    train_on_random_grads(twin, twin_params, 1, seed=3)
    assert_state_dict_equal(_snapshot(opt), _snapshot(twin), names=("saved", "loaded"))


# ------------------------------------------------------------------------------------------
# Async save
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_async_save_holds_the_state_at_the_call(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps run while the background thread writes; the checkpoint is the state at the call."""
    build = BUILDERS[name]
    opt, params = build(0)
    train_on_random_grads(opt, params, 2, seed=1)
    save_optimizer(opt, tmp_path / "sync", chunk_bytes=CHUNK)

    release = threading.Event()
    started = threading.Event()
    original = dcp_fs._write_item

    def held(*args: Any, **kwargs: Any) -> Any:
        started.set()
        assert release.wait(60), "the test never released the writer"
        return original(*args, **kwargs)

    monkeypatch.setattr(dcp_fs, "_write_item", held)
    future = save_optimizer(opt, tmp_path / "async", chunk_bytes=CHUNK, async_=True)
    assert started.wait(60)
    train_on_random_grads(opt, params, 2, seed=2)  # while the save is writing
    assert not future.done()
    release.set()
    future.result(timeout=60)
    monkeypatch.undo()

    at_call, _ = build(3)
    load_optimizer(at_call, tmp_path / "sync")
    from_async, _ = build(4)
    load_optimizer(from_async, tmp_path / "async")
    assert_state_dict_equal(_snapshot(at_call), _snapshot(from_async), names=("sync", "async"))


def test_async_save_failure_surfaces_in_the_future(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opt, params = _precision(0)
    train_on_random_grads(opt, params, 1, seed=1)
    save_optimizer(opt, tmp_path / "ckpt")
    good = _snapshot(opt)
    monkeypatch.setattr(
        dcp_fs, "_write_item", _failing(dcp_fs._write_item, 1, Planted(errno.ENOSPC, "full"))
    )
    train_on_random_grads(opt, params, 1, seed=2)
    future = save_optimizer(opt, tmp_path / "ckpt", async_=True)
    with pytest.raises(BaseException):  # noqa: B017
        future.result(timeout=60)
    monkeypatch.undo()
    fresh, _ = _precision(3)
    load_optimizer(fresh, tmp_path / "ckpt")
    assert_state_dict_equal(good, _snapshot(fresh), names=("saved", "loaded"))
