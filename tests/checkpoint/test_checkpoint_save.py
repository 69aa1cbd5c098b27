"""What ``save_optimizer`` and its planner (``wrapped_optim.checkpoint._save``) write and
free: the chunks DCP records for tensors of every rank and dtype, each chunk buffer released
once written, the asynchronous save's thread and writer, a writer of another kind, and the
``refuse_non_finite`` check state by state."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_write_items
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from wrapped_optim.checkpoint import (
    OptimizerCheckpointError,
    StreamingSavePlanner,
    load_optimizer,
    save_optimizer,
)
from wrapped_optim.optimizers import PrecisionAwareAdamW

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _chunks(metadata: Metadata, key: str) -> list[tuple[list[int], list[int]]]:
    entry = metadata.state_dict_metadata[key]
    assert isinstance(entry, TensorStorageMetadata)
    return sorted((list(c.offsets), list(c.sizes)) for c in entry.chunks)


def _planned_save(state_dict: dict[str, Any], path: Path, chunk_bytes: int) -> Metadata:
    planner = StreamingSavePlanner(chunk_bytes=chunk_bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        metadata = dcp.save(state_dict, checkpoint_id=path, no_dist=True, planner=planner)
        out = {k: torch.zeros_like(v) for k, v in state_dict.items()}
        dcp.load(out, checkpoint_id=path, no_dist=True)
    for key, value in state_dict.items():
        assert torch.equal(out[key], value), key
    return metadata


def test_rows_are_cut_by_the_tensors_own_element_size(tmp_path: Path) -> None:
    state_dict = {
        "f64": torch.arange(8.0, dtype=torch.float64).reshape(4, 2),  # 16-byte rows
        "u8": torch.arange(10, dtype=torch.uint8),  # 1-byte rows
        "no_columns": torch.zeros(5, 0),  # rows of no bytes: one chunk
        "scalar": torch.tensor(3.0),
    }
    metadata = _planned_save(state_dict, tmp_path, chunk_bytes=16)
    assert _chunks(metadata, "f64") == [([r, 0], [1, 2]) for r in range(4)]
    assert _chunks(metadata, "u8") == [([0], [10])]
    assert _chunks(metadata, "no_columns") == [([0, 0], [5, 0])]
    assert _chunks(metadata, "scalar") == [([], [])]
    small = _planned_save({"u8": state_dict["u8"]}, tmp_path / "u8", chunk_bytes=4)
    assert _chunks(small, "u8") == [([0], [4]), ([4], [4]), ([8], [2])]


def test_a_tensor_in_one_chunk_is_planned_as_the_default_planner_plans_it() -> None:
    state_dict = {"w": torch.randn(3, 2), "s": torch.tensor(1.0), "v": torch.randn(4)}
    planner = StreamingSavePlanner(chunk_bytes=1000)
    planner.set_up_planner(state_dict, is_coordinator=True)
    plan = planner.create_local_plan()
    expected = [
        item for key, value in state_dict.items() for item in _create_write_items(key, value)
    ]
    assert [(i.index, i.type, i.tensor_data) for i in plan.items] == [
        (i.index, i.type, i.tensor_data) for i in expected
    ]
    assert {i.type for i in plan.items} == {WriteItemType.TENSOR}


class _Recording(FileSystemWriter):
    """DCP's file writer that records each chunk the planner hands it, the thread that
    asked, and whether the chunk asked for before it still held memory afterwards."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.chunks: list[torch.Tensor] = []
        self.previous_kept: list[int] = []  # the previous chunk's bytes after each call
        self.threads: set[str] = set()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        resolve = planner.resolve_data

        def recording(item: Any) -> Any:
            data = resolve(item)
            if isinstance(data, torch.Tensor):
                if self.chunks:
                    self.previous_kept.append(self.chunks[-1].untyped_storage().nbytes())
                self.chunks.append(data)
            self.threads.add(threading.current_thread().name)
            return data

        planner.resolve_data = recording  # type: ignore[method-assign,assignment]
        return super().write_data(plan, planner)


def _holder(*shapes: tuple[int, ...]) -> PrecisionAwareAdamW:
    params = [
        torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(1)))
        for s in shapes
    ]
    opt = PrecisionAwareAdamW(
        params, lr=0.1, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.uint8
    )
    for p in params:
        p.grad = torch.linspace(-1.0, 1.0, p.numel()).reshape(p.shape)
    opt.step()
    return opt


def _expanded(opt: PrecisionAwareAdamW) -> list[torch.Tensor]:
    return [
        opt.get_unscaled_state(p, name)
        for p in opt.param_groups[0]["params"]
        for name in ("exp_avg", "exp_avg_sq")
    ]


def test_each_chunk_is_freed_once_the_writer_asks_for_the_next(tmp_path: Path) -> None:
    opt = _holder((6, 4), ())
    writer = _Recording(tmp_path / "ckpt")
    metadata = save_optimizer(opt, tmp_path / "ckpt", storage_writer=writer, chunk_bytes=32)
    assert _chunks(metadata, "state.0.exp_avg") == [([r, 0], [2, 4]) for r in (0, 2, 4)]
    count = len(writer.chunks)  # (a freed chunk's repr would crash a failing assert)
    assert count == 8  # three chunks of each moment, and the scalar's two
    assert writer.previous_kept == [0] * 7  # freed when the next one is asked for
    left = [c.untyped_storage().nbytes() for c in writer.chunks]
    assert left == [0] * 8  # the last one too, after the save
    out = {
        "state": {
            i: {n: torch.zeros(s) for n in ("exp_avg", "exp_avg_sq")}
            for i, s in ((0, (6, 4)), (1, ()))
        }
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    read = [out["state"][i][n] for i in (0, 1) for n in ("exp_avg", "exp_avg_sq")]
    for got, want in zip(read, _expanded(opt), strict=True):
        assert torch.equal(got, want)


def test_an_async_save_writes_through_the_callers_writer_in_its_own_thread(tmp_path: Path) -> None:
    opt = _holder((6, 4))
    writer = _Recording(tmp_path / "ckpt")
    future = save_optimizer(
        opt, tmp_path / "ckpt", storage_writer=writer, chunk_bytes=48, async_=True
    )
    metadata = future.result(timeout=60)
    assert [name.rsplit("_", 1)[0] for name in writer.threads] == ["wrapped_optim-save"]
    assert _chunks(metadata, "state.0.exp_avg_sq") == [([0, 0], [3, 4]), ([3, 0], [3, 4])]
    count = len(writer.chunks)  # (a freed chunk's repr would crash a failing assert)
    assert count == 4
    assert _chunks(FileSystemReader(tmp_path / "ckpt").read_metadata(), "state.0.exp_avg") == [
        ([0, 0], [3, 4]),
        ([3, 0], [3, 4]),
    ]


class _Forwarding(StorageWriter):
    """A storage writer of its own kind (no ``FileSystemWriter``) that writes through one."""

    def __init__(self, path: Path) -> None:
        self.inner = FileSystemWriter(path)
        self.planners: list[SavePlanner] = []

    def reset(self, checkpoint_id: Any = None) -> None:
        self.inner.reset(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.inner.set_up_storage_writer(is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return self.inner.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return self.inner.prepare_global_plan(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self.planners.append(planner)
        return self.inner.write_data(plan, planner)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.inner.finish(metadata, results)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return FileSystemWriter.validate_checkpoint_id(checkpoint_id)


def test_a_writer_of_another_kind_is_written_in_place_and_keeps_its_chunks(tmp_path: Path) -> None:
    opt = _holder((6, 4))
    writer = _Forwarding(tmp_path / "ckpt")
    save_optimizer(opt, storage_writer=writer, chunk_bytes=32)
    (planner,) = writer.planners
    assert isinstance(planner, StreamingSavePlanner) and not planner.release_after_write
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging, no lock
    twin = _holder((6, 4))
    load_optimizer(twin, tmp_path / "ckpt")
    for got, want in zip(_expanded(twin), _expanded(opt), strict=True):
        assert torch.equal(got, want)


def test_a_save_needs_somewhere_to_write() -> None:
    with pytest.raises(
        ValueError, match=r"^save_optimizer needs a checkpoint_id or a storage_writer$"
    ):
        save_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))


class _CountingSGD(torch.optim.SGD):
    """An SGD that also keeps a plain number in each param's state, before its buffer."""

    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["count"] = self.state[p].get("count", 0) + 1
        return super().step(closure)


def _refused(opt: torch.optim.Optimizer, path: Path) -> str:
    with pytest.raises(ValueError) as caught:
        save_optimizer(opt, path, refuse_non_finite=True)
    assert not path.exists()
    return str(caught.value)


def test_refuse_non_finite_names_the_state_in_full(tmp_path: Path) -> None:
    frozen, empty, weight = (torch.nn.Parameter(torch.ones(s)) for s in ((2,), (0,), (3,)))
    opt = torch.optim.AdamW([frozen, empty, weight], lr=0.1)
    empty.grad, weight.grad = torch.ones(0), torch.ones(3)
    opt.step()  # the frozen param has no state, the empty one empty tensors
    save_optimizer(opt, tmp_path / "finite", refuse_non_finite=True)
    opt.state[weight]["exp_avg"][1] = float("inf")  # one value: the minimum stays finite
    assert _refused(opt, tmp_path / "ckpt") == (
        "param 2: state 'exp_avg' holds non-finite values (inf or NaN) and "
        "refuse_non_finite=True; nothing was written. Fix the run (a gradient overflowed?), "
        "or save without refuse_non_finite to keep them as torch's optimizers do"
    )
    opt.state[weight]["exp_avg"][1] = -float("inf")  # now the maximum stays finite
    assert _refused(opt, tmp_path / "ckpt").startswith("param 2: state 'exp_avg' holds")


def test_refuse_non_finite_looks_past_numbers_and_codes_at_every_size(tmp_path: Path) -> None:
    weight = torch.nn.Parameter(torch.ones(3))
    counting = _CountingSGD([weight], lr=0.1, momentum=0.9)
    weight.grad = torch.ones(3)
    counting.step()
    counting.state[weight]["momentum_buffer"][0] = float("nan")
    assert _refused(counting, tmp_path / "a").startswith("param 0: state 'momentum_buffer' holds")
    holder = PrecisionAwareAdamW(
        [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(()))],
        lr=0.1,
        exp_avg_dtype=torch.uint8,  # FP8 codes, kept before the FP32 second moment
    )
    for p in holder.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    holder.step()
    vector, scalar = holder.param_groups[0]["params"]
    holder.state[scalar]["exp_avg_sq"].fill_(float("inf"))  # one element
    assert _refused(holder, tmp_path / "b").startswith("param 1: state 'exp_avg_sq' holds")
    holder.state[scalar]["exp_avg_sq"].fill_(0.0)
    holder.state[vector]["exp_avg_sq"][3] = float("inf")
    assert _refused(holder, tmp_path / "c").startswith("param 0: state 'exp_avg_sq' holds")


def test_a_planner_left_to_its_defaults_frees_nothing_and_counts_what_it_made() -> None:
    state_dict = {"w": torch.arange(12.0).reshape(6, 2), "none": torch.zeros(0, 3), "n": 3}
    planner = StreamingSavePlanner(chunk_bytes=16)
    planner.set_up_planner(state_dict, is_coordinator=True)
    assert planner.peak_chunk_bytes == 0
    items = [i for i in planner.create_local_plan().items if i.index.fqn == "w"]
    chunks = [cast(torch.Tensor, planner.resolve_data(item)) for item in items]
    assert [c.tolist() for c in chunks] == [
        [[0.0, 1.0], [2.0, 3.0]],
        [[4.0, 5.0], [6.0, 7.0]],
        [[8.0, 9.0], [10.0, 11.0]],
    ]
    assert [c.untyped_storage().nbytes() for c in chunks] == [16, 16, 16]  # none freed
    assert planner.peak_chunk_bytes == 16
    empty = StreamingSavePlanner(chunk_bytes=16)
    empty.set_up_planner({"none": torch.zeros(0, 3)}, is_coordinator=True)
    (item,) = empty.create_local_plan().items
    assert cast(torch.Tensor, empty.resolve_data(item)).numel() == 0
    assert empty.peak_chunk_bytes == 0


def test_a_meta_tensor_with_nothing_to_expand_it_is_refused_by_name() -> None:
    planner = StreamingSavePlanner()
    planner.set_up_planner(
        {"state": {0: {"exp_avg": torch.empty(3, device="meta")}}}, is_coordinator=True
    )
    with pytest.raises(
        OptimizerCheckpointError,
        match=r"^state dict entry 'state\.0\.exp_avg' is a meta tensor with nothing to expand "
        r"it from$",
    ):
        planner.create_local_plan()
