"""torch's four state-dict hooks fire, in torch's order, on every optimizer of this package
that writes its own state_dict / load_state_dict (they share one runner)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from wrapped_optim import OptimizerWrapper
from wrapped_optim.optimizers import HybridOffloadOptimizer, PrecisionAwareAdamW

BF16 = torch.bfloat16


def _wrapped(p: torch.nn.Parameter) -> torch.optim.Optimizer:
    return OptimizerWrapper(torch.optim.Adam([p], lr=0.1))


def _precision_aware(p: torch.nn.Parameter) -> torch.optim.Optimizer:
    return PrecisionAwareAdamW([p], lr=0.1, exp_avg_dtype=BF16)


def _hybrid_with_holder(p: torch.nn.Parameter) -> torch.optim.Optimizer:
    return HybridOffloadOptimizer(
        [p], offload_fraction=1.0, cpu_optimizer_cls=PrecisionAwareAdamW, exp_avg_dtype=BF16
    )


@pytest.mark.parametrize("make", [_wrapped, _precision_aware, _hybrid_with_holder])
def test_hooks_fire_in_torchs_order_and_may_replace(
    make: Callable[[torch.nn.Parameter], torch.optim.Optimizer],
) -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = make(p)
    p.grad = torch.ones(3)
    opt.step()
    calls: list[str] = []

    def post_save(o: Any, sd: dict[str, Any]) -> dict[str, Any]:
        calls.append("post-save")
        return {**sd, "tag": "saved"}

    def pre_load(o: Any, sd: dict[str, Any]) -> dict[str, Any]:
        calls.append("pre-load")
        assert sd["tag"] == "saved"
        return {k: v for k, v in sd.items() if k != "tag"}  # the loader never sees the tag

    opt.register_state_dict_pre_hook(lambda o: calls.append("pre-save"))
    opt.register_state_dict_post_hook(post_save)
    opt.register_load_state_dict_pre_hook(pre_load)
    opt.register_load_state_dict_post_hook(lambda o: calls.append("post-load"))
    saved = opt.state_dict()
    assert saved["tag"] == "saved"
    opt.load_state_dict(saved)
    assert calls == ["pre-save", "post-save", "pre-load", "post-load"]
