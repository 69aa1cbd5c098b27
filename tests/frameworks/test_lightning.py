"""Lightning: configure_optimizers with a stack and a scheduler, clipping, fit(ckpt_path=...)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from docs.guides.examples import lightning_module
from docs.guides.examples.stacks import RECIPES
from tests.frameworks.harness import SAVE_AFTER, check_resume

pytestmark = [
    # The resumed runs write no checkpoints of their own, on purpose.
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`:UserWarning"),
    # Lightning's own use of a torch API deprecated in 2.13.
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"),
]


def _optimizer_state(checkpoint_dir: Path) -> dict[str, Any]:
    checkpoint = torch.load(checkpoint_dir / f"epoch={SAVE_AFTER - 1}.ckpt", weights_only=False)
    (state,) = checkpoint["optimizer_states"]
    return dict(state)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_lightning_manual_optimization_resumes_the_stack(recipe: str, tmp_path: Path) -> None:
    train = functools.partial(lightning_module.train, module_cls=lightning_module.ManualRegressor)
    check_resume(train, recipe, tmp_path, _optimizer_state)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_lightning_resumes_the_stack_as_the_bare_optimizer(recipe: str, tmp_path: Path) -> None:
    check_resume(lightning_module.train, recipe, tmp_path, _optimizer_state)
