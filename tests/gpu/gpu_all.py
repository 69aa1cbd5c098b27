"""The GPU validation run: every ``tests/gpu/gpu_<topic>`` check in one command.

On a CUDA machine, from the repository root (torch installed; nothing else needed)::

    python -m tests.gpu.gpu_all --out gpu-results.md

First a set-up step installs what the checks import and the machine lacks, pinned and
without dependencies (so torch is never touched): ``attrs`` (the package needs it) and
``megatron-core==0.16.1`` with its ``numpy`` and ``packaging`` (``gpu_hybrid`` and
``gpu_factory`` need it). ``--no-setup`` skips
it. Then each check runs in turn (each a module whose ``run()`` returns a
:class:`~tests.gpu._report.Section`):

* ``gpu_staged`` -- real ``torch.cuda`` peak memory and time of unstaged, whole-tensor and
  chunked saves and loads (the one-chunk bound is a row), and of the FP32 no-copy load;
* ``gpu_precision_adam`` -- PrecisionAwareAdamW on CUDA: chunk API, resume bit-identity,
  step times;
* ``gpu_fused_step`` -- the fused Triton step: taken, launches per step (profiler), no host
  sync (sync debug mode), bitwise against the same kernels interpreted on CPU and against
  the CPU kernel;
* ``gpu_block_moments`` -- block-scaled moments on CUDA: the Triton block kernel taken,
  bitwise against the CPU kernel at 1M parameters, resume bit-identity, step times;
* ``gpu_hybrid`` -- megatron-core's real ``HybridDeviceOptimizer`` through
  ``HybridSyncOptimizer``;
* ``gpu_hybrid_precision`` -- ``HybridOffloadOptimizer`` with ``PrecisionAwareAdamW``
  sub-optimizers on CUDA, staged;
* ``gpu_factory`` -- ``setup_optimizer`` with megatron-core's real builders;
* ``gpu_streaming`` -- ``save_optimizer`` / ``load_optimizer`` with CUDA-resident state.

Exit code: 0 when every row of every check passed; 1 when a row failed, a check raised, or
there is no CUDA device; 2 when nothing failed but a check was not run (its requirement is
missing: it is never reported as passed). ``--allow-not-run`` turns that 2 into 0.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

import torch

from ._report import NotRun, Section

__all__ = ["CHECKS", "REQUIREMENTS", "exit_code", "main", "run_checks", "setup"]

CHECKS = (
    "gpu_precision_adam",
    "gpu_fused_step",
    "gpu_block_moments",
    "gpu_hybrid_precision",
    "gpu_streaming",
    "gpu_hybrid",
    "gpu_factory",
    "gpu_staged",
)
#: (importable module, pinned requirement) installed by :func:`setup` when missing.
REQUIREMENTS = (
    ("attrs", "attrs>=23.1"),
    # megatron-core's own requirements besides torch (installed without dependencies).
    ("numpy", "numpy"),
    ("packaging", "packaging>=24.2"),
    ("megatron.core", "megatron-core==0.16.1"),
)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package
        return False


def setup(requirements: Sequence[tuple[str, str]] = REQUIREMENTS) -> list[str]:
    """Install each missing requirement with pip (``--no-deps``); returns what it did.

    A failed install is reported, not raised: the checks that need it then say "not run".

    Example:
        >>> setup([("sys", "never-installed==0")])  # already importable: nothing to do
        []
    """
    done = []
    for module, requirement in requirements:
        if _importable(module):
            continue
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", requirement]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        importlib.invalidate_caches()
        if result.returncode == 0 and _importable(module):
            done.append(f"installed {requirement}")
        else:
            last = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["?"]
            done.append(f"could not install {requirement}: {last[0]}")
    return done


def _header(notes: Sequence[str]) -> str:
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    lines = [
        "# GPU validation",
        "",
        f"- device: {device}",
        f"- torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"Python {platform.python_version()}",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "- reproduce: `python -m tests.gpu.gpu_all --out gpu-results.md`",
        *[f"- set-up: {note}" for note in notes],
    ]
    return "\n".join(lines) + "\n"


def run_checks(
    names: Sequence[str] = CHECKS, notes: Sequence[str] = ()
) -> tuple[str, list[str], list[str]]:
    """Run the named checks in order; returns the report, the failures and the not-run.

    A check that raises, or returns a section with failed rows, is a failure; one that
    raises :class:`~tests.gpu._report.NotRun` is listed as not run. Either way the others
    still run, so one broken check does not hide the results of the rest.

    Example:
        >>> from tests.gpu.gpu_all import run_checks
        >>> report, failed, not_run = run_checks([])  # no checks: just the header
        >>> report.startswith("# GPU validation"), failed, not_run
        (True, [], [])
    """
    sections = [_header(notes)]
    failed: list[str] = []
    not_run: list[str] = []
    for name in names:
        started = time.perf_counter()
        try:
            module = importlib.import_module(f"{__package__}.{name}")
            section = module.run()
            if not isinstance(section, Section):
                raise TypeError(f"{name}.run() returned {type(section).__name__}, not a Section")
            text = section.markdown
            failed += [f"{name}: {label}" for label in section.failures]
        except NotRun as reason:
            not_run.append(f"{name}: {reason}")
            text = f"## {name}: {reason}\n"
        except Exception:  # report and go on: one broken check must not hide the others
            failed.append(f"{name}: raised")
            text = f"## {name}: FAILED\n\n```\n{traceback.format_exc()}```\n"
        seconds = time.perf_counter() - started
        sections.append(f"{text.rstrip()}\n\n_{name}: {seconds:.0f} s_\n")
    summary = ["## Summary", ""]
    summary += [f"- FAILED {item}" for item in failed] + [f"- {item}" for item in not_run]
    if not failed and not not_run:
        summary.append("- every row of every check passed")
    sections.append("\n".join(summary) + "\n")
    return "\n".join(sections), failed, not_run


def exit_code(failed: Sequence[str], not_run: Sequence[str], allow_not_run: bool = False) -> int:
    """1 when anything failed; else 2 when a check was not run (0 with ``allow_not_run``).

    Example:
        >>> exit_code([], []), exit_code(["x: row"], ["y"]), exit_code([], ["y"], True)
        (0, 1, 0)
    """
    if failed:
        return 1
    return 2 if not_run and not allow_not_run else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (see the module docstring for the exit codes).

    Example:
        >>> from tests.gpu.gpu_all import main
        >>> main(["--only", "gpu_staged", "--out", "gpu-results.md"])  # doctest: +SKIP
        0
    """
    parser = argparse.ArgumentParser(prog="python -m tests.gpu.gpu_all")
    parser.add_argument("--only", nargs="+", choices=CHECKS, help="run only these checks")
    parser.add_argument("--out", type=Path, help="also write the report to this file")
    parser.add_argument("--no-setup", action="store_true", help="install nothing")
    parser.add_argument(
        "--allow-not-run", action="store_true", help="exit 0 when checks were only not run"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("tests.gpu.gpu_all: no CUDA device; nothing was checked", file=sys.stderr)
        return 1
    notes = [] if args.no_setup else setup()
    report, failed, not_run = run_checks(args.only or CHECKS, notes)
    print(report)
    if args.out is not None:
        args.out.write_text(report)
    for item in failed:
        print(f"FAILED {item}", file=sys.stderr)
    for item in not_run:
        print(item, file=sys.stderr)
    return exit_code(failed, not_run, args.allow_not_run)


if __name__ == "__main__":
    sys.exit(main())
