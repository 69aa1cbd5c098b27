"""A parameter resized behind the optimizer's back never reaches a kernel (issue #36, item 1).

Every step path (torch's fused AdamW on FP32 state, the bf16/fp16/FP8 paths, the compiled CPU
kernel, HybridOffloadOptimizer's copies and fused host step) checks its operands first: the
step raises naming the parameter, and nothing was written.
"""

from __future__ import annotations

import copy

import pytest
import torch

from wrapped_optim.optimizers import HybridOffloadOptimizer, PrecisionAwareAdamW
from wrapped_optim.optimizers._step_checks import StepOperandError
from wrapped_optim.testing import assert_state_dict_equal

FORMATS = {
    "fp32": ({}, torch.float32),
    "bf16-moments": ({"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16},
                     torch.float32),
    "fp8-fp16": ({"exp_avg_dtype": torch.uint8, "exp_avg_sq_dtype": torch.float16},
                 torch.float32),
    "bf16-param-remainders": (
        {"master_weights": True, "store_param_remainders": True,
         "exp_avg_dtype": torch.bfloat16}, torch.bfloat16),
    "bf16-param-fp16-master": (
        {"master_weights": True, "master_weight_dtype": torch.float16}, torch.bfloat16),
}  # fmt: skip


def _grads(*params: torch.nn.Parameter) -> None:
    for p in params:
        p.grad = torch.full_like(p, 0.5)


@pytest.mark.parametrize("grow", [True, False], ids=["grown", "shrunk"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("atomic", [False, True])
def test_precision_adam_refuses_a_resized_param_and_changes_nothing(
    fmt: str, grow: bool, atomic: bool
) -> None:
    options, dtype = FORMATS[fmt]
    kept = torch.nn.Parameter(torch.ones(4, dtype=dtype))
    resized = torch.nn.Parameter(torch.ones(64, 16, dtype=dtype))
    opt = PrecisionAwareAdamW([kept, resized], lr=0.1, atomic_step=atomic, **options)
    _grads(kept, resized)
    opt.step()
    before = copy.deepcopy(opt.state_dict())
    kept_before = kept.detach().clone()
    resized.data = torch.ones(256 if grow else 16, 16, dtype=dtype)  # an embedding resize
    _grads(kept, resized)
    with pytest.raises(StepOperandError, match=r"param group 0 index 1 \(shape \((256|16), 16\)"):
        opt.step()
    assert isinstance(StepOperandError("x"), RuntimeError)
    assert torch.equal(kept, kept_before)
    assert opt.param_groups[0]["step"] == 1
    assert_state_dict_equal(opt.state_dict(), before)
    assert torch.equal(resized, torch.ones_like(resized))


def test_a_resized_param_in_a_later_group_stops_the_earlier_groups_too() -> None:
    first = torch.nn.Parameter(torch.ones(8))
    second = torch.nn.Parameter(torch.ones(8))
    opt = PrecisionAwareAdamW([{"params": [first]}, {"params": [second]}], lr=0.1)
    _grads(first, second)
    opt.step()
    first_before = first.detach().clone()
    second.data = torch.ones(32)
    _grads(first, second)
    with pytest.raises(StepOperandError, match="param group 1 index 0"):
        opt.step()
    assert torch.equal(first, first_before)
    assert [g["step"] for g in opt.param_groups] == [1, 1]


def test_a_gradient_of_another_size_is_refused_before_any_write() -> None:
    p = torch.nn.Parameter(torch.ones(8))
    opt = PrecisionAwareAdamW([p], lr=0.1, exp_avg_dtype=torch.bfloat16, use_decoupled_grad=True)
    p.decoupled_grad = torch.ones(4)  # autograd checks .grad's size; this one is ours
    with pytest.raises(StepOperandError, match="gradient has 4 elements"):
        opt.step()
    assert not opt.state[p] and "step" not in opt.param_groups[0]


def test_a_state_of_the_wrong_dtype_is_refused() -> None:
    p = torch.nn.Parameter(torch.ones(8))
    opt = PrecisionAwareAdamW([p], lr=0.1, exp_avg_dtype=torch.bfloat16)
    _grads(p)
    opt.step()
    opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"].float()  # written behind its back
    with pytest.raises(StepOperandError, match=r"state 'exp_avg' is torch\.float32"):
        opt.step()


def _moments(sub: torch.optim.Optimizer) -> dict:
    """A sub-optimizer's state dict without the master alias (an in-place param itself)."""
    saved = copy.deepcopy(sub.state_dict())
    for entry in saved["state"].values():
        entry.pop("master_param", None)
    return saved


@pytest.mark.parametrize("fraction", [1.0, 0.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("host", ["torch", "precision"])
def test_hybrid_offload_refuses_a_resized_param_and_changes_nothing(
    fraction: float, dtype: torch.dtype, host: str
) -> None:
    kept = torch.nn.Parameter(torch.ones(4, dtype=dtype))
    resized = torch.nn.Parameter(torch.ones(64, 16, dtype=dtype))
    cls = PrecisionAwareAdamW if host == "precision" else torch.optim.AdamW
    opt = HybridOffloadOptimizer(
        [kept, resized], offload_fraction=fraction, lr=0.1, cpu_optimizer_cls=cls,
        gpu_optimizer_cls=cls,
    )  # fmt: skip
    _grads(kept, resized)
    opt.step()
    before = [_moments(sub) for sub in opt.sub_optimizers]
    kept_before = kept.detach().clone()
    resized.data = torch.ones(256, 16, dtype=dtype)
    _grads(kept, resized)
    with pytest.raises(RuntimeError, match=r"param group 0 index 1 \(shape \(256, 16\)"):
        opt.step()
    assert torch.equal(kept, kept_before)
    for sub, saved in zip(opt.sub_optimizers, before, strict=True):
        assert_state_dict_equal(_moments(sub), saved)
    for copy_ in opt.gpu_params_map_cpu_copy.values():
        assert copy_.shape in {(4,), (64, 16)}
