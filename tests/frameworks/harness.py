"""One check for every framework: the stack resumes as the bare optimizer does, bit for bit.

A framework example (docs/guides/examples/) exposes ``train(make_optimizer, *, epochs,
checkpoint_dir, save_after, resume, dtype) -> model``; :func:`check_resume` runs it with the
bare optimizer and with the stack of one recipe (docs/guides/examples/stacks.py):

1. uninterrupted runs with the bare optimizer and with the stack, each saving a checkpoint
   through the framework after ``save_after`` epochs: same weights, bit for bit, and the
   saved optimizer states are equal (the stack writes the bare optimizer's checkpoint);
2. fresh runs resumed from each checkpoint with each optimizer (bare -> bare, stack ->
   stack, stack -> bare, bare -> stack): every one ends on the uninterrupted run's weights.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from docs.guides.examples.stacks import RECIPES
from wrapped_optim import OptimizerWrapper
from wrapped_optim.testing import assert_state_dict_equal

Train = Callable[..., torch.nn.Module]
ReadOptimizerState = Callable[[Path], dict[str, Any]]

EPOCHS = 2
SAVE_AFTER = 1


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_bitwise_weights(
    got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str
) -> None:
    assert got.keys() == expected.keys(), what
    for name, tensor in expected.items():
        other = got[name]
        assert other.dtype == tensor.dtype, f"{what}: {name} dtype {other.dtype}"
        assert torch.equal(other, tensor), (
            f"{what}: {name} differs by up to {(other.float() - tensor.float()).abs().max()}"
        )


def check_resume(
    train: Train, recipe: str, tmp_path: Path, read_optimizer_state: ReadOptimizerState
) -> None:
    make, dtype = RECIPES[recipe]
    built: dict[bool, list[Any]] = {True: [], False: []}

    def optimizer(wrapped: bool) -> Callable[[torch.nn.Module], Any]:
        def build(model: torch.nn.Module) -> Any:
            opt = make(model, wrapped=wrapped)
            built[wrapped].append(opt)
            return opt

        return build

    def run(wrapped: bool, checkpoint_dir: Path, *, resume: bool) -> dict[str, torch.Tensor]:
        model = train(
            optimizer(wrapped),
            epochs=EPOCHS,
            checkpoint_dir=checkpoint_dir,
            save_after=SAVE_AFTER,
            resume=resume,
            dtype=dtype,
        )
        return weights(model)

    checkpoints = {wrapped: tmp_path / ("stack" if wrapped else "bare") for wrapped in built}
    reference = run(False, checkpoints[False], resume=False)
    assert_bitwise_weights(run(True, checkpoints[True], resume=False), reference, "stack run")
    assert all(isinstance(opt, OptimizerWrapper) for opt in built[True])
    assert not any(isinstance(opt, OptimizerWrapper) for opt in built[False])
    assert_state_dict_equal(
        read_optimizer_state(checkpoints[True]), read_optimizer_state(checkpoints[False])
    )
    for writer in (False, True):
        for reader in (False, True):
            resumed = run(reader, checkpoints[writer], resume=True)
            assert_bitwise_weights(
                resumed,
                reference,
                f"{'stack' if reader else 'bare'} resumed from the "
                f"{'stack' if writer else 'bare'} checkpoint",
            )
