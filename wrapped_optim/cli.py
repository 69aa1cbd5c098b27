"""The ``wrapped-optim`` command: ``demo`` (more subcommands join as features land)."""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Sequence

import torch

from wrapped_optim.wrapper import OptimizerWrapper

__all__ = ["main"]


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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``wrapped-optim`` command."""
    parser = argparse.ArgumentParser(prog="wrapped-optim", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train, checkpoint, resume and verify on CPU")
    demo.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return run_demo(args.steps)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
