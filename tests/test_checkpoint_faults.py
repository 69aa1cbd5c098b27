"""Checkpoint faults a user can meet, each a clear ``Exception`` (issue #36, items 3, 8-10).

- a checkpoint that cannot be read (a data file that is a directory, missing, truncated, a
  symlink loop, ``.metadata`` a directory, a pickle frame bomb) raises
  ``OptimizerCheckpointError`` naming the file and the cause, DCP's exception chained, and
  leaves the optimizer as it was;
- ``load_optimizer`` refuses a non-positive ``chunk_bytes`` as ``save_optimizer`` does;
- ``save_optimizer(opt, ".")`` keeps the caller's working directory usable;
- a save into a directory another save is writing fails at once with ``SaveInProgressError``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from wrapped_optim.checkpoint import OptimizerCheckpointError, load_optimizer, save_optimizer
from wrapped_optim.checkpoint._commit import CheckpointCommit, SaveInProgressError
from wrapped_optim.testing import assert_state_dict_equal

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _stepped() -> torch.optim.Optimizer:
    p = torch.nn.Parameter(torch.arange(8.0))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.ones(8)
    opt.step()
    return opt


def _data_file(d: Path) -> Path:
    return sorted(d.glob("*.distcp"))[0]


def _data_is_a_directory(d: Path) -> str:
    f = _data_file(d)
    f.unlink()
    f.mkdir()
    return f"{f.name}: IsADirectoryError"


def _data_missing(d: Path) -> str:
    f = _data_file(d)
    f.unlink()
    return f"{f.name}: FileNotFoundError"


def _data_truncated(d: Path) -> str:
    f = _data_file(d)
    f.write_bytes(f.read_bytes()[:40])
    return "Error"


def _symlink_loop(d: Path) -> str:
    f = _data_file(d)
    f.unlink()
    os.symlink(f.name, f)
    return f"{f.name}: OSError: Too many levels of symbolic links"


def _metadata_is_a_directory(d: Path) -> str:
    (d / ".metadata").unlink()
    (d / ".metadata").mkdir()
    return ".metadata"


def _pickle_frame_bomb(d: Path) -> str:
    # protocol 4, a FRAME opcode announcing 2**62 bytes, then None and STOP
    (d / ".metadata").write_bytes(b"\x80\x04\x95" + (2**62).to_bytes(8, "little") + b"N.")
    return "metadata"


DAMAGE: dict[str, Callable[[Path], str]] = {
    "data-file-is-a-directory": _data_is_a_directory,
    "data-file-missing": _data_missing,
    "data-file-truncated": _data_truncated,
    "data-file-symlink-loop": _symlink_loop,
    "metadata-is-a-directory": _metadata_is_a_directory,
    "pickle-frame-bomb": _pickle_frame_bomb,
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_an_unreadable_checkpoint_is_one_catchable_error(kind: str, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    save_optimizer(_stepped(), ckpt)
    expected = DAMAGE[kind](ckpt)
    other = _stepped()
    with torch.no_grad():
        other.param_groups[0]["params"][0].mul_(3)
    before = other.state_dict()
    try:
        load_optimizer(other, ckpt)
    except Exception as error:  # the point: `except Exception` catches it
        assert isinstance(error, OptimizerCheckpointError), type(error)
        message = str(error)
        assert message.startswith(f"cannot read the checkpoint {ckpt}"), message
        assert expected in message, message
        assert "/proc/self/fd" not in message
        assert isinstance(error.__cause__, CheckpointException)
    else:
        pytest.fail("a damaged checkpoint loaded")
    assert_state_dict_equal(other.state_dict(), before)


@pytest.mark.parametrize("chunk_bytes", [0, -1])
def test_load_refuses_a_non_positive_chunk_bytes_as_save_does(
    chunk_bytes: int, tmp_path: Path
) -> None:
    opt = _stepped()
    with pytest.raises(ValueError, match="chunk_bytes must be positive"):
        save_optimizer(opt, tmp_path / "never", chunk_bytes=chunk_bytes)
    save_optimizer(opt, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="chunk_bytes must be a positive number of bytes"):
        load_optimizer(opt, tmp_path / "ckpt", chunk_bytes=chunk_bytes)


def test_saving_into_the_working_directory_keeps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "run"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    opt = _stepped()
    save_optimizer(opt, ".")
    assert Path(os.getcwd()) == work  # raised FileNotFoundError before the fix
    assert Path("notes.txt").read_text() == "mine"
    save_optimizer(opt, ".")  # and again, from the new directory
    other = _stepped()
    load_optimizer(other, ".")
    assert_state_dict_equal(other.state_dict(), opt.state_dict())
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_a_second_saver_is_told_another_save_is_in_progress(tmp_path: Path) -> None:
    """The first save is held inside its DCP write (its lock taken, its staging filled);
    a second save into the same directory fails at once and touches nothing of it."""
    target = tmp_path / "ckpt"
    opt = _stepped()
    save_optimizer(opt, target)
    first = CheckpointCommit(target, process_group=None)
    first.prepare()  # what a running save holds: the lock and its staging directory
    (first.staging / "partial").write_text("being written")
    with pytest.raises(SaveInProgressError, match="another save into this checkpoint is in"):
        save_optimizer(opt, target)
    assert (first.staging / "partial").read_text() == "being written"
    first.abort()
    save_optimizer(opt, target)  # the lock was released
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_concurrent_savers_in_threads_either_save_or_hear_why(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    errors: list[BaseException] = []
    saved = []

    def save(seed: int) -> None:
        p = torch.nn.Parameter(torch.full((64,), float(seed)))
        opt = torch.optim.AdamW([p], lr=0.1)
        p.grad = torch.ones(64)
        opt.step()
        try:
            save_optimizer(opt, target)
            saved.append(seed)
        except BaseException as error:  # any other kind is the bug this test is about
            errors.append(error)

    threads = [threading.Thread(target=save, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert saved, errors
    assert all(isinstance(error, SaveInProgressError) for error in errors), errors
    p = torch.nn.Parameter(torch.zeros(64))
    other = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.ones(64)
    other.step()
    load_optimizer(other, target)  # the last committed checkpoint is whole
    assert other.state[p]["exp_avg"].shape == (64,)


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "stepped"])
def test_zero_element_params_keep_their_empty_precision_aware_state(
    fresh: bool, tmp_path: Path
) -> None:
    """Issue #36 item 6: a (0, 4) parameter's empty FP8 moments and fp16 master survive the
    streaming round trip, as they survive ``load_state_dict``."""
    from wrapped_optim.optimizers import PrecisionAwareAdamW

    def make() -> tuple[PrecisionAwareAdamW, torch.nn.Parameter]:
        empty = torch.nn.Parameter(torch.zeros(0, 4, dtype=torch.bfloat16))
        full = torch.nn.Parameter(torch.ones(3, 4, dtype=torch.bfloat16))
        opt = PrecisionAwareAdamW(
            [empty, full], lr=0.1, master_weights=True, master_weight_dtype=torch.float16,
            exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8,
        )  # fmt: skip
        empty.grad, full.grad = torch.zeros_like(empty), torch.ones_like(full)
        opt.step()
        return opt, empty

    opt, _ = make()
    save_optimizer(opt, tmp_path / "ckpt")
    other, empty = make()
    if fresh:
        other.state.clear()
    load_optimizer(other, tmp_path / "ckpt")
    assert sorted(other.state[empty]) == ["exp_avg", "exp_avg_sq", "master_param"]
    assert_state_dict_equal(other.state_dict(), opt.state_dict())


def _with_inf() -> tuple[torch.optim.Optimizer, torch.nn.Parameter]:
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.tensor([1.0, float("inf"), 1.0, 1.0])  # one overflowed gradient element
    opt.step()
    assert not bool(torch.isfinite(opt.state[p]["exp_avg"]).all())
    return opt, p


def test_what_the_library_saves_it_loads_with_non_finite_state(tmp_path: Path) -> None:
    """Issue #36 item 4: one rule on both sides. By default the save refuses inf/NaN state
    (the load would refuse it) before writing anything; ``allow_non_finite=True`` on both
    sides keeps it, as torch's ``load_state_dict`` does."""
    opt, _ = _with_inf()
    with pytest.raises(ValueError, match=r"param 0: state 'exp_avg(_sq)?' holds non-finite"):
        save_optimizer(opt, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    assert sorted(os.listdir(tmp_path)) == []
    save_optimizer(opt, tmp_path / "ckpt", allow_non_finite=True)
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.ones(4))], lr=0.1)
    with pytest.raises(OptimizerCheckpointError, match="non-finite"):
        load_optimizer(fresh, tmp_path / "ckpt")  # the default rule, on the load side too
    assert not fresh.state
    load_optimizer(fresh, tmp_path / "ckpt", allow_non_finite=True)
    reference = torch.optim.AdamW([torch.nn.Parameter(torch.ones(4))], lr=0.1)
    reference.load_state_dict(opt.state_dict())  # torch's own loader accepts it
    assert_state_dict_equal(fresh.state_dict(), reference.state_dict())
