"""Issue 27 item 7: a step at lr=0 leaves the weights alone in every master format, and
HybridOffloadOptimizer's groups and defaults hold what a torch optimizer's hold, so that
schedulers which cycle momentum drive it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from wrapped_optim._formats import codecs
from wrapped_optim.optimizers import HybridOffloadOptimizer, PrecisionAwareAdamW

MASTERS: dict[str, dict[str, Any]] = {
    "fp32": {"master_weights": True},
    "remainder": {"master_weights": True, "store_param_remainders": True},
    "none": {"master_weights": False},
    "fp16": {"master_weights": True, "master_weight_dtype": torch.float16},
}
MOMENTS = {"fp32": torch.float32, "fp16": torch.float16, "fp8": torch.uint8}


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(3,), (64,), (1000,), (100, 40)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16)) for s in shapes]


def _grads(params: list[torch.nn.Parameter], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


@pytest.mark.parametrize("cpu_kernel", [False, None], ids=["torch-path", "default-path"])
@pytest.mark.parametrize("moments", sorted(MOMENTS))
@pytest.mark.parametrize("master", sorted(MASTERS))
def test_a_step_at_lr_zero_leaves_bf16_weights_bitwise_unchanged(
    master: str, moments: str, cpu_kernel: bool | None
) -> None:
    """After training steps (lr > 0), one step at lr=0 changes no weight bit. Before the fix
    an fp16 master changed ~3% of them: the param was rounded from the FP32 value before
    the master was encoded with its new scale, not from the master as stored."""
    params = _params(0)
    options = {} if cpu_kernel is None else {"cpu_kernel": cpu_kernel}
    opt = PrecisionAwareAdamW(
        params,
        lr=1e-2,
        exp_avg_dtype=MOMENTS[moments],
        exp_avg_sq_dtype=MOMENTS[moments],
        **MASTERS[master],
        **options,
    )
    for step in range(3):
        _grads(params, step)
        opt.step()
    before = [p.detach().clone() for p in params]
    opt.param_groups[0]["lr"] = 0.0
    for step in range(3, 5):
        _grads(params, step)
        opt.step()
        for p, then in zip(params, before, strict=True):
            assert torch.equal(p.detach(), then)


def test_an_fp16_master_rounds_to_its_bf16_param_after_every_step() -> None:
    """The invariant behind the lr=0 promise: the bf16 param is bf16(master as stored)."""
    params = _params(1)
    opt = PrecisionAwareAdamW(params, lr=1e-2, cpu_kernel=False, **MASTERS["fp16"])
    for step in range(4):
        _grads(params, step)
        opt.step()
        for p in params:
            master = opt.get_unscaled_state(p, "master_param")
            assert torch.equal(master.to(torch.bfloat16), p.detach())


def test_hybrid_groups_and_defaults_carry_the_sub_optimizers_hyper_parameters() -> None:
    params = [torch.nn.Parameter(torch.ones(8)) for _ in range(2)]
    opt = HybridOffloadOptimizer(params, offload_fraction=0.5, lr=1e-2)
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.ones(8))], lr=1e-2)
    for key in ("betas", "eps", "weight_decay", "amsgrad", "maximize"):
        assert opt.defaults[key] == plain.defaults[key]
        assert opt.param_groups[0][key] == plain.param_groups[0][key]
    assert "fused" not in opt.defaults  # implementation switches stay the caller's
    assert opt.sub_optimizer_keywords == {"lr": 1e-2}


def test_hybrid_precision_sub_optimizers_expose_their_own_defaults() -> None:
    params = [torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16)) for _ in range(2)]
    opt = HybridOffloadOptimizer(
        params, offload_fraction=1.0, cpu_optimizer_cls=PrecisionAwareAdamW, lr=1e-2,
        exp_avg_dtype=torch.bfloat16, betas=(0.8, 0.95),
    )  # fmt: skip
    assert opt.param_groups[0]["betas"] == (0.8, 0.95)
    assert opt.param_groups[0]["eps"] == opt.cpu_optimizers[0].param_groups[0]["eps"]


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_one_cycle_lr_with_cycle_momentum_drives_a_hybrid_like_adamw(fraction: float) -> None:
    """OneCycleLR (cycle_momentum=True) used to refuse the hybrid ("optimizer must support
    momentum or beta1"); now it cycles its betas, and FP32 params follow the AdamW each side
    promises (torch's default AdamW on the device, AdamW(fused=True) for host copies) under
    the same schedule, bit for bit."""
    g = torch.Generator().manual_seed(3)
    start = [torch.randn(16, 4, generator=g) for _ in range(2)]
    params = [torch.nn.Parameter(t.clone()) for t in start]
    twins = [torch.nn.Parameter(t.clone()) for t in start]
    opt = HybridOffloadOptimizer(params, offload_fraction=fraction, lr=1e-2, fused_host_step=False)
    ref = torch.optim.AdamW(twins, lr=1e-2, **({"fused": True} if fraction else {}))
    schedules = [
        torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=8, cycle_momentum=True)
        for o in (opt, ref)
    ]
    for step in range(6):
        for group in (params, twins):
            _grads(group, step)  # type: ignore[arg-type]
        opt.step()
        ref.step()
        for schedule in schedules:
            schedule.step()
        assert opt.param_groups[0]["betas"] == ref.param_groups[0]["betas"]
    for p, t in zip(params, twins, strict=True):
        assert torch.equal(p.detach(), t.detach())
    sub_betas = {sub.param_groups[0]["betas"] for sub in opt.sub_optimizers}
    assert len(sub_betas) == 1  # every sub-optimizer was handed the cycled value


def test_fp16_master_lr_zero_scale_codec_round_trip_is_stable() -> None:
    """What the lr=0 promise relies on for a scaled master: re-encoding decoded fp16 values
    with the scale they were encoded with gives the same stored values."""
    g = torch.Generator().manual_seed(5)
    values = torch.randn(4096, generator=g)
    scale = codecs.scale_from_amax(codecs.amax_of(values), torch.float16)
    stored = torch.empty(4096, dtype=torch.float16)
    codecs.encode_into(values.clone(), stored, torch.float16, scale)
    decoded = torch.empty(4096)
    codecs.decode_into(stored, decoded, torch.float16, scale)
    again = torch.empty(4096, dtype=torch.float16)
    codecs.encode_into(decoded.clone(), again, torch.float16, scale)
    assert torch.equal(again, stored)
