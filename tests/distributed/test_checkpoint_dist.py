"""Streaming DCP optimizer checkpoints across world sizes, with real gloo process groups.

Two gloo processes are spawned once for the module (spawning is the slow part on a small CI
machine); each test then checks one scenario's results. Optimizers are replicated (every rank
builds the same parameters and gradients), which is how DCP treats plain tensors; the FSDP2
scenario covers sharded (DTensor) state.
"""

from __future__ import annotations

import copy
import os
import socket
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from wrapped_optim import OptimizerWrapper
from wrapped_optim.checkpoint import OptimizerCheckpointError, load_optimizer, save_optimizer

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

WORLD = 2
SHAPES = [(9, 4), (11,), (2, 3, 3)]


# ------------------------------------------------------------------------------------------
# Shared builders (run identically in the test process and in every rank)
# ------------------------------------------------------------------------------------------
def _params(seed: int = 0, shapes: list[tuple[int, ...]] = SHAPES) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _train(opt: Any, params: list[torch.nn.Parameter], steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()


def _trained_adam() -> torch.optim.Optimizer:
    params = _params()
    opt = torch.optim.AdamW(params, lr=2e-2, weight_decay=0.1)
    _train(opt, params, 3)
    return opt


def _trained_holder() -> Any:
    from wrapped_optim.optimizers import PrecisionAwareAdamW

    params = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in _params(seed=2)]
    opt = PrecisionAwareAdamW(
        params,
        lr=0.05,
        master_weights=True,
        exp_avg_dtype=torch.float16,
        exp_avg_sq_dtype=torch.uint8,
    )
    _train(opt, params, 2)
    return opt


def _fresh_holder(lr: float = 3.0) -> Any:
    from wrapped_optim.optimizers import PrecisionAwareAdamW

    params = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in _params(seed=2)]
    return PrecisionAwareAdamW(
        params,
        lr=lr,
        master_weights=True,
        exp_avg_dtype=torch.float16,
        exp_avg_sq_dtype=torch.uint8,
    )


def _holder_storage(opt: Any) -> list[torch.Tensor]:
    out = []
    for p in opt.param_groups[0]["params"]:
        for name in ("exp_avg", "exp_avg_sq", "master_param"):
            out += [opt.state[p][name], opt.get_unscaled_state(p, name)]
    return out


def _assert_sd_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i, entries in a["state"].items():
        for name, value in entries.items():
            assert torch.equal(value, b["state"][i][name]), (i, name)


# ------------------------------------------------------------------------------------------
# Spawning
# ------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, fn: Callable[..., None], port: int, out: str, args: tuple[Any, ...]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        fn(rank, *args)
        dist.barrier()
    except BaseException:
        Path(out, f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _spawn(fn: Callable[..., None], tmp_path: Path, *args: Any) -> None:
    try:
        mp.spawn(_entry, args=(fn, _free_port(), str(tmp_path), args), nprocs=WORLD, join=True)
    except Exception as exc:
        errors = [p.read_text() for p in sorted(tmp_path.glob("error*.txt"))]
        raise AssertionError("a rank failed:\n" + "\n".join(errors)) from exc


# ------------------------------------------------------------------------------------------
# World 2 writes, world 1 reads
# ------------------------------------------------------------------------------------------
def _save_on_two_ranks(rank: int, root: str) -> None:
    adam = _trained_adam()
    save_optimizer(OptimizerWrapper(adam), Path(root, "stream"), chunk_bytes=48)
    dcp.save(adam.state_dict(), checkpoint_id=Path(root, "plain"))
    save_optimizer(_trained_holder(), Path(root, "holder"), chunk_bytes=40)


# ------------------------------------------------------------------------------------------
# World 1 writes, world 2 reads (and rejects a mismatch on every rank)
# ------------------------------------------------------------------------------------------
def _load_on_two_ranks(rank: int, root: str) -> None:
    expected = _trained_adam()
    for name in ("stream", "plain"):
        fresh = OptimizerWrapper(torch.optim.AdamW(_params(seed=rank + 5), lr=1.0))
        load_optimizer(fresh, Path(root, name))
        _assert_sd_equal(fresh.state_dict(), expected.state_dict())

    holder = _fresh_holder()
    load_optimizer(holder, Path(root, "holder"))
    for a, b in zip(_holder_storage(holder), _holder_storage(_trained_holder()), strict=True):
        assert torch.equal(a, b)

    wrong = torch.optim.AdamW(_params(shapes=[(9, 4), (12,), (2, 3, 3)]), lr=1.0)
    try:
        load_optimizer(wrong, Path(root, "stream"))
    except OptimizerCheckpointError as exc:
        Path(root, f"rejected{rank}.txt").write_text(str(exc))
    assert len(wrong.state) == 0  # rejected before anything was installed
    Path(root, f"loaded{rank}.txt").write_text("ok")


# ------------------------------------------------------------------------------------------
# FSDP2: sharded (DTensor) optimizer state, streamed and resharded
# ------------------------------------------------------------------------------------------
def _fsdp_model(seed: int) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 4))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def _fsdp_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(5, 6, generator=g)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def _fsdp_round_trip(rank: int, root: str) -> None:
    from torch.distributed.tensor import DTensor

    model = _fsdp_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(2):
        _fsdp_step(model, opt, s)
    save_optimizer(opt, Path(root, "fsdp"), chunk_bytes=32)

    other = _fsdp_model(0)
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.5)
    _fsdp_step(other, other_opt, 9)  # creates (different) state to load into
    load_optimizer(other_opt, Path(root, "fsdp"))
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        for name, value in opt.state[p].items():
            loaded = other_opt.state[q][name]
            if isinstance(value, DTensor):
                assert torch.equal(value.to_local(), loaded.to_local()), name
            else:
                assert torch.equal(value, loaded), name
    assert other_opt.param_groups[0]["lr"] == 1e-2
    full = {
        str(i): {n: v.full_tensor() if isinstance(v, DTensor) else v for n, v in st.items()}
        for i, st in enumerate(opt.state[p] for p in model.parameters())
    }
    if rank == 0:
        torch.save(full, Path(root, "full.pt"))


def _pa_for(model: torch.nn.Module, exp_avg_sq_dtype: torch.dtype, lr: float = 1e-2) -> Any:
    from wrapped_optim.optimizers import PrecisionAwareAdamW

    return PrecisionAwareAdamW(
        model.parameters(),
        lr=lr,
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=exp_avg_sq_dtype,
    )


def _fsdp_precision_aware(rank: int, root: str) -> None:
    from torch.distributed.tensor import DTensor

    for tag, sq_dtype in (("fp8", torch.uint8), ("bf16", torch.bfloat16)):
        model = _fsdp_model(0)
        opt = _pa_for(model, sq_dtype)
        for s in range(2):
            _fsdp_step(model, opt, s)
        save_optimizer(opt, Path(root, f"pa_{tag}"), chunk_bytes=24)
        dcp.save(opt.state_dict(), checkpoint_id=Path(root, f"pa_{tag}_plain"))
        for name in (f"pa_{tag}", f"pa_{tag}_plain"):
            other = _fsdp_model(0)
            other_opt = _pa_for(other, sq_dtype, lr=0.5)
            _fsdp_step(other, other_opt, 9)  # different local storage and scales
            load_optimizer(other_opt, Path(root, name))
            for p, q in zip(model.parameters(), other.parameters(), strict=True):
                for n, stored in opt.state[p].items():
                    assert not isinstance(stored, DTensor)  # local shard storage
                    assert torch.equal(stored, other_opt.state[q][n]), (name, n)
                    a = opt.get_unscaled_state(p, n).to_local()
                    b = other_opt.get_unscaled_state(q, n).to_local()
                    assert torch.equal(a, b), (name, n)
            assert other_opt.param_groups[0]["lr"] == 1e-2
        full = {
            i: {n: opt.get_unscaled_state(p, n).full_tensor() for n in opt.state[p]}
            for i, p in enumerate(model.parameters())
        }
        if rank == 0:
            torch.save(full, Path(root, f"pa_{tag}_full.pt"))


# ------------------------------------------------------------------------------------------
# Atomic and asynchronous saves on two ranks
# ------------------------------------------------------------------------------------------
def _atomic_and_async(rank: int, root: str) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    opt = _trained_adam()
    params = [p for group in opt.param_groups for p in group["params"]]
    save_optimizer(opt, Path(root, "good"), chunk_bytes=16)
    _train(opt, params, 1, seed=5)

    original = FileSystemWriter.write_data

    def full_disk(self: Any, *args: Any, **kwargs: Any) -> Any:
        if rank == 1:
            raise OSError(28, "No space left on device")  # ENOSPC on one rank only
        return original(self, *args, **kwargs)

    FileSystemWriter.write_data = full_disk  # type: ignore[method-assign]
    try:
        save_optimizer(opt, Path(root, "good"), chunk_bytes=16)
    except BaseException as exc:  # every rank learns of the failure (DCP gathers them)
        Path(root, f"failed{rank}.txt").write_text(type(exc).__name__)
    finally:
        FileSystemWriter.write_data = original  # type: ignore[method-assign]

    group = dist.new_group(backend="gloo")  # the save's own collectives
    future = save_optimizer(
        opt, Path(root, "async"), chunk_bytes=16, async_=True, process_group=group
    )
    _train(opt, params, 2, seed=6)  # while it writes
    future.result(timeout=120)


# ------------------------------------------------------------------------------------------
# One spawn, every scenario
# ------------------------------------------------------------------------------------------
def _all_scenarios(rank: int, root: str) -> None:
    _atomic_and_async(rank, str(Path(root, "atomic")))
    _save_on_two_ranks(rank, str(Path(root, "w2")))
    _load_on_two_ranks(rank, str(Path(root, "w1")))
    _fsdp_round_trip(rank, str(Path(root, "fsdp2")))
    _fsdp_precision_aware(rank, str(Path(root, "fsdp2")))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dist")
    # World 1 writes what the two ranks will read.
    w1 = root / "w1"
    adam = _trained_adam()
    save_optimizer(adam, w1 / "stream", chunk_bytes=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(adam.state_dict(), checkpoint_id=w1 / "plain", no_dist=True)
    save_optimizer(_trained_holder(), w1 / "holder", chunk_bytes=24)
    (root / "atomic").mkdir()
    _spawn(_all_scenarios, root, str(root))
    return root


def test_failed_save_on_one_rank_keeps_the_checkpoint_and_async_saves_the_call(
    world: Path,
) -> None:
    root = world / "atomic"
    assert sorted(p.name for p in root.glob("failed*.txt")) == ["failed0.txt", "failed1.txt"]
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["async", "good"]
    expected = _trained_adam()
    fresh = torch.optim.AdamW(_params(seed=7), lr=1.0)
    load_optimizer(fresh, root / "good")  # the first save: the failed one changed nothing
    _assert_sd_equal(fresh.state_dict(), expected.state_dict())

    params = [p for group in expected.param_groups for p in group["params"]]
    _train(expected, params, 1, seed=5)  # the state when the async save was called
    load_optimizer(fresh, root / "async")
    _assert_sd_equal(fresh.state_dict(), expected.state_dict())


def test_two_ranks_save_one_process_loads(world: Path) -> None:
    tmp_path = world / "w2"
    expected = _trained_adam()
    for name in ("stream", "plain"):
        fresh = torch.optim.AdamW(_params(seed=7), lr=1.0)
        load_optimizer(fresh, tmp_path / name)
        _assert_sd_equal(fresh.state_dict(), expected.state_dict())

    scaffold = copy.deepcopy(expected.state_dict())
    for entries in scaffold["state"].values():
        for value in entries.values():
            value.zero_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(scaffold, checkpoint_id=tmp_path / "stream", no_dist=True)
    _assert_sd_equal(scaffold, expected.state_dict())

    holder = _trained_holder()
    fresh_holder = _fresh_holder()
    load_optimizer(fresh_holder, tmp_path / "holder")
    for a, b in zip(_holder_storage(fresh_holder), _holder_storage(holder), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_one_process_saves_two_ranks_load(world: Path) -> None:
    tmp_path = world / "w1"
    for rank in range(WORLD):
        message = (tmp_path / f"rejected{rank}.txt").read_text()
        assert "parameter 1" in message and "(12,)" in message
    assert (tmp_path / "loaded0.txt").read_text() == (tmp_path / "loaded1.txt").read_text() == "ok"


def test_fsdp2_sharded_state_streams_and_reads_back_unsharded(world: Path) -> None:
    tmp_path = world / "fsdp2"
    full = torch.load(tmp_path / "full.pt")
    # One process, no sharding: plain DCP reassembles the full tensors from the shards.
    scaffold: dict[str, Any] = {
        "state": {int(i): {n: torch.zeros_like(v) for n, v in st.items()} for i, st in full.items()}
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(scaffold, checkpoint_id=tmp_path / "fsdp", no_dist=True)
    for i, entries in full.items():
        for name, value in entries.items():
            assert torch.equal(scaffold["state"][int(i)][name], value), (i, name)


def test_fsdp2_precision_aware_state_streams_and_reshards_to_one_process(world: Path) -> None:
    root = world / "fsdp2"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 4))
    full = torch.load(root / "pa_bf16_full.pt")
    for name in ("pa_bf16", "pa_bf16_plain"):
        opt = _pa_for(model, torch.bfloat16, lr=0.3)
        load_optimizer(opt, root / name)  # written by two ranks, each its own shard
        for i, p in enumerate(model.parameters()):
            for n, value in full[i].items():
                assert torch.equal(opt.get_unscaled_state(p, n), value), (name, i, n)
        assert opt.param_groups[0]["lr"] == 1e-2
    scaffold: dict[str, Any] = {
        "state": {i: {n: torch.zeros_like(v) for n, v in st.items()} for i, st in full.items()}
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(scaffold, checkpoint_id=root / "pa_fp8", no_dist=True)
    fp8_full = torch.load(root / "pa_fp8_full.pt")
    for i, entries in fp8_full.items():
        for n, value in entries.items():
            assert torch.equal(scaffold["state"][i][n], value), (i, n)
