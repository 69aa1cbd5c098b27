"""The GPU validation command's own logic (its checks need CUDA and are not run here): every
check module imports without CUDA, a failed row or a raising check fails the run, a missing
requirement is "not run" and never passed, and the command runs from the repository root."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.gpu import _report, gpu_all, gpu_staged

ROOT = Path(__file__).resolve().parents[1]


def test_every_check_module_imports_without_cuda_and_has_run() -> None:
    for name in gpu_all.CHECKS:
        module = importlib.import_module(f"tests.gpu.{name}")
        assert callable(module.run), name
    # The checks are test code: nothing of them ships in the package.
    in_package = [p.name for p in (ROOT / "wrapped_optim").rglob("gpu_*")]
    assert in_package == [], in_package


def _fake_checks(monkeypatch: pytest.MonkeyPatch, modules: dict[str, object]) -> None:
    real_import = importlib.import_module

    def fake_import(name: str) -> object:
        short = name.rsplit(".", 1)[-1]
        return modules[short] if short in modules else real_import(name)

    monkeypatch.setattr(gpu_all.importlib, "import_module", fake_import)


def _check(run: object) -> SimpleNamespace:
    return SimpleNamespace(run=run)


def _raise_not_run() -> _report.Section:
    raise _report.NotRun("not run: megatron-core missing")


def test_failed_rows_raised_checks_and_not_run_checks_are_told_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ran: list[str] = []

    def ok() -> _report.Section:
        ran.append("ok")
        return _report.Section("## ok\n")

    _fake_checks(
        monkeypatch,
        {
            "ok_check": _check(ok),
            "row_check": _check(
                lambda: _report.row_table([("a", True, ""), ("b", False, "")], "#")
            ),
            "str_check": _check(lambda: "## an old-style string section"),
            "needs_megatron": _check(_raise_not_run),
        },
    )
    names = ["no_such_check", "row_check", "str_check", "needs_megatron", "ok_check"]
    report, failed, not_run = gpu_all.run_checks(names)
    assert failed == ["no_such_check: raised", "row_check: b", "str_check: raised"]
    assert not_run == ["needs_megatron: not run: megatron-core missing"]
    assert "## no_such_check: FAILED" in report and "ModuleNotFoundError" in report
    assert "| b | FAIL |" in report and "returned str, not a Section" in report
    assert ran == ["ok"] and "## ok" in report and report.startswith("# GPU validation")
    assert gpu_all.exit_code(failed, not_run) == 1
    assert gpu_all.exit_code([], not_run) == 2  # not run is never a pass...
    assert gpu_all.exit_code([], not_run, allow_not_run=True) == 0  # ...unless allowed
    _, failed, not_run = gpu_all.run_checks(["ok_check"])
    assert (failed, not_run, gpu_all.exit_code(failed, not_run)) == ([], [], 0)


def test_megatron_checks_say_not_run_without_megatron(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_report.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(_report.NotRun, match="not run: megatron-core missing"):
        _report.require_megatron()


def test_a_script_exits_non_zero_on_a_failed_row(capsys: pytest.CaptureFixture[str]) -> None:
    assert _report.main_of(lambda: _report.row_table([("x", False, "d")], "## t")) == 1
    assert "FAILED: x" in capsys.readouterr().err
    assert _report.main_of(_raise_not_run) == 2


def test_setup_installs_only_what_is_missing_and_reports_a_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    commands: list[list[str]] = []

    def fake_run(command: list[str], **_: object) -> SimpleNamespace:
        commands.append(command)
        return SimpleNamespace(returncode=1, stdout="", stderr="ERROR: no index\n")

    monkeypatch.setattr(gpu_all.subprocess, "run", fake_run)
    notes = gpu_all.setup([("torch", "torch==0"), ("no_such_module_x", "nsmx==1.0")])
    assert notes == ["could not install nsmx==1.0: ERROR: no index"]
    assert commands == [
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "nsmx==1.0"]
    ]


def test_the_staged_bounds_are_rows_that_fail() -> None:
    row = {
        "params": 10**8,
        "largest": 1,
        "storage": 100,
        "save_chunked_peak": 65,
        "load_host_chunked_peak": 64 + gpu_staged.LOAD_SLACK_BYTES,
        "load_dev_chunked_peak": 65 + gpu_staged.LOAD_SLACK_BYTES,
    }
    bound = 64 + gpu_staged.LOAD_SLACK_BYTES
    assert gpu_staged.bound_failures([row], 64) == [
        "100M: chunked save peak 65 B > 64 B",
        f"100M: chunked load (device ckpt) peak {bound + 1} B > {bound} B",
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA answer")
def test_without_cuda_the_command_fails_and_says_so() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tests.gpu.gpu_all", "--no-setup"],
        cwd=ROOT, capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1
    assert "no CUDA device; nothing was checked" in result.stderr
