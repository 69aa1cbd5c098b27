"""The real DistributedOptimizer (and HybridDeviceOptimizer inside it) sharded over 2 gloo ranks."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("megatron.core.optimizer")

from tests.distributed.conftest import Launcher, mismatches
from tests.megatron_real.test_real_stacks import _compare_worker

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
