"""The ``wrapped-optim`` command: ``demo``, ``bench`` and ``inspect``."""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Sequence
from typing import Any

import torch

from wrapped_optim.wrapper import OptimizerWrapper

__all__ = ["main", "run_inspect"]


def _make(seed: int) -> tuple[torch.nn.Module, OptimizerWrapper]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    return model, OptimizerWrapper(torch.optim.AdamW(model.parameters(), lr=1e-2))


def _train(model: torch.nn.Module, opt: OptimizerWrapper, steps: range) -> float:
    loss = torch.tensor(0.0)
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(64, 16, generator=gen)
        y = x.sum(dim=1, keepdim=True).sin()
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


def run_demo(steps: int = 200) -> int:
    """Trains, checkpoints half-way, resumes in a fresh stack, checks bit-identity."""
    half = steps // 2
    model, opt = _make(0)
    uninterrupted_loss = _train(model, opt, range(steps))
    reference = [p.detach().clone() for p in model.parameters()]

    model, opt = _make(0)
    _train(model, opt, range(half))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buffer)
    checkpoint_bytes = buffer.tell()

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    model, opt = _make(1)  # a different init: everything must come from the checkpoint
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])
    resumed_loss = _train(model, opt, range(half, steps))
    identical = all(torch.equal(a, b) for a, b in zip(reference, model.parameters(), strict=True))

    print(opt)
    print(f"steps: {steps}, checkpoint at {half}, checkpoint size {checkpoint_bytes} bytes")
    print(f"final loss uninterrupted {uninterrupted_loss:.6f}, resumed {resumed_loss:.6f}")
    print(f"resume bit-identical: {'yes' if identical else 'NO'}")
    return 0 if identical else 1


def run_inspect(path: str, *, per_param: bool = True, trusted: bool = False) -> int:
    """``wrapped-optim inspect PATH``: prints what an optimizer checkpoint holds.

    Returns 0, or 2 (with the reason on stderr) when the path is not an optimizer checkpoint.

    Example:
        >>> from wrapped_optim.cli import run_inspect
        >>> run_inspect("/no/such/file.pt")
        2
    """
    from wrapped_optim.inspection import InspectError, format_report, inspect_checkpoint

    try:
        report = inspect_checkpoint(path, trusted=trusted)
    except InspectError as error:
        print(f"wrapped-optim inspect: error: {error}", file=sys.stderr)
        return 2
    print(format_report(report, per_param=per_param))
    return 0


def _add_bench_command(commands: Any) -> None:
    from wrapped_optim.bench.report import add_arguments

    bench = commands.add_parser(
        "bench",
        help="run the benchmarks, write docs/benchmarks.md and its figures",
        description="Runs every wrapped_optim.bench topic and writes <out>/benchmarks.md "
        "(plus PNG figures in <out>/img/ when matplotlib is installed).",
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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``wrapped-optim`` command.

    Example:
        >>> from wrapped_optim.cli import main
        >>> main(["inspect", "/no/such/checkpoint"])
        2
    """
    parser = argparse.ArgumentParser(prog="wrapped-optim", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train, checkpoint, resume and verify on CPU")
    demo.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    _add_bench_command(commands)
    _add_inspect_command(commands)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return run_demo(args.steps)
    if args.command == "bench":
        from wrapped_optim.bench.report import run_from_args

        return run_from_args(args)
    if args.command == "inspect":
        return run_inspect(args.path, per_param=not args.summary, trusted=args.trust)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
