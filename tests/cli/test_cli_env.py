"""The ``wrapped-optim`` command's own surface: ``env``, ``--version`` (fast: no torch),
``python -m wrapped_optim``, help text without markup and agreeing with itself, ``bench
--help`` listing its topics and ``bench`` progress; NumPy's absence is silent."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

import wrapped_optim
from wrapped_optim._bench import _topics, report
from wrapped_optim._cli import main
from wrapped_optim.optimizers.kernels import cpu_kernel

ROOT = Path(__file__).resolve().parents[2]


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


def test_version_and_help_import_no_torch() -> None:
    """``--version`` answered in a tenth of a second, not the seconds importing torch takes
    (3.8 s before): ``import wrapped_optim`` and the command line import no torch."""
    for command in (["--version"], ["--help"], ["bench", "--help"]):
        result = subprocess.run([sys.executable, "-X", "importtime", "-m", "wrapped_optim",
                                 *command], capture_output=True, text=True, timeout=300,
                                cwd=ROOT)  # fmt: skip
        assert result.returncode == 0, result.stderr
        imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines()}
        assert "torch" not in imported and "wrapped_optim" in imported, command
    code = "import sys, wrapped_optim; assert 'torch' not in sys.modules; wrapped_optim.wrap"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=300).returncode == 0


def test_python_dash_m_is_the_command(tmp_path: Path) -> None:
    """``python -m wrapped_optim`` runs the same command line as the ``wrapped-optim`` script."""
    run = [sys.executable, "-m", "wrapped_optim"]
    version = subprocess.run([*run, "--version"], capture_output=True, text=True, timeout=300)
    assert version.stdout.strip() == f"wrapped-optim {wrapped_optim.__version__}"
    usage = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert usage.returncode == 2 and usage.stderr.startswith("usage: python -m wrapped_optim")
    missing = tmp_path / "missing.pt"
    inspect = subprocess.run([*run, "inspect", str(missing)], capture_output=True, text=True,
                             timeout=300)  # fmt: skip
    assert inspect.returncode == 2
    assert inspect.stderr.startswith(f"wrapped-optim inspect: error: {missing}")


def test_bench_help_says_where_bench_writes(capsys: pytest.CaptureFixture[str]) -> None:
    """The top-level help and ``bench --help`` name the folder ``bench`` really writes to."""
    with pytest.raises(SystemExit):
        main(["--help"])
    top = " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    bench = " ".join(capsys.readouterr().out.split())
    assert "docs/benchmarks.md" not in top
    assert f"./{_topics.DEFAULT_OUT}" in top and f"./{_topics.DEFAULT_OUT}" in bench
    # what bench does without --out (test_cli checks that it writes there)
    assert inspect.signature(report.run_benchmarks).parameters["out_dir"].default == (
        _topics.DEFAULT_OUT
    )


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
    for topic, summary in _topics.topic_summaries():
        assert f"  {topic} " in listed
        assert summary.split()[0] in listed


def test_bench_says_a_long_topic_is_still_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = types.ModuleType("wrapped_optim._bench.slow_toy")

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
    # env imports torch (every command but --version and --help does)
    result = subprocess.run([sys.executable, "-m", "wrapped_optim", "env"], env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "wrapped-optim" in result.stdout and "torch" in result.stdout
    assert "NumPy" not in result.stderr, result.stderr
    # the warning is torch's, and still there for a bare `import torch`
    bare = subprocess.run([sys.executable, "-c", "import torch"], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert "Failed to initialize NumPy" in bare.stderr


def test_the_demo_asks_for_sleeping_openmp_workers_unless_the_user_chose() -> None:
    """Spinning OpenMP workers made the demo's CPU time 2.77x its idle figure beside four busy
    processes on two cores; sleeping ones keep it at 0.93x (docs/bench/by_hand.md). The
    policy is read when torch loads the OpenMP runtime, so the command sets it first."""
    probe = (
        "import os, sys\n"
        "import wrapped_optim._cli as cli\n"
        "def seen(**kwargs):\n"
        "    print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)\n"
        "    return 0\n"
        "cli.run_demo = seen\n"
        "sys.exit(cli.main(['demo', '--steps', '4']))\n"
    )
    for preset, expected in ((None, "PASSIVE"), ("ACTIVE", "ACTIVE")):
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        if preset is not None:
            env["OMP_WAIT_POLICY"] = preset
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                cwd=ROOT, env=env, timeout=300)  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert result.stdout.split()[0] == expected, result.stdout
