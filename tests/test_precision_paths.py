"""One source for which path a parameter takes, and for "did the caller pick torch's AdamW".

PrecisionAwareAdamW's per-parameter path choice lives in ``optimizers/precision_paths.py``
(split out of ``precision_adam.py``); ``kernel_would_update`` is the one answer to "would its
step hand this parameter to the CPU kernel", which the step itself and HybridOffloadOptimizer's
fused host step both use (the fused host step used to repeat the rule). Likewise
``HybridOffloadOptimizer._implementation_chosen`` is the one reading of the ``fused`` /
``foreach`` keywords, for the host sub-optimizer's default and for the fused host step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from wrapped_optim.optimizers import PrecisionAwareAdamW, cpu_kernel, precision_paths

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
        opt.initialize_state(p)
        p.grad = torch.randn(p.shape).to(dtype)
    predicted = [precision_paths.kernel_would_update(opt, p, p.grad, group) for p in params]
    handed: list[int] = []
    real = precision_paths.kernel_update

    def spy(optimizer: Any, operands: Any, group: Any) -> None:
        handed.extend(ops[0].data_ptr() for ops in operands)
        real(optimizer, operands, group)

    monkeypatch.setattr(precision_paths, "kernel_update", spy)
    opt.step()
    assert [p.data_ptr() in handed for p in params] == predicted
    if cpu_kernel.available() and config == "bf16 moments" and dtype == FP32:
        assert predicted == [True, True]  # the spy can see a positive answer too
