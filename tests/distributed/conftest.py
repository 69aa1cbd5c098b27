"""Multi-process fixtures: a gloo launcher, and the CUDA shim Megatron-FSDP needs on a CPU.

Megatron-FSDP's experimental ``fully_shard`` schedules its collectives on CUDA streams and
marks phases with NVTX ranges. On a CPU those calls are the only obstacle: with them replaced
by no-ops, its forward, backward and optimizer step run on gloo. The replacement is test-only
code and lives here alone; it is installed in the pytest process for the test's duration and
in every spawned worker (a spawned process starts from a fresh interpreter).
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.cuda_stand_ins import NoOpStream, current_stream, no_op, null_context

WORKER_TIMEOUT_S = 120


_SHIM = {
    (torch.cuda, "device"): null_context,
    (torch.cuda, "stream"): null_context,
    (torch.cuda, "current_stream"): current_stream,
    (torch.cuda, "Stream"): NoOpStream,
    (torch.cuda.nvtx, "range_push"): no_op,
    (torch.cuda.nvtx, "range_pop"): no_op,
}


def install_cuda_shim() -> Callable[[], None]:
    """Replaces the CUDA stream/device/NVTX calls with no-ops; returns the undo function."""
    saved = {key: getattr(*key) for key in _SHIM}
    for (module, name), replacement in _SHIM.items():
        setattr(module, name, replacement)

    def undo() -> None:
        for (module, name), original in saved.items():
            setattr(module, name, original)

    return undo


def _bootstrap(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    store_path: str,
    result_dir: str,
    cuda_shim: bool,
    args: tuple[Any, ...],
) -> None:
    torch.set_num_threads(1)
    if cuda_shim:
        install_cuda_shim()
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=WORKER_TIMEOUT_S),
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(result_dir, f"result_{rank}.pt"))
    except BaseException:
        Path(result_dir, f"error_{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


class Launcher:
    """Runs ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes.

    Returns the per-rank return values (anything ``torch.save`` can write), rank order.
    """

    def __init__(
        self, tmp_path: Path, cuda_shim: bool, timeout_s: float = WORKER_TIMEOUT_S
    ) -> None:
        self.tmp_path = tmp_path
        self.cuda_shim = cuda_shim
        self.timeout_s = timeout_s
        self.runs = 0

    def __call__(self, fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
        self.runs += 1
        run_dir = self.tmp_path / f"run{self.runs}"
        run_dir.mkdir()
        context = mp.start_processes(
            _bootstrap,
            args=(fn, world_size, str(run_dir / "store"), str(run_dir), self.cuda_shim, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + self.timeout_s + 30
        try:
            while not context.join(timeout=1):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__} did not finish in time")
        except mp.ProcessRaisedException as error:
            details = "".join(path.read_text() for path in sorted(run_dir.glob("error_*.txt")))
            raise AssertionError(f"a worker of {fn.__name__} failed:\n{details}") from error
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
        return [torch.load(run_dir / f"result_{rank}.pt") for rank in range(world_size)]


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    return x.numel() == 0 or torch.equal(
        x.detach().reshape(-1).view(torch.uint8), y.detach().reshape(-1).view(torch.uint8)
    )


def mismatches(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors differ in any bit (or dtype/shape), plus keys only one side has."""
    bad = set(a.keys() ^ b.keys())
    bad.update(key for key in a.keys() & b.keys() if not _same_bits(a[key], b[key]))
    return sorted(bad)


def requantized_fp8_mismatches(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys: list[str]
) -> list[str]:
    """Keys where ``b`` is not ``a`` re-quantized to FP8 E4M3 under another per-tensor scale.

    A per-tensor scale (amax / 448) belongs to each rank's *local* shard; reloading into
    another world size re-encodes every shard with the new shard's scale, which moves a value
    by at most half an E4M3 step: 2**-4 relative, or 2**-10 scales in the subnormal range.
    """
    bad = []
    for key in keys:
        x, y = a[key].double(), b[key].double()
        scale = max(float(x.abs().max()), float(y.abs().max())) / 448
        if x.shape != y.shape or bool(((x - y).abs() > x.abs() / 16 + scale / 1024).any()):
            bad.append(key)
    return bad


def become_solo(rank: int) -> None:
    """Leaves the launch's world for a world of one, this process alone, on a fresh store.

    Lets one launch of N processes do world-of-one work too, N pieces of it at once, after its
    N-rank work (no second spawn and its seconds of imports). Call it last: the launcher's
    teardown destroys the solo group. ``rank`` (in the old world) only names the store.
    """
    dist.barrier()  # every rank's collectives in the old world are done
    dist.destroy_process_group()
    store = Path(tempfile.mkdtemp(prefix=f"solo{rank}_")) / "store"
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=WORKER_TIMEOUT_S),
    )


def merge_solo_results(parts: list[dict[Any, Any]]) -> list[dict[Any, Any]]:
    """The results of a world of one, as one rank's, put together from the launch's ranks
    that each did a part of it after :func:`become_solo`."""
    return [{key: value for part in parts for key, value in part.items()}]


def run_in_this_process(fn: Callable[..., Any], tmp_dir: Path, *args: Any) -> Any:
    """Runs ``fn(0, 1, *args)`` in a one-process gloo group created here, then tears it down.

    A world of one needs no spawn (which costs seconds of imports); the group is destroyed
    before returning, also when ``fn`` raises.
    """
    if dist.is_initialized():
        raise RuntimeError("a default process group already exists in this process")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_dir / 'single_store'}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=WORKER_TIMEOUT_S),
    )
    try:
        return fn(0, 1, *args)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def cuda_shim() -> Iterator[None]:
    """The Megatron-FSDP CUDA shim, installed in this process for the module's tests."""
    undo = install_cuda_shim()
    try:
        yield
    finally:
        undo()


@pytest.fixture(scope="module")
def megatron_fsdp_launcher(tmp_path_factory: pytest.TempPathFactory, cuda_shim: None) -> Launcher:
    """A gloo launcher whose workers run with the Megatron-FSDP CUDA shim installed.

    Module-scoped so a test module can run a few spawns and share their results.
    """
    pytest.importorskip("megatron_fsdp.experimental")
    return Launcher(tmp_path_factory.mktemp("mfsdp"), cuda_shim=True)


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Launcher:
    """A plain gloo launcher (no shim), module-scoped."""
    return Launcher(tmp_path_factory.mktemp("gloo"), cuda_shim=False)
