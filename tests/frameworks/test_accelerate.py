"""Hugging Face Accelerate: prepare, clip_grad_norm_, save_state / load_state with our stacks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from docs.guides.examples import accelerate_loop
from docs.guides.examples.stacks import RECIPES
from tests.frameworks.harness import check_resume


def _optimizer_state(checkpoint_dir: Path) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(checkpoint_dir / "optimizer.bin", weights_only=True)
    return state


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_accelerate_resumes_the_stack_as_the_bare_optimizer(recipe: str, tmp_path: Path) -> None:
    check_resume(accelerate_loop.train, recipe, tmp_path, _optimizer_state)
