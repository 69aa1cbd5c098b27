"""Real megatron-core optimizer objects built on CPU, for tests.

megatron-core's FP32Optimizer.__init__ allocates its loss scale with ``device='cuda'``; this
builds the same object (the real class and methods) with the scale on the CPU instead.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core.optimizer")
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.optimizer import (
    ChainedOptimizer,
    FP32Optimizer,
    MegatronOptimizer,
)

__all__ = ["ChainedOptimizer", "OptimizerConfig", "cpu_fp32_optimizer", "megatron_group"]


def megatron_group(params: list[torch.nn.Parameter], **options: Any) -> dict[str, Any]:
    """A param group with the identifier keys Megatron's loaders match groups by."""
    group = {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False}
    group["is_decoupled_lr"] = False
    return {"params": params, **group, **options}


def cpu_fp32_optimizer(inner: torch.optim.Optimizer | None, **config: Any) -> FP32Optimizer:
    """megatron-core's FP32Optimizer around ``inner`` with its CUDA-only line done on CPU."""
    config.setdefault("lr", inner.param_groups[0]["lr"] if inner is not None else 0.0)
    config.setdefault("clip_grad", 0.0)
    opt = FP32Optimizer.__new__(FP32Optimizer)
    MegatronOptimizer.__init__(opt, inner, OptimizerConfig(**config), lambda *_: None)
    opt._scale = torch.tensor([1.0])
    opt.is_stub_optimizer = inner is None
    return opt
