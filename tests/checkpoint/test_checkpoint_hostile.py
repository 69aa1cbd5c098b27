"""Checkpoints under hostile conditions (issue 27): process death at every point of the
commit, a second process committing between a load's reads, two threads on one optimizer,
symlinks and ``..``, and an async save followed by a scheduler step or an ``os.chdir``.

Every test here failed before its fix (see docs/checkpoint.md, "Guarantees").
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import filesystem as dcp_fs

from tests.param_builders import train_on_random_grads
from wrapped_optim.checkpoint import OptimizerCheckpointError, load_optimizer, save_optimizer
from wrapped_optim.checkpoint import _load as load_module
from wrapped_optim.checkpoint import _save as save_module
from wrapped_optim.optimizers import PrecisionAwareAdamW
from wrapped_optim.patching import ConcurrentPatchError
from wrapped_optim.testing import assert_state_dict_equal, checkpoint_roundtrip
from wrapped_optim.testing.faults import COMMIT_CRASH_POINTS, crash_save_at

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ROOT = Path(__file__).resolve().parents[2]
SIDE = {"config.json": '{"lr": 1}', "notes.txt": "keep me", "extras/tokenizer.txt": "tok"}


def _build(kind: str, seed: int, lr: float = 1e-2) -> tuple[Any, list[torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float32 if kind == "adamw" else torch.bfloat16
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in [(24, 8), (8,)]]
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr), params
    opt = PrecisionAwareAdamW(
        params, lr=lr, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16
    )
    return opt, params


def _state(opt: Any) -> Any:
    return checkpoint_roundtrip(opt.state_dict())


def _loaded(kind: str, path: Path) -> Any:
    fresh, _ = _build(kind, 99)
    load_optimizer(fresh, path)
    return _state(fresh)


def _write_side_files(directory: Path) -> None:
    for name, text in SIDE.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(text)


def _side_files_in(directory: Path) -> dict[str, str]:
    return {name: (directory / name).read_text() for name in SIDE if (directory / name).exists()}


# ------------------------------------------------------------------------------------------
# 1. kill -9 at every point of the commit
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("point", sorted(COMMIT_CRASH_POINTS))
def test_a_save_killed_at_any_point_of_the_commit_loses_no_file(point: str, tmp_path: Path) -> None:
    """The state machine of docs/checkpoint.md, one state per kill point: the next load
    returns the old or the new checkpoint as the table says, the side files are kept, and the
    next save recovers the directory to exactly one clean checkpoint."""
    target = tmp_path / "ckpt"
    opt, params = _build("adamw", 0)
    train_on_random_grads(opt, params, 1, seed=1)
    save_optimizer(opt, target)
    old = _state(opt)
    _write_side_files(target)
    train_on_random_grads(opt, params, 1, seed=2)
    new = _state(opt)

    crash_save_at(point, lambda: save_optimizer(opt, target))

    expected = old if COMMIT_CRASH_POINTS[point] == "old" else new
    assert_state_dict_equal(expected, _loaded("adamw", target), names=("expected", "loaded"))
    train_on_random_grads(opt, params, 1, seed=3)
    save_optimizer(opt, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert _side_files_in(target) == SIDE
    assert_state_dict_equal(_state(opt), _loaded("adamw", target), names=("saved", "loaded"))


# ------------------------------------------------------------------------------------------
# 2. a second process committing between the two reads of a load
# ------------------------------------------------------------------------------------------
_SAVE_OTHER = """
import sys, torch
sys.path.insert(0, {root!r})
from tests.param_builders import train_on_random_grads
from tests.checkpoint.test_checkpoint_hostile import _build
from wrapped_optim.checkpoint import save_optimizer
opt, params = _build({kind!r}, 5, lr=0.5)
train_on_random_grads(opt, params, 3, seed=6)
save_optimizer(opt, {path!r})
"""


@pytest.mark.parametrize("kind", ["adamw", "precision"])
def test_a_save_committed_between_the_reads_of_a_load_is_never_mixed_in(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "ckpt"
    opt, params = _build(kind, 0)
    train_on_random_grads(opt, params, 1, seed=1)
    save_optimizer(opt, target)
    old = _state(opt)
    victim, victim_params = _build(kind, 7, lr=0.3)
    train_on_random_grads(victim, victim_params, 2, seed=4)
    before = _state(victim)

    script = _SAVE_OTHER.format(root=str(ROOT), kind=kind, path=str(target))
    original = load_module.StreamingLoadPlanner

    class Between(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:  # after the objects' read
            subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(load_module, "StreamingLoadPlanner", Between)
    try:
        load_optimizer(victim, target)
    except OptimizerCheckpointError as error:
        assert "since this load read .metadata" in str(error)
        assert_state_dict_equal(before, _state(victim), names=("before", "after"))
    else:  # one checkpoint, whole: the one whose metadata the load read first
        assert_state_dict_equal(old, _state(victim), names=("old checkpoint", "loaded"))
    monkeypatch.undo()
    other, _ = _build(kind, 5, lr=0.5)
    load_optimizer(other, target)  # the new one is whole and loads
    assert other.param_groups[0]["lr"] == 0.5


def test_a_data_file_outside_the_checkpoint_directory_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    opt, params = _build("adamw", 0)
    train_on_random_grads(opt, params, 1, seed=1)
    save_optimizer(opt, target)
    (tmp_path / "outside").mkdir()
    (target / "__0_0.distcp").rename(tmp_path / "outside" / "__0_0.distcp")
    metadata = pickle.loads((target / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../outside/__0_0.distcp"
    (target / ".metadata").write_bytes(pickle.dumps(metadata))
    victim, victim_params = _build("adamw", 7)
    train_on_random_grads(victim, victim_params, 1, seed=4)
    before = _state(victim)
    with pytest.raises(OptimizerCheckpointError, match="outside the checkpoint directory"):
        load_optimizer(victim, target)
    assert_state_dict_equal(before, _state(victim), names=("before", "after"))


# ------------------------------------------------------------------------------------------
# 3. async save: a snapshot of everything, the path resolved at the call
# ------------------------------------------------------------------------------------------
def _held_writer(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    started, release = threading.Event(), threading.Event()
    original = dcp_fs._write_item

    def held(*args: Any, **kwargs: Any) -> Any:
        started.set()
        assert release.wait(60), "the test never released the writer"
        return original(*args, **kwargs)

    monkeypatch.setattr(dcp_fs, "_write_item", held)
    return started, release


def test_async_save_holds_a_tensor_lr_at_the_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=torch.tensor(0.1))
    scheduler = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    p.grad = torch.ones(4)
    opt.step()
    started, release = _held_writer(monkeypatch)
    future = save_optimizer(opt, tmp_path / "ckpt", async_=True)
    assert started.wait(60)
    scheduler.step()  # fill_ on the group's lr tensor, while the save writes
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.05)
    release.set()
    future.result(timeout=60)
    monkeypatch.undo()
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.ones(4))], lr=torch.tensor(1.0))
    load_optimizer(fresh, tmp_path / "ckpt")
    assert float(fresh.param_groups[0]["lr"]) == pytest.approx(0.1)


def test_async_save_resolves_a_relative_path_at_the_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The background thread is held before it builds anything, and the caller changes its
    working directory meanwhile: the checkpoint still lands where the path named at the call."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    opt, params = _build("adamw", 0)
    train_on_random_grads(opt, params, 1, seed=1)
    monkeypatch.chdir(tmp_path / "a")
    caller, moved = threading.current_thread(), threading.Event()
    writer_class = save_module.FileSystemWriter

    class HeldInWorker(writer_class):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if threading.current_thread() is not caller:
                assert moved.wait(60)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(save_module, "FileSystemWriter", HeldInWorker)
    future = save_optimizer(opt, "ckpt", async_=True)
    os.chdir(tmp_path / "b")
    moved.set()
    future.result(timeout=60)
    assert (tmp_path / "a" / "ckpt" / ".metadata").is_file()
    assert not (tmp_path / "b" / "ckpt").exists()


# ------------------------------------------------------------------------------------------
# 4. two threads on one optimizer
# ------------------------------------------------------------------------------------------
def test_two_threads_checkpointing_one_optimizer_leave_no_patch_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ordered so that before the fix the first save's restore ran before the second's: the
    second then put the first's placeholder back for good. Now the second fails at once
    (ConcurrentPatchError) or succeeds; the optimizer is as it was either way."""
    opt, params = _build("precision", 0)
    train_on_random_grads(opt, params, 2, seed=1)
    before = _state(opt)
    first_inside, second_moved, first_done = (threading.Event() for _ in range(3))
    original = PrecisionAwareAdamW.state_dict
    outcome: dict[str, BaseException | None] = {}

    def held(self: Any) -> Any:
        if threading.current_thread().name == "first":
            first_inside.set()
            assert second_moved.wait(30)
        else:
            second_moved.set()
            first_done.wait(30)
        return original(self)

    monkeypatch.setattr(PrecisionAwareAdamW, "state_dict", held)

    def run(name: str) -> None:
        try:
            save_optimizer(opt, tmp_path / name)
            outcome[name] = None
        except BaseException as error:
            outcome[name] = error
        finally:
            if name == "first":
                first_done.set()
            else:
                second_moved.set()

    first = threading.Thread(target=run, args=("first",), name="first")
    first.start()
    assert first_inside.wait(30)
    second = threading.Thread(target=run, args=("second",), name="second")
    second.start()
    first.join(60)
    second.join(60)
    monkeypatch.undo()
    assert outcome["first"] is None
    assert outcome["second"] is None or isinstance(outcome["second"], ConcurrentPatchError)
    assert "get_unscaled_state" not in vars(opt)
    assert_state_dict_equal(before, _state(opt), names=("before", "after"))
    assert_state_dict_equal(before, _loaded("precision", tmp_path / "first"))


@pytest.mark.parametrize("cpu_kernel", [False, None], ids=["torch-path", "default-path"])
def test_two_threads_stepping_one_optimizer_step_one_at_a_time(cpu_kernel: bool | None) -> None:
    """fp16 moments share a scale per tensor; steps from two threads are serialised, so the
    result is bitwise that of the same number of steps in one thread (finite, of course)."""

    def build() -> tuple[PrecisionAwareAdamW, list[torch.nn.Parameter]]:
        g = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(20_000, generator=g)) for _ in range(3)]
        options: dict[str, Any] = {} if cpu_kernel is None else {"cpu_kernel": cpu_kernel}
        opt = PrecisionAwareAdamW(
            params,
            lr=1e-2,
            exp_avg_dtype=torch.float16,
            exp_avg_sq_dtype=torch.float16,
            chunk_numel=1024,
            **options,
        )
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 1e3
        return opt, params

    steps = 60
    want, want_params = build()
    for _ in range(2 * steps):
        want.step()
    opt, params = build()
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(steps):
                barrier.wait(30)
                opt.step()
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    for got, expected in zip(params, want_params, strict=True):
        assert torch.isfinite(got).all()
        assert torch.equal(got, expected)
    assert_state_dict_equal(_state(want), _state(opt), names=("one thread", "two threads"))


# ------------------------------------------------------------------------------------------
# 5. symlinks and ..
# ------------------------------------------------------------------------------------------
def test_saving_to_a_symlink_replaces_the_directory_it_names(tmp_path: Path) -> None:
    opt, params = _build("adamw", 0)
    train_on_random_grads(opt, params, 1, seed=1)
    step_100 = tmp_path / "step_100"
    save_optimizer(opt, step_100)
    _write_side_files(step_100)
    (tmp_path / "latest").symlink_to("step_100")
    for seed in (2, 3):  # twice: the second save through the link used to fail
        train_on_random_grads(opt, params, 1, seed=seed)
        save_optimizer(opt, tmp_path / "latest")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_100"]
    assert os.readlink(tmp_path / "latest") == "step_100"
    assert _side_files_in(step_100) == SIDE
    assert_state_dict_equal(_state(opt), _loaded("adamw", tmp_path / "latest"))


@pytest.mark.parametrize("reserved", [".ckpt.old", ".ckpt.saving"])
@pytest.mark.parametrize("existing", [False, True], ids=["first-save", "over-a-checkpoint"])
def test_a_planted_symlink_at_a_reserved_name_is_refused_and_never_followed(
    reserved: str, existing: bool, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    _write_side_files(victim)
    opt, params = _build("adamw", 0)
    train_on_random_grads(opt, params, 1, seed=1)
    if existing:
        save_optimizer(opt, tmp_path / "ckpt")
    (tmp_path / reserved).symlink_to(victim)
    with pytest.raises(FileExistsError, match="is a symlink"):
        save_optimizer(opt, tmp_path / "ckpt")
    assert _side_files_in(victim) == SIDE
    assert sorted(os.listdir(victim)) == ["config.json", "extras", "notes.txt"]
    assert (tmp_path / reserved).is_symlink()
    assert (tmp_path / "ckpt").is_dir() == existing
    if existing:
        assert not (tmp_path / "ckpt").is_symlink()


def test_dotdot_after_a_symlink_saves_and_loads_the_same_place(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "a" / "b")
    path = tmp_path / "link" / ".." / "ckpt"  # the kernel: a/ckpt; textually: ckpt
    opt, params = _build("adamw", 0)
    train_on_random_grads(opt, params, 1, seed=1)
    save_optimizer(opt, path)
    assert (tmp_path / "a" / "ckpt" / ".metadata").is_file()
    assert not (tmp_path / "ckpt").exists()
    assert_state_dict_equal(_state(opt), _loaded("adamw", path))
