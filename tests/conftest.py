"""Shared test configuration: hypothesis profiles and thread limits for 2-core CI."""

from __future__ import annotations

import atexit
import os
import random
import re
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings

# "ci" keeps the suite inside its time budget; "thorough" is for local, on-demand runs:
#   HYPOTHESIS_PROFILE=thorough pytest
# Both draw from a random seed each run (pytest_configure below), printed in the header.
# derandomize is set off explicitly: where a CI variable is set, hypothesis makes its own
# derandomized "ci" profile the default, and a profile registered here would inherit it.
settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=500,
    deadline=None,
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=10, deadline=None, derandomize=False)
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
    "tests/adapters/test_adapters.py",
    "tests/integrations/test_compat.py",
    "tests/config/test_config.py",
    "tests/adapters/test_doubles_match_core.py",
    "tests/integrations/test_bridge_parity.py",
    "tests/config/test_builder.py",
    "tests/wrappers/test_fsdp.py",
    "tests/optimizers/hybrid_offload/test_hybrid_precision.py",
    "tests/wrappers/test_hybrid_sync.py",
    "tests/wrappers/test_megatron_wrapping.py",
    "tests/wrappers/test_schedulers.py",
    "tests/wrappers/test_stack.py",
    "tests/wrappers/test_staged.py",
    "tests/wrappers/test_stale_copies.py",
    "wrapped_optim/compat.py",
    "wrapped_optim/integrations/bridge.py",
)


_SEED_ENV = "WRAPPED_OPTIM_TEST_HYPOTHESIS_SEED"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Draws a hypothesis seed for this run unless ``--hypothesis-seed`` gives one.

    It is set as that option before hypothesis' own plugin reads it, so every test explores
    from it, and the header and the summary print it: ``pytest --hypothesis-seed=N`` replays
    the run's examples. xdist workers (started after this, from the controller's environment)
    take the controller's seed from ``_SEED_ENV``.
    """
    seed = config.getoption("hypothesis_seed", None)
    if seed is None:
        seed = os.environ.get(_SEED_ENV) or str(random.SystemRandom().getrandbits(32))
        config.option.hypothesis_seed = seed
    os.environ[_SEED_ENV] = str(seed)


def _seed_line(config: pytest.Config) -> str:
    seed = config.getoption("hypothesis_seed", None)
    return f"hypothesis seed {seed} (replay: pytest --hypothesis-seed={seed})"


def pytest_report_header(config: pytest.Config) -> str:
    return _seed_line(config)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    terminalreporter.write_line(_seed_line(config))  # also under -q, beside the failures


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the Megatron-facing tests ``megatron`` (see ``MEGATRON_FACING``)."""
    root = config.rootpath
    for item in items:
        path = item.path.relative_to(root).as_posix()
        if path.startswith(MEGATRON_FACING):
            item.add_marker(pytest.mark.megatron)


# Where the Megatron packages are meant to be installed (.ci/run and .ci/megatron_env set
# this), a Megatron import that fails is a failure, not a skip: the suite's
# ``pytest.importorskip("megatron...")`` calls would otherwise turn a Core release that
# moved or broke a module into silently skipped tests.
REQUIRE_MEGATRON = "WRAPPED_OPTIM_REQUIRE_MEGATRON"
_MEGATRON_IMPORT_SKIP = re.compile(r"could not import '(megatron[._][\w.]*)'")


def megatron_import_skip(report: pytest.CollectReport | pytest.TestReport) -> str | None:
    """The skip reason if ``report`` is a skip by a failed Megatron import, else ``None``."""
    if not report.skipped:
        return None
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason if _MEGATRON_IMPORT_SKIP.search(reason) else None


def fail_megatron_import_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    """Turns a Megatron import skip into a failure when ``REQUIRE_MEGATRON`` is ``1``."""
    if os.environ.get(REQUIRE_MEGATRON) != "1":
        return
    reason = megatron_import_skip(report)
    if reason is not None:
        report.outcome = "failed"
        report.longrepr = (
            f"{REQUIRE_MEGATRON}=1 (the Megatron packages are meant to be installed here), "
            f"but a Megatron import failed: {reason}"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome = yield
    fail_megatron_import_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Any:
    outcome = yield
    fail_megatron_import_skip(outcome.get_result())


@pytest.fixture
def one_process_group() -> Iterator[None]:
    """A real one-process gloo group for DTensor and mesh tests on the CPU; one already there
    (a test that made its own) is used and left alone."""
    dist = torch.distributed
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()
