"""The GPU validation run: every ``wrapped_optim.bench.gpu_<topic>`` check in one command.

On a CUDA machine, from a checkout (no network needed)::

    python -m wrapped_optim.bench.gpu_all --out gpu-results.md

Checks (each a module with ``run() -> str``, a Markdown section):

* ``gpu_staged`` -- real ``torch.cuda`` peak memory and time of unstaged, whole-tensor and
  chunked saves and loads, and of the FP32 no-copy load, up to 1B parameters;
* ``gpu_hybrid`` -- megatron-core's real ``HybridDeviceOptimizer`` on CUDA params:
  model-only sync and full resume through ``HybridSyncOptimizer``;
* ``gpu_factory`` -- ``setup_optimizer`` with megatron-core's real builders (FP32,
  distributed FP32, CPU offload);
* ``gpu_hybrid_precision`` -- ``HybridOffloadOptimizer`` with ``PrecisionAwareAdamW``
  sub-optimizers on CUDA params, staged: portable format, chunked reads/writes, one-chunk
  peak, bit-identical resume.

``gpu_hybrid`` and ``gpu_factory`` need megatron-core importable. Where the machine cannot
install it from an index, carry it as a wheel: on a machine with pip access run
``pip download --no-deps --only-binary=:all: --python-version 3.12 megatron-core==0.16.1 -d
wheels`` (plus its pure-Python requirements, listed by the wheel's ``Requires-Dist``), copy
``wheels/`` over, then ``pip install --no-deps --target /tmp/site wheels/*.whl`` and run with
``PYTHONPATH=/tmp/site:.``. A check that fails or whose requirements are missing is reported
as such; the others still run, and the exit code is 1.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["CHECKS", "main", "run_checks"]

CHECKS = (
    "gpu_staged",
    "gpu_precision_adam",
    "gpu_hybrid",
    "gpu_hybrid_precision",
    "gpu_factory",
    "gpu_streaming",
)


def _header() -> str:
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    return (
        "# GPU validation\n\n"
        f"- device: {device}\n- torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"Python {platform.python_version()}\n"
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n"
        "- reproduce: `python -m wrapped_optim.bench.gpu_all --out gpu-results.md`\n"
    )


def run_checks(names: Sequence[str] = CHECKS) -> tuple[str, bool]:
    """Runs the named checks in order; returns the Markdown report and whether all passed.

    A failing check becomes a FAILED section instead of an exception, so one broken check
    (or a missing megatron-core) does not hide the results of the others.

    Example:
        >>> from wrapped_optim.bench.gpu_all import run_checks
        >>> report, ok = run_checks([])  # no checks: just the header
        >>> report.startswith("# GPU validation"), ok
        (True, True)
        >>> report, ok = run_checks(["gpu_staged", "gpu_factory"])  # doctest: +SKIP
    """
    sections = [_header()]
    ok = True
    for name in names:
        started = time.perf_counter()
        try:
            module = importlib.import_module(f"wrapped_optim.bench.{name}")
            section = module.run()
        except Exception:  # report and go on: one broken check must not hide the others
            ok = False
            section = f"## {name}: FAILED\n\n```\n{traceback.format_exc()}```\n"
        seconds = time.perf_counter() - started
        sections.append(f"{section.rstrip()}\n\n_{name}: {seconds:.0f} s_\n")
    return "\n".join(sections), ok


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; exit code 1 when a check failed or no CUDA is present.

    A non-zero exit without CUDA keeps a CPU-only CI job from passing as if it had validated.

    Example:
        >>> from wrapped_optim.bench.gpu_all import main
        >>> main(["--only", "gpu_staged", "--out", "gpu-results.md"])  # doctest: +SKIP
        0
    """
    parser = argparse.ArgumentParser(prog="python -m wrapped_optim.bench.gpu_all")
    parser.add_argument("--only", nargs="+", choices=CHECKS, help="run only these checks")
    parser.add_argument("--out", type=Path, help="also write the report to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("wrapped_optim.bench.gpu_all: no CUDA device; nothing to check", file=sys.stderr)
        return 1
    report, ok = run_checks(args.only or CHECKS)
    print(report)
    if args.out is not None:
        args.out.write_text(report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
