"""The CPU kernel's hand-written vector loops for fp16/FP8 moments (the AVX-512 and the AVX2
family): which run where, how another is selected, and that each family this CPU has gives
the portable loops' bits for every format combination, tail length and special value (an
AVX-512 machine checks both families, an AVX2 one the AVX2 family); and that a step's bits do
not depend on the caller's denormal flushing."""

from __future__ import annotations

import platform
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kernel_support import CPU_FAMILIES, needs_kernel, param_and_master, running
from wrapped_optim._formats import codecs
from wrapped_optim.optimizers.kernels import cpu_kernel

FP32, BF16, FP16, FP8 = torch.float32, torch.bfloat16, torch.float16, codecs.FP8_E4M3
MOMENTS = [FP32, BF16, FP16, FP8]
SCALED_PAIRS = [
    (m, v) for m in MOMENTS for v in MOMENTS if codecs.is_scaled(m) or codecs.is_scaled(v)
]
HYPER: dict[str, Any] = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
                         "bias_correction1": 0.19, "bias_correction2": 0.0975}  # fmt: skip

# The CPU flags each hand-written family needs (/proc/cpuinfo's names).
_FLAGS = {
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vbmi", "f16c"),
    "avx2": ("avx2", "f16c"),
}


def cpu_loop_families() -> tuple[str, ...]:
    """The families /proc/cpuinfo says this CPU can run, fastest first."""
    cpuinfo = Path("/proc/cpuinfo")
    flags: list[str] = []
    if platform.machine() == "x86_64" and cpuinfo.exists():
        flags = next(
            (line.split(":", 1)[1].split() for line in cpuinfo.read_text().splitlines()
             if line.startswith("flags")),
            [],
        )  # fmt: skip
    return (*(f for f, need in _FLAGS.items() if all(x in flags for x in need)), "portable")


#: The hand-written families this CPU runs, each checked against the portable loops.
VECTOR_FAMILIES = [f for f in CPU_FAMILIES if f != "portable"]
needs_vector_loops = pytest.mark.skipif(
    not VECTOR_FAMILIES,
    reason="this CPU has neither AVX2 with F16C nor AVX-512: the portable loops are the only "
    "ones (they are checked against torch in test_cpu_kernel.py)",
)
each_family = pytest.mark.parametrize("family", VECTOR_FAMILIES or ["none"])


@pytest.fixture(autouse=True)
def _fastest_loops_afterwards() -> Iterator[None]:
    yield
    if cpu_kernel.available():
        cpu_kernel.use_loops()


def raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.view(width)


def nan_mask(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == FP8:
        return (t & 0x7F) == 0x7F
    return torch.isnan(t)


# The NaN each stored format writes (sign aside): the portable conversions' canonical NaN.
_CANONICAL_NAN = {FP16: 0x7E00, BF16: 0x7FC0, FP8: 0x7F}


def operands(
    n: int, master: str, g_dtype: torch.dtype, m_dtype: torch.dtype, v_dtype: torch.dtype,
    magnitude: float, specials: bool, seed: int,
) -> list[Any]:  # fmt: skip
    """[param, grad, exp_avg, exp_avg_sq, master, m_scale, v_scale] for one tensor: values
    spread over several decades around ``magnitude`` (so scaled moments hold subnormal codes
    too), with NaN, inf and -0 in the gradient when ``specials``."""
    gen = torch.Generator().manual_seed(seed)
    spread = torch.exp2(torch.randint(-12, 1, (n,), generator=gen).float())
    param, master_t, _ = param_and_master(torch.randn(n, generator=gen), master)
    g = torch.randn(n, generator=gen) * magnitude * spread
    if specials:
        g[torch.randint(0, n, (3,), generator=gen)] = torch.tensor(
            [float("nan"), -float("inf"), -0.0]
        )
    m_values = torch.randn(n, generator=gen) * 0.1 * magnitude * spread
    v_values = torch.rand(n, generator=gen) * (magnitude * spread) ** 2

    def stored(values: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
        if codecs.is_scaled(dtype):
            return codecs.encode(values, dtype)
        return values.to(dtype), None

    m, m_scale = stored(m_values, m_dtype)
    v, v_scale = stored(v_values, v_dtype)
    return [param, g.to(g_dtype), m, v, master_t, m_scale, v_scale]


def step_both_ways(
    columns: list[Any], adam_w_mode: bool, family: str, threads: int = 1
) -> list[list[Any]]:
    """The same step with the portable loops and with ``family``'s, on copies."""
    results = []
    for loops in ("portable", family):
        ops = [None if t is None else t.clone() for t in columns]
        param, g, m, v, master, m_scale, v_scale = ops
        with running(loops):
            cpu_kernel.adamw_step_(
                [param], [g], [m], [v], [master], **HYPER, adam_w_mode=adam_w_mode,
                num_threads=threads, exp_avg_scales=[m_scale], exp_avg_sq_scales=[v_scale],
            )  # fmt: skip
        results.append(ops)
    return results


def assert_same_bits(portable: list[Any], vector: list[Any]) -> None:
    """Bitwise equal, NaNs at the same places and, in a stored moment, both the canonical
    NaN. A NaN's sign (and an FP32 NaN's payload) is left out: where both operands of an
    addition are NaN, x86 returns the first one, and which one is first is the compiler's
    choice in either loop (IEEE leaves it open; torch's kernels differ the same way)."""
    names = ["param", "grad", "exp_avg", "exp_avg_sq", "master", "m_scale", "v_scale"]
    for name, a, b in zip(names, portable, vector, strict=True):
        assert (a is None) == (b is None), name
        if a is None:
            continue
        nan = nan_mask(a)
        assert torch.equal(nan, nan_mask(b)), f"{name}: NaNs at other places"
        assert torch.equal(raw(a)[~nan], raw(b)[~nan]), f"{name} differs between the loops"
        canonical = _CANONICAL_NAN.get(a.dtype)
        if canonical is not None and name.startswith("exp_avg"):
            magnitude = 0x7F if a.dtype == FP8 else 0x7FFF
            for t in (a, b):
                assert bool(((raw(t)[nan].int() & magnitude) == canonical).all()), name


@needs_kernel
def test_each_family_runs_where_the_cpu_has_it_and_can_be_selected() -> None:
    """status() lists exactly the families the CPU has what they need for (so the comparisons
    below are not vacuous on such a machine) and runs the fastest; use_loops switches to each
    of them and back, and refuses one the CPU lacks or that does not exist."""
    expected = cpu_loop_families()
    s = cpu_kernel.status()
    assert s.loop_families == expected
    assert s.loops == expected[0]
    for family in reversed(expected):
        assert cpu_kernel.use_loops(family) == family
        assert cpu_kernel.status().loops == family
    assert cpu_kernel.use_loops() == expected[0] == cpu_kernel.status().loops
    for missing in sorted(set(cpu_kernel.LOOP_FAMILIES) - set(expected)):
        with pytest.raises(ValueError, match=f"cannot run the {missing} loops"):
            cpu_kernel.use_loops(missing)
    with pytest.raises(ValueError, match="unknown loop family 'sse9'; choose one of"):
        cpu_kernel.use_loops("sse9")
    assert cpu_kernel.status().loops == expected[0]  # a refusal changes nothing


@needs_kernel
@needs_vector_loops
@each_family
@settings(max_examples=150, deadline=None)
@given(
    n=st.one_of(
        st.integers(1, 200), st.sampled_from([15, 16, 17, 63, 64, 65, 511, 512, 513, 1500])
    ),
    master=st.sampled_from(["none", "fp32", "fp32 copy", "remainder"]),
    g_dtype=st.sampled_from([FP32, BF16]),
    moments=st.sampled_from(SCALED_PAIRS),
    magnitude=st.sampled_from([1e-30, 1e-6, 1.0, 1e4, 1e30]),
    specials=st.booleans(),
    adam_w_mode=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_vector_loops_give_the_portable_loops_bits(
    family: str, n: int, master: str, g_dtype: torch.dtype,
    moments: tuple[torch.dtype, torch.dtype], magnitude: float, specials: bool,
    adam_w_mode: bool, seed: int,
) -> None:  # fmt: skip
    """Every combination with an fp16/FP8 moment, any length (the masked tails of 16 and 64
    lanes), values from FP32 subnormals to overflow, NaN/inf/-0 gradients, both modes:
    params, masters, moments and new scales bitwise those of the portable loops."""
    columns = operands(n, master, g_dtype, *moments, magnitude, specials, seed)
    assert_same_bits(*step_both_ways(columns, adam_w_mode, family))


@needs_kernel
@needs_vector_loops
@each_family
@pytest.mark.parametrize("dtype", [FP16, FP8])
@pytest.mark.parametrize("scale", [1.0, 0.37, 3e-7, 2.5e5])
def test_every_stored_code_decodes_and_encodes_as_in_the_portable_loops(
    family: str, dtype: torch.dtype, scale: float
) -> None:
    """Every fp16 / FP8 bit pattern (NaNs, infinities, subnormals, both zeros) as both stored
    moments, under scales that push the new values over and under the range, with gradients
    at every code's value: the vector loops' bits are the portable loops'."""
    if dtype == FP16:
        codes = torch.arange(-(2**15), 2**15).to(torch.int16).view(FP16)
    else:
        codes = torch.arange(256).to(torch.uint8)
    n = codes.numel() * 2 + 37
    stored = codes.repeat(3)[:n].clone()
    decoded = (stored.view(torch.float8_e4m3fn) if dtype == FP8 else stored).float()
    g = torch.nan_to_num(decoded.flip(0), nan=1.0, posinf=2.0, neginf=-2.0) * scale
    for adam_w_mode in (True, False):
        columns = [torch.randn(n), g, stored.clone(), stored.roll(1).clone(), None,
                   torch.tensor([scale]), torch.tensor([1.0 / scale])]  # fmt: skip
        assert_same_bits(*step_both_ways(columns, adam_w_mode, family))


@needs_kernel
@needs_vector_loops
@each_family
def test_threads_split_the_vector_loops_without_changing_bits(family: str) -> None:
    """Several OpenMP threads over a tensor longer than a block, with an odd tail."""
    columns = operands(3 * 2**16 + 77, "remainder", BF16, FP16, FP8, 1e-3, True, seed=5)
    portable, vector = step_both_ways(columns, True, family, threads=2)
    assert_same_bits(portable, vector)
    _, one_thread = step_both_ways(columns, True, family, threads=1)
    assert_same_bits(one_thread, vector)


@needs_kernel
@pytest.mark.parametrize("family", CPU_FAMILIES)
@pytest.mark.parametrize("threads", [1, 2])
def test_caller_denormal_flushing_changes_no_bits(threads: int, family: str) -> None:
    """torch.set_flush_denormal(True) sets the calling thread's flush-to-zero and
    denormals-are-zero flags; the kernel keeps denormals whatever they are (every subnormal
    operand and intermediate is exact), and restores the caller's flags afterwards. (The
    new scales are torch's arithmetic, which does flush: they are kept normal here.)"""
    n = 2**17 + 5
    columns = operands(n, "none", FP32, FP32, FP8, 1e-3, False, seed=9)
    columns[1] = columns[1] * 1e-36  # gradients whose products are subnormal
    columns[2] = torch.full((n,), 1e-39) * torch.randn(n)  # FP32 moments: subnormal
    results = []
    try:
        for flush in (False, True):
            if not torch.set_flush_denormal(flush):
                pytest.skip("this CPU cannot flush denormals: nothing to check")
            ops = [None if t is None else t.clone() for t in columns]
            param, g, m, v, master, m_scale, v_scale = ops
            with running(family):
                cpu_kernel.adamw_step_(
                    [param], [g], [m], [v], [master], **HYPER, num_threads=threads,
                    exp_avg_scales=[m_scale], exp_avg_sq_scales=[v_scale],
                )  # fmt: skip
            # The caller's setting is back: torch flushes a subnormal product again.
            tiny = torch.tensor([1e-39]) * torch.tensor([1.0])
            assert (float(tiny) == 0.0) is flush
            results.append(ops)
    finally:
        torch.set_flush_denormal(False)
    assert_same_bits(*results)
    assert bool((raw(results[0][2]) != raw(columns[2])).any())  # the step did write m


@needs_kernel
def test_one_call_for_many_tensors_gives_each_tensors_own_bits() -> None:
    """The scales and multipliers of all scaled moments in a call are computed together (one
    torch call per storage dtype): the bits are those of one call per tensor."""
    pairs = [(FP16, FP8), (FP8, FP8), (FP32, FP16), (BF16, FP8), (FP8, BF16)]
    columns = [
        operands(97 + 31 * i, "none", FP32, m, v, (1e-3, 1.0, 1e3)[i % 3], i == 2, seed=i)
        for i, (m, v) in enumerate(pairs)
    ]
    together = [[None if t is None else t.clone() for t in c] for c in columns]
    param, g, m, v, master, m_scale, v_scale = (list(x) for x in zip(*together, strict=True))
    cpu_kernel.adamw_step_(
        param, g, m, v, master, **HYPER, num_threads=1, exp_avg_scales=m_scale,
        exp_avg_sq_scales=v_scale,
    )  # fmt: skip
    for i, column in enumerate(columns):
        alone = [None if t is None else t.clone() for t in column]
        p1, g1, m1, v1, master1, ms1, vs1 = alone
        cpu_kernel.adamw_step_(
            [p1], [g1], [m1], [v1], [master1], **HYPER, num_threads=1,
            exp_avg_scales=[ms1], exp_avg_sq_scales=[vs1],
        )  # fmt: skip
        assert_same_bits(alone, [t[i] for t in (param, g, m, v, master, m_scale, v_scale)])


@needs_kernel
@needs_vector_loops
@each_family
def test_a_nan_code_gives_the_same_scale_bits_in_every_family(family: str) -> None:
    """An FP8 NaN code (0x7F, 0xFF) decodes to the portable loops' quiet NaN, so the amax and
    the new scale, NaN payload included, are bit for bit the portable loops' (the comparisons
    above leave NaN payloads out)."""
    n = 256 * 3 + 5
    codes = torch.arange(n).remainder(256).to(torch.uint8)
    columns = [torch.randn(n), torch.randn(n) * 1e-3, codes.clone(), codes.flip(0).clone(),
               None, torch.tensor([0.01]), torch.tensor([1e-4])]  # fmt: skip
    portable, vector = step_both_ways(columns, True, family)
    for index in (5, 6):  # the new scales
        assert bool(torch.isnan(portable[index]).all())
        assert torch.equal(raw(portable[index]), raw(vector[index]))
