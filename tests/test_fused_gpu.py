"""PrecisionAwareAdamW's fused GPU step, run on CPU by Triton's interpreter: the very kernel
a GPU runs, bitwise against the CPU kernel's single-rounding reference, through ``step()``
too, with a device ``lr`` tensor, and only where its formats apply."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cpu_kernel import reference_step

from wrapped_optim import codecs
from wrapped_optim.optimizers import PrecisionAwareAdamW, cpu_kernel, fused_gpu

pytest.importorskip("triton")

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture
def interpreted() -> Iterator[None]:
    """The kernel runs on host tensors through TRITON_INTERPRET=1 (set before its import)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        patch.setattr(fused_gpu, "_DEVICE_TYPES", {"cuda", "cpu"})
        fused_gpu._reset_for_tests()
        yield
    fused_gpu._reset_for_tests()


@pytest.mark.usefixtures("interpreted")
@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 2500),
    master=st.sampled_from(["none", "fp32", "remainder"]),
    param_dtype=st.sampled_from([FP32, BF16, FP16]),
    grad_dtype=st.sampled_from([FP32, BF16, FP16]),
    m_dtype=st.sampled_from([FP32, BF16]),
    v_dtype=st.sampled_from([FP32, BF16]),
    adam_w_mode=st.booleans(),
    wd=st.sampled_from([0.0, 0.01, 0.3]),
    step=st.integers(1, 1000),
    lr=st.floats(1e-6, 1.0),
    seed=st.integers(0, 2**16),
)
def test_kernel_equals_the_single_rounding_reference_bitwise(
    n: int,
    master: str,
    param_dtype: torch.dtype,
    grad_dtype: torch.dtype,
    m_dtype: torch.dtype,
    v_dtype: torch.dtype,
    adam_w_mode: bool,
    wd: float,
    step: int,
    lr: float,
    seed: int,
) -> None:
    if master == "remainder":
        param_dtype = BF16  # remainders exist for bf16 parameters only
    elif master == "fp32" and param_dtype == FP32:
        param_dtype = BF16  # an fp32 parameter's master is the torch path's
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(n, generator=gen) * 3
    beta1, beta2, eps = 0.9, 0.95, 1e-8
    opt = PrecisionAwareAdamW(
        [torch.nn.Parameter(values.to(param_dtype))], lr=lr, betas=(beta1, beta2), eps=eps,
        weight_decay=wd, adam_w_mode=adam_w_mode, master_weights=master != "none",
        store_param_remainders=master == "remainder", exp_avg_dtype=m_dtype,
        exp_avg_sq_dtype=v_dtype,
    )  # fmt: skip
    p = opt.param_groups[0]["params"][0]
    opt.initialize_state(p)
    state = opt.state[p]
    if master == "remainder":
        high, low = codecs.split_master(values)
        p.data.copy_(high)
        state["master_param"].copy_(low)
        p32 = codecs.join_master(high, low)
    elif master == "fp32":
        state["master_param"].copy_(values)
        p32 = values
    else:
        p32 = p.detach().float()
    g = torch.randn(n, generator=gen).to(grad_dtype)
    state["exp_avg"].copy_((torch.randn(n, generator=gen) * 0.1).to(m_dtype))
    state["exp_avg_sq"].copy_((torch.rand(n, generator=gen) * 0.01).to(v_dtype))
    m, v = state["exp_avg"].clone(), state["exp_avg_sq"].clone()
    group = opt.param_groups[0]
    group["step"] = step
    want_p, want_m, want_v = reference_step(
        p32.clone(), g, m, v, lr=lr, beta1=beta1, beta2=beta2, eps=eps, wd=wd,
        bc1=1 - beta1**step, bc2=1 - beta2**step, adam_w_mode=adam_w_mode,
    )  # fmt: skip
    assert fused_gpu.applicable(opt, p, g, group)
    fused_gpu.update(opt, p, g, group)
    assert torch.equal(state["exp_avg"], want_m.to(m_dtype))
    assert torch.equal(state["exp_avg_sq"], want_v.to(v_dtype))
    if master == "remainder":
        assert torch.equal(codecs.join_master(p.detach(), state["master_param"]), want_p)
    else:
        if master == "fp32":
            assert torch.equal(state["master_param"], want_p)
        assert torch.equal(p.detach(), want_p.to(param_dtype))


def _trained(steps: int, *, lr: float | torch.Tensor, **kw: object) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n).to(BF16)) for n in (3000, 7, 1025)]
    opt = PrecisionAwareAdamW(
        params, lr=lr, weight_decay=0.1, master_weights=True, exp_avg_dtype=BF16,
        exp_avg_sq_dtype=BF16, **kw,
    )  # fmt: skip
    for i in range(steps):
        gen = torch.Generator().manual_seed(100 + i)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(BF16)
        opt.step()
    return torch.cat([p.detach().float() for p in params]), opt.state_dict()


@pytest.mark.skipif(not cpu_kernel.available(), reason="compares with the CPU kernel")
@pytest.mark.usefixtures("interpreted")
def test_step_through_the_fused_gpu_path_equals_the_cpu_kernel() -> None:
    """Every parameter (small ones too: no packing) through the Triton kernel gives the CPU
    kernel's bits, step after step; a one-element ``lr`` tensor is read by the kernel."""
    launches = []
    real_update = fused_gpu.update

    def counting(*args: object) -> None:
        launches.append(1)
        real_update(*args)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("wrapped_optim.optimizers.torch_step._fused_gpu.update", counting)
        fused_p, fused_sd = _trained(3, lr=1e-2, cpu_kernel=False)
    assert len(launches) == 3 * 3  # one launch per parameter and step
    kernel_p, kernel_sd = _trained(3, lr=1e-2, cpu_kernel=True)
    assert torch.equal(fused_p, kernel_p)
    for index, entry in kernel_sd["state"].items():
        for name, value in entry.items():
            assert torch.equal(fused_sd["state"][index][name], value), (index, name)
    tensor_p, _ = _trained(3, lr=torch.tensor([1e-2]), cpu_kernel=False)
    assert torch.equal(tensor_p, kernel_p)


@pytest.mark.usefixtures("interpreted")
def test_scaled_state_and_fused_true_keep_the_torch_path() -> None:
    p = torch.nn.Parameter(torch.zeros(8, dtype=BF16))
    g = torch.ones(8, dtype=BF16)
    for kw, expected in (
        ({"exp_avg_dtype": torch.uint8}, False),
        ({"exp_avg_sq_dtype": FP16}, False),
        ({"master_weights": True, "master_weight_dtype": FP16}, False),
        ({"fused": True}, False),
        ({"exp_avg_dtype": BF16}, True),
    ):
        opt = PrecisionAwareAdamW([p], **kw)  # type: ignore[arg-type]
        opt.initialize_state(p)
        assert fused_gpu.applicable(opt, p, g, opt.param_groups[0]) is expected, kw


def test_off_the_kernel_devices_nothing_applies() -> None:
    p = torch.nn.Parameter(torch.zeros(8))
    opt = PrecisionAwareAdamW([p], exp_avg_dtype=BF16)
    opt.initialize_state(p)
    assert not fused_gpu.applicable(opt, p, torch.ones(8), opt.param_groups[0])
    with pytest.raises(ValueError, match="does not apply"):
        fused_gpu.update(opt, p, torch.ones(8), opt.param_groups[0])
