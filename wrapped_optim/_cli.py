"""The ``wrapped-optim`` command (also ``python -m wrapped_optim``): ``demo``, ``bench``,
``inspect`` and ``env``. Building the command line imports no torch, so ``--version`` and
``--help`` answer at once."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

__all__ = ["main", "run_demo", "run_env", "run_inspect"]

_DESCRIPTION = (
    "Composable wrappers that make large-model optimizers cheap to checkpoint, offload and "
    "shard. Commands: demo (a one-minute tour that checks every claim), bench (the "
    "benchmarks), inspect (what an optimizer checkpoint holds), env (versions and the CPU "
    "kernel's status, for bug reports)."
)


def run_demo(
    *, steps: int = 200, device: str = "cpu", config: str | None = None, progress: bool = True
) -> int:
    """``wrapped-optim demo``: 0 when every verification passed, 1 otherwise.

    See :mod:`wrapped_optim._demo` for what it shows.

    Example:
        >>> import contextlib, io
        >>> with contextlib.redirect_stdout(io.StringIO()):
        ...     code = run_demo(steps=8, progress=False)
        >>> code
        0
    """
    from wrapped_optim._demo import run_demo as demo

    result = demo(steps=steps, device=device, config_path=config, progress=progress)
    return 0 if result.ok else 1


def run_inspect(path: str, *, per_param: bool = True, trusted: bool = False) -> int:
    """``wrapped-optim inspect PATH``: prints what an optimizer checkpoint holds.

    Returns 0, or 2 with the reason on one line of stderr (no traceback) when the path is not
    an optimizer checkpoint or cannot be read safely.

    Example:
        >>> from wrapped_optim._cli import run_inspect
        >>> run_inspect("/no/such/file.pt")
        2
    """
    from wrapped_optim.inspection import InspectError, format_report, inspect_checkpoint

    try:
        report = inspect_checkpoint(path, trusted=trusted)
        text = format_report(report, per_param=per_param)
    except InspectError as error:
        print(f"wrapped-optim inspect: error: {error}", file=sys.stderr)
        return 2
    except (Exception, RecursionError) as error:  # any other failure: one line, no traceback
        first = (str(error).strip().splitlines() or [""])[0][:300]
        print(
            f"wrapped-optim inspect: error: {path}: cannot be inspected "
            f"({type(error).__name__}: {first})",
            file=sys.stderr,
        )
        return 2
    print(text)
    return 0


def run_env() -> int:
    """``wrapped-optim env``: prints the versions and kernel status a bug report needs; 0.

    Example:
        >>> import contextlib, io
        >>> from wrapped_optim._cli import run_env
        >>> out = io.StringIO()
        >>> with contextlib.redirect_stdout(out):
        ...     code = run_env()
        >>> code, "CPU kernel" in out.getvalue()
        (0, True)
    """
    from wrapped_optim._env_report import collect, format_rows

    print(format_rows(collect()))
    return 0


def _add_bench_command(commands: Any) -> None:
    from wrapped_optim.bench._topics import DEFAULT_OUT, add_arguments, topic_summaries

    topics = "\n".join(
        textwrap.fill(summary, 79, initial_indent=f"  {name:<16}", subsequent_indent=" " * 18)
        for name, summary in topic_summaries()
    )
    bench = commands.add_parser(
        "bench",
        help=f"run the benchmarks; write benchmarks.md and its figures into ./{DEFAULT_OUT} "
        "(or --out DIR)",
        description="Runs the wrapped_optim.bench topics (all, or those named) and writes "
        "<out>/benchmarks.md (plus PNG figures in <out>/img/ when matplotlib is installed).",
        epilog=f"topics:\n{topics}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(bench)


def _add_inspect_command(commands: Any) -> None:
    inspect = commands.add_parser(
        "inspect",
        help="describe an optimizer checkpoint (torch.save file or DCP directory)",
        description="Prints each optimizer state dict in a checkpoint: its detected format, "
        "every state tensor (dtype, shape, bytes), step counters and param groups.",
    )
    inspect.add_argument("path", metavar="PATH", help="a torch.save file or a DCP directory")
    inspect.add_argument(
        "--summary", action="store_true", help="one line per state name, no per-parameter rows"
    )
    inspect.add_argument(
        "--trust",
        action="store_true",
        help="the file is trusted: unpickle objects other than tensors and containers "
        "(runs code from the file; needed e.g. for Megatron checkpoints holding args)",
    )


def main(argv: Sequence[str] | None = None, *, prog: str = "wrapped-optim") -> int:
    """Entry point of the ``wrapped-optim`` command (``prog`` names it in help and errors).

    Example:
        >>> from wrapped_optim._cli import main
        >>> main(["inspect", "/no/such/checkpoint"])
        2
    """
    from wrapped_optim import __version__

    parser = argparse.ArgumentParser(prog=prog, description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"wrapped-optim {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="train, crash, resume and fine-tune a small model; verify every promise",
        description="Trains a tiny GPT-style model with a stack built from a config "
        "(default: PrecisionAwareAdamW with bf16 moments under hybrid offload, staged "
        "checkpoints), checks that a resume is bit-identical and that fine-tuning from "
        "loaded weights works only with HybridSyncOptimizer. Exit code 1 if a check fails.",
    )
    demo.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    demo.add_argument("--device", default="cpu", help="torch device (default cpu)")
    demo.add_argument(
        "--config", metavar="TOML", help="stack config in build_optimizer's TOML layout"
    )
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    _add_bench_command(commands)
    _add_inspect_command(commands)
    commands.add_parser(
        "env",
        help="print versions and the CPU kernel's status (for bug reports)",
        description="Prints the versions of wrapped-optim, Python, torch, CUDA and the "
        "optional frameworks (megatron-core, Transformer Engine, Triton, ...), and the CPU "
        "AdamW kernel's status, loop families, library and cache directory.",
    )
    args = parser.parse_args(argv)  # --version and --help exit here, before torch is imported
    if args.command == "demo" and "torch" not in sys.modules:
        # OpenMP workers that sleep while they wait, unless the user chose: spinning ones
        # multiply the demo's CPU time on a busy machine (docs/bench/by_hand.md). Read by
        # the OpenMP runtime when torch loads it, so only before torch is imported.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import wrapped_optim._quiet_torch  # noqa: F401  (every command imports torch: quietly)

    if args.command == "demo":
        if args.steps < 4:
            parser.error("--steps must be at least 4")
        return run_demo(
            steps=args.steps, device=args.device, config=args.config, progress=not args.no_progress
        )
    if args.command == "bench":
        from wrapped_optim.bench.report import run_from_args

        return run_from_args(args)
    if args.command == "inspect":
        return run_inspect(args.path, per_param=not args.summary, trusted=args.trust)
    if args.command == "env":
        return run_env()
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
