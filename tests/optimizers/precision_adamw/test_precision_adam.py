"""PrecisionAwareAdamW: FusedAdam's API, chunk capability, checkpoints and numerics."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from wrapped_optim._adapters.precision import (
    ChunkedStateHolder,
    PrecisionAwareStateHolder,
    has_compressed_state,
    is_precision_aware_holder,
    supports_chunked_state,
)
from wrapped_optim._formats import codecs, remainders
from wrapped_optim.optimizers import PrecisionAwareAdamW
from wrapped_optim.optimizers.precision_adamw import _state as precision_state
from wrapped_optim.optimizers.precision_adamw import _torch_step as torch_step

BF16, FP16, FP32, FP8 = torch.bfloat16, torch.float16, torch.float32, torch.uint8

CONFIGS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16-moments": {"exp_avg_dtype": BF16, "exp_avg_sq_dtype": BF16},
    "fp16-moments": {"exp_avg_dtype": FP16, "exp_avg_sq_dtype": FP16},
    "fp8-moments": {"exp_avg_dtype": FP8, "exp_avg_sq_dtype": FP8},
    "fp32-master": {"master_weights": True},
    "fp16-master-mixed": {
        "master_weights": True,
        "master_weight_dtype": FP16,
        "exp_avg_dtype": FP8,
        "exp_avg_sq_dtype": BF16,
    },
    "remainders": {
        "master_weights": True,
        "store_param_remainders": True,
        "exp_avg_dtype": BF16,
        "exp_avg_sq_dtype": FP16,
    },
}
PARAM_DTYPES = (FP32, BF16, FP16)


def _scale_of(opt: Any, param: torch.Tensor, name: str) -> torch.Tensor | None:
    """The per-tensor scale of ``param``'s state ``name`` in ``opt`` (None if unscaled)."""
    return precision_state.scale_of(opt.layout, opt.scales, param, name)


def make_params(shapes: list[tuple[int, ...]], dtype: torch.dtype, seed: int = 0) -> list[Any]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def set_grads(params: list[Any], step: int, seed: int = 1, attr: str = "grad") -> None:
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    for p in params:
        g = torch.randn(p.shape, generator=gen).to(p.dtype)
        setattr(p, attr, g)


def clone_params(params: list[Any]) -> list[Any]:
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def assert_same_optimizer(
    a: PrecisionAwareAdamW, b: PrecisionAwareAdamW, *, scales: bool = True
) -> None:
    """Bitwise equal params, groups, storage and expansions (and scales, unless told not to:
    after a reload an fp16/FP8 scale may differ in its last bit while every stored and
    expanded value is identical, which is what the next step reads)."""
    for ga, gb in zip(a.param_groups, b.param_groups, strict=True):
        assert {k: v for k, v in ga.items() if k != "params"} == {
            k: v for k, v in gb.items() if k != "params"
        }
        for pa, pb in zip(ga["params"], gb["params"], strict=True):
            assert same_bits(pa, pb)
            assert list(a.state[pa]) == list(b.state[pb])
            for name in a.state[pa]:
                assert same_bits(a.state[pa][name], b.state[pb][name]), name
                ea, eb = a.get_unscaled_state(pa, name), b.get_unscaled_state(pb, name)
                assert same_bits(ea, eb), name
                sa, sb = _scale_of(a, pa, name), _scale_of(b, pb, name)
                assert (sa is None) == (sb is None)
                if scales and sa is not None and sb is not None:
                    assert same_bits(sa, sb), name


def clone_sd(sd: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(sd)


# ----------------------------------------------------------------------------- constructor


def test_fused_adam_validation() -> None:
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(RuntimeError, match="AMSGrad"):
        PrecisionAwareAdamW(p, amsgrad=True)
    with pytest.raises(RuntimeError, match="bf16 masters are rejected"):
        PrecisionAwareAdamW(p, master_weights=True, master_weight_dtype=BF16)
    with pytest.raises(RuntimeError, match="exp_avg_dtype"):
        PrecisionAwareAdamW(p, exp_avg_dtype=torch.int8)
    with pytest.raises(RuntimeError, match="exp_avg_sq_dtype"):
        PrecisionAwareAdamW(p, exp_avg_sq_dtype=torch.float64)
    with pytest.raises(RuntimeError, match="capturable"):
        PrecisionAwareAdamW(p, capturable=True)
    with pytest.raises(ValueError, match="lr must be a finite number >= 0"):
        PrecisionAwareAdamW(p, lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        PrecisionAwareAdamW(p, betas=(1.0, 0.9))
    # A bf16 master dtype without master weights is ignored, as in FusedAdam.
    PrecisionAwareAdamW(p, master_weight_dtype=BF16)
    # Remainders are only effective with an fp32 master.
    assert not PrecisionAwareAdamW(p, store_param_remainders=True).store_param_remainders
    opt = PrecisionAwareAdamW(p, master_weights=True, store_param_remainders=True)
    assert opt.store_param_remainders
    assert opt.name_to_dtype_map == {"exp_avg": FP32, "exp_avg_sq": FP32, "master_param": FP32}


def test_protocols_and_predicates() -> None:
    p = [torch.nn.Parameter(torch.zeros(2))]
    ours = PrecisionAwareAdamW(p, exp_avg_dtype=FP8)
    assert isinstance(ours, PrecisionAwareStateHolder) and isinstance(ours, ChunkedStateHolder)
    assert is_precision_aware_holder(ours) and supports_chunked_state(ours)
    assert has_compressed_state(ours) and not has_compressed_state(PrecisionAwareAdamW(p))
    plain = torch.optim.AdamW(p)
    assert not is_precision_aware_holder(plain) and not supports_chunked_state(plain)
    assert not has_compressed_state(plain)

    class WholeOnly:  # what TE FusedAdam offers: no chunk methods
        name_to_dtype_map = {"exp_avg": BF16, "exp_avg_sq": FP32, "master_param": FP32}

        def get_unscaled_state(self, param: Any, state_name: str) -> Any: ...

        def set_scaled_state(self, param: Any, state_name: str, unscaled_state: Any) -> None: ...

    assert is_precision_aware_holder(WholeOnly()) and not supports_chunked_state(WholeOnly())
    assert has_compressed_state(WholeOnly())


def test_initialize_state_layout() -> None:
    p = torch.nn.Parameter(torch.randn(5).to(BF16))
    opt = PrecisionAwareAdamW([p], **CONFIGS["remainders"])
    opt.initialize_state(p, True)
    st_ = opt.state[p]
    assert [st_[k].dtype for k in st_] == [BF16, FP16, torch.int16]
    assert torch.equal(st_["master_param"], torch.zeros(5, dtype=torch.int16))
    # The master reconstructed from param + zero remainder is the param itself.
    assert torch.equal(remainders.join_master(p.data, st_["master_param"]), p.data.float())
    with pytest.raises(ValueError, match="contradicts"):
        opt.initialize_state(p, False)
    q = torch.nn.Parameter(torch.randn(3).to(BF16))
    opt2 = PrecisionAwareAdamW([q], master_weights=True, master_weight_dtype=FP16)
    opt2.initialize_state(q, False)
    assert opt2.state[q]["master_param"].dtype == FP16
    assert torch.allclose(opt2.get_unscaled_state(q, "master_param"), q.float(), rtol=1e-3)


# ----------------------------------------------------------------------------- chunk API


def _trained(config: str, dtype: torch.dtype, shapes: list[tuple[int, ...]], steps: int) -> Any:
    params = make_params(shapes, dtype)
    opt = PrecisionAwareAdamW(params, lr=1e-2, weight_decay=0.1, chunk_numel=7, **CONFIGS[config])
    for i in range(steps):
        set_grads(params, i)
        opt.step()
    return params, opt


@given(
    config=st.sampled_from(sorted(CONFIGS)),
    dtype=st.sampled_from(PARAM_DTYPES),
    chunk=st.integers(1, 23),
    steps=st.integers(0, 3),
)
def test_chunked_read_equals_get_unscaled_state(
    config: str, dtype: torch.dtype, chunk: int, steps: int
) -> None:
    params, opt = _trained(config, dtype, [(5, 7), (3,), (1,)], steps)
    for p in params:
        if not opt.state[p]:
            opt.initialize_state(p, opt.layout.uses_remainder(p))
        for name in opt.state[p]:
            whole = opt.get_unscaled_state(p, name).reshape(-1)
            out = torch.full_like(whole, 77)
            for s, e in codecs.chunk_bounds(whole.numel(), chunk):
                piece = torch.empty(e - s, dtype=whole.dtype)
                opt.read_unscaled_state_chunk(p, name, s, piece)
                out[s:e] = piece
            assert same_bits(out, whole), (config, name)


@given(
    config=st.sampled_from(sorted(CONFIGS)),
    dtype=st.sampled_from(PARAM_DTYPES),
    chunk=st.integers(1, 23),
    seed=st.integers(0, 2**16),
    scale_exp=st.integers(-30, 30),
)
def test_chunked_write_equals_set_scaled_state(
    config: str, dtype: torch.dtype, chunk: int, seed: int, scale_exp: int
) -> None:
    pa = make_params([(6, 5)], dtype)
    pb = clone_params(pa)
    a = PrecisionAwareAdamW(pa, **CONFIGS[config])
    b = PrecisionAwareAdamW(pb, **CONFIGS[config])
    gen = torch.Generator().manual_seed(seed)
    for name in a.name_to_dtype_map:
        if name == "master_param" and not a.master_weights:
            continue
        if a.layout.uses_remainder(pa[0], name):
            src = torch.randint(-(2**15), 2**15, (30,), generator=gen, dtype=torch.int16)
        else:
            src = torch.randn(30, generator=gen) * 2.0**scale_exp
        before = src.clone()
        a.set_scaled_state(pa[0], name, src.view(6, 5))
        b.write_scaled_state_chunked(pb[0], name, src, chunk)
        assert torch.equal(src, before)  # the caller's tensor is never modified
    assert_same_optimizer(a, b)


def test_chunk_api_checks_arguments() -> None:
    p = torch.nn.Parameter(torch.zeros(4))
    opt = PrecisionAwareAdamW([p], exp_avg_dtype=BF16)
    opt.initialize_state(p, False)
    with pytest.raises(ValueError, match="outside"):
        opt.read_unscaled_state_chunk(p, "exp_avg", 3, torch.empty(2))
    with pytest.raises(ValueError, match="contiguous 1-D"):
        opt.read_unscaled_state_chunk(p, "exp_avg", 0, torch.empty(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="unknown optimizer state"):
        opt.read_unscaled_state_chunk(p, "momentum", 0, torch.empty(2))
    with pytest.raises(ValueError, match="elements"):
        opt.write_scaled_state_chunked(p, "exp_avg", torch.zeros(3), 2)
    with pytest.raises(ValueError, match="dtype"):
        opt.set_scaled_state(p, "exp_avg", torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="master_weights"):
        opt.set_scaled_state(p, "master_param", torch.zeros(4))


def test_fp16_set_scaled_state_leaves_caller_tensor_alone() -> None:
    """TE's fp16 path scales the caller's tensor in place; ours must not."""
    p = torch.nn.Parameter(torch.zeros(3))
    opt = PrecisionAwareAdamW([p], exp_avg_dtype=FP16, exp_avg_sq_dtype=FP8)
    x = torch.tensor([1e-3, -5.0, 7.0])
    before = x.clone()
    opt.set_scaled_state(p, "exp_avg", x)
    opt.set_scaled_state(p, "exp_avg_sq", x)
    assert torch.equal(x, before)
    assert opt.get_unscaled_state(p, "exp_avg") is not x


def test_fp32_state_is_returned_live() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    opt = PrecisionAwareAdamW([p])
    opt.initialize_state(p, False)
    assert opt.get_unscaled_state(p, "exp_avg") is opt.state[p]["exp_avg"]


# ----------------------------------------------------------------------------- step


# Documented tolerances (docs/precision_adam.md): L2 error of the parameters after 20 steps
# (lr 1e-2, weight decay 0.01), relative to how far the all-FP32 reference moved them.
# Measured values are about half of these. State formats add STATE_TOL; the parameter's own
# storage adds PARAM_TOL (bf16 params without a master lose most small updates to rounding).
STATE_TOL = {
    "fp32": 1e-6,
    "fp32-master": 1e-6,
    "bf16-moments": 5e-3,
    "remainders": 5e-3,
    "fp16-moments": 1e-3,
    "fp8-moments": 8e-2,
    "fp16-master-mixed": 8e-2,
}
PARAM_TOL = {
    (FP32, False): 0.0,
    (BF16, False): 0.5,
    (BF16, True): 0.1,
    (FP16, False): 0.05,
    (FP16, True): 0.015,
}


@pytest.mark.parametrize("cpu_kernel", [None, False])
@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", PARAM_DTYPES)
def test_step_tracks_fp32_reference(
    config: str, dtype: torch.dtype, cpu_kernel: bool | None
) -> None:
    """Every config x param dtype trains close to an all-FP32 run, with and without the
    compiled CPU kernel."""
    shapes = [(33, 17), (50,)]
    params = make_params(shapes, dtype)
    ref_params = [torch.nn.Parameter(p.detach().float().clone()) for p in params]  # same start
    start = [p.detach().clone() for p in ref_params]
    ref = PrecisionAwareAdamW(ref_params, lr=1e-2, weight_decay=0.01)
    kw = CONFIGS[config]
    opt = PrecisionAwareAdamW(
        params, lr=1e-2, weight_decay=0.01, chunk_numel=100, cpu_kernel=cpu_kernel, **kw
    )
    for i in range(20):
        set_grads(ref_params, i)
        for p, r in zip(params, ref_params, strict=True):
            p.grad = r.grad.to(dtype)
        ref.step()
        opt.step()
    moved = sum(((r - s) ** 2).sum() for r, s in zip(ref_params, start, strict=True)) ** 0.5
    err = sum(((p.float() - r) ** 2).sum() for p, r in zip(params, ref_params, strict=True)) ** 0.5
    master = bool(kw.get("master_weights")) and dtype != FP32
    tol = STATE_TOL[config] + PARAM_TOL[(dtype, master and dtype != FP32)]
    assert (err / moved).item() <= tol, (config, dtype, (err / moved).item(), tol)
    if master and config != "fp16-master-mixed":  # the FP32 master itself is much closer
        full = [
            remainders.join_master(p.data, opt.state[p]["master_param"])
            if opt.layout.uses_remainder(p)
            else opt.get_unscaled_state(p, "master_param")
            for p in params
        ]
        err = sum(((f - r) ** 2).sum() for f, r in zip(full, ref_params, strict=True)) ** 0.5
        grad_rounding = 4e-3 if dtype == BF16 else 2e-3  # the grads are bf16 / fp16 too
        assert (err / moved).item() <= STATE_TOL[config] + grad_rounding


@pytest.mark.parametrize("fused", [None, False])
def test_fp32_matches_torch_adamw_100_steps(fused: bool | None) -> None:
    """Both update paths: torch's fused kernel (default on CPU) and TE's elementwise form
    ``p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)`` (``fused=False``)."""
    shapes = [(64, 32), (100,), (7, 3, 5)]
    ours = make_params(shapes, FP32)
    theirs = make_params(shapes, FP32)
    opt = PrecisionAwareAdamW(
        ours, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=fused
    )
    ref = torch.optim.AdamW(theirs, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for i in range(100):
        set_grads(ours, i)
        set_grads(theirs, i)
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs, strict=True):
        # 1e-5 relative, in norm: per-element ratios are meaningless where values cancel to ~0.
        assert ((a - b).norm() / b.norm()).item() < 1e-5
        assert ((a - b).abs().max() / b.abs().max()).item() < 1e-5
        assert torch.allclose(opt.state[a]["exp_avg_sq"], ref.state[b]["exp_avg_sq"], rtol=1e-5)


@pytest.mark.parametrize("fused", [None, False])
def test_l2_mode_matches_torch_adam(fused: bool | None) -> None:
    ours = make_params([(40,)], FP32)
    theirs = make_params([(40,)], FP32)
    opt = PrecisionAwareAdamW(ours, lr=1e-2, weight_decay=0.05, adam_w_mode=False, fused=fused)
    ref = torch.optim.Adam(theirs, lr=1e-2, weight_decay=0.05)
    for i in range(30):
        set_grads(ours, i)
        set_grads(theirs, i)
        grads = [p.grad.clone() for p in ours]
        opt.step()
        ref.step()
        assert all(torch.equal(p.grad, g) for p, g in zip(ours, grads, strict=True))
    assert torch.allclose(ours[0], theirs[0], rtol=1e-5, atol=1e-6)


def test_without_bias_correction_uses_te_form() -> None:
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = PrecisionAwareAdamW([p], lr=0.1, weight_decay=0.5, bias_correction=False, eps=1e-3)
    g = torch.tensor([0.5, 0.25])
    p.grad = g
    opt.step()
    m, v = 0.1 * g, 0.001 * g * g
    expected = torch.tensor([1.0, -2.0]) - 0.1 * (
        m / (v.sqrt() + 1e-3) + 0.5 * torch.tensor([1.0, -2.0])
    )
    assert torch.allclose(p.detach(), expected, rtol=1e-6)


def test_all_bf16_single_pass_equals_chunked_path() -> None:
    """bf16 param + grad + moments go through torch's fused kernel in one pass; the result
    is bitwise the decode -> FP32 update -> encode path (taken here for FP32 grads)."""
    a = torch.nn.Parameter(torch.randn(10007).to(BF16))
    b = torch.nn.Parameter(a.detach().clone())
    kw = {"weight_decay": 0.1, "lr": 1e-2, "exp_avg_dtype": BF16, "exp_avg_sq_dtype": BF16}
    oa = PrecisionAwareAdamW([a], **kw)
    ob = PrecisionAwareAdamW([b], use_decoupled_grad=True, chunk_numel=999, **kw)
    for i in range(4):
        g = torch.randn(10007, generator=torch.Generator().manual_seed(i)).to(BF16)
        a.grad = g
        b.decoupled_grad = g.float()
        oa.step()
        ob.step()
    assert same_bits(a, b)
    for name in ("exp_avg", "exp_avg_sq"):
        assert same_bits(oa.state[a][name], ob.state[b][name])


def test_decoupled_grads_group_hyperparameters_and_tensor_lr() -> None:
    a = make_params([(8,), (8,)], BF16)
    b = clone_params(a)
    groups_a = [{"params": [a[0]], "lr": torch.tensor(0.01)}, {"params": [a[1]], "lr": 0.1}]
    groups_b = [{"params": [b[0]], "lr": 0.01}, {"params": [b[1]], "lr": 0.1, "betas": (0.5, 0.9)}]
    kw = {"master_weights": True, "exp_avg_dtype": BF16}
    opt_a = PrecisionAwareAdamW(groups_a, use_decoupled_grad=True, **kw)
    opt_b = PrecisionAwareAdamW(groups_b, **kw)
    for i in range(3):
        set_grads(a, i, attr="decoupled_grad")
        set_grads(b, i)
        assert all(p.grad is None for p in a)
        opt_a.step()
        opt_b.step()
    assert torch.equal(a[0], b[0])  # tensor lr == float lr, decoupled grads == grads
    assert not torch.equal(a[1], b[1])  # group 1 has its own betas in opt_b
    assert opt_a.param_groups[0]["step"] == 3
    opt_a.zero_grad()
    assert all(p.decoupled_grad is None for p in a)


def test_params_without_grads_get_no_state_and_do_not_move() -> None:
    # As torch's optimizers: frozen (or unused) params cost no optimizer memory. Megatron
    # creates state for every param explicitly (initialize_state), which still works.
    a, b = make_params([(4,), (4,)], FP32)
    before = b.detach().clone()
    opt = PrecisionAwareAdamW([a, b], weight_decay=0.1, exp_avg_dtype=FP8)
    a.grad = torch.ones(4)
    opt.step()
    assert torch.equal(b, before) and not opt.state[b]
    assert set(opt.state_dict()["state"]) == {0}
    opt.initialize_state(b, False)
    assert opt.get_unscaled_state(b, "exp_avg").eq(0).all()


def test_zero_gradient_fp8_state_stays_finite() -> None:
    p = torch.nn.Parameter(torch.randn(6))
    opt = PrecisionAwareAdamW([p], exp_avg_dtype=FP8, exp_avg_sq_dtype=FP8)
    p.grad = torch.zeros(6)
    for _ in range(2):
        opt.step()
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(opt.get_unscaled_state(p, name), torch.zeros(6))
    assert torch.isfinite(p).all()


def test_non_contiguous_param() -> None:
    base = torch.randn(6, 4)
    p = torch.nn.Parameter(base.t())  # non-contiguous view
    ref = torch.nn.Parameter(base.t().contiguous())
    o1 = PrecisionAwareAdamW([p], lr=0.1)
    o2 = PrecisionAwareAdamW([ref], lr=0.1)
    p.grad = torch.ones_like(p)
    ref.grad = torch.ones_like(ref)
    o1.step()
    o2.step()
    assert torch.equal(p, ref)


# ----------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_state_dict_is_portable_fp32(config: str) -> None:
    _params, opt = _trained(config, BF16, [(4, 3)], 2)
    sd = opt.state_dict()
    assert sd["param_groups"][0]["step"] == 2 and sd["param_groups"][0]["params"] == [0]
    entry = sd["state"][0]
    expected = ["exp_avg", "exp_avg_sq"] + (["master_param"] if opt.master_weights else [])
    assert list(entry) == expected
    for name, value in entry.items():
        want = torch.int16 if config == "remainders" and name == "master_param" else FP32
        assert value.dtype == want and value.shape == (4, 3)
    assert not any("scale" in k for k in str(sd))


def test_state_dict_goes_through_instance_patches() -> None:
    _params, opt = _trained("bf16-moments", FP32, [(3,)], 1)
    calls: list[tuple[str, str]] = []
    original_get, original_set = opt.get_unscaled_state, opt.set_scaled_state

    def get(param: Any, name: str) -> torch.Tensor:
        calls.append(("get", name))
        return original_get(param, name).clone()

    def set_(param: Any, name: str, value: torch.Tensor) -> None:
        calls.append(("set", name))
        original_set(param, name, value)

    opt.get_unscaled_state = get  # type: ignore[method-assign]
    opt.set_scaled_state = set_  # type: ignore[method-assign]
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    assert calls == [
        ("get", "exp_avg"),
        ("get", "exp_avg_sq"),
        ("set", "exp_avg"),
        ("set", "exp_avg_sq"),
    ]


@given(
    config=st.sampled_from(sorted(CONFIGS)),
    dtype=st.sampled_from(PARAM_DTYPES),
    shapes=st.lists(
        st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple), min_size=1, max_size=3
    ),
    before=st.integers(1, 4),
    after=st.integers(1, 4),
    chunk=st.integers(1, 40),
    fused=st.sampled_from([None, False]),
    cpu_kernel=st.sampled_from([None, False]),
)
def test_save_load_continue_is_bit_identical(
    config: str,
    dtype: torch.dtype,
    shapes: list[tuple[int, ...]],
    before: int,
    after: int,
    chunk: int,
    fused: bool | None,
    cpu_kernel: bool | None,
) -> None:
    kw = {
        "lr": 1e-2,
        "weight_decay": 0.05,
        "chunk_numel": chunk,
        "fused": fused,
        "cpu_kernel": cpu_kernel,
    }
    kw.update(CONFIGS[config])
    params = make_params(shapes, dtype)
    opt = PrecisionAwareAdamW(params, **kw)
    for i in range(before):
        set_grads(params, i)
        opt.step()
    sd = clone_sd(opt.state_dict())
    resumed_params = clone_params(params)  # the model checkpoint
    resumed = PrecisionAwareAdamW(resumed_params, **kw)
    resumed.load_state_dict(sd)
    assert_same_optimizer(opt, resumed, scales=False)
    for i in range(before, before + after):
        set_grads(params, i)
        set_grads(resumed_params, i)
        opt.step()
        resumed.step()
    assert_same_optimizer(opt, resumed)


def _bad_checkpoints(sd: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    cases: list[tuple[str, dict[str, Any]]] = []

    def variant(match: str, edit: Any) -> None:
        bad = clone_sd(sd)
        edit(bad)
        cases.append((match, bad))

    variant("2 param groups", lambda d: d["param_groups"].append(d["param_groups"][0]))
    variant(
        "param group 0: the checkpoint has 1 params", lambda d: d["param_groups"][0]["params"].pop()
    )
    variant(
        r"param 1: state 'exp_avg' has shape \(2,\)",
        lambda d: d["state"][1].update(exp_avg=torch.zeros(2)),
    )
    variant(
        "param 0: unknown state 'momentum'",
        lambda d: d["state"][0].update(momentum=torch.zeros(4, 3)),
    )
    variant("param 1: missing state 'master_param'", lambda d: d["state"][1].pop("master_param"))
    variant("param 0: missing state 'exp_avg_sq'", lambda d: d["state"][0].pop("exp_avg_sq"))
    variant(
        r"param 1: state 'exp_avg_sq' has non-finite",
        lambda d: d["state"][1]["exp_avg_sq"].__setitem__(0, float("nan")),
    )
    variant(
        r"param 0: state 'master_param' is torch.float32.*remainders",
        lambda d: d["state"][0].update(master_param=torch.zeros(4, 3)),
    )
    variant("param 7: the checkpoint has state for a param", lambda d: d["state"].update({7: {}}))
    variant("invalid step", lambda d: d["param_groups"][0].update(step=-1))
    return cases


def test_rejected_checkpoints_leave_optimizer_untouched() -> None:
    a = torch.nn.Parameter(torch.randn(4, 3).to(BF16))
    b = torch.nn.Parameter(torch.randn(5).to(BF16))
    opt = PrecisionAwareAdamW([a, b], **CONFIGS["remainders"])
    for i in range(2):
        set_grads([a, b], i)
        opt.step()
    sd = clone_sd(opt.state_dict())
    snapshot = copy.deepcopy(opt)
    for match, bad in _bad_checkpoints(sd):
        caller_copy = clone_sd(bad)
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(bad)
        assert_same_optimizer(opt, snapshot)
        for key, entry in bad["state"].items():  # the caller's tensors are untouched
            for name, value in entry.items():
                assert same_bits(value, caller_copy["state"][key][name])
    # An fp32 master checkpoint into a remainder optimizer, and the reverse, are named.
    full = PrecisionAwareAdamW([a, b], master_weights=True)
    with pytest.raises(ValueError, match="int16 parameter remainder"):
        full.load_state_dict(sd)


def test_load_does_not_alias_or_modify_caller_tensors() -> None:
    params, opt = _trained("fp32", FP32, [(6,)], 2)
    sd = clone_sd(opt.state_dict())
    before = clone_sd(sd)
    other = PrecisionAwareAdamW(clone_params(params))
    other.load_state_dict(sd)
    p = other.param_groups[0]["params"][0]
    assert other.state[p]["exp_avg"].data_ptr() != sd["state"][0]["exp_avg"].data_ptr()
    p.grad = torch.ones(6)
    other.step()
    assert same_bits(sd["state"][0]["exp_avg"], before["state"][0]["exp_avg"])


def test_load_accepts_other_float_dtypes_and_failure_mid_write_restores() -> None:
    params, opt = _trained("bf16-moments", FP32, [(6,)], 2)
    sd = clone_sd(opt.state_dict())
    half = clone_sd(sd)
    half["state"][0] = {k: v.double() for k, v in half["state"][0].items()}
    other = PrecisionAwareAdamW(clone_params(params), exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)
    other.load_state_dict(half)
    assert_same_optimizer(opt, other, scales=False)
    snapshot = copy.deepcopy(other)

    def boom(*args: Any) -> None:
        raise RuntimeError("disk on fire")

    other.set_scaled_state = boom  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="disk on fire"):
        other.load_state_dict(sd)
    del other.set_scaled_state
    assert_same_optimizer(other, snapshot)


def test_load_state_dict_hooks_run() -> None:
    _params, opt = _trained("fp8-moments", FP32, [(3,)], 1)
    seen: list[str] = []
    opt.register_load_state_dict_pre_hook(lambda o, sd: seen.append("pre"))
    opt.register_load_state_dict_post_hook(lambda o: seen.append("post"))
    opt.register_state_dict_post_hook(lambda o, sd: seen.append("sd-post"))
    opt.load_state_dict(opt.state_dict())
    assert seen == ["sd-post", "pre", "post"]


@pytest.mark.parametrize(
    ("source", "target"),
    [("fp32", "fp8-moments"), ("fp8-moments", "bf16-moments"), ("fp16-moments", "fp32")],
)
def test_checkpoints_move_between_storage_formats(source: str, target: str) -> None:
    """The portable format is FP32: a checkpoint from one storage config loads into another
    (quantized on the way in) and training continues."""
    params, opt = _trained(source, FP32, [(4, 6)], 3)
    sd = clone_sd(opt.state_dict())
    other_params = clone_params(params)
    other = PrecisionAwareAdamW(other_params, lr=1e-2, weight_decay=0.1, **CONFIGS[target])
    other.load_state_dict(sd)
    p = other_params[0]
    for name in ("exp_avg", "exp_avg_sq"):
        assert other.state[p][name].dtype == other.name_to_dtype_map[name]
        expanded = other.get_unscaled_state(p, name)
        assert torch.allclose(expanded, sd["state"][0][name], rtol=0.07, atol=1e-12)
    assert other.param_groups[0]["step"] == 3
    set_grads(other_params, 3)
    other.step()
    assert other.param_groups[0]["step"] == 4 and torch.isfinite(p).all()


def test_gpu_check_module_logic_runs_on_cpu() -> None:
    """tests/gpu/gpu_precision_adam.py runs its checks on CUDA in the GPU job; the same
    checks on CPU here keep that module honest on machines without a GPU."""
    from tests.gpu.gpu_precision_adam import _checks

    results = _checks("cpu")
    assert len(results) == 16
    assert all(ok for _, ok in results), [label for label, ok in results if not ok]


@pytest.mark.parametrize(
    ("config", "dtype"),
    [(c, d) for c in ("bf16-moments", "fp32-master", "fp32") for d in (FP32, BF16)]
    + [("remainders", BF16)],  # remainders apply to bf16 parameters only
)
def test_small_params_packed_together_equal_one_by_one(config: str, dtype: torch.dtype) -> None:
    """Small parameters are updated many per fused call; the result is bitwise that of the
    one-parameter-at-a-time path. (Results may differ in the last bit between chunk sizes:
    torch's fused kernel rounds its vectorized body and scalar tail differently.) Packing is
    the pure-torch path: the compiled CPU kernel updates such parameters one call each."""
    shapes = [(7,), (3, 5), (64,), (1,), (40, 3)]
    packed_params = make_params(shapes, dtype)
    single_params = clone_params(packed_params)
    kw = {"lr": 1e-2, "weight_decay": 0.1, "cpu_kernel": False, **CONFIGS[config]}
    if config == "remainders":
        kw["exp_avg_sq_dtype"] = BF16  # fp16 would take the two-pass path
    packed = PrecisionAwareAdamW(packed_params, chunk_numel=1024, **kw)
    single = PrecisionAwareAdamW(single_params, chunk_numel=1024, **kw)
    single._pack_small = False
    for i in range(3):
        set_grads(packed_params, i)
        set_grads(single_params, i)
        packed.step()
        single.step()
    assert_same_optimizer(packed, single)


@pytest.mark.parametrize("atomic", [True, False])
def test_atomic_step_undoes_a_step_that_raises_partway(
    atomic: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two params: the second update raises after the first has been applied.
    a, b = make_params([(4,), (3,)], FP32)
    # The sliced torch path (the CPU kernel would update both in one call, without it).
    opt = PrecisionAwareAdamW(
        [a, b], lr=0.1, exp_avg_dtype=FP8, atomic_step=atomic, cpu_kernel=False
    )
    opt._pack_small = False  # one sliced update per param, so the fault lands between them
    for p in (a, b):
        p.grad = torch.ones_like(p)
    opt.step()
    before = copy.deepcopy(opt.state_dict())
    params_before = [a.detach().clone(), b.detach().clone()]
    original = torch_step.update
    calls = []

    def failing_update(*args: Any) -> None:
        calls.append(args[3])  # the param
        if len(calls) == 2:
            raise RuntimeError("device failure")
        original(*args)

    monkeypatch.setattr(torch_step, "update", failing_update)
    with pytest.raises(RuntimeError, match="device failure"):
        opt.step()
    after = opt.state_dict()
    unchanged = torch.equal(a, params_before[0]) and after["param_groups"][0]["step"] == 1
    assert unchanged is atomic
    if atomic:
        assert torch.equal(b, params_before[1])
        for index in (0, 1):
            for name in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(after["state"][index][name], before["state"][index][name])
