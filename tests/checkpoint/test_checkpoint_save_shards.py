"""The streaming save of a sharded param's compressed state
(``wrapped_optim.checkpoint._save``): each rank writes its own DTensor shard as row chunks at
the shard's place in the whole tensor, and a load reads back exactly the expanded values.
Rank 0's shard is saved through ``save_optimizer`` on a real one-process gloo group; a shard
that starts elsewhere than row 0 through the planner on rank 1 of torch's fake two-rank
group, and on the planner's item function itself."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from wrapped_optim.checkpoint import StreamingSavePlanner, save_optimizer
from wrapped_optim.checkpoint._deferred import _placeholder_state_dict
from wrapped_optim.checkpoint._save import _shard_write_items
from wrapped_optim.optimizers import PrecisionAwareAdamW

ROWS, COLS = 7, 3  # 12 bytes a row of the float32 expansion


class _WholeStatesOnly(PrecisionAwareAdamW):
    """A holder that expands whole states only (as TE's FusedAdam does)."""

    read_unscaled_state_chunk = None  # type: ignore[assignment]


@pytest.fixture
def mesh(one_process_group: None) -> DeviceMesh:
    """The one-process gloo group's CPU mesh."""
    return init_device_mesh("cpu", (torch.distributed.get_world_size(),))


def _sharded_holder(mesh: DeviceMesh, cls: type[PrecisionAwareAdamW]) -> PrecisionAwareAdamW:
    """A stepped holder of one ``Shard(0)`` param, its moments kept in bf16 and FP8."""
    full = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0))
    param = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
    opt = cls([param], lr=0.1, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.uint8)
    param.grad = distribute_tensor(
        torch.linspace(-1.0, 1.0, ROWS * COLS).reshape(full.shape), mesh, [Shard(0)]
    )
    opt.step()
    return opt


def _chunks(entry: object) -> list[tuple[list[int], list[int]]]:
    assert isinstance(entry, TensorStorageMetadata)
    return sorted((list(c.offsets), list(c.sizes)) for c in entry.chunks)


@pytest.mark.parametrize(
    ("cls", "chunk_bytes", "rows"),
    [
        (PrecisionAwareAdamW, 30, [(0, 2), (2, 4), (4, 6), (6, 7)]),  # two 12-byte rows fit
        (PrecisionAwareAdamW, 5, [(r, r + 1) for r in range(ROWS)]),  # at least one row
        (PrecisionAwareAdamW, None, [(0, ROWS)]),
        (_WholeStatesOnly, 30, [(0, ROWS)]),  # whole expansions: the shard in one item
    ],
)
def test_a_shard_is_written_in_row_chunks_and_read_back_exactly(
    mesh: DeviceMesh,
    tmp_path: Path,
    cls: type[PrecisionAwareAdamW],
    chunk_bytes: int | None,
    rows: list[tuple[int, int]],
) -> None:
    opt = _sharded_holder(mesh, cls)
    (param,) = opt.param_groups[0]["params"]
    metadata = save_optimizer(opt, tmp_path, chunk_bytes=chunk_bytes)
    for name in ("exp_avg", "exp_avg_sq"):
        entry = metadata.state_dict_metadata[f"state.0.{name}"]
        assert _chunks(entry) == [([start, 0], [stop - start, COLS]) for start, stop in rows]
        assert isinstance(entry, TensorStorageMetadata)
        assert entry.size == torch.Size([ROWS, COLS])
        assert entry.properties.dtype == torch.float32
    out = {
        "state": {0: {n: torch.full((ROWS, COLS), float("nan")) for n in ("exp_avg", "exp_avg_sq")}}
    }
    dcp.load(out, checkpoint_id=tmp_path, no_dist=True)
    for name, read in out["state"][0].items():
        expected = opt.get_unscaled_state(param, name).to_local()  # type: ignore[attr-defined]
        assert torch.equal(read, expected), name


def _shard(fqn: str, origin: list[int], sizes: list[int], size: list[int]) -> WriteItem:
    offsets = torch.Size(origin)
    return WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(sizes)),
            properties=TensorProperties(dtype=torch.float32, requires_grad=True),
            size=torch.Size(size),
        ),
    )


def test_another_ranks_shard_is_split_at_its_own_rows_of_the_whole_tensor() -> None:
    # Rows 4..9 and columns 2..5 of a 12 x 6 tensor (a 2-D sharding), two 12-byte rows a chunk.
    items = _shard_write_items(
        _shard("state.3.exp_avg", [4, 2], [5, 3], [12, 6]), torch.float32, 24
    )
    expected = [([4, 2], [2, 3]), ([6, 2], [2, 3]), ([8, 2], [1, 3])]
    assert [(list(i.index.offset), list(i.tensor_data.chunk.sizes)) for i in items] == expected  # type: ignore[union-attr,arg-type]
    for item, (offsets, _) in zip(items, expected, strict=True):
        assert item.index == MetadataIndex("state.3.exp_avg", torch.Size(offsets))
        assert item.type == WriteItemType.SHARD
        assert item.tensor_data is not None
        assert list(item.tensor_data.chunk.offsets) == offsets
        assert item.tensor_data.size == torch.Size([12, 6])
        assert item.tensor_data.properties == TensorProperties(dtype=torch.float32)


def test_a_shard_is_split_by_the_element_size_of_its_expansion() -> None:
    shard = _shard("state.1.master_param", [4, 2], [5, 3], [12, 6])
    items = _shard_write_items(shard, torch.int16, 12)  # 6-byte rows of an int16 remainder
    assert [(list(i.index.offset), list(i.tensor_data.chunk.sizes)) for i in items] == [  # type: ignore[union-attr,arg-type]
        ([4, 2], [2, 3]),
        ([6, 2], [2, 3]),
        ([8, 2], [1, 3]),
    ]
    assert {i.tensor_data.properties.dtype for i in items} == {torch.int16}  # type: ignore[union-attr]


def test_a_shard_in_one_chunk_is_kept_with_the_expansions_dtype() -> None:
    shard = _shard("state.1.master_param", [4, 2], [5, 3], [12, 6])
    for chunk_bytes in (None, 60, 1000):
        (item,) = _shard_write_items(shard, torch.int16, chunk_bytes)
        assert item.index == shard.index and item.type == WriteItemType.SHARD
        assert item.tensor_data is not None and shard.tensor_data is not None
        assert item.tensor_data.chunk == shard.tensor_data.chunk
        assert item.tensor_data.size == torch.Size([12, 6])
        assert item.tensor_data.properties == TensorProperties(dtype=torch.int16)


@pytest.fixture
def second_of_two_ranks() -> Iterator[DeviceMesh]:
    """A CPU mesh of two ranks seen from rank 1, on torch's fake process group (no other
    process; its collectives are never called: the planner and a ``no_dist`` save need none)."""
    dist = torch.distributed
    assert not dist.is_initialized(), "a process group was left behind by another test"
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def test_the_second_ranks_shard_is_written_at_its_rows_and_read_back_exactly(
    second_of_two_ranks: DeviceMesh, tmp_path: Path
) -> None:
    mesh = second_of_two_ranks
    shape, stride = torch.Size([ROWS, COLS]), (COLS, 1)
    local = torch.randn(3, COLS, generator=torch.Generator().manual_seed(0))  # rows 4..6
    param = torch.nn.Parameter(
        DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)
    )
    opt = PrecisionAwareAdamW(
        [param], lr=0.1, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.uint8
    )
    grad = torch.linspace(-1.0, 1.0, 3 * COLS).reshape(3, COLS)
    param.grad = DTensor.from_local(
        grad, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride
    )
    opt.step()
    state_dict, deferred = _placeholder_state_dict(opt)
    planner = StreamingSavePlanner(
        {f"state.{i}.{name}": d for (i, name), d in deferred.items()}, chunk_bytes=24
    )
    metadata = dcp.save(state_dict, checkpoint_id=tmp_path, planner=planner, no_dist=True)
    names = ("exp_avg", "exp_avg_sq")
    for name in names:
        entry = metadata.state_dict_metadata[f"state.0.{name}"]
        assert _chunks(entry) == [([4, 0], [2, COLS]), ([6, 0], [1, COLS])]
    nan = torch.full((3, COLS), float("nan"))
    out = {
        "state": {
            0: {
                n: DTensor.from_local(
                    nan.clone(), mesh, [Shard(0)], run_check=False, shape=shape, stride=stride
                )
                for n in names
            }
        }
    }
    dcp.load(out, checkpoint_id=tmp_path, no_dist=True)
    for name, read in out["state"][0].items():
        expected = opt.get_unscaled_state(param, name).to_local()  # type: ignore[attr-defined]
        assert torch.equal(read.to_local(), expected), name


def test_a_plain_optimizers_sharded_state_is_written_as_its_shard(
    mesh: DeviceMesh, tmp_path: Path
) -> None:
    full = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(2))
    param = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
    opt = torch.optim.AdamW([param], lr=0.1)
    param.grad = distribute_tensor(full * 0.5, mesh, [Shard(0)])
    opt.step()
    metadata = save_optimizer(opt, tmp_path, chunk_bytes=12)  # DTensors are not cut in rows
    for name in ("exp_avg", "exp_avg_sq"):
        assert _chunks(metadata.state_dict_metadata[f"state.0.{name}"]) == [([0, 0], [ROWS, COLS])]
    out = {"state": {0: {n: torch.zeros(ROWS, COLS) for n in ("exp_avg", "exp_avg_sq")}}}
    dcp.load(out, checkpoint_id=tmp_path, no_dist=True)
    for name, read in out["state"][0].items():
        assert torch.equal(read, opt.state[param][name].to_local()), name


def test_a_replicated_scalar_params_state_is_read_from_its_start(
    mesh: DeviceMesh, tmp_path: Path
) -> None:
    param = torch.nn.Parameter(distribute_tensor(torch.tensor(2.0), mesh, [Replicate()]))
    opt = PrecisionAwareAdamW(
        [param], lr=0.1, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.uint8
    )
    param.grad = distribute_tensor(torch.tensor(0.75), mesh, [Replicate()])
    opt.step()
    metadata = save_optimizer(opt, tmp_path, chunk_bytes=2)
    out = {"state": {0: {n: torch.tensor(float("nan")) for n in ("exp_avg", "exp_avg_sq")}}}
    dcp.load(out, checkpoint_id=tmp_path, no_dist=True)
    for name, read in out["state"][0].items():
        assert _chunks(metadata.state_dict_metadata[f"state.0.{name}"]) == [([], [])]
        expected = opt.get_unscaled_state(param, name).to_local()  # type: ignore[attr-defined]
        assert read.item() != 0.0 and torch.equal(read, expected), name
