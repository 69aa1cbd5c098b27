"""One source for which path a parameter takes, and for "did the caller pick torch's AdamW".

PrecisionAwareAdamW's per-parameter path choice lives in ``optimizers/_precision_paths.py``;
``kernel_would_update`` is the one answer to "would its
step hand this parameter to the CPU kernel", which the step itself and HybridOffloadOptimizer's
fused host step both use (the fused host step used to repeat the rule). Likewise
``_offload_layout.implementation_chosen`` is the one reading of the ``fused`` /
``foreach`` keywords, for the host sub-optimizer's default and for the fused host step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import wrapped_optim.optimizers.hybrid_offload._layout as offload_layout
from tests.kernel_support import needs_kernel
from wrapped_optim.optimizers import HybridOffloadOptimizer, PrecisionAwareAdamW
from wrapped_optim.optimizers.hybrid_offload._optimizer import fused_plan
from wrapped_optim.optimizers.kernels import cpu_kernel
from wrapped_optim.optimizers.precision_adamw import _step as precision_paths
from wrapped_optim.optimizers.precision_adamw._operand import Operand

BF16, FP32 = torch.bfloat16, torch.float32


CONFIGS: dict[str, dict[str, Any]] = {
    "fp32 moments": {},
    "fp32 moments, TE formula": {"fused": False},
    "bf16 moments": {"exp_avg_dtype": BF16, "exp_avg_sq_dtype": BF16},
    "fp16/FP8 moments": {"exp_avg_dtype": torch.float16, "exp_avg_sq_dtype": torch.uint8},
    "bf16 moments, no kernel": {"exp_avg_dtype": BF16, "cpu_kernel": False},
    "master": {"master_weights": True, "exp_avg_dtype": BF16},
    "remainders": {"master_weights": True, "store_param_remainders": True},
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_kernel_would_update_is_what_the_step_does(
    config: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """For every configuration, the params ``kernel_would_update`` names are exactly those
    the step hands to the kernel (a spy on the kernel call)."""
    params = [torch.nn.Parameter(torch.randn(n).to(dtype)) for n in (3, 70_000)]
    opt = PrecisionAwareAdamW(params, lr=1e-2, **CONFIGS[config])
    group = opt.param_groups[0]
    for p in params:
        opt.initialize_state(p, opt.layout.uses_remainder(p))
        p.grad = torch.randn(p.shape).to(dtype)
    predicted = [
        precision_paths.kernel_would_update(
            opt.layout, Operand(p, p.grad, opt.state[p], opt.scales.get(p, {})), group
        )
        for p in params
    ]
    handed: list[int] = []
    real = precision_paths.kernel_update

    def spy(operands: Any, group: Any, **options: Any) -> None:
        handed.extend(ops[0].data_ptr() for ops in operands)
        real(operands, group, **options)

    monkeypatch.setattr(precision_paths, "kernel_update", spy)
    opt.step()
    assert [p.data_ptr() in handed for p in params] == predicted
    if cpu_kernel.available() and config == "bf16 moments" and dtype == FP32:
        assert predicted == [True, True]  # the spy can see a positive answer too


@needs_kernel
def test_the_fused_host_step_asks_the_optimizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused host step takes a PrecisionAwareAdamW copy exactly when
    ``kernel_would_update`` says the optimizer would give it to the kernel."""
    params = [torch.nn.Parameter(torch.randn(40).to(BF16)) for _ in range(2)]
    opt = HybridOffloadOptimizer(
        params,
        offload_fraction=1.0,
        lr=1e-2,
        cpu_optimizer_cls=PrecisionAwareAdamW,
        gpu_optimizer_cls=PrecisionAwareAdamW,
        exp_avg_dtype=BF16,
    )
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(40).to(BF16)
        opt.step()
    for p in params:
        p.grad = torch.randn(40).to(BF16)
    assert [e.param for e in fused_plan(opt)] == params
    asked: list[torch.Tensor] = []

    def says_no(layout: Any, operand: Any, group: Any) -> bool:
        asked.append(operand.param)
        return False

    monkeypatch.setattr(precision_paths, "kernel_would_update", says_no)
    assert fused_plan(opt) == []
    assert len(asked) == 2


@pytest.mark.parametrize(
    ("defaults", "groups", "chosen"),
    [
        ({}, [{}, {}], [False, False]),
        ({"fused": False}, [{}, {}], [True, True]),
        ({"foreach": True}, [{}, {}], [True, True]),
        ({}, [{}, {"fused": True}], [False, True]),
        ({}, [{"foreach": False}, {}], [True, False]),
    ],
)
def test_one_rule_for_the_callers_implementation_choice(
    defaults: dict[str, Any], groups: list[dict[str, Any]], chosen: list[bool]
) -> None:
    """``fused`` or ``foreach`` from the caller, as a default or in a group, is their choice;
    torch's fused CPU AdamW is the host default only when the defaults name neither."""
    params = [torch.nn.Parameter(torch.randn(4).to(BF16)) for _ in groups]
    opt = HybridOffloadOptimizer(
        [{"params": [p], **g} for p, g in zip(params, groups, strict=True)],
        offload_fraction=1.0,
        **defaults,
    )
    keywords = opt.sub_optimizer_keywords
    assert [
        offload_layout.implementation_chosen(keywords, opt.param_groups[i])
        for i in range(len(groups))
    ] == chosen
    assert offload_layout.implementation_chosen(keywords) == bool(defaults)
    assert ("fused" not in defaults and "foreach" not in defaults) == (
        offload_layout.host_keywords(opt.cpu_optimizer_cls, keywords).get("fused") is True
    )


@needs_kernel
def test_both_readers_of_the_choice_ask_the_one_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host default and the fused host step both follow ``implementation_chosen``."""
    params = [torch.nn.Parameter(torch.randn(4).to(BF16))]
    opt = HybridOffloadOptimizer(params, offload_fraction=1.0, lr=1e-2)
    params[0].grad = torch.randn(4).to(BF16)
    assert len(fused_plan(opt)) == 1
    keywords = opt.sub_optimizer_keywords
    assert offload_layout.host_keywords(opt.cpu_optimizer_cls, keywords)["fused"] is True
    monkeypatch.setattr(offload_layout, "implementation_chosen", lambda *args: True)
    assert fused_plan(opt) == []
    assert "fused" not in offload_layout.host_keywords(opt.cpu_optimizer_cls, keywords)
