"""The compiled one-pass CPU AdamW kernel: bitwise against the same update in single torch
ops, thread-split invariance, its build and cache, its errors, and PrecisionAwareAdamW's use
of it (and fallback without it)."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.kernel_support import (
    CPU_FAMILIES,
    block_kernel_step,
    block_operands,
    needs_kernel,
    param_and_master,
    running,
    same_block_results,
)
from wrapped_optim._formats import blocks, codecs, remainders
from wrapped_optim.optimizers import PrecisionAwareAdamW
from wrapped_optim.optimizers.kernels import _build as _kernel_build
from wrapped_optim.optimizers.kernels import cpu_kernel

BF16, FP32 = torch.bfloat16, torch.float32


@pytest.fixture
def fresh_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty cache directory and a kernel that is built (or refused) again on first use;
    afterwards the session's kernel is reloaded from its own cache."""
    monkeypatch.setenv("WRAPPED_OPTIM_KERNEL_CACHE", str(tmp_path))
    # as in a source tree without the library the package build makes
    monkeypatch.setattr(cpu_kernel, "_packaged_library", lambda: tmp_path / "not-built.so")
    cpu_kernel._reset_for_tests()
    yield tmp_path
    monkeypatch.undo()
    cpu_kernel._reset_for_tests()


def f32(x: float) -> float:
    """x rounded to the nearest float32, as the kernel receives it."""
    return float(torch.tensor(x, dtype=FP32))


def reference_step(
    p32: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    wd: float,
    bc1: float,
    bc2: float,
    adam_w_mode: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TE's update in FP32, one correctly rounded op at a time (no fused multiply-add), with
    every hyper-parameter rounded to float32 as the kernel's are. The square root is taken
    in float64 and rounded once, which is the correctly rounded FP32 root: torch's own CPU
    ``sqrt`` may be off by one ulp (it goes through a vector math library)."""
    g = g.float()
    m = m.float()
    v = v.float()
    lr, eps, wd = f32(lr), f32(eps), f32(wd)
    b1, omb1, b2, omb2 = f32(beta1), f32(1.0 - beta1), f32(beta2), f32(1.0 - beta2)
    if not adam_w_mode:
        g = g + p32 * wd
    m = m * b1 + g * omb1
    v = v * b2 + (g * omb2) * g
    denom = torch.sqrt((v * f32(1.0 / bc2)).double()).float() + eps
    update = (m * f32(1.0 / bc1)) / denom
    if adam_w_mode:
        update = update + p32 * wd
    return p32 - update * lr, m, v


# ----------------------------------------------------------------------------- the kernel


MASTERS = ["none", "fp32", "remainder", "fp32 copy"]
#: (exp_avg, exp_avg_sq) dtypes: the fast loop takes equal unscaled ones (AdamW mode), the
#: split loop scaled (fp16, FP8 as uint8) and mixed ones.
MOMENT_PAIRS = [(FP32, FP32), (BF16, BF16), (BF16, FP32), (torch.float16, torch.uint8),
                (torch.uint8, BF16)]  # fmt: skip


@needs_kernel
@given(
    n=st.integers(1, 300),
    master=st.sampled_from(MASTERS),
    grad_dtype=st.sampled_from([FP32, BF16]),
    m_dtype=st.sampled_from([FP32, BF16]),
    v_dtype=st.sampled_from([FP32, BF16]),
    adam_w_mode=st.booleans(),
    wd=st.sampled_from([0.0, 0.01, 0.3]),
    step=st.integers(1, 1000),
    lr=st.floats(1e-6, 1.0),
    seed=st.integers(0, 2**16),
)
def test_kernel_equals_single_torch_ops_bitwise(
    n: int,
    master: str,
    grad_dtype: torch.dtype,
    m_dtype: torch.dtype,
    v_dtype: torch.dtype,
    adam_w_mode: bool,
    wd: float,
    step: int,
    lr: float,
    seed: int,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(n, generator=gen) * 3
    g = torch.randn(n, generator=gen).to(grad_dtype)
    m = (torch.randn(n, generator=gen) * 0.1).to(m_dtype)
    v = (torch.rand(n, generator=gen) * 0.01).to(v_dtype)
    beta1, beta2, eps = 0.9, 0.95, 1e-8
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    param, master_t, p32 = param_and_master(values, master)
    want_p, want_m, want_v = reference_step(
        p32.clone(), g, m, v, lr=lr, beta1=beta1, beta2=beta2, eps=eps, wd=wd,
        bc1=bc1, bc2=bc2, adam_w_mode=adam_w_mode,
    )  # fmt: skip
    cpu_kernel.adamw_step_(
        [param], [g], [m], [v], [master_t], lr=lr, betas=(beta1, beta2), eps=eps,
        weight_decay=wd, bias_correction1=bc1, bias_correction2=bc2, adam_w_mode=adam_w_mode,
    )  # fmt: skip
    assert torch.equal(m, want_m.to(m_dtype))
    assert torch.equal(v, want_v.to(v_dtype))
    if master == "none":
        assert torch.equal(param, want_p)
    elif master == "fp32":
        assert master_t is not None
        assert torch.equal(master_t, want_p)
        assert torch.equal(param, want_p.to(BF16))
    elif master == "fp32 copy":
        assert master_t is not None
        assert torch.equal(master_t, want_p) and torch.equal(param, want_p)
    else:
        assert master_t is not None
        assert torch.equal(remainders.join_master(param, master_t), want_p)


@needs_kernel
@given(
    moments=st.sampled_from(MOMENT_PAIRS),
    grad_dtype=st.sampled_from([FP32, BF16]),
    adam_w_mode=st.booleans(),
    threads=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_fp32_copy_master_is_the_in_place_update_of_the_same_values(
    moments: tuple[torch.dtype, torch.dtype],
    grad_dtype: torch.dtype,
    adam_w_mode: bool,
    threads: int,
    seed: int,
) -> None:
    """An FP32 param with an FP32 master (a host copy and its param): master and param both
    get, bit for bit, what the in-place update of an FP32 param with no master gives, through
    the fast loop (AdamW mode, equal unscaled moments) and the split loop (scaled or mixed
    moments, L2 mode), split between threads."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [1, 700, 1500]
    values = [torch.randn(n, generator=gen) * 3 for n in sizes]
    grads = [(torch.randn(n, generator=gen) * 0.1).to(grad_dtype) for n in sizes]
    first = [torch.randn(n, generator=gen) * 0.1 for n in sizes]
    second = [torch.rand(n, generator=gen) * 0.01 for n in sizes]
    hyper: dict[str, Any] = {"lr": 3e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
                             "bias_correction1": 0.19, "bias_correction2": 0.0975,
                             "adam_w_mode": adam_w_mode, "num_threads": threads}  # fmt: skip
    results = []
    for master in ("none", "fp32 copy"):
        columns: list[list[Any]] = [[], [], [], [], [], [], []]
        for x, g, m_values, v_values in zip(values, grads, first, second, strict=True):
            param, master_t, _ = param_and_master(x, master)
            m, m_scale = stored_moment(m_values.clone(), moments[0])  # FP32: not a copy
            v, v_scale = stored_moment(v_values.clone(), moments[1])
            for column, value in zip(columns, (param, g, m, v, master_t, m_scale, v_scale),
                                     strict=True):  # fmt: skip
                column.append(value)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cpu_kernel, "_MIN_ELEMENTS_PER_THREAD", 1)
            mp.setattr(cpu_kernel, "_BLOCK_ELEMENTS", 64)
            for _ in range(2):
                cpu_kernel.adamw_step_(
                    *columns[:5], **hyper, exp_avg_scales=columns[5],
                    exp_avg_sq_scales=columns[6],
                )  # fmt: skip
        results.append(columns)
    alone, with_copy = results
    for x, param in zip(values, with_copy[0], strict=True):
        assert not torch.equal(param, x)  # it did update
    for want, param, master_t in zip(alone[0], with_copy[0], with_copy[4], strict=True):
        assert same_bits(master_t, want) and same_bits(param, want)
    for column in (2, 3, 5, 6):  # moments and scales
        for want, got in zip(alone[column], with_copy[column], strict=True):
            assert (want is None and got is None) or same_bits(got, want)


@needs_kernel
def test_written_tensors_get_new_versions_as_with_torchs_in_place_ops() -> None:
    """Autograd's version counters must see writes made through raw pointers."""
    columns = random_operands([10, 20], [("none", FP32, BF16, FP32), ("fp32", BF16, FP32, BF16)], 0)
    versions = [[t._version if t is not None else None for t in column] for column in columns]
    cpu_kernel.adamw_step_(*columns, lr=0.1, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    for name, column, before in zip(("param", "grad", "m", "v", "master"), columns, versions,
                                    strict=True):  # fmt: skip
        for t, version in zip(column, before, strict=True):
            if t is None:
                continue
            assert (t._version > version) == (name != "grad"), name


@needs_kernel
def test_bf16_encoding_is_torchs_round_to_nearest_even() -> None:
    """beta1 = 0, lr = 0: the stored first moment is ``0 * 0 + 1 * g`` encoded by the kernel."""
    specials = torch.tensor(
        [0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38, 3.4028235e38, -3.4028235e38, 1.0 + 2**-8,
         1.0 + 3 * 2**-8, 65504.0, float("inf"), float("-inf"), float("nan")]
    )  # fmt: skip
    g = torch.cat([specials, torch.randn(4096) * 1e3, torch.randn(4096) * 1e-30])
    bits = torch.randint(0, 2**31 - 1, (4096,), dtype=torch.int32).view(FP32)  # any finite
    g = torch.cat([g, bits[torch.isfinite(bits)]])
    m = torch.zeros(g.numel(), dtype=BF16)
    v = torch.zeros(g.numel())
    p = torch.zeros(g.numel())
    cpu_kernel.adamw_step_([p], [g], [m], [v], lr=0.0, betas=(0.0, 0.5), eps=1.0, weight_decay=0)
    want = (torch.zeros_like(g) * 0.0 + g * 1.0).to(BF16)  # +0 + -0 is +0: math, not encoding
    nan = torch.isnan(g)
    assert torch.isnan(m[nan]).all()
    assert torch.equal(m[~nan].view(torch.int16), want[~nan].view(torch.int16))


def random_operands(
    sizes: list[int], kinds: list[tuple[str, torch.dtype, torch.dtype, torch.dtype]], seed: int
) -> list[list[Any]]:
    """[params, grads, exp_avgs, exp_avg_sqs, masters] for tensors of the given sizes and
    (master, grad, exp_avg, exp_avg_sq) storage kinds."""
    gen = torch.Generator().manual_seed(seed)
    columns: list[list[Any]] = [[], [], [], [], []]
    for n, (master, g_dtype, m_dtype, v_dtype) in zip(sizes, kinds, strict=True):
        values = torch.randn(n, generator=gen)
        param, master_t, _ = param_and_master(values, master)
        g = torch.randn(n, generator=gen).to(g_dtype)
        m = (torch.randn(n, generator=gen) * 0.1).to(m_dtype)
        v = (torch.rand(n, generator=gen) * 0.01).to(v_dtype)
        for column, value in zip(columns, (param, g, m, v, master_t), strict=True):
            column.append(value)
    return columns


KINDS = st.tuples(
    st.sampled_from(MASTERS),
    st.sampled_from([FP32, BF16]),
    st.sampled_from([FP32, BF16]),
    st.sampled_from([FP32, BF16]),
)


@needs_kernel
@given(
    tensors=st.lists(st.tuples(st.integers(0, 700), KINDS), min_size=1, max_size=5),
    threads=st.integers(2, 8),
    seed=st.integers(0, 2**16),
)
def test_thread_split_changes_nothing(
    tensors: list[tuple[int, tuple[str, torch.dtype, torch.dtype, torch.dtype]]],
    threads: int,
    seed: int,
) -> None:
    """Blocks cut across tensor borders at any point (blocks and the per-thread minimum are
    made small so that small tensors are split): every element is updated once, as by one
    thread."""
    sizes = [n for n, _ in tensors]
    kinds = [k for _, k in tensors]
    results = []
    for count in (1, threads):
        columns = random_operands(sizes, kinds, seed)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cpu_kernel, "_MIN_ELEMENTS_PER_THREAD", 1)
            mp.setattr(cpu_kernel, "_BLOCK_ELEMENTS", 64)
            cpu_kernel.adamw_step_(
                *columns, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
                bias_correction1=0.1, bias_correction2=0.001, num_threads=count,
            )  # fmt: skip
        results.append(columns)
    for one, many in zip(*results, strict=True):
        for a, b in zip(one, many, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)
    before = random_operands(sizes, kinds, seed)[2]
    for m_after, m_before in zip(results[0][2], before, strict=True):
        assert m_after.numel() == 0 or not torch.equal(m_after, m_before)  # it did update


def _step_in_child(conn: Any) -> None:
    cpu_kernel._MIN_ELEMENTS_PER_THREAD = 1
    cpu_kernel._BLOCK_ELEMENTS = 64
    columns = random_operands([500, 300], [("none", FP32, BF16, BF16)] * 2, seed=1)
    cpu_kernel.adamw_step_(
        *columns, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, num_threads=4
    )
    conn.send([t.tolist() for t in columns[0]])  # plain floats: no shared-memory handoff


@needs_kernel
def test_threads_after_fork_and_from_several_python_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """OpenMP's workers do not survive fork(): a child forked after the parent used them runs
    the kernel on one thread instead of hanging. Python threads that call at once each get
    every element updated once."""
    import multiprocessing
    import threading

    monkeypatch.setattr(cpu_kernel, "_MIN_ELEMENTS_PER_THREAD", 1)
    monkeypatch.setattr(cpu_kernel, "_BLOCK_ELEMENTS", 64)
    hyper: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
    kinds = [("none", FP32, BF16, BF16)] * 2
    expected = random_operands([500, 300], kinds, seed=1)
    cpu_kernel.adamw_step_(*expected, **hyper, num_threads=1)
    warm = random_operands([500, 300], kinds, seed=1)
    cpu_kernel.adamw_step_(*warm, **hyper, num_threads=4)  # the parent's workers now exist

    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=_step_in_child, args=(child_end,))
    child.start()
    assert parent_end.poll(60), "the forked child hung in the kernel"
    got = parent_end.recv()
    child.join(60)
    assert child.exitcode == 0
    assert all(torch.equal(torch.tensor(a), b) for a, b in zip(got, expected[0], strict=True))

    jobs = [random_operands([500, 300], kinds, seed=1) for _ in range(6)]
    threads = [
        threading.Thread(
            target=cpu_kernel.adamw_step_, args=job, kwargs={**hyper, "num_threads": 3}
        )
        for job in jobs
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for job in jobs:
        for column, want in zip(job, expected, strict=True):
            for a, b in zip(column, want, strict=True):
                assert (a is None and b is None) or torch.equal(a, b)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The kernel built with -DWO_NO_CLONES: the baseline code alone, no vector clones."""
    compiler = _kernel_build.find_compiler()
    assert compiler is not None
    directory = tmp_path_factory.mktemp("baseline")
    library = directory / "baseline.so"
    _kernel_build.compile_library(compiler, library, ["-DWO_NO_CLONES"])
    return library


@needs_kernel
def test_baseline_build_gives_the_bits_of_the_vectorized_clones(baseline: Path) -> None:
    """The library picks an AVX-512, AVX2 or baseline clone at load time; the baseline alone
    (built with -DWO_NO_CLONES) must give the same bits as the clone this machine runs."""
    kinds = [(m, g, a, v) for m in MASTERS for g in (FP32, BF16)
             for a in (FP32, BF16) for v in (FP32, BF16)]  # fmt: skip
    sizes = [1000 + 37 * i for i in range(len(kinds))]
    hyper: dict[str, Any] = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
                             "bias_correction1": 0.19, "bias_correction2": 0.0975}  # fmt: skip
    results = []
    for lib in (None, cpu_kernel._open(baseline)):
        columns = random_operands(sizes, kinds, seed=7)
        with pytest.MonkeyPatch.context() as mp:
            if lib is not None:
                mp.setattr(cpu_kernel, "_loaded", (cpu_kernel.status(), lib))
            for mode in (True, False):
                cpu_kernel.adamw_step_(*columns, **hyper, adam_w_mode=mode, num_threads=1)
        results.append(columns)
    for clone, base in zip(*results, strict=True):
        for a, b in zip(clone, base, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)


@needs_kernel
def test_baseline_build_gives_the_bits_of_the_clones_for_scaled_and_mixed_moments(
    baseline: Path,
) -> None:
    """The split loop (fp16/FP8 moments, mixed moment formats, L2 mode): every combination of
    master, gradient and moment formats, both modes, gradients from subnormal to huge, one NaN
    or inf in some tensors; the baseline build gives the bits (and the new scales) of the
    clone this machine runs."""
    kinds = [(m, g, a, v) for m in MASTERS for g in (FP32, BF16)
             for a in MOMENT_DTYPES for v in MOMENT_DTYPES]  # fmt: skip
    hyper: dict[str, Any] = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
                             "bias_correction1": 0.19, "bias_correction2": 0.0975}  # fmt: skip

    def operands() -> tuple[list[list[Any]], list[Any], list[Any]]:
        gen = torch.Generator().manual_seed(11)
        columns: list[list[Any]] = [[], [], [], [], []]
        scales: tuple[list[Any], list[Any]] = ([], [])
        for i, (master, g_dtype, m_dtype, v_dtype) in enumerate(kinds):
            n = 700 + 37 * i
            magnitude = (1e-30, 1e-6, 1.0, 1e4)[i % 4]
            param, master_t, _ = param_and_master(torch.randn(n, generator=gen), master)
            g = torch.randn(n, generator=gen) * magnitude
            if i % 7 == 3:
                g[i % n] = (float("nan"), float("inf"))[i % 2]
            m, m_scale = stored_moment(torch.randn(n, generator=gen) * 0.1 * magnitude, m_dtype)
            v, v_scale = stored_moment(torch.rand(n, generator=gen) * magnitude**2, v_dtype)
            for column, value in zip(columns, (param, g.to(g_dtype), m, v, master_t), strict=True):
                column.append(value)
            scales[0].append(m_scale)
            scales[1].append(v_scale)
        return columns, *scales

    results = []
    for lib in (None, cpu_kernel._open(baseline)):
        columns, m_scales, v_scales = operands()
        with pytest.MonkeyPatch.context() as mp:
            if lib is not None:
                mp.setattr(cpu_kernel, "_loaded", (cpu_kernel.status(), lib))
            for mode in (True, False):
                cpu_kernel.adamw_step_(
                    *columns, **hyper, adam_w_mode=mode, num_threads=1,
                    exp_avg_scales=m_scales, exp_avg_sq_scales=v_scales,
                )  # fmt: skip
        results.append([*columns, m_scales, v_scales])
    before = operands()[0]
    for clone, base in zip(*results, strict=True):
        for a, b in zip(clone, base, strict=True):
            assert (a is None and b is None) or same_bits(a, b)
    assert not any(same_bits(a, b) for a, b in zip(results[0][2], before[2], strict=True))


@needs_kernel
def test_baseline_build_gives_the_bits_of_the_clones_for_block_moments(baseline: Path) -> None:
    """The block-scaled moments' loop is the file's portable C in every clone (AVX-512, AVX2,
    baseline: GCC vectorizes each for its target): the baseline build alone gives the bits of
    the clone this machine runs, for every block format, master kind, gradient dtype, mode
    and tail."""
    results = []
    for lib in (None, cpu_kernel._open(baseline)):
        runs = []
        with pytest.MonkeyPatch.context() as mp:
            if lib is not None:
                mp.setattr(cpu_kernel, "_loaded", (cpu_kernel.status(), lib))
            for name in blocks.BLOCK_FORMATS:
                fmt = blocks.BlockFormat(name, 64)
                ops = block_operands(fmt, seed=13)
                for mode in (True, False):
                    block_kernel_step(ops, fmt, mode, threads=1)
                runs.append(ops)
        results.append(runs)
    for clone, base in zip(*results, strict=True):
        same_block_results(clone, base)


@needs_kernel
def test_openmp_build_runs_on_the_runtime_torch_loaded() -> None:
    """With GCC the library is built with OpenMP, and the process then holds one OpenMP
    runtime: the kernel's threads are torch's intra-op workers, not a second pool."""
    import subprocess
    import sys

    compiler = _kernel_build.find_compiler()
    assert compiler is not None
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    if "Free Software Foundation" not in version:  # GCC's banner
        pytest.skip(f"not GCC ({version.splitlines()[0]}): OpenMP is optional there")
    assert cpu_kernel.status().parallel
    maps = Path("/proc/self/maps")
    if not maps.exists() or sys.platform != "linux":
        return
    runtimes = {line.split()[-1] for line in maps.read_text().splitlines() if "libgomp" in line}
    assert runtimes, "the OpenMP build loaded no libgomp"
    assert len(runtimes) == 1, runtimes


@needs_kernel
def test_operands_are_checked_before_anything_is_written() -> None:
    p = torch.ones(4)
    g, m, v = torch.ones(4), torch.zeros(4, dtype=BF16), torch.zeros(4, dtype=BF16)
    hyper: dict[str, Any] = {"lr": 0.1, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.0}
    good = ([p.clone()], [g], [m.clone()], [v.clone()])  # a valid first entry: still unwritten
    cases = [
        ((p, g[:3], m, v), {}, r"grads\[1\] has 3 elements, its parameter has 4"),
        ((p, g, m.float().to(torch.float16), v), {},
         r"exp_avgs\[1\] is torch.float16 \(scaled\): its per-tensor scale is missing"),
        ((p, g, m.float().to(torch.float64), v), {}, r"exp_avgs\[1\] has dtype torch.float64"),
        ((p, g, m, v), {"exp_avg_scales": [None, torch.ones(1)]},
         r"exp_avgs\[1\] is torch.bfloat16, which has no scale; pass None"),
        ((p, g, m, v.to(torch.uint8)), {"exp_avg_sq_scales": [None, torch.ones(2)]},
         r"the scale of exp_avg_sqs\[1\] must be a one-element float32 CPU tensor"),
        ((torch.ones(4, 2).t(), torch.ones(2, 4), torch.zeros(8), torch.zeros(8)), {},
         r"params\[1\] must be contiguous"),
        ((p, g, m, torch.zeros(4, dtype=BF16, device="meta")), {},
         r"exp_avg_sqs\[1\] must be a CPU tensor, got one on meta"),
        ((p, g, m, v, torch.ones(4, dtype=torch.int16)), {},
         r"masters\[1\] has dtype torch.int16; the kernel takes torch.float32$"),
        ((p.to(torch.float16), g, m, v, torch.ones(4)), {},
         r"params\[1\] has dtype torch.float16; the kernel takes torch.bfloat16, torch.float32"),
        ((p.to(BF16), g, m, v, torch.ones(4, dtype=torch.int32)), {}, r"masters\[1\] has"),
        ((p, g, m, v, p), {}, r"masters\[1\] is the storage of params\[1\]: pass None"),
        ((p, g, m, v), {"num_threads": 0}, "num_threads must be at least 1"),
    ]  # fmt: skip
    for args, extra, match in cases:
        columns = [[*column, arg] for column, arg in zip(good, args, strict=False)]
        masters = [None, args[4]] if len(args) == 5 else None
        before = [t.clone() for column in columns for t in column if t.device.type == "cpu"]
        with pytest.raises(ValueError, match=match):
            cpu_kernel.adamw_step_(*columns, masters, **hyper, **extra)
        after = [t for column in columns for t in column if t.device.type == "cpu"]
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    with pytest.raises(ValueError, match="one entry per parameter; got 1, 1, 1, 0, 1, 1 and 1"):
        cpu_kernel.adamw_step_([p], [g], [m], [], **hyper)


# ----------------------------------------------------------------------------- build and cache


@needs_kernel
def test_builds_once_into_its_cache(fresh_kernel: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = cpu_kernel.status()
    assert first.available and first.library is not None
    assert first.library.parent == fresh_kernel
    assert [f.name for f in fresh_kernel.iterdir()] == [first.library.name]  # no temporaries
    cpu_kernel._reset_for_tests()

    def no_compiler(*args: Any) -> None:
        raise AssertionError("rebuilt although the cache holds the library")

    monkeypatch.setattr(cpu_kernel, "_compile", no_compiler)
    assert cpu_kernel.status() == first


def test_disabled_by_environment(fresh_kernel: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WRAPPED_OPTIM_CPU_KERNEL", "0")
    s = cpu_kernel.status()
    assert not s.available and s.library is None
    assert s.reason == "disabled by WRAPPED_OPTIM_CPU_KERNEL=0"
    with pytest.raises(RuntimeError, match="unavailable: disabled by"):
        cpu_kernel.adamw_step_(
            [torch.ones(1)], [torch.ones(1)], [torch.ones(1)], [torch.ones(1)],
            lr=0.1, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="cpu_kernel=True, but the CPU AdamW kernel"):
        PrecisionAwareAdamW([torch.nn.Parameter(torch.ones(1))], cpu_kernel=True)
    assert list(fresh_kernel.iterdir()) == []


@needs_kernel
def test_loop_family_chosen_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """WRAPPED_OPTIM_CPU_LOOPS, read when the library is loaded (the cached build is reused):
    each family this CPU has runs and status() says so; ``auto`` is the fastest; a family it
    lacks, or an unknown name, leaves the kernel unavailable with the reason and the fix."""
    missing = [f for f in cpu_kernel.LOOP_FAMILIES if f not in CPU_FAMILIES]
    before = cpu_kernel.status().loops  # the fastest, or the family the run was started with
    try:
        for family in (*CPU_FAMILIES, "auto"):
            monkeypatch.setenv("WRAPPED_OPTIM_CPU_LOOPS", f" {family.upper()} ")
            cpu_kernel._reset_for_tests()
            want = CPU_FAMILIES[0] if family == "auto" else family
            assert cpu_kernel.status().loops == want
        for bad in (*missing, "sse9"):
            monkeypatch.setenv("WRAPPED_OPTIM_CPU_LOOPS", bad)
            cpu_kernel._reset_for_tests()
            s = cpu_kernel.status()
            assert not s.available and s.reason is not None
            assert s.reason.startswith(f"RuntimeError: WRAPPED_OPTIM_CPU_LOOPS={bad}: ")
            assert "unset it or set it to auto or one of " + ", ".join(CPU_FAMILIES) in s.reason
    finally:
        monkeypatch.undo()
        cpu_kernel._reset_for_tests()
    assert cpu_kernel.status().loops == before


def test_without_a_compiler(fresh_kernel: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(fresh_kernel))
    monkeypatch.delenv("CC", raising=False)
    s = cpu_kernel.status()
    assert not s.available
    assert s.reason == "no C compiler found (install gcc or clang, or set CC to one)"


def test_a_failing_compiler_leaves_no_files(
    fresh_kernel: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path_factory.mktemp("bin")
    fake = bin_dir / "broken-cc"
    fake.write_text("#!/bin/sh\necho 'broken-cc 1.0'\n[ \"$1\" = --version ] && exit 0\n"
                    "echo 'error: no' >&2\nexit 1\n")  # fmt: skip
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(fake))
    s = cpu_kernel.status()
    assert not s.available
    assert s.reason is not None and "failed to build _adamw_cpu.c" in s.reason
    assert "error: no" in s.reason
    assert list(fresh_kernel.iterdir()) == []


@needs_kernel
@pytest.mark.slow
def test_a_compiler_without_the_vector_intrinsics_gets_the_portable_loops(
    fresh_kernel: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compiler that cannot build the hand-written vector loops still gets a kernel: the
    build is retried without them (-DWO_NO_VECTOR_LOOPS), and its steps give the same bits."""
    real = _kernel_build.find_compiler()
    assert real is not None
    bin_dir = tmp_path_factory.mktemp("bin")
    fake = bin_dir / "no-vector-cc"
    fake.write_text(
        "#!/bin/sh\ncase \" $* \" in *' -DWO_NO_VECTOR_LOOPS '*|*' --version '*) "
        f'exec {real} "$@";; esac\necho "error: no vector intrinsics here" >&2\nexit 1\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    columns = random_operands([3000], [("none", FP32, torch.float16, codecs.FP8_E4M3)], seed=3)
    scales = [[torch.tensor([0.01])], [torch.tensor([1e-4])]]
    want = [[None if t is None else t.clone() for t in column] for column in columns]
    want_scales = [[s.clone() for s in column] for column in scales]
    hyper: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
    cpu_kernel.adamw_step_(*want, **hyper, exp_avg_scales=want_scales[0],
                           exp_avg_sq_scales=want_scales[1])  # fmt: skip
    monkeypatch.setenv("CC", str(fake))
    # A run that forces a vector family (WRAPPED_OPTIM_CPU_LOOPS) would ask this build for one.
    monkeypatch.delenv("WRAPPED_OPTIM_CPU_LOOPS", raising=False)
    cpu_kernel._reset_for_tests()
    s = cpu_kernel.status()
    assert s.available and s.loops == "portable" and s.loop_families == ("portable",)
    assert s.library is not None and s.library.parent == fresh_kernel
    cpu_kernel.adamw_step_(*columns, **hyper, exp_avg_scales=scales[0],
                           exp_avg_sq_scales=scales[1])  # fmt: skip
    for got, expected in zip([*columns, *scales], [*want, *want_scales], strict=True):
        for a, b in zip(got, expected, strict=True):
            assert (a is None and b is None) or same_bits(a, b)


def test_unwritable_explicit_cache_is_reported(
    fresh_kernel: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = fresh_kernel / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("WRAPPED_OPTIM_KERNEL_CACHE", str(blocker / "cache"))
    s = cpu_kernel.status()
    if _kernel_build.find_compiler() is None:
        assert s.reason == "no C compiler found (install gcc or clang, or set CC to one)"
    else:
        assert s.reason is not None
        assert "no private writable kernel cache directory (set" in s.reason


def test_source_ships_with_the_package() -> None:
    """The C file is package data: a wheel without it would silently run the slow path."""
    import tomllib

    root = Path(__file__).resolve().parents[3]
    data = tomllib.loads((root / "pyproject.toml").read_text())
    patterns = data["tool"]["setuptools"]["package-data"]["wrapped_optim"]
    sources = _kernel_build.sources()
    assert _kernel_build.MAIN_SOURCE in sources
    for path in sources:
        source = path.relative_to(root / "wrapped_optim")
        assert any(source.match(pattern) for pattern in patterns), patterns
        assert path.is_file()
    # every file the C sources include from their own directory is one of them
    included = {line.split('"')[1] for path in sources for line in path.read_text().splitlines()
                if line.startswith("#include \"")}  # fmt: skip
    assert included == {path.name for path in sources if path.suffix == ".h"}


# ----------------------------------------------------------------------------- in the optimizer


CONFIGS: dict[str, tuple[torch.dtype, dict[str, Any]]] = {
    "fp32 params, bf16 moments": (FP32, {"exp_avg_dtype": BF16, "exp_avg_sq_dtype": BF16}),
    "fp32 params, bf16 m": (FP32, {"exp_avg_dtype": BF16}),
    "bf16 params, fp32 master, bf16 moments": (
        BF16,
        {"master_weights": True, "exp_avg_dtype": BF16, "exp_avg_sq_dtype": BF16},
    ),
    "bf16 params, remainders, fp32 moments": (
        BF16,
        {"master_weights": True, "store_param_remainders": True},
    ),
    "fp32 params, fp16 m, FP8 v": (
        FP32,
        {"exp_avg_dtype": torch.float16, "exp_avg_sq_dtype": torch.uint8},
    ),
    "bf16 params, remainders, FP8 m, bf16 v": (
        BF16,
        {
            "master_weights": True,
            "store_param_remainders": True,
            "exp_avg_dtype": torch.uint8,
            "exp_avg_sq_dtype": BF16,
        },
    ),
}


def as_stored(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """New FP32 moment values as the next step reads them back (encoded, then decoded)."""
    stored, scale = codecs.encode(values, dtype)
    return codecs.decode(stored, dtype, scale)


@needs_kernel
@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_optimizer_steps_are_the_kernel_formula(config: str, adam_w_mode: bool) -> None:
    """Through the optimizer (groups, bias correction, tensor lr, decoupled grads), five steps
    equal the single-op reference bit for bit; the kernel is what ran."""
    dtype, kw = CONFIGS[config]
    gen = torch.Generator().manual_seed(3)
    shapes = [(33, 7), (5,), (64, 65)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]
    groups = [
        {"params": params[:2]},
        {"params": params[2:], "lr": torch.tensor(3e-3), "weight_decay": 0.2,
         "betas": (0.8, 0.9)},
    ]  # fmt: skip
    opt = PrecisionAwareAdamW(
        groups, lr=1e-2, weight_decay=0.05, adam_w_mode=adam_w_mode, use_decoupled_grad=True,
        cpu_kernel=True, **kw,
    )  # fmt: skip
    ref: dict[int, list[torch.Tensor]] = {}
    for i, p in enumerate(params):
        opt.initialize_state(p, opt.layout.uses_remainder(p))
        state = opt.state[p]
        if "master_param" not in state:
            p32 = p.detach().float()
        elif opt.layout.uses_remainder(p):
            p32 = remainders.join_master(p.detach(), state["master_param"])
        else:
            p32 = state["master_param"]
        ref[i] = [p32.reshape(-1).clone(), torch.zeros(p.numel()), torch.zeros(p.numel())]
    calls = []
    original = cpu_kernel.adamw_step_

    def counting(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        original(*args, **kwargs)

    m_dtype, v_dtype = opt.exp_avg_dtype, opt.exp_avg_sq_dtype
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_kernel, "adamw_step_", counting)
        for step in range(1, 6):
            for i, p in enumerate(params):
                g = torch.randn(p.shape, generator=gen).to(dtype)
                p.decoupled_grad = g
                group = groups[0] if i < 2 else groups[1]
                b1, b2 = group.get("betas", (0.9, 0.999))
                lr = float(group.get("lr", 1e-2))
                wd = group.get("weight_decay", 0.05)
                p32, m, v = ref[i]
                p32, m, v = reference_step(
                    p32, g.reshape(-1), m, v, lr=lr, beta1=b1, beta2=b2, eps=1e-8, wd=wd,
                    bc1=1 - b1**step, bc2=1 - b2**step, adam_w_mode=adam_w_mode,
                )  # fmt: skip
                # What the state stores, not the FP32 value, is what the next step reads.
                ref[i] = [p32, as_stored(m, m_dtype), as_stored(v, v_dtype)]
            opt.step()
    assert len(calls) == 5 * len(groups)  # one call per group and step
    for i, p in enumerate(params):
        p32, m, v = ref[i]
        assert torch.equal(opt.get_unscaled_state(p, "exp_avg").view(-1), m)
        assert torch.equal(opt.get_unscaled_state(p, "exp_avg_sq").view(-1), v)
        assert torch.equal(p.detach().view(-1), p32.to(dtype))
        if "master_param" in opt.state[p]:
            master = (
                remainders.join_master(p.data, opt.state[p]["master_param"])
                if opt.layout.uses_remainder(p)
                else opt.state[p]["master_param"]
            )
            assert torch.equal(master.reshape(-1), p32)


@needs_kernel
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_kernel_is_as_accurate_as_the_torch_path(config: str) -> None:
    """Same formula, different rounding (torch's ops may fuse a multiply-add, its sqrt may be
    an ulp off, and then a bf16 moment may round the other way): after 20 steps both paths
    are equally far from an all-FP32 run and close to each other."""
    dtype, kw = CONFIGS[config]
    gen = torch.Generator().manual_seed(5)
    shapes = [(300, 31), (17,)]
    ref_params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    start = [p.detach().clone() for p in ref_params]
    a = [torch.nn.Parameter(p.detach().to(dtype, copy=True)) for p in ref_params]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    hyper = {"lr": 1e-2, "weight_decay": 0.1}
    reference = PrecisionAwareAdamW(ref_params, **hyper)  # type: ignore[arg-type]
    with_kernel = PrecisionAwareAdamW(a, cpu_kernel=True, **hyper, **kw)  # type: ignore[arg-type]
    without = PrecisionAwareAdamW(b, cpu_kernel=False, **hyper, **kw)  # type: ignore[arg-type]
    for _ in range(20):
        for r, pa, pb in zip(ref_params, a, b, strict=True):
            r.grad = torch.randn(r.shape, generator=gen)
            pa.grad = r.grad.to(dtype)
            pb.grad = pa.grad.clone()
        reference.step()
        with_kernel.step()
        without.step()

    def distance(params: list[torch.nn.Parameter], to: list[torch.Tensor]) -> float:
        sq = sum(((p.detach().float() - t) ** 2).sum() for p, t in zip(params, to, strict=True))
        return float(sq) ** 0.5

    ref_values = [r.detach() for r in ref_params]
    moved = distance(ref_params, start)
    err_kernel, err_torch = distance(a, ref_values), distance(b, ref_values)
    apart = distance(a, [p.detach().float() for p in b])
    assert 0.8 <= err_kernel / max(err_torch, 1e-30) <= 1.25, (err_kernel, err_torch)
    assert apart <= 0.5 * max(err_torch, 1e-3 * moved), (apart, err_torch, moved)


def test_fused_true_keeps_torchs_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the compiled kernel ran although fused=True")

    monkeypatch.setattr(cpu_kernel, "adamw_step_", forbidden)
    p = torch.nn.Parameter(torch.ones(8))
    for kw in ({"fused": True}, {"cpu_kernel": False}):
        opt = PrecisionAwareAdamW([p], exp_avg_dtype=BF16, **kw)  # type: ignore[arg-type]
        p.grad = torch.ones(8)
        opt.step()
    with pytest.raises(ValueError, match="cpu_kernel=True and fused=True"):
        PrecisionAwareAdamW([p], cpu_kernel=True, fused=True)


def test_without_the_kernel_the_optimizer_still_trains(
    fresh_kernel: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WRAPPED_OPTIM_CPU_KERNEL", "off")
    p = torch.nn.Parameter(torch.ones(8))
    opt = PrecisionAwareAdamW([p], lr=0.1, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)
    p.grad = torch.ones(8)
    opt.step()
    assert torch.allclose(p.detach(), torch.full((8,), 0.899))  # 1 - lr * (1 + 0.01 decay)
    assert cpu_kernel.status().reason == "disabled by WRAPPED_OPTIM_CPU_KERNEL=off"


# ----------------------------------------------------------------------------- scaled moments

FP16, FP8 = torch.float16, codecs.FP8_E4M3
MOMENT_DTYPES = [FP32, BF16, FP16, FP8]


def stored_moment(values: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
    """``values`` in storage ``dtype`` as the optimizer keeps them (with the codecs' scale)."""
    if not codecs.is_scaled(dtype):
        return values.to(dtype), None
    stored, scale = codecs.encode(values, dtype)
    return stored, scale


def reference_moment(values: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
    """What the torch path stores for new FP32 moment values: the codecs' amax, scale and
    encoding, applied to the whole tensor."""
    if not codecs.is_scaled(dtype):
        return values.to(dtype), None
    scale = codecs.scale_from_amax(codecs.amax_of(values), dtype)
    out = torch.empty(values.shape, dtype=dtype)
    codecs.encode_into(values, out, dtype, scale)
    return out, scale


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, except that any NaN matches any NaN (torch's casts differ in payload)."""
    if a.dtype == FP8:
        a, b = a.view(torch.float8_e4m3fn).float(), b.view(torch.float8_e4m3fn).float()
    nan = torch.isnan(a.float())
    if not torch.equal(nan, torch.isnan(b.float())):
        return False
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a[~nan].view(width), b[~nan].view(width))


@needs_kernel
@pytest.mark.parametrize("family", CPU_FAMILIES)
@given(
    n=st.integers(1, 1500),
    master=st.sampled_from(MASTERS),
    grad_dtype=st.sampled_from([FP32, BF16]),
    m_dtype=st.sampled_from(MOMENT_DTYPES),
    v_dtype=st.sampled_from([FP16, FP8]),
    adam_w_mode=st.booleans(),
    step=st.integers(1, 1000),
    magnitude=st.sampled_from([1e-30, 1e-6, 1.0, 1e4]),
    special=st.sampled_from([None, 0.0, float("inf"), float("nan")]),
    threads=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_scaled_moments_equal_reference_and_codecs_bitwise(
    family: str,
    n: int,
    master: str,
    grad_dtype: torch.dtype,
    m_dtype: torch.dtype,
    v_dtype: torch.dtype,
    adam_w_mode: bool,
    step: int,
    magnitude: float,
    special: float | None,
    threads: int,
    seed: int,
) -> None:
    """fp16/FP8 moments: decoded with the old scale, updated by the single-op reference,
    re-encoded with the scale of the new amax exactly as the codecs do it (amax, scale,
    multiplier, rounding, FP8 saturation), across subnormal, huge and non-finite values and
    thread splits; the new scales are written into the scale tensors. Each loop family this
    CPU runs (the hand-written AVX-512 and AVX2 ones, the portable ones) on its own."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(n, generator=gen) * 3
    g32 = torch.randn(n, generator=gen) * magnitude
    if special is not None:
        g32[torch.randint(0, n, (1,), generator=gen)] = special
    g = g32.to(grad_dtype)
    m, m_scale = stored_moment(torch.randn(n, generator=gen) * 0.1 * magnitude, m_dtype)
    v, v_scale = stored_moment(torch.rand(n, generator=gen) * 0.01 * magnitude**2, v_dtype)
    m_old = codecs.decode(m, m_dtype, m_scale)
    v_old = codecs.decode(v, v_dtype, v_scale)
    beta1, beta2, eps, lr, wd = 0.9, 0.95, 1e-8, 1e-3, 0.1
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    param, master_t, p32 = param_and_master(values, master)
    want_p, want_m, want_v = reference_step(
        p32.clone(), g, m_old, v_old, lr=lr, beta1=beta1, beta2=beta2, eps=eps, wd=wd,
        bc1=bc1, bc2=bc2, adam_w_mode=adam_w_mode,
    )  # fmt: skip
    want_m_stored, want_m_scale = reference_moment(want_m, m_dtype)
    want_v_stored, want_v_scale = reference_moment(want_v, v_dtype)
    with pytest.MonkeyPatch.context() as mp, running(family):
        mp.setattr(cpu_kernel, "_MIN_ELEMENTS_PER_THREAD", 1)
        mp.setattr(cpu_kernel, "_BLOCK_ELEMENTS", 64)
        cpu_kernel.adamw_step_(
            [param], [g], [m], [v], [master_t], lr=lr, betas=(beta1, beta2), eps=eps,
            weight_decay=wd, bias_correction1=bc1, bias_correction2=bc2,
            adam_w_mode=adam_w_mode, num_threads=threads, exp_avg_scales=[m_scale],
            exp_avg_sq_scales=[v_scale],
        )  # fmt: skip
    assert same_bits(m, want_m_stored)
    assert same_bits(v, want_v_stored)
    for got, want in ((m_scale, want_m_scale), (v_scale, want_v_scale)):
        assert (got is None) == (want is None)
        if got is not None:
            assert same_bits(got, want)
    p_now = param if master == "none" else (
        master_t if master in ("fp32", "fp32 copy") else remainders.join_master(param, master_t)
    )  # fmt: skip
    assert p_now is not None and same_bits(p_now, want_p)
    if master == "fp32":
        assert same_bits(param, want_p.to(BF16))
    if master == "fp32 copy":
        assert torch.equal(param.view(torch.int32), master_t.view(torch.int32))


@needs_kernel
@pytest.mark.parametrize("family", CPU_FAMILIES)
@pytest.mark.parametrize("dtype", [FP16, FP8])
def test_fp16_and_fp8_conversions_match_the_codecs_for_every_code(
    dtype: torch.dtype, family: str
) -> None:
    """lr = 0, beta1 = 0, beta2 = 1: the new exp_avg is the gradient, encoded under scale 1
    (its amax is the format's range): every finite code, every midpoint between neighbours
    (ties round to even) and points just off them, below the smallest subnormal and past the
    range. The new exp_avg_sq is every finite code decoded with a scale, then re-encoded. In
    each loop family this CPU runs."""
    with running(family):
        _check_every_code(dtype)


def _check_every_code(dtype: torch.dtype) -> None:
    if dtype == FP16:
        codes = torch.arange(-(2**15), 2**15).to(torch.int16).view(FP16)
    else:
        codes = torch.arange(256).to(torch.uint8)
    decoded = codes.view(torch.float8_e4m3fn).float() if dtype == FP8 else codes.float()
    finite = torch.isfinite(decoded)
    top = codecs.storage_range(dtype)
    values = decoded[finite & (decoded.abs() <= top)].unique()
    mids = (values[1:] + values[:-1]) / 2
    off = torch.cat([mids.nextafter(values[1:]), mids.nextafter(values[:-1])])
    tiny = torch.tensor([1e-45, -1e-45, 2.0**-26, 2.0**-25, 2.0**-11, 2.0**-10, 1e-38, -0.0])
    g = torch.cat([values, mids, off, tiny, torch.tensor([top, -top])])
    over = torch.tensor([top * 2, 465.0 if dtype == FP8 else 65520.0])
    n = max(g.numel(), int(finite.sum()))
    g = g.repeat(n // g.numel() + 1)[:n]
    v = codes[finite].repeat(n // int(finite.sum()) + 1)[:n].clone()
    m = torch.zeros(n, dtype=dtype)
    m_scale, v_scale = torch.ones(1), torch.tensor([0.5])
    v_old = codecs.decode(v, dtype, v_scale)
    p = torch.zeros(n)
    cpu_kernel.adamw_step_(
        [p], [g], [m], [v], lr=0.0, betas=(0.0, 1.0), eps=1.0, weight_decay=0.0,
        exp_avg_scales=[m_scale], exp_avg_sq_scales=[v_scale],
    )  # fmt: skip
    want_m, want_m_scale = reference_moment(torch.zeros(n) * 0.0 + g * 1.0, dtype)
    want_v, want_v_scale = reference_moment(v_old * 1.0 + (g * 0.0) * g, dtype)
    assert float(m_scale) == 1.0 and same_bits(m_scale, want_m_scale)
    assert same_bits(v_scale, want_v_scale)
    assert same_bits(m, want_m)
    assert same_bits(v, want_v)
    # Past the range (saturation / overflow), under a scale that keeps them there.
    m2 = torch.zeros(2, dtype=dtype)
    scale = torch.ones(1)
    g2 = torch.cat([over, torch.tensor([top * 4])])[:2]
    cpu_kernel.adamw_step_(
        [torch.zeros(2)], [g2], [m2], [torch.zeros(2)], lr=0.0, betas=(0.0, 0.5), eps=1.0,
        weight_decay=0.0, exp_avg_scales=[scale],
    )  # fmt: skip
    assert same_bits(m2, reference_moment(g2 * 1.0, dtype)[0])
