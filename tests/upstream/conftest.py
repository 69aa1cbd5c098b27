"""tests/upstream: upstream's own test files, run from a local checkout (see _harness)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.upstream._harness import mark_expected


def pytest_configure(config: pytest.Config) -> None:
    # Megatron-Bridge's device marker, so --strict-markers accepts its tests.
    config.addinivalue_line("markers", "run_only_on(device): upstream's device requirement")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mark_expected(items)
    for item in items:
        marker = item.get_closest_marker("run_only_on")
        if marker is not None and marker.args == ("gpu",) and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="upstream runs it on a GPU only"))


@pytest.fixture(scope="session")
def mfsdp_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[str, str]]]:
    """Megatron-FSDP's selected cases, run once in two gloo ranks: case -> per-rank outcome."""
    from tests.distributed.conftest import Launcher
    from tests.upstream import _mfsdp

    root = os.environ[_mfsdp.VARIABLE]
    launcher = Launcher(tmp_path_factory.mktemp("upstream_mfsdp"), cuda_shim=True, timeout_s=600)
    per_rank = launcher(_mfsdp.run_ranks, 2, root)
    return {case: [ranks[case] for ranks in per_rank] for case in per_rank[0]}
