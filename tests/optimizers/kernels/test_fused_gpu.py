"""PrecisionAwareAdamW's fused GPU step, run on CPU by Triton's interpreter: the very kernels
a GPU runs, bitwise against the CPU kernel's single-rounding reference and the codecs (every
format mix, fp16/FP8 moments and fp16 masters included), through ``step()`` against the CPU
kernel, one launch per group and format combination (three when scaled), no host reads; and
the same kernels compiled for sm_90 by Triton's real GPU compiler."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from wrapped_optim._formats import codecs, remainders
from wrapped_optim.optimizers import PrecisionAwareAdamW
from wrapped_optim.optimizers.kernels import cpu_kernel
from wrapped_optim.optimizers.precision_adamw import _fused_gpu as fused_gpu
from wrapped_optim.optimizers.precision_adamw._operand import Operand

from .test_cpu_kernel import reference_moment, reference_step, same_bits

pytest.importorskip("triton")

BF16, FP16, FP32, FP8 = torch.bfloat16, torch.float16, torch.float32, codecs.FP8_E4M3
MOMENTS = [FP32, BF16, FP16, FP8]


@pytest.fixture
def interpreted() -> Iterator[None]:
    """The kernels run on host tensors through TRITON_INTERPRET=1 (set before their import);
    the interpreter's numpy warns on the discarded lanes of a division by zero (or an
    overflowing reciprocal, which the codecs turn into a zero multiplier)."""
    with (
        pytest.MonkeyPatch.context() as patch,
        np.errstate(divide="ignore", invalid="ignore", over="ignore"),
    ):
        patch.setenv("TRITON_INTERPRET", "1")
        patch.setattr(fused_gpu, "_DEVICE_TYPES", {"cuda", "cpu"})
        fused_gpu._reset_for_tests()
        yield
    fused_gpu._reset_for_tests()


@contextmanager
def counting_launches() -> Iterator[list[str]]:
    """The names of the kernels launched (every launch goes through fused_gpu._launch)."""
    seen: list[str] = []
    real = fused_gpu._launch

    def counting(kernel: Any, grid: tuple[int], *args: Any, **kw: Any) -> None:
        seen.append(kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__)
        real(kernel, grid, *args, **kw)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused_gpu, "_launch", counting)
        yield seen


@pytest.fixture
def launches() -> Iterator[list[str]]:
    with counting_launches() as seen:
        yield seen


# ----------------------------------------------------------------------------- conversions


def _convert(op: int, src: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    kernels = fused_gpu._kernel_module()
    out = torch.empty(src.numel(), dtype=out_dtype)
    kernels.convert_kernel[(-(-src.numel() // 4096),)](src, out, src.numel(), OP=op, BLOCK=4096)
    return out


def _probe_values(decoded: torch.Tensor, top: float) -> torch.Tensor:
    """Every finite value up to ``top``, the midpoints between neighbours (ties), points just
    off them, tiny values, and values past the range, inf and NaN."""
    values = decoded[torch.isfinite(decoded) & (decoded.abs() <= top)].unique()
    mids = (values[1:] + values[:-1]) / 2
    off = torch.cat([mids.nextafter(values[1:]), mids.nextafter(values[:-1])])
    extra = torch.tensor([1e-45, -1e-45, 2.0**-26, 2.0**-25, 2.0**-11, 1e-38, -0.0, 0.0,
                          top * 1.01, -top * 4, 65520.0, 1e30, float("inf"), float("-inf"),
                          float("nan"), -float("nan")])  # fmt: skip
    return torch.cat([values, mids, off, extra])


@pytest.mark.usefixtures("interpreted")
def test_fp16_conversions_match_torch_for_every_code() -> None:
    codes = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    assert same_bits(_convert(1, codes, FP32), codes.view(FP16).float())
    x = _probe_values(codes.view(FP16).float(), 65504.0)
    assert same_bits(_convert(0, x, torch.int16).view(FP16), x.to(FP16))


@pytest.mark.usefixtures("interpreted")
def test_e4m3_conversions_match_torch_and_the_codecs_for_every_code() -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    decoded = codes.view(torch.float8_e4m3fn).float()
    assert same_bits(_convert(3, codes, FP32), decoded)
    x = _probe_values(decoded, 448.0)
    want = torch.empty(x.numel(), dtype=FP8)  # the codecs' encoding under scale 1
    codecs.encode_into(x, want, FP8, torch.ones(1))
    assert same_bits(_convert(2, x, torch.uint8), want)


@pytest.mark.usefixtures("interpreted")
def test_bf16_conversions_match_torch() -> None:
    codes = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    assert same_bits(_convert(5, codes, FP32), codes.view(BF16).float())
    x = _probe_values(codes.view(BF16).float(), 3e38)
    assert same_bits(_convert(4, x, torch.int16).view(BF16), x.to(BF16))


# ----------------------------------------------------------------------------- one group


def _build(
    sizes: list[int],
    param_dtypes: list[torch.dtype],
    grad_dtypes: list[torch.dtype],
    master: str,
    m_dtype: torch.dtype,
    v_dtype: torch.dtype,
    seed: int,
    magnitude: float = 1.0,
    special: float | None = None,
    **kw: Any,
) -> tuple[PrecisionAwareAdamW, list[torch.nn.Parameter], list[torch.Tensor]]:
    """An optimizer over params of these sizes and dtypes, its state set to random values
    (one param all zeros, when there are several), and grads (``special`` in one element;
    also set as ``.grad`` where their dtype is the param's)."""
    gen = torch.Generator().manual_seed(seed)
    params = []
    for n, dtype in zip(sizes, param_dtypes, strict=True):
        if master == "remainder":
            dtype = BF16
        params.append(torch.nn.Parameter((torch.randn(n, generator=gen) * 3).to(dtype)))
    opt = PrecisionAwareAdamW(
        params, master_weights=master != "none", store_param_remainders=master == "remainder",
        master_weight_dtype=FP16 if master == "fp16" else FP32, exp_avg_dtype=m_dtype,
        exp_avg_sq_dtype=v_dtype, **kw,
    )  # fmt: skip
    grads = []
    for i, (p, g_dtype) in enumerate(zip(params, grad_dtypes, strict=True)):
        n = p.numel()
        opt.initialize_state(p, opt.layout.uses_remainder(p))
        zero = i == 1  # all state and the grad zero: scales 0
        scale = 0.0 if zero else magnitude
        opt.set_scaled_state(p, "exp_avg", torch.randn(n, generator=gen) * 0.1 * scale)
        opt.set_scaled_state(p, "exp_avg_sq", torch.rand(n, generator=gen) * 0.01 * scale**2)
        g = torch.randn(n, generator=gen) * scale
        if special is not None and n and not zero:
            g[int(torch.randint(0, n, (1,), generator=gen))] = special
        grads.append(g.to(g_dtype))
        if g_dtype == p.dtype:
            p.grad = grads[-1]
    return opt, params, grads


def _applicable(opt: PrecisionAwareAdamW, p: torch.Tensor, g: torch.Tensor) -> bool:
    return fused_gpu.applicable(
        opt.layout, Operand(p, g, opt.state.get(p, {}), opt.scales.get(p, {}))
    )


def _operands(
    opt: PrecisionAwareAdamW, pairs: list[tuple[torch.Tensor, torch.Tensor]]
) -> list[Operand]:
    return [Operand(p, g, opt.state[p], opt.scales.get(p, {})) for p, g in pairs]


def _expected(
    opt: PrecisionAwareAdamW, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]
) -> dict[str, Any]:
    """What the step must store for ``p``: the single-rounding reference on the decoded old
    state, encoded as the codecs encode (whole-tensor amax and scale)."""
    state = opt.state[p]
    master = state.get("master_param")
    if master is None or p.dtype == FP32:
        p32 = p.detach().float().clone()
    elif opt.layout.uses_remainder(p):
        p32 = remainders.join_master(p.detach(), master)
    else:
        p32 = opt.get_unscaled_state(p, "master_param").clone()
    m_old = opt.get_unscaled_state(p, "exp_avg").clone()
    v_old = opt.get_unscaled_state(p, "exp_avg_sq").clone()
    beta1, beta2 = group["betas"]
    step = group["step"]
    want_p, want_m, want_v = reference_step(
        p32, grad, m_old, v_old, lr=float(group["lr"]), beta1=beta1, beta2=beta2,
        eps=group["eps"], wd=group["weight_decay"], bc1=1 - beta1**step, bc2=1 - beta2**step,
        adam_w_mode=bool(opt.adam_w_mode),
    )  # fmt: skip
    out: dict[str, Any] = {
        "exp_avg": reference_moment(want_m, opt.exp_avg_dtype),
        "exp_avg_sq": reference_moment(want_v, opt.exp_avg_sq_dtype),
    }
    if master is not None and opt.layout.uses_remainder(p):
        out["param"], out["master_param"] = remainders.split_master(want_p)
        out["master_param"] = (out["master_param"], None)
    else:
        out["param"] = want_p.to(p.dtype)
        if master is not None:
            out["master_param"] = reference_moment(want_p, master.dtype)
    return out


def _check(opt: PrecisionAwareAdamW, p: torch.Tensor, want: dict[str, Any]) -> None:
    assert same_bits(p.detach(), want["param"]), "param"
    for name in ("exp_avg", "exp_avg_sq", "master_param"):
        if name not in want:
            continue
        stored, scale = want[name]
        assert same_bits(opt.state[p][name], stored), name
        if scale is not None:
            assert same_bits(opt._scales[p][name], scale), f"{name} scale"


@pytest.mark.usefixtures("interpreted")
# Each example runs the interpreter; a failure is reported as found (shrinking takes minutes).
@settings(max_examples=40, deadline=None, phases=[Phase.explicit, Phase.generate])
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=4),
    dtypes=st.lists(st.sampled_from([FP32, BF16, FP16]), min_size=8, max_size=8),
    master=st.sampled_from(["none", "fp32", "fp16", "remainder"]),
    m_dtype=st.sampled_from(MOMENTS),
    v_dtype=st.sampled_from(MOMENTS),
    adam_w_mode=st.booleans(),
    wd=st.sampled_from([0.0, 0.01, 0.3]),
    step=st.integers(1, 1000),
    lr=st.floats(1e-6, 1.0),
    magnitude=st.sampled_from([1e-30, 1e-20, 1e-6, 1.0, 1e4]),
    special=st.sampled_from([None, float("inf"), float("nan")]),
    seed=st.integers(0, 2**16),
)
def test_group_kernel_equals_the_reference_and_codecs_bitwise(
    sizes: list[int],
    dtypes: list[torch.dtype],
    master: str,
    m_dtype: torch.dtype,
    v_dtype: torch.dtype,
    adam_w_mode: bool,
    wd: float,
    step: int,
    lr: float,
    magnitude: float,
    special: float | None,
    seed: int,
) -> None:
    """Several params of odd sizes (empty ones, several programs each: 64-element blocks
    here) in one group, each with its own param and grad dtype (so several format
    combinations), every moment and master format, subnormal to huge values, inf/NaN grads,
    an all-zero tensor (scale 0): every stored bit and scale is the reference's."""
    k = len(sizes)
    opt, params, grads = _build(
        sizes, dtypes[:k], dtypes[4 : 4 + k], master, m_dtype, v_dtype, seed, magnitude,
        special, lr=lr, weight_decay=wd, adam_w_mode=adam_w_mode,
    )  # fmt: skip
    group = opt.param_groups[0]
    group["step"] = step
    want = [_expected(opt, p, g, group) for p, g in zip(params, grads, strict=True)]
    pairs = list(zip(params, grads, strict=True))
    assert all(_applicable(opt, p, g) for p, g in pairs)
    expected_launches = fused_gpu.launches_per_step(opt.layout, _operands(opt, pairs))  # type: ignore[arg-type]
    with pytest.MonkeyPatch.context() as patch, counting_launches() as launches:
        patch.setattr(fused_gpu, "BLOCK", 64)
        fused_gpu.update_group(opt.layout, _operands(opt, pairs), group, tables={}, group_index=0)  # type: ignore[arg-type]
    assert len(launches) == expected_launches
    for p, w in zip(params, want, strict=True):
        _check(opt, p, w)


@pytest.mark.usefixtures("interpreted")
def test_one_launch_per_combination_three_when_scaled(launches: list[str]) -> None:
    """Eight params, three format combinations (fp32, bf16 and fp16 params) under FP8/fp16
    moments: 3 x 3 launches; the same under bf16 moments: 3. Bitwise as the reference."""
    sizes = [5000, 4096, 1, 0, 8193, 300, 17, 4097]
    dtypes = [FP32, BF16, FP16, FP32, BF16, FP16, FP32, BF16]
    for m_dtype, v_dtype, per_combo in ((FP8, FP16, 3), (BF16, BF16, 1)):
        launches.clear()
        opt, params, grads = _build(sizes, dtypes, [FP32] * 8, "none", m_dtype, v_dtype,
                                    seed=3, lr=1e-2, weight_decay=0.1)  # fmt: skip
        group = {**opt.param_groups[0], "step": 2}
        want = [_expected(opt, p, g, group) for p, g in zip(params, grads, strict=True)]
        pairs = list(zip(params, grads, strict=True))
        fused_gpu.update_group(opt.layout, _operands(opt, pairs), group, tables={})
        assert len(launches) == 3 * per_combo
        if per_combo == 3:
            assert launches[:3] == ["adamw_group_kernel", "finalize_kernel", "adamw_group_kernel"]
        for p, w in zip(params, want, strict=True):
            _check(opt, p, w)


# ----------------------------------------------------------------------------- step()


def _trained(steps: int, lr: float | torch.Tensor, *, fp8: bool, **kw: Any) -> tuple[Any, Any]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n).to(BF16)) for n in (5000, 7, 1025, 4096)]
    moments = {"exp_avg_dtype": FP16, "exp_avg_sq_dtype": FP8} if fp8 else {
        "exp_avg_dtype": BF16, "exp_avg_sq_dtype": BF16}  # fmt: skip
    opt = PrecisionAwareAdamW(params, lr=lr, weight_decay=0.1, master_weights=True, **moments,
                              **kw)  # fmt: skip
    for i in range(steps):
        gen = torch.Generator().manual_seed(100 + i)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(BF16)
        opt.step()
    scales = [s.clone() for p in params for s in opt._scales.get(p, {}).values()]
    return [p.detach().clone() for p in params], (opt.state_dict(), scales)


@pytest.mark.skipif(not cpu_kernel.available(), reason="compares with the CPU kernel")
@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16 moments", "fp16 m + FP8 v"])
def test_step_through_the_fused_gpu_path_equals_the_cpu_kernel(
    fp8: bool, launches: list[str]
) -> None:
    """step() sends every parameter of the group (small ones too: no packing) to one fused
    bucket: one launch per step (three with fp16/FP8 moments), and the CPU kernel's bits,
    scales included, step after step; a one-element ``lr`` tensor is read by the kernel."""
    fused_p, fused_state = _trained(3, 1e-2, fp8=fp8, cpu_kernel=False)
    assert len(launches) == 3 * (3 if fp8 else 1)
    kernel_p, kernel_state = _trained(3, 1e-2, fp8=fp8, cpu_kernel=True)
    assert all(torch.equal(a, b) for a, b in zip(fused_p, kernel_p, strict=True))
    for a, b in zip(fused_state[1], kernel_state[1], strict=True):
        assert same_bits(a, b)
    for index, entry in kernel_state[0]["state"].items():
        for name, value in entry.items():
            assert torch.equal(fused_state[0]["state"][index][name], value), (index, name)
    tensor_p, _ = _trained(3, torch.tensor([1e-2]), fp8=fp8, cpu_kernel=False)
    assert all(torch.equal(a, b) for a, b in zip(tensor_p, kernel_p, strict=True))


class _HostRead(AssertionError):
    pass


def _forbid(*_: object, **__: object) -> Any:
    raise _HostRead("a host read of tensor data inside the fused step")


@pytest.mark.usefixtures("interpreted")
def test_step_reads_nothing_back_and_rebuilds_tables_only_when_addresses_change(
    launches: list[str],
) -> None:
    """With every way of reading a tensor's value on the host (item, float, bool, tolist,
    numpy, cpu, synchronize) turned into an error, step() runs its fused launches (scaled
    formats, a tensor lr); a second step with the same tensors builds nothing; new grads
    rebuild only the small address table."""
    opt, params, _ = _build([300, 7, 40], [BF16, BF16, BF16], [BF16] * 3, "fp32", FP8, FP16,
                            seed=1, lr=torch.tensor(1e-2), cpu_kernel=False)  # fmt: skip
    recorded: list[Any] = []

    def record(kernel: Any, grid: tuple[int], *args: Any, **kw: Any) -> None:
        recorded.append(grid)

    built: list[torch.Tensor] = []
    real_to_device = fused_gpu._to_device

    def counting_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
        built.append(host)
        return real_to_device(host, device)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused_gpu, "_launch", record)
        patch.setattr(fused_gpu, "_to_device", counting_to_device)
        for name in ("item", "tolist", "numpy", "cpu", "__float__", "__int__", "__bool__"):
            patch.setattr(torch.Tensor, name, _forbid)
        patch.setattr(torch.cuda, "synchronize", _forbid)
        opt.step()
        assert len(recorded) == 3 and len(built) == 2  # block map and table
        opt.step()
        assert len(recorded) == 6 and len(built) == 2  # cached
        for p in params:
            p.grad = p.grad.clone()
        opt.step()
        assert len(recorded) == 9 and len(built) == 3  # the table only
        assert built[-1].dtype == torch.int64 and built[-1].shape == (3, 10)


@pytest.mark.usefixtures("interpreted")
def test_scaled_state_is_fused_and_fused_true_keeps_torch() -> None:
    p = torch.nn.Parameter(torch.zeros(8, dtype=BF16))
    g = torch.ones(8, dtype=BF16)
    for kw, expected in (
        ({"exp_avg_dtype": FP8}, True),
        ({"exp_avg_sq_dtype": FP16}, True),
        ({"master_weights": True, "master_weight_dtype": FP16}, True),
        ({"fused": True}, False),
        ({"exp_avg_dtype": BF16}, True),
    ):
        opt = PrecisionAwareAdamW([p], **kw)  # type: ignore[arg-type]
        opt.initialize_state(p, opt.layout.uses_remainder(p))
        assert _applicable(opt, p, g) is expected, kw
    opt = PrecisionAwareAdamW([p], exp_avg_dtype=FP8)
    opt.initialize_state(p, opt.layout.uses_remainder(p))
    del opt._scales[p]["exp_avg"]  # a scaled state without its scale is not the kernel's
    assert not _applicable(opt, p, g)


def test_off_the_kernel_devices_nothing_applies() -> None:
    p = torch.nn.Parameter(torch.zeros(8))
    opt = PrecisionAwareAdamW([p], exp_avg_dtype=BF16)
    opt.initialize_state(p, opt.layout.uses_remainder(p))
    assert not _applicable(opt, p, torch.ones(8))
    with pytest.raises(ValueError, match="does not apply"):
        pairs = [(p, torch.ones(8))]
        fused_gpu.update_group(opt.layout, _operands(opt, pairs), opt.param_groups[0], tables={})


# ----------------------------------------------------------------------------- sm_90 build


def _compile_for_sm90(fn: Any, types: list[str], constexprs: dict[str, Any]) -> str:
    """PTX of ``fn`` from Triton's real CUDA compiler (no GPU needed): the code a GPU runs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = dict(zip(fn.arg_names, types, strict=False))
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    source = ASTSource(
        fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()}
    )
    options = {"enable_fp_fusion": False, "enable_reflect_ftz": False, "num_warps": 8}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    ptx: str = compiled.asm["ptx"]
    return ptx


_GROUP_TYPES = ["*i64", "*i32", "*fp32", "*i32", "*fp32"] + ["fp32"] * 9


def _check_sm90(kinds: dict[str, Any]) -> None:
    kernels = fused_gpu._kernel_module()
    scaled = kinds["MASTER"] == 3 or kinds["M_KIND"] >= 2 or kinds["V_KIND"] >= 2
    for pass_ in (0, 1) if scaled else (0,):
        constexprs = {**kinds, "PASS": pass_, "BLOCK": fused_gpu.BLOCK}
        ptx = _compile_for_sm90(kernels.adamw_group_kernel, _GROUP_TYPES, constexprs)
        # No contraction into FMA, no flush-to-zero: the interpreter's (and CPU's) bits.
        assert not re.search(r"\bfma\.", ptx) and ".ftz" not in ptx
        if pass_ == 0:
            assert "sqrt.rn.f32" in ptx and "div.rn.f32" in ptx
        else:
            assert re.search(r"\batom\.global\.(\w+\.)*max\.s32", ptx)
        if kinds["ALIGNED"]:  # full blocks: 16-byte loads
            assert re.search(r"ld\.global(\.\w+)*\.v4", ptx)
    if scaled:
        ptx = _compile_for_sm90(
            kernels.finalize_kernel, ["*i64", "*fp32", "*i32", "i32"],
            {"M_KIND": kinds["M_KIND"], "V_KIND": kinds["V_KIND"], "MASTER": kinds["MASTER"],
             "BLOCK": fused_gpu.FINALIZE_BLOCK},
        )  # fmt: skip
        assert "div.rn.f32" in ptx and ".ftz" not in ptx


def test_kernels_compile_for_sm90_without_fma_or_flush_to_zero() -> None:
    """Triton's CUDA compiler (frontend, LLVM, ptxas) accepts the kernels for an H200's
    sm_90, with correctly rounded sqrt/div, no FMA, no FTZ, vectorized full blocks."""
    fused_gpu._reset_for_tests()
    for kinds in (
        {"MASTER": 1, "P_KIND": 1, "G_KIND": 1, "M_KIND": 3, "V_KIND": 2},
        {"MASTER": 2, "P_KIND": 1, "G_KIND": 0, "M_KIND": 1, "V_KIND": 1},
        {"MASTER": 3, "P_KIND": 0, "G_KIND": 2, "M_KIND": 0, "V_KIND": 3},
    ):
        _check_sm90({**kinds, "ADAM_W": True, "LR_TENSOR": False, "ALIGNED": True})


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(
    master=st.sampled_from([0, 1, 2, 3]),
    p_kind=st.sampled_from([0, 1, 2]),
    g_kind=st.sampled_from([0, 1, 2]),
    m_kind=st.sampled_from([0, 1, 2, 3]),
    v_kind=st.sampled_from([0, 1, 2, 3]),
    adam_w=st.booleans(),
    lr_tensor=st.booleans(),
    aligned=st.booleans(),
)
def test_every_combination_compiles_for_sm90(
    master: int, p_kind: int, g_kind: int, m_kind: int, v_kind: int, adam_w: bool,
    lr_tensor: bool, aligned: bool,
) -> None:  # fmt: skip
    fused_gpu._reset_for_tests()
    _check_sm90({"MASTER": master, "P_KIND": 1 if master == 2 else p_kind, "G_KIND": g_kind,
                 "M_KIND": m_kind, "V_KIND": v_kind, "ADAM_W": adam_w,
                 "LR_TENSOR": lr_tensor, "ALIGNED": aligned})  # fmt: skip


# ----------------------------------------------------------------------------- GPU check


@pytest.mark.slow
@pytest.mark.usefixtures("interpreted")
def test_gpu_check_runs_its_rows_on_the_interpreter() -> None:
    """tests/gpu/gpu_fused_step.py's logic on CPU: each configuration is the fused path's,
    and one (three format combinations in a group, fp16 moments, subnormal values) passes
    every row: no host sync, launches per step, bitwise = its interpreted child process."""
    from tests.gpu import gpu_fused_step

    for name in gpu_fused_step.CONFIGS:
        opt, params, grads = gpu_fused_step._make(name, (5, 3, 2), "cpu", cpu_kernel=False)
        for p in params:
            opt.initialize_state(p, opt.layout.uses_remainder(p))
        pairs = gpu_fused_step._pairs(params, grads, 0)
        assert all(_applicable(opt, p, g) for p, g in pairs), name
    name = list(gpu_fused_step.CONFIGS)[-1]
    rows = gpu_fused_step.rows(name, "cpu", large=False)
    assert len(rows) == 4 and all(ok for _, ok, _ in rows), rows
    assert rows[2][2].startswith("9 0 0")  # three combinations, three launches each
