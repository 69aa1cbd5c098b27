"""The ``wrapped-optim`` command's own surface: ``env``, ``--version``, help text without
markup, ``bench --help`` listing its topics and ``bench`` progress; NumPy's absence is silent."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

import wrapped_optim
from wrapped_optim._cli import main
from wrapped_optim.bench import report
from wrapped_optim.optimizers import cpu_kernel

ROOT = Path(__file__).resolve().parents[1]


def test_env_prints_versions_and_the_kernel(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    rows = dict(line.split(" : ", 1) for line in out.splitlines())
    rows = {label.strip(): value for label, value in rows.items()}
    import torch

    assert rows["torch"].startswith(torch.__version__)
    assert rows["wrapped-optim"].startswith(wrapped_optim.__version__)
    for label in ("megatron-core", "transformer-engine", "triton", "CUDA", "kernel cache"):
        assert rows[label]
    status = cpu_kernel.status()
    if status.available:
        assert rows["CPU kernel"].startswith("available")
        assert str(status.library) in rows["kernel library"]
        assert rows["kernel loops"].split()[0] == status.loops
        assert rows["kernel loop families"] == ", ".join(status.loop_families)
    else:
        assert rows["CPU kernel"] == f"unavailable: {status.reason}"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"wrapped-optim {wrapped_optim.__version__}"


@pytest.mark.parametrize("command", [[], ["demo"], ["bench"], ["inspect"], ["env"]])
def test_help_has_no_markup(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: wrapped-optim")
    for markup in ("``", ":func:", ":class:", ":mod:"):
        assert markup not in out


def test_bench_help_lists_every_topic(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    listed = out.split("topics:\n", 1)[1]
    for topic, summary in report.topic_summaries():
        assert f"  {topic} " in listed
        assert summary.split()[0] in listed


def test_bench_says_a_long_topic_is_still_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = types.ModuleType("wrapped_optim.bench.slow_toy")

    def run(quick: bool) -> str:
        time.sleep(0.35)
        return "## Slow toy\n"

    module.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(report, "HEARTBEAT_SECONDS", 0.1)
    lines: list[str] = []
    report.run_benchmarks(quick=True, only=["slow_toy"], out_dir=tmp_path, plots=False,
                          echo=lines.append)  # fmt: skip
    still = [line for line in lines if "slow_toy: still running" in line]
    assert len(still) >= 2
    assert lines[0] == "running slow_toy ..." and lines[-1].startswith("  slow_toy: ok in")


def test_no_numpy_warning_when_numpy_is_absent(tmp_path: Path) -> None:
    """torch warns at import when NumPy is missing (a plain `pip install wrapped-optim` has
    none); every command would print it."""
    (tmp_path / "numpy").mkdir()
    (tmp_path / "numpy" / "__init__.py").write_text(
        "raise ModuleNotFoundError('no numpy here', name='numpy')\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    result = subprocess.run([sys.executable, "-m", "wrapped_optim._cli", "--version"], env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("wrapped-optim ")
    assert "NumPy" not in result.stderr, result.stderr
    # the warning is torch's, and still there for a bare `import torch`
    bare = subprocess.run([sys.executable, "-c", "import torch"], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert "Failed to initialize NumPy" in bare.stderr
