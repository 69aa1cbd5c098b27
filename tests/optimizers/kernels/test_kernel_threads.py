"""The CPU kernel's default thread count: the cores the process may use (affinity, cgroup
quota), never the host's, and fewer when other processes keep the cores busy."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.kernel_support import needs_kernel
from wrapped_optim.optimizers.kernels import _build as _kernel_build
from wrapped_optim.optimizers.kernels import _threads as _kernel_threads
from wrapped_optim.optimizers.kernels import cpu_kernel


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_cgroup_v2_quota_is_the_smallest_on_the_path(tmp_path: Path) -> None:
    write(tmp_path / "cpu.max", "max 100000\n")
    write(tmp_path / "job" / "cpu.max", "150000 100000\n")
    write(tmp_path / "job" / "step" / "cpu.max", "max 100000\n")
    write(tmp_path / "self", "0::/job/step\n")
    assert _kernel_threads.cgroup_cpu_limit(tmp_path, tmp_path / "self") == 1.5
    write(tmp_path / "job" / "cpu.max", "max 100000\n")
    assert _kernel_threads.cgroup_cpu_limit(tmp_path, tmp_path / "self") is None


def test_a_cgroup_v1_quota_counts_also_in_a_hybrid_layout(tmp_path: Path) -> None:
    write(tmp_path / "self", "4:memory:/x\n1:cpu:/\n0::/\n")
    write(tmp_path / "cpu" / "cpu.cfs_quota_us", "-1\n")
    write(tmp_path / "cpu" / "cpu.cfs_period_us", "100000\n")
    assert _kernel_threads.cgroup_cpu_limit(tmp_path, tmp_path / "self") is None
    write(tmp_path / "cpu" / "cpu.cfs_quota_us", "200000\n")
    assert _kernel_threads.cgroup_cpu_limit(tmp_path, tmp_path / "self") == 2.0


def test_usable_cores_follow_affinity_and_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(before)})
        assert _kernel_threads.usable_cores() == 1
        assert _kernel_threads.default_threads(8, own_threads=8, load=0.0) == 1
    finally:
        os.sched_setaffinity(0, before)
    assert _kernel_threads.usable_cores() == min(
        len(before), int(_kernel_threads.cgroup_cpu_limit() or len(before))
    )
    monkeypatch.setattr(_kernel_threads, "cgroup_cpu_limit", lambda: 1.5)
    assert _kernel_threads.usable_cores() == 1  # a second thread would be throttled


def test_busy_cores_are_left_to_their_owners(monkeypatch: pytest.MonkeyPatch) -> None:
    threads = _kernel_threads.default_threads
    assert threads(2, own_threads=2, cores=2, load=2.0) == 2  # this process alone
    assert threads(2, own_threads=2, cores=2, load=3.0) == 1  # one busy process besides
    assert threads(2, own_threads=2, cores=2, load=6.0) == 1  # load 2x the cores
    assert threads(1, own_threads=1, cores=8, load=0.0) == 1  # never more than wanted
    # 4 of a 64-core host's cores: its load counts in proportion
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert threads(4, own_threads=4, cores=4, load=44.0) == 2
    assert threads(4, own_threads=4, cores=4, load=4.0) == 4


@needs_kernel
def test_the_kernel_uses_the_default_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel call runs on one thread when the load says the cores are taken, on torch's
    count (within the usable cores) when they are free, and on what it is told."""
    seen: list[int] = []
    run = cpu_kernel._run_passes

    def spy(lib: Any, status: Any, args: tuple[Any, ...], scaled: Any) -> None:
        seen.append(args[3])
        run(lib, status, args, scaled)

    monkeypatch.setattr(cpu_kernel, "_run_passes", spy)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(_kernel_threads, "usable_cores", lambda: 2)
    n = 1 << 20  # enough elements for 2 threads
    operands = [[torch.zeros(n)], [torch.ones(n)], [torch.zeros(n)], [torch.zeros(n)]]
    options: dict[str, Any] = {"lr": 0.1, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0}
    for load, expected in ((50.0, 1), (0.0, 2)):
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        cpu_kernel.adamw_step_(*operands, **options)
        assert seen[-1] == expected, load
    monkeypatch.setattr(os, "getloadavg", lambda: (50.0, 50.0, 50.0))
    cpu_kernel.adamw_step_(*operands, num_threads=2, **options)
    assert seen[-1] == 2  # an explicit count is the caller's


def test_a_step_asks_for_the_cores_cheaply(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each kernel call asks for its thread count: one thread looks at nothing, and this
    process's own quota is read at most once a second (a read costs tens of microseconds,
    a share of a small step), while other cgroup paths are read each time."""
    monkeypatch.setattr(_kernel_threads, "usable_cores", lambda: pytest.fail("cores asked"))
    assert _kernel_threads.default_threads(1, own_threads=1) == 1
    monkeypatch.undo()

    reads: list[Path] = []
    real_read = _kernel_threads._read

    def counting(path: Path) -> str | None:
        reads.append(path)
        return real_read(path)

    clock = [1000.0]
    monkeypatch.setattr(_kernel_threads, "_read", counting)
    monkeypatch.setattr(_kernel_threads.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(_kernel_threads, "_own_limit", None)
    first = _kernel_threads.cgroup_cpu_limit()
    assert reads and reads[0] == _kernel_threads._PROC_CGROUP
    count = len(reads)
    clock[0] += 0.9
    assert _kernel_threads.cgroup_cpu_limit() == first
    assert len(reads) == count  # reused within the second
    clock[0] += 0.2
    assert _kernel_threads.cgroup_cpu_limit() == first
    assert len(reads) == 2 * count  # read again after it
    tmp = reads[0].parent
    assert _kernel_threads.cgroup_cpu_limit(Path("/nonexistent"), tmp / "none") is None
    assert len(reads) > 2 * count  # another path is read, not the cached quota


def test_the_kernel_is_found_available_without_a_compiler_search(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step asks whether the kernel is available for every param: the answer is the loaded
    library's, never a new search for a compiler on PATH (status() reports that)."""
    expected = cpu_kernel.status().available
    monkeypatch.setattr(_kernel_build, "find_compiler", lambda: pytest.fail("searched"))
    assert cpu_kernel.available() is expected
