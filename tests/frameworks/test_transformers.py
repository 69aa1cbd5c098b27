"""transformers Trainer: optimizers=(stack, scheduler), save_steps, resume_from_checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from docs.guides.examples import transformers_trainer
from docs.guides.examples.stacks import RECIPES
from tests.frameworks.harness import SAVE_AFTER, check_resume


def _optimizer_state(checkpoint_dir: Path) -> dict[str, Any]:
    steps = SAVE_AFTER * len(transformers_trainer.TokenData()) // transformers_trainer.BATCH_SIZE
    path = checkpoint_dir / f"checkpoint-{steps}" / "optimizer.pt"
    state: dict[str, Any] = torch.load(path, weights_only=True)
    return state


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_trainer_resumes_the_stack_as_the_bare_optimizer(recipe: str, tmp_path: Path) -> None:
    check_resume(transformers_trainer.train, recipe, tmp_path, _optimizer_state)
