"""HybridOffloadOptimizer steps a host copy with its param's own grad where the formats allow
(same dtype, device and layout, a host optimizer that only reads grads), bit for bit as with a
copy of it, and never writes into a param's grad. These are the unfused path's rules
(``fused_host_step=False``): by default the fused host step reads an FP32 CPU param's grad
itself (tests/optimizers/hybrid_offload/test_hybrid_offload_fused.py) and the copy gets none."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wrapped_optim.optimizers import HybridOffloadOptimizer
from wrapped_optim.optimizers.kernels import cpu_kernel


class CopyingAdamW(torch.optim.AdamW):
    """torch's AdamW under another type: the optimizer does not know it only reads grads."""


def make_params(seed: int, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype)) for shape in SHAPES]


SHAPES = [(4, 3), (5,), (2, 2)]


def set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


@settings(max_examples=15, deadline=None)
@given(
    fraction=st.sampled_from([0.3, 1.0]),
    options=st.sampled_from(
        [{}, {"fused": False}, {"foreach": True}, {"maximize": True, "weight_decay": 0.1}]
    ),
    cls=st.sampled_from([torch.optim.AdamW, torch.optim.Adam]),
)
def test_shared_grads_step_bit_identically_to_copied_ones(fraction, options, cls):
    shared_params, copied_params = make_params(0, torch.float32), make_params(0, torch.float32)
    shared = HybridOffloadOptimizer(
        shared_params, fraction, cpu_optimizer_cls=cls, lr=0.01, fused_host_step=False, **options
    )
    copying_cls = type("Copying" + cls.__name__, (cls,), {})
    copied = HybridOffloadOptimizer(
        copied_params, fraction, cpu_optimizer_cls=copying_cls, lr=0.01, **options
    )
    for step in range(3):
        set_grads(shared_params, step)
        set_grads(copied_params, step)
        grads_before = [p.grad.clone() for p in shared_params]
        shared.step()
        copied.step()
        for p, q, before in zip(shared_params, copied_params, grads_before, strict=True):
            assert torch.equal(p, q)
            assert torch.equal(p.grad, before)  # the host step never wrote the shared grad
        for p, inner in shared.gpu_params_map_cpu_copy.items():
            assert inner.grad is p.grad and inner is not p  # shared grad, distinct master
        for p, inner in copied.gpu_params_map_cpu_copy.items():
            assert inner.grad is not p.grad  # another host optimizer type: a copy


def test_bf16_params_and_other_host_optimizers_still_copy():
    params = make_params(1, torch.bfloat16)
    # (by default the fused host step reads a bf16 param's grad itself: no copy at all)
    opt = HybridOffloadOptimizer(params, offload_fraction=1.0, lr=0.01, fused_host_step=False)
    set_grads(params, 0)
    opt.step()
    for p, inner in opt.gpu_params_map_cpu_copy.items():
        assert inner.grad.dtype == torch.float32 and inner.grad is not p.grad
    fp32 = make_params(1, torch.float32)
    other = HybridOffloadOptimizer(fp32, offload_fraction=1.0, cpu_optimizer_cls=CopyingAdamW)
    set_grads(fp32, 0)
    other.step()
    assert all(inner.grad is not p.grad for p, inner in other.gpu_params_map_cpu_copy.items())


def test_the_fused_host_step_gives_fp32_copies_no_grad():
    """By default (where the kernel exists) an offloaded FP32 param's grad is read by the fused
    host step; its copy gets no grad, shared or copied."""
    params = make_params(4, torch.float32)
    opt = HybridOffloadOptimizer(params, offload_fraction=1.0, lr=0.01)
    set_grads(params, 0)
    grads = [p.grad for p in params]
    opt.step()
    fused = cpu_kernel.available()
    for p, grad in zip(params, grads, strict=True):
        inner = opt.gpu_params_map_cpu_copy[p]
        assert (inner.grad is None) == fused and p.grad is grad
        assert torch.equal(p, inner)


def test_a_grad_that_was_shared_is_never_written_later():
    """A grad the copy stepped with, then a grad that must be copied (another layout): the
    copy gets a buffer of its own; the earlier grad, still held by the caller, is untouched."""
    params = make_params(2, torch.float32)
    opt = HybridOffloadOptimizer(params, offload_fraction=1.0, lr=0.01, fused_host_step=False)
    set_grads(params, 0)
    opt.step()
    first = params[0].grad
    kept = first.clone()
    params[0].grad = torch.randn(3, 4).t()  # same shape, another stride: not shareable
    opt.step()
    inner = opt.gpu_params_map_cpu_copy[params[0]]
    assert inner.grad is not first and inner.grad is not params[0].grad
    assert torch.equal(inner.grad, params[0].grad)
    assert torch.equal(first, kept)
    params[0].grad = None
    opt.step()
    assert inner.grad is None


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_device_side_copies_never_share(fraction):
    params = make_params(3, torch.bfloat16)
    opt = HybridOffloadOptimizer(params, offload_fraction=fraction, lr=0.01)
    set_grads(params, 0)
    opt.step()
    for p, inner in opt.param_to_fp32_param.items():
        assert inner.grad is not p.grad
