"""``WRAPPED_OPTIM_REQUIRE_MEGATRON=1`` (set by .ci/run and .ci/megatron_env) turns a failed
Megatron import into a failure instead of a skip, in a test body and at module level, and
leaves every other skip alone. Each run is a real pytest process with tests/conftest.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REQUIRE_MEGATRON, fail_megatron_import_skip

ROOT = Path(__file__).resolve().parents[1]
IN_A_TEST = """
import pytest

def test_megatron_module_gone():
    pytest.importorskip("megatron.core.no_such_module_here")

def test_megatron_fsdp_gone():
    pytest.importorskip("megatron_fsdp.no_such_module_here")

def test_other_optional_package():
    pytest.importorskip("no_such_optional_package_here")
"""
AT_MODULE_LEVEL = """
import pytest

pytest.importorskip("megatron.core.no_such_module_here")

def test_never_collected():
    pass
"""


def _run(tmp_path: Path, require: str | None) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_in_a_test.py").write_text(IN_A_TEST)
    (tmp_path / "test_at_module_level.py").write_text(AT_MODULE_LEVEL)
    env = dict(os.environ)
    env.pop(REQUIRE_MEGATRON, None)
    if require is not None:
        env[REQUIRE_MEGATRON] = require
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-rA",
            "--continue-on-collection-errors",
            "-p",
            "tests.conftest",
            "-p",
            "no:cacheprovider",
            f"--rootdir={tmp_path}",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_required_megatron_imports_fail_instead_of_skipping(tmp_path: Path) -> None:
    result = _run(tmp_path, "1")
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert "2 failed, 1 skipped, 1 error" in out, out
    # One report each for the two tests and the module; the short summary after them repeats
    # the message, cut to the terminal's width unless a CI variable is set, so it is not counted.
    reports = out.split("short test summary info")[0]
    assert reports.count("but a Megatron import failed") == 3, out
    assert "could not import 'megatron.core.no_such_module_here'" in out
    assert "could not import 'megatron_fsdp.no_such_module_here'" in out
    assert "SKIPPED" in out and "no_such_optional_package_here" in out  # others still skip


def test_without_the_variable_they_skip() -> None:
    report = pytest.TestReport(
        "t.py::test",
        ("t.py", 1, "test"),
        {},
        "skipped",
        ("t.py", 2, "Skipped: could not import 'megatron.core.x': No module named 'x'"),
        "call",
    )
    saved = os.environ.pop(REQUIRE_MEGATRON, None)
    try:
        fail_megatron_import_skip(report)
        assert report.outcome == "skipped"
        os.environ[REQUIRE_MEGATRON] = "1"
        fail_megatron_import_skip(report)
        assert report.outcome == "failed"
    finally:
        os.environ.pop(REQUIRE_MEGATRON, None)
        if saved is not None:
            os.environ[REQUIRE_MEGATRON] = saved
