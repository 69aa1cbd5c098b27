"""The ``wrapped-optim`` command (also ``python -m wrapped_optim``): ``demo``, ``bench``,
``inspect``, ``convert``, ``names`` and ``env``. Building the command line imports no torch,
so ``--version`` and ``--help`` answer at once."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

__all__ = ["main", "run_convert", "run_demo", "run_env", "run_inspect", "run_names"]

_DESCRIPTION = (
    "Composable wrappers that make large-model optimizers cheap to checkpoint, offload and "
    "shard. Commands: demo (a one-minute tour that checks every claim), bench (the "
    "benchmarks), inspect (what an optimizer checkpoint holds), convert (carry an optimizer "
    "checkpoint to another runtime's format), names (a model's parameter names, for convert), "
    "env (versions and the CPU kernel's status, for bug reports)."
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
        described, why = _described_by_converter(path, per_param=per_param, trusted=trusted)
        if described is None:
            print(f"wrapped-optim inspect: error: {why or error}", file=sys.stderr)
            return 2
        print(described)
        return 0
    except (Exception, RecursionError) as error:  # any other failure: one line, no traceback
        first = (str(error).strip().splitlines() or [""])[0][:300]
        print(
            f"wrapped-optim inspect: error: {path}: cannot be inspected "
            f"({type(error).__name__}: {first})",
            file=sys.stderr,
        )
        return 2
    print(text)
    print(f"convert reads it as: {_convert_format(path)}")
    return 0


_INSPECTED_FORMATS = ("torch-save", "dcp", "dcp-flat", "dcp-streaming")
"""Formats inspection reads itself; its error stands for them."""


def _described_by_converter(
    path: str, *, per_param: bool, trusted: bool
) -> tuple[str | None, str | None]:
    """What the converter reads of ``path`` when it is in a format only the converter knows
    (Megatron's, DeepSpeed's), or why it cannot; ``(None, None)`` for any other path."""
    from pathlib import Path

    from wrapped_optim.checkpoint._convert._describe import describe_index
    from wrapped_optim.checkpoint._convert._formats import detect_format
    from wrapped_optim.checkpoint._convert._options import FormatOptions

    try:
        fmt = detect_format(path)
    except Exception:  # no format the converter knows: inspection's own error is the answer
        return None, None
    if fmt.name in _INSPECTED_FORMATS or fmt.reader is None:
        return None, None
    try:
        reader = fmt.reader(Path(path), FormatOptions(trusted=trusted))
        try:
            return describe_index(reader.index(), fmt.name, per_param=per_param), None
        finally:
            reader.close()
    except Exception as error:
        first = (str(error).strip().splitlines() or [""])[0][:300]
        return None, f"{path}: a {fmt.name} checkpoint, which the converter reads ({first})"


def _convert_format(path: str) -> str:
    """The format ``wrapped-optim convert`` would detect, or why none."""
    from wrapped_optim.checkpoint._convert._formats import detect_format

    try:
        return detect_format(path).name
    except Exception as error:  # detection never unpickles; any failure is reported
        return f"no known format ({str(error).splitlines()[0][:200]})"


def _error(command: str, error: BaseException) -> int:
    first = (str(error).strip().splitlines() or [""])[0][:500]
    print(f"wrapped-optim {command}: error: {first}", file=sys.stderr)
    return 2


def run_convert(args: argparse.Namespace) -> int:
    """``wrapped-optim convert SRC DST --to FORMAT``: 0 on success, 2 with a one-line reason.

    Example:
        >>> import argparse
        >>> from wrapped_optim._cli import run_convert
        >>> run_convert(argparse.Namespace(list=False, src="/no/such", dst="/tmp/x", to="dcp"))
        2
    """
    from wrapped_optim.checkpoint import OptimizerCheckpointError, convert
    from wrapped_optim.checkpoint._convert._formats import known_formats
    from wrapped_optim.checkpoint._convert._names import load_model_spec

    if args.list:
        for fmt in known_formats():
            modes = "".join(["r" if fmt.reader else "-", "w" if fmt.writer else "-"])
            print(
                textwrap.fill(
                    fmt.summary,
                    100,
                    initial_indent=f"{fmt.name:<28} {modes}  ",
                    subsequent_indent=" " * 33,
                )
            )
        return 0
    if not args.src or not args.dst or not args.to:
        return _error("convert", ValueError("SRC, DST and --to FORMAT are required"))
    try:
        model = load_model_spec(args.model) if getattr(args, "model", None) else None
        report = convert(
            args.src,
            args.dst,
            to=args.to,
            model=model,
            names=getattr(args, "names", None),
            dp=getattr(args, "dp", None),
            bucket_size=getattr(args, "bucket_size", None),
            moments=getattr(args, "moments", None),
            master=getattr(args, "master", None),
            layout=getattr(args, "layout", None),
            param_remainders=getattr(args, "param_remainders", False),
            source_format=getattr(args, "source_format", None),
            location=getattr(args, "location", None),
            under=getattr(args, "under", None),
            allow_lossy=getattr(args, "allow_lossy", False),
            verify=getattr(args, "verify", False),
            trusted=getattr(args, "trust", False),
            progress=not getattr(args, "no_progress", True),
        )
    except (OptimizerCheckpointError, OSError, TypeError) as error:
        return _error("convert", error)
    verified = ", verified" if report.verified else ""
    print(
        f"{report.source_format} -> {report.target_format}: {report.tensors} tensors, "
        f"{report.bytes / 2**20:,.1f} MiB in {report.seconds:.2f} s{verified}: {args.dst}"
    )
    for tensor, largest in report.lossy.items():
        print(f"  lossy {tensor}: largest error {largest:.3g}")
    return 0


def run_names(spec: str, out: str) -> int:
    """``wrapped-optim names MODULE:CALLABLE OUT``: writes the model's parameter names.

    Example:
        >>> from wrapped_optim._cli import run_names
        >>> run_names("no_such_module:build", "/tmp/names.json")
        2
    """
    from wrapped_optim.checkpoint import OptimizerCheckpointError, names_from_model, save_names
    from wrapped_optim.checkpoint._convert._names import load_model_spec

    try:
        model, optimizer = load_model_spec(spec)
        names = names_from_model(model, optimizer)
        save_names(names, out)
    except (OptimizerCheckpointError, OSError) as error:
        return _error("names", error)
    print(f"{len(names.names)} parameter names written to {out}")
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
    from wrapped_optim._bench._topics import DEFAULT_OUT, add_arguments, topic_summaries

    topics = "\n".join(
        textwrap.fill(summary, 79, initial_indent=f"  {name:<16}", subsequent_indent=" " * 18)
        for name, summary in topic_summaries()
    )
    bench = commands.add_parser(
        "bench",
        help=f"run the benchmarks; write benchmarks.md and its figures into ./{DEFAULT_OUT} "
        "(or --out DIR)",
        description="Runs the wrapped_optim._bench topics (all, or those named) and writes "
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


_MODEL_HELP = (
    "MODULE:CALLABLE (or FILE.py:CALLABLE): a function taking no argument that builds the "
    "model on the CPU, or a (model, optimizer) pair when the optimizer orders its "
    "parameters otherwise (e.g. transformers' Trainer groups)"
)


def _add_convert_command(commands: Any) -> None:
    convert = commands.add_parser(
        "convert",
        help="carry an optimizer checkpoint to another format (torch.save, DCP, ...)",
        description="Reads an optimizer checkpoint (its format detected, or --from) and writes "
        "it in --to's format, one tensor at a time, into a staging path renamed into place "
        "when complete. --list shows the formats.",
    )
    convert.add_argument("src", metavar="SRC", nargs="?", help="the checkpoint to read")
    convert.add_argument(
        "dst", metavar="DST", nargs="?", help="the new checkpoint (must not exist)"
    )
    convert.add_argument("--to", metavar="FORMAT", help="the destination format")
    convert.add_argument("--from", dest="source_format", metavar="FORMAT", help="the source format")
    convert.add_argument("--list", action="store_true", help="list the formats and exit")
    convert.add_argument("--model", metavar="MODULE:CALLABLE", help=_MODEL_HELP)
    convert.add_argument("--names", metavar="FILE", help="a names file (wrapped-optim names)")
    convert.add_argument(
        "--dp",
        type=int,
        metavar="N",
        help="DP size of a sharded destination; with --moments fp8, of the run that loads it "
        "(one FP8 scale per DP shard)",
    )
    convert.add_argument(
        "--bucket-size",
        type=int,
        metavar="N",
        help="Megatron bucket-space formats: the run's DDP bucket_size (with "
        "overlap_grad_reduce), which places each parameter (default: one bucket per buffer)",
    )
    convert.add_argument("--moments", choices=["fp32", "bf16", "fp16", "fp8"])
    convert.add_argument("--master", choices=["fp32", "fp16", "none"])
    convert.add_argument(
        "--layout",
        choices=["torch", "precision-aware"],
        help="state-dict layout of the destination (default: the source's)",
    )
    convert.add_argument(
        "--param-remainders",
        action="store_true",
        help="the source keeps FP32 masters as bf16 weights plus int16 remainders "
        "(store_param_remainders): rebuild them (megatron-fully-reshardable)",
    )
    convert.add_argument("--location", help="which optimizer, where the source holds several")
    convert.add_argument("--under", help="DCP destination: the key to put the state under")
    convert.add_argument("--allow-lossy", action="store_true", help="convert lossy changes too")
    convert.add_argument("--verify", action="store_true", help="read back and compare")
    convert.add_argument("--trust", action="store_true", help="unpickle objects in SRC")
    convert.add_argument("--no-progress", action="store_true", help="no progress line")
    names = commands.add_parser(
        "names",
        help="write a model's parameter names (what convert's --names reads)",
        description="Builds the model MODULE:CALLABLE on the CPU and writes its parameter "
        "names and shapes, in the optimizer's order, to OUT (JSON).",
    )
    names.add_argument("model", metavar="MODULE:CALLABLE", help=_MODEL_HELP)
    names.add_argument("out", metavar="OUT", help="the names file to write")


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
    _add_convert_command(commands)
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
        from wrapped_optim._bench.report import run_from_args

        return run_from_args(args)
    if args.command == "inspect":
        return run_inspect(args.path, per_param=not args.summary, trusted=args.trust)
    if args.command == "convert":
        return run_convert(args)
    if args.command == "names":
        return run_names(args.model, args.out)
    if args.command == "env":
        return run_env()
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
