"""The optimizers the framework guide hands to Accelerate, Lightning and the transformers Trainer.

Each recipe builds a wrapped_optim stack (``wrapped=True``) or the bare optimizer it wraps
(``wrapped=False``) over the same parameters, so the tests can check that the frameworks
drive both alike (tests/frameworks/).
"""

from __future__ import annotations

# --8<-- [start:resume-imports]
import tempfile

# --8<-- [end:resume-imports]
from pathlib import Path

# isort: split
# --8<-- [start:imports]
from collections.abc import Callable
from typing import Any

import torch

# --8<-- [start:wrapped-imports]
import wrapped_optim
from wrapped_optim.optimizers import PrecisionAwareAdamW

# --8<-- [end:wrapped-imports]
# --8<-- [end:imports]

__all__ = ["RECIPES", "check_resume", "fsdp_aware", "hybrid_offload", "precision_adamw"]


# --8<-- [start:precision]
def precision_adamw(model: torch.nn.Module, *, wrapped: bool = True) -> Any:
    """PrecisionAwareAdamW with bf16 moments; ``wrap`` adds staged checkpoints."""
    optimizer = PrecisionAwareAdamW(
        model.parameters(),
        lr=1e-2,
        weight_decay=0.01,
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16,
    )
    return wrapped_optim.wrap(optimizer) if wrapped else optimizer
    # --8<-- [end:precision]


# --8<-- [start:hybrid]
HYBRID_CONFIG: dict[str, Any] = {
    # Half of the parameters are stepped by a "host" AdamW on FP32 copies, half by a
    # "device" AdamW on FP32 working copies; the bf16 model weights are refreshed from both.
    "optimizer": {"name": "hybrid_offload", "lr": 1e-2, "offload_fraction": 0.5},
    "hybrid": {"on_stale": "refresh"},  # HybridSyncOptimizer keeps every master copy in step
    "staged": {"chunk_bytes": "4KiB"},
}


def hybrid_offload(model: torch.nn.Module, *, wrapped: bool = True) -> Any:
    """HybridOffloadOptimizer under HybridSyncOptimizer, built from a config (bf16 models)."""
    config = HYBRID_CONFIG
    if not wrapped:
        config = {**config, "hybrid": False, "staged": False, "fsdp": False}
    optimizer, _ = wrapped_optim.build_optimizer(model, config)
    return optimizer
    # --8<-- [end:hybrid]


# --8<-- [start:fsdp]
def fsdp_aware(model: torch.nn.Module, *, wrapped: bool = True) -> Any:
    """An FSDPAwareOptimizer stack stepping FP32 weights whose grads arrive in bf16.

    Megatron-FSDP's sharded parameters look like this; on one CPU, ``grad_dtype`` makes
    autograd produce the same bf16 grads. The stack casts them for the optimizer; the bare
    PrecisionAwareAdamW consumes them itself.
    """
    for param in model.parameters():
        param.grad_dtype = torch.bfloat16
    optimizer = PrecisionAwareAdamW(
        model.parameters(),
        lr=1e-2,
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16,
    )
    # wrap() sees grads in another dtype than their weights: FSDPAwareOptimizer on top.
    return wrapped_optim.wrap(optimizer) if wrapped else optimizer
    # --8<-- [end:fsdp]


# --8<-- [start:resume]
def check_resume(train: Callable[..., torch.nn.Module], framework: str) -> None:
    """Trains two epochs with a checkpoint after the first, then resumes a fresh run (model,
    stack, framework objects) from that checkpoint: both end on the same weights, bit for bit."""
    with tempfile.TemporaryDirectory() as folder:
        uninterrupted = train(precision_adamw, epochs=2, checkpoint_dir=Path(folder))
        resumed = train(precision_adamw, epochs=2, checkpoint_dir=Path(folder), resume=True)
    for before, after in zip(uninterrupted.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(before, after)
    print(f"{framework}: the resumed run ends on the uninterrupted run's weights")
    # --8<-- [end:resume]


# name -> (recipe, model dtype)
RECIPES: dict[str, tuple[Callable[..., Any], torch.dtype]] = {
    "precision": (precision_adamw, torch.float32),
    "hybrid": (hybrid_offload, torch.bfloat16),
    "fsdp": (fsdp_aware, torch.float32),
}
