"""LR schedulers drive a wrapped optimizer exactly as the bare one (torchao #959, #1209)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from wrapped_optim import OptimizerWrapper

STEPS = 12


def make_params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(5, 4)), torch.nn.Parameter(torch.randn(4))]


def run(
    wrap: bool, make_scheduler: Callable[[Any], Any], optimizer_cls: type = torch.optim.AdamW
) -> tuple[list[list[float]], list[torch.Tensor], list[float]]:
    params = make_params()
    groups = [{"params": params[:1]}, {"params": params[1:], "lr": 0.02}]
    optimizer: Any = optimizer_cls(groups, lr=0.05, weight_decay=0.01)
    if wrap:
        optimizer = OptimizerWrapper(OptimizerWrapper(optimizer))
    scheduler = make_scheduler(optimizer)
    lrs, wds = [], []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
        optimizer.zero_grad()
        if hasattr(scheduler, "get_last_lr"):
            scheduler.step()
        else:  # megatron-core's OptimizerParamScheduler counts increments
            scheduler.step(1)
        lrs.append([float(g["lr"]) for g in optimizer.param_groups])
        wds.append(float(optimizer.param_groups[0]["weight_decay"]))
    return lrs, [p.detach().clone() for p in params], wds


def megatron_scheduler(optimizer: Any) -> Any:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=0.05,
        min_lr=0.001,
        lr_warmup_steps=3,
        lr_decay_steps=10,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.1,
        wd_incr_steps=10,
        wd_incr_style="linear",
    )


SCHEDULERS: dict[str, Callable[[Any], Any]] = {
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.9**e),
    "CosineAnnealingLR": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8),
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=[0.1, 0.05], total_steps=STEPS + 1
    ),
    "megatron.OptimizerParamScheduler": megatron_scheduler,
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_scheduler_drives_wrapped_like_bare(name: str) -> None:
    bare_lrs, bare_params, bare_wds = run(False, SCHEDULERS[name])
    wrapped_lrs, wrapped_params, wrapped_wds = run(True, SCHEDULERS[name])
    assert wrapped_lrs == bare_lrs
    assert wrapped_wds == bare_wds
    assert len({tuple(lr) for lr in bare_lrs}) > 3, "the schedule must actually change the lr"
    for a, b in zip(bare_params, wrapped_params, strict=True):
        assert torch.equal(a, b)


def test_one_cycle_momentum_through_wrapper() -> None:
    # OneCycleLR also cycles betas, which it reads from and writes to ``defaults`` / groups.
    bare_lrs, bare_params, _ = run(False, SCHEDULERS["OneCycleLR"], torch.optim.Adam)
    wrapped_lrs, wrapped_params, _ = run(True, SCHEDULERS["OneCycleLR"], torch.optim.Adam)
    assert wrapped_lrs == bare_lrs
    assert all(torch.equal(a, b) for a, b in zip(bare_params, wrapped_params, strict=True))


def test_scheduler_does_not_warn_about_step_order(recwarn: pytest.WarningsRecorder) -> None:
    run(True, SCHEDULERS["LambdaLR"])
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]


def test_scheduler_state_round_trips_through_wrapper() -> None:
    params = make_params()
    opt = OptimizerWrapper(torch.optim.SGD(params, lr=0.1))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(5):
        opt.step()
        sched.step()
    state = sched.state_dict()
    fresh = OptimizerWrapper(torch.optim.SGD(params, lr=0.1))
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh, step_size=2, gamma=0.5)
    fresh.load_state_dict(opt.state_dict())
    fresh_sched.load_state_dict(state)
    assert fresh.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 0.025
