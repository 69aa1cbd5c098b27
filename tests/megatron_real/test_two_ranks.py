"""The real DistributedOptimizer (and HybridDeviceOptimizer inside it) sharded over 2 gloo ranks,
and resumed in fresh spawned processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core.optimizer")

from tests.distributed.conftest import Launcher, mismatches
from tests.megatron_real.test_real_stacks import _compare_worker, _first_run, _resumed_run

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.xdist_group("megatron_real")]


def _both(rank: int, world: int) -> dict[str, Any]:
    return {name: _compare_worker(rank, world, name) for name in ("distributed", "offload_full")}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return Launcher(tmp_path_factory.mktemp("megatron_real"), cuda_shim=False)(_both, 2)


@pytest.mark.parametrize("name", ["distributed", "offload_full"])
def test_two_rank_wrapped_equals_bare_bitwise(ranks: list[dict[str, Any]], name: str) -> None:
    for result in (rank[name] for rank in ranks):
        assert result["leaf"] == "DistributedOptimizer"
        assert mismatches(result["bare"], result["wrapped"]) == []
        assert mismatches(result["bare_state"], result["wrapped_state"]) == []
    # Both ranks hold the same (all-gathered) weights, each only its own optimizer shard.
    assert mismatches(ranks[0][name]["wrapped"], ranks[1][name]["wrapped"]) == []
    assert mismatches(ranks[0][name]["bare_state"], ranks[1][name]["bare_state"]) != []


# --------------------------------------------------------------------------------------
# Resume in fresh OS processes: save in 2 spawned ranks, load in 2 new ones, continue
# --------------------------------------------------------------------------------------
RESUMED = ("distributed", "offload_full")


def _save_and_continue(rank: int, world: int, root: str) -> dict[str, Any]:
    return {
        name: _first_run(rank, world, name, str(Path(root, name)), "derived") for name in RESUMED
    }


def _load_and_continue(rank: int, world: int, root: str) -> dict[str, Any]:
    return {
        name: _resumed_run(rank, world, name, str(Path(root, name)), "derived") for name in RESUMED
    }


@pytest.fixture(scope="module")
def resumed_in_new_processes(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("megatron_real_resume")
    for name in RESUMED:
        (root / name).mkdir()
    launch = Launcher(root, cuda_shim=False)
    uninterrupted = launch(_save_and_continue, 2, str(root))
    continued = launch(_load_and_continue, 2, str(root))  # fresh processes, fresh group
    return uninterrupted, continued


@pytest.mark.parametrize("name", RESUMED)
def test_two_rank_resume_in_fresh_processes_is_bitwise(
    resumed_in_new_processes: Any, name: str
) -> None:
    # wrap(optimizer) as a user calls it; each rank saved and reloads only its own shard.
    uninterrupted, continued = resumed_in_new_processes
    for rank in range(2):
        before, after = uninterrupted[rank][name], continued[rank][name]
        assert "error" not in after, after.get("error")
        assert mismatches(before["weights"], after["weights"]) == []
        assert len(before["masters"]) == len(after["masters"])
        assert (
            mismatches(dict(enumerate(before["masters"])), dict(enumerate(after["masters"]))) == []
        )
    assert continued[0][name]["layers"][-1] == "ChainedOptimizer"
    assert mismatches(continued[0][name]["weights"], continued[1][name]["weights"]) == []
