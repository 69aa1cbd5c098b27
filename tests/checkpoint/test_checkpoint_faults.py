"""Checkpoint faults a user can meet, each a clear ``Exception`` (issue #36, items 3, 8-10).

- a checkpoint that cannot be read (a data file that is a directory, missing, truncated, a
  symlink loop, ``.metadata`` a directory, a pickle frame bomb) raises
  ``OptimizerCheckpointError`` naming the file and the cause, DCP's exception chained, and
  leaves the optimizer as it was;
- ``load_optimizer`` refuses a non-positive ``chunk_bytes`` as ``save_optimizer`` does;
- ``save_optimizer(opt, ".")`` keeps the caller's working directory usable;
- a save into a directory another save is writing fails at once with ``SaveInProgressError``;
- non-finite state (item 4) is written and loaded back bitwise by default, refused (nothing
  written, nothing changed) under ``refuse_non_finite=True``, and refused by a precision-aware
  holder, which cannot hold it.
"""

from __future__ import annotations

import copy
import math
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.api import CheckpointException

from wrapped_optim.checkpoint import OptimizerCheckpointError, load_optimizer, save_optimizer
from wrapped_optim.checkpoint._commit import CheckpointCommit, SaveInProgressError
from wrapped_optim.optimizers import HybridOffloadOptimizer, PrecisionAwareAdamW
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


_PAYLOAD_NAN = 0x7FC0_1234  # a quiet NaN with a payload: bitwise round trips keep it


def _with_inf() -> torch.optim.Optimizer:
    """A torch AdamW after one overflowed gradient element, plus a NaN with a payload."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.tensor([1.0, float("inf"), 1.0, 1.0])
    opt.step()
    assert math.isinf(float(opt.state[p]["exp_avg"][1]))
    opt.state[p]["exp_avg"].view(torch.int32)[2] = _PAYLOAD_NAN
    return opt


def _bits(opt: torch.optim.Optimizer) -> dict[str, list[int]]:
    """Each state tensor's bit patterns (NaN payloads included; NaN != NaN as floats)."""
    (state,) = opt.state.values()
    return {name: value.view(torch.int32).tolist() for name, value in state.items()}


def _stepped_four(lr: float) -> torch.optim.Optimizer:
    p = torch.nn.Parameter(torch.arange(4.0))
    opt = torch.optim.AdamW([p], lr=lr)
    p.grad = torch.full((4,), 0.5)
    opt.step()
    return opt


def test_non_finite_state_round_trips_bitwise_by_default(tmp_path: Path) -> None:
    """What the library saves, it loads (issue #36 item 4): inf and NaN (its payload kept)
    are written and read back bit for bit by default, as torch's ``load_state_dict`` takes
    them; the victim's own state and hyper-parameters differ from the checkpoint's."""
    opt = _with_inf()
    save_optimizer(opt, tmp_path / "ckpt")
    fresh = _stepped_four(lr=0.5)
    load_optimizer(fresh, tmp_path / "ckpt")
    assert _bits(fresh) == _bits(opt)
    assert int(fresh.state_dict()["state"][0]["exp_avg"].view(torch.int32)[2]) == _PAYLOAD_NAN
    assert fresh.param_groups[0]["lr"] == 0.1
    reference = torch.optim.AdamW([torch.nn.Parameter(torch.ones(4))], lr=0.5)
    reference.load_state_dict(opt.state_dict())  # torch's own loader takes it too
    assert_state_dict_equal(fresh.state_dict(), reference.state_dict())


def test_refuse_non_finite_at_save_writes_nothing(tmp_path: Path) -> None:
    opt = _with_inf()
    before = _bits(opt)
    with pytest.raises(ValueError, match=r"param 0: state 'exp_avg' holds non-finite.*refuse_non"):
        save_optimizer(opt, tmp_path / "ckpt", refuse_non_finite=True)
    assert sorted(os.listdir(tmp_path)) == []
    assert _bits(opt) == before


def test_refuse_non_finite_at_load_leaves_the_optimizer_untouched(tmp_path: Path) -> None:
    save_optimizer(_with_inf(), tmp_path / "ckpt")
    victim = _stepped_four(lr=0.01)
    before = _bits(victim)
    with pytest.raises(OptimizerCheckpointError, match=r"param 0: state 'exp_avg' has non-finite"):
        load_optimizer(victim, tmp_path / "ckpt", refuse_non_finite=True)
    assert _bits(victim) == before
    assert victim.param_groups[0]["lr"] == 0.01


def _precision_aware(fmt: torch.dtype, lr: float) -> PrecisionAwareAdamW:
    p = torch.nn.Parameter(torch.arange(4.0))
    opt = PrecisionAwareAdamW([p], lr=lr, exp_avg_dtype=fmt)
    p.grad = torch.full((4,), 0.5)
    opt.step()
    return opt


@pytest.mark.parametrize("fmt", [torch.float16, torch.uint8, torch.float32])
def test_precision_aware_state_refuses_non_finite_even_by_default(
    tmp_path: Path, fmt: torch.dtype
) -> None:
    """A precision-aware holder cannot take inf/NaN (fp16/FP8 scale a tensor by its amax):
    even by default the load names the parameter and state, and nothing changes."""
    source = _precision_aware(torch.float32, lr=0.1)
    (state,) = source.state.values()
    state["exp_avg"][1] = float("inf")  # FP32 storage holds it; the others could not
    save_optimizer(source, tmp_path / "ckpt")
    victim = _precision_aware(fmt, lr=0.01)
    before = copy.deepcopy(victim.state_dict())
    with pytest.raises(
        OptimizerCheckpointError, match=r"param 0: state 'exp_avg' has non-finite.*precision-aware"
    ):
        load_optimizer(victim, tmp_path / "ckpt")
    assert_state_dict_equal(victim.state_dict(), before)
    assert victim.param_groups[0]["lr"] == 0.01


_SPECIAL_BITS = [0x7F80_0000, 0xFF80_0000, 0x7FC0_0000, 0x7FC0_1234, 0xFFC0_0001, 0x7F80_0001]


@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    bits=st.lists(
        st.one_of(st.sampled_from(_SPECIAL_BITS), st.integers(0, 2**32 - 1)),
        min_size=1,
        max_size=6,
    )
)
def test_any_float32_state_round_trips_bitwise(tmp_path: Path, bits: list[int]) -> None:
    """Property: whatever bit patterns a torch optimizer's state holds (inf, signed NaNs with
    payloads, finite values), the default save and load give them back bit for bit."""
    p = torch.nn.Parameter(torch.ones(len(bits)))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.ones(len(bits))
    opt.step()
    as_int32 = torch.tensor(bits, dtype=torch.int64).to(torch.int32)  # wraps, as the bits
    opt.state[p]["exp_avg"].view(torch.int32).copy_(as_int32)
    target = tmp_path / f"ckpt-{len(os.listdir(tmp_path))}"
    save_optimizer(opt, target)
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(len(bits)))], lr=0.5)
    load_optimizer(fresh, target)
    assert _bits(fresh) == _bits(opt)


def test_hybrid_offload_non_finite_state_round_trips_by_default(tmp_path: Path) -> None:
    """The same rule through a hybrid offload optimizer (device and host halves): the
    loaded stack holds the saved bits and steps on exactly as the saved one does."""

    def hybrid() -> tuple[HybridOffloadOptimizer, list[torch.nn.Parameter]]:
        params = [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(3))]
        opt = HybridOffloadOptimizer([{"params": params}], offload_fraction=0.5, lr=0.1)
        for param in params:
            param.grad = torch.ones_like(param)
        opt.step()
        return opt, params

    opt, params = hybrid()
    params[0].grad = torch.tensor([1.0, float("inf"), 1.0, 1.0])
    params[1].grad = torch.tensor([float("-inf"), 1.0, 1.0])
    opt.step()
    save_optimizer(opt, tmp_path / "ckpt")
    fresh, fresh_params = hybrid()
    with torch.no_grad():
        for mine, theirs in zip(fresh_params, params, strict=True):
            mine.copy_(theirs)
    load_optimizer(fresh, tmp_path / "ckpt")
    assert_state_dict_equal(fresh.state_dict(), opt.state_dict())
    for stack, stack_params in ((opt, params), (fresh, fresh_params)):
        for param in stack_params:
            param.grad = torch.full_like(param, 0.5)
        stack.step()
    for mine, theirs in zip(fresh_params, params, strict=True):
        assert torch.equal(mine.view(torch.int32), theirs.view(torch.int32))
