"""The contracts upstream's own unit tests hold compat and the portable optimizers to.

Megatron-Bridge's, Megatron-FSDP's and Transformer Engine's test files are not on PyPI, so CI
cannot run them (tests/upstream runs them from a local checkout, see docs/configuration.md,
"Upstream test suites"). These tests state the same contracts in this project's words, on real
components, so CI checks them on every run.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from wrapped_optim import compat
from wrapped_optim.fsdp import FSDPAwareOptimizer
from wrapped_optim.optimizers import HybridOffloadOptimizer, PrecisionAwareAdamW
from wrapped_optim.wrapper import OptimizerWrapper, find_layer

staging = compat.memory_efficient_precision_aware_optimizer_state_checkpointing


class Distributed:
    """What the walk sees of a Megatron DistributedOptimizer: the leaf and its config."""

    def __init__(self, optimizer: Any, *, precision_aware: bool = True) -> None:
        self.optimizer = optimizer
        self.config = SimpleNamespace(
            use_precision_aware_optimizer=precision_aware, optimizer_cpu_offload=False
        )
        self.ddp_config = SimpleNamespace(use_megatron_fsdp=False)
        self.is_stub_optimizer = False


class Chain:
    def __init__(self, *optimizers: Any) -> None:
        self.chained_optimizers = list(optimizers)


class Unrecognised:
    """A Megatron-looking container around something that is no optimizer at all."""

    def __init__(self) -> None:
        self.optimizer = object()


class NewerAccessor(PrecisionAwareAdamW):
    """A holder whose accessor grew arguments, as TE's has across releases."""

    def get_unscaled_state(  # type: ignore[override]
        self, param: torch.Tensor, state_name: str, skip_unscale: bool = False, *, factor: float = 1
    ) -> torch.Tensor:
        value = super().get_unscaled_state(param, state_name)
        return value if skip_unscale else value * factor


def stepped(cls: type[PrecisionAwareAdamW] = PrecisionAwareAdamW) -> PrecisionAwareAdamW:
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(6))
    optimizer = cls([param], lr=0.01, exp_avg_dtype=torch.bfloat16)
    param.grad = torch.randn(6)
    optimizer.step()
    return optimizer


def only_param(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    return optimizer.param_groups[0]["params"][0]


# ----------------------------------------------------------------------------------------
# Save staging: the accessor wrapper
# ----------------------------------------------------------------------------------------
def test_staged_accessor_passes_any_call_signature_through() -> None:
    holder = stepped(NewerAccessor)
    param = only_param(holder)
    expected = holder.get_unscaled_state(param, "exp_avg")
    with staging(Distributed(holder), enabled=True) as count:
        assert count == 1
        tripled = holder.get_unscaled_state(param, "exp_avg", False, factor=3.0)
        by_keyword = holder.get_unscaled_state(param=param, state_name="exp_avg")
        skipped = holder.get_unscaled_state(param, "exp_avg", skip_unscale=True, factor=3.0)
    assert tripled.device.type == "cpu"
    assert torch.equal(tripled, expected * 3.0)
    assert torch.equal(by_keyword, expected) and torch.equal(skipped, expected)
    assert "get_unscaled_state" not in vars(holder)


def test_staged_accessor_errors_carry_upstreams_key_phrases() -> None:
    holder = stepped()
    param = only_param(holder)
    own = lambda *args, **kwargs: "not a tensor"  # noqa: E731
    holder.get_unscaled_state = own  # type: ignore[method-assign]
    message = r"get_unscaled_state\(\) must return a torch\.Tensor"
    with staging(Distributed(holder), enabled=True), pytest.raises(TypeError, match=message):
        holder.get_unscaled_state(param, "exp_avg", True)
    assert vars(holder)["get_unscaled_state"] is own
    holder.get_unscaled_state = None  # type: ignore[assignment, method-assign]
    message = r"AdamW\.get_unscaled_state\(\).*callable"
    with pytest.raises(RuntimeError, match=message), staging(Distributed(holder), enabled=True):
        pass
    assert vars(holder)["get_unscaled_state"] is None


# ----------------------------------------------------------------------------------------
# Helpers given what they do not handle: nothing done, nothing raised
# ----------------------------------------------------------------------------------------
def test_every_bridge_helper_leaves_an_unrecognised_optimizer_alone() -> None:
    for thing in (Unrecognised(), Chain(Unrecognised()), object(), None):
        assert compat.sync_hybrid_device_optimizer_fp32_master_copies(thing) is False
        assert compat.init_optimizer_state(thing) is False
        with staging(thing, enabled=True) as count:
            assert count == 0
        with compat.memory_efficient_fp32_optimizer_state_loading(thing) as count:
            assert count == 0
        with compat.hybrid_optimizer_state_loading(thing) as count:
            assert count == 0


def test_sync_handles_the_recognised_members_of_a_mixed_chain() -> None:
    param = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    hybrid = HybridOffloadOptimizer([param], offload_fraction=1.0, lr=0.1)
    with torch.no_grad():
        param.fill_(2.0)  # a model-only load
    chain = Chain(Unrecognised(), Distributed(hybrid, precision_aware=False))
    assert compat.sync_hybrid_device_optimizer_fp32_master_copies(chain) is True
    assert hybrid.gpu_params_map_cpu_copy[param].tolist() == [2.0, 2.0, 2.0]


# ----------------------------------------------------------------------------------------
# fully_shard_optimizer: the instance it is given is adapted
# ----------------------------------------------------------------------------------------
def bf16_grad_param() -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.ones(4))
    param.grad_dtype = torch.bfloat16
    return param


def test_fully_shard_optimizer_adapts_the_instance_in_place() -> None:
    param = bf16_grad_param()
    optimizer = torch.optim.AdamW([param], lr=0.1)
    (param * 2).sum().backward()
    with pytest.raises(RuntimeError):
        optimizer.step()
    compat.fully_shard_optimizer(optimizer)  # the return value ignored, as upstream's callers do
    grad = param.grad
    optimizer.step()
    assert param.grad is grad and grad.dtype == torch.bfloat16
    assert torch.all(param < 1.0)
    assert compat.fully_shard_optimizer(optimizer) is optimizer  # again: nothing doubled
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    before = param.detach().clone()
    optimizer.step()  # through the scheduler's own step wrapper
    scheduler.step()
    assert param.grad is grad and not torch.equal(param, before)
    assert optimizer.param_groups[0]["lr"] == 0.05


def test_fully_shard_optimizer_keeps_a_schedulers_step_counter() -> None:
    param = bf16_grad_param()
    optimizer = torch.optim.SGD([param], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    compat.fully_shard_optimizer(optimizer)  # after the scheduler wrapped the instance's step
    (param * 2).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()"
        optimizer.step()
        scheduler.step()
    assert param.grad.dtype == torch.bfloat16 and torch.all(param < 1.0)
    assert optimizer.param_groups[0]["lr"] == 0.05


def test_fully_shard_optimizer_sets_precision_aware_where_the_step_is_adapted() -> None:
    param = bf16_grad_param()
    optimizer = PrecisionAwareAdamW([param], lr=0.1)
    compat.fully_shard_optimizer(optimizer, precision_aware=True)
    seen: list[torch.dtype] = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(param.grad.dtype))
    (param * 2).sum().backward()
    optimizer.step()
    assert seen == [torch.bfloat16]  # not cast: the optimizer reads bf16 grads itself
    compat.fully_shard_optimizer(optimizer)
    optimizer.step()
    assert seen[-1] == torch.float32
    stack = FSDPAwareOptimizer(torch.optim.SGD([bf16_grad_param()], lr=0.1))
    assert compat.fully_shard_optimizer(OptimizerWrapper(stack), precision_aware=True)
    assert stack.precision_aware is True and find_layer(stack, FSDPAwareOptimizer) is stack


# ----------------------------------------------------------------------------------------
# PrecisionAwareAdamW: every group counts its steps (TE #3318)
# ----------------------------------------------------------------------------------------
def test_an_empty_param_group_gets_a_step_count() -> None:
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = PrecisionAwareAdamW([{"params": [param]}, {"params": []}], lr=0.1)
    param.grad = torch.ones(3)
    optimizer.step()
    optimizer.step()
    assert [group["step"] for group in optimizer.param_groups] == [2, 2]
    saved = optimizer.state_dict()["param_groups"]
    assert [group["step"] for group in saved] == [2, 2]
