"""The GPU validation command's own logic (its checks need CUDA and are not run here)."""

from __future__ import annotations

import importlib

import pytest
import torch

from wrapped_optim.bench import gpu_all


def test_every_check_module_imports_and_has_run() -> None:
    for name in gpu_all.CHECKS:
        module = importlib.import_module(f"wrapped_optim.bench.{name}")
        assert callable(module.run), name


def test_a_failing_check_is_reported_and_the_others_still_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ran: list[str] = []
    real_import = importlib.import_module

    def fake_import(name: str) -> object:
        if name.endswith(".ok_check"):
            return type("M", (), {"run": staticmethod(lambda: ran.append("ok") or "## ok\n")})
        return real_import(name)

    monkeypatch.setattr(gpu_all.importlib, "import_module", fake_import)
    report, ok = gpu_all.run_checks(["no_such_check", "ok_check"])
    assert not ok
    assert "## no_such_check: FAILED" in report and "ModuleNotFoundError" in report
    assert ran == ["ok"] and "## ok" in report
    assert "# GPU validation" in report


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA answer")
def test_without_cuda_the_command_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_all.main([]) == 1
    assert "no CUDA device" in capsys.readouterr().err
