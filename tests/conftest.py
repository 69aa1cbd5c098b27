"""Shared test configuration: hypothesis profiles and thread limits for 2-core CI."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, settings

# "ci" keeps the suite inside its time budget; "thorough" is for local, on-demand runs:
#   HYPOTHESIS_PROFILE=thorough pytest
settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.register_profile(
    "thorough",
    max_examples=500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=10, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(1)

# The compiled CPU AdamW kernel comes from the package build (`pip install -e .`; its name
# carries the hash of the C sources, so a stale one is never loaded), else it is built afresh
# for each test run into a private cache, so a build in the user's cache never stands in for
# the source under test.
if "WRAPPED_OPTIM_KERNEL_CACHE" not in os.environ:
    _kernel_cache = tempfile.mkdtemp(prefix="wrapped-optim-kernel-")
    os.environ["WRAPPED_OPTIM_KERNEL_CACHE"] = _kernel_cache
    atexit.register(shutil.rmtree, _kernel_cache, ignore_errors=True)


# The Megatron-facing tests: every module that drives megatron-core or megatron-fsdp (real
# classes or the doubles checked against them), and the doctests that need megatron-core.
# `pytest -m megatron` runs them against whichever Core is installed; .ci/megatron_env builds
# an environment with another Core release and runs exactly these.
MEGATRON_FACING = (
    "tests/megatron_real/",
    "tests/distributed/test_megatron_fsdp.py",
    "tests/test_adapters.py",
    "tests/test_compat.py",
    "tests/test_config.py",
    "tests/test_doubles_match_core.py",
    "tests/test_bridge_parity.py",
    "tests/test_factory.py",
    "tests/test_fsdp.py",
    "tests/test_hybrid_precision.py",
    "tests/test_hybrid_sync.py",
    "tests/test_megatron_wrapping.py",
    "tests/test_schedulers.py",
    "tests/test_stack.py",
    "tests/test_staged.py",
    "tests/test_stale_copies.py",
    "wrapped_optim/compat.py",
    "wrapped_optim/integrations/bridge.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the Megatron-facing tests ``megatron`` (see ``MEGATRON_FACING``)."""
    root = config.rootpath
    for item in items:
        path = item.path.relative_to(root).as_posix()
        if path.startswith(MEGATRON_FACING):
            item.add_marker(pytest.mark.megatron)
