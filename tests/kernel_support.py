"""What the tests of the compiled CPU kernel (and of what runs on it) share: the skip mark
(one definition, so every file skips for the same, stated reason), the operand builder for
each master kind and the loop families to run."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from wrapped_optim._formats import blocks, remainders
from wrapped_optim.optimizers.kernels import cpu_kernel

# gcc or clang is part of every supported build machine; without one the kernel is off and
# these tests say so instead of passing vacuously.
needs_kernel = pytest.mark.skipif(
    not cpu_kernel.available(), reason=f"CPU kernel unavailable: {cpu_kernel.status().reason}"
)


def param_and_master(values: torch.Tensor, master: str) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """(parameter, master or None, FP32 value the kernel updates) for a master kind."""
    if master == "none":
        return values.clone(), None, values
    if master == "fp32":
        return values.to(torch.bfloat16), values.clone(), values
    if master == "fp32 copy":  # an FP32 master and the FP32 param that gets its value
        return values.clone(), values.clone(), values
    param, remainder = remainders.split_master(values)
    return param, remainder, remainders.join_master(param, remainder)


#: The fp16/FP8 moment loop families this CPU runs, fastest first (the portable loops at
#: least): the tests that check those loops run each of them.
CPU_FAMILIES = cpu_kernel.status().loop_families if cpu_kernel.available() else ("portable",)


@contextlib.contextmanager
def running(family: str) -> Iterator[None]:
    """The kernel's fp16/FP8 moments run ``family`` inside; the fastest family afterwards."""
    assert cpu_kernel.use_loops(family) == family
    try:
        yield
    finally:
        cpu_kernel.use_loops()


# ------------------------------------------------------------------ block-scaled moments

_BLOCK_MASTERS = ["none", "fp32", "remainder", "fp32 copy"]
#: The kernel's hyper-parameters of the block tests, and the same as step_blocks takes them.
BLOCK_HYPER: dict[str, Any] = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8,
                               "weight_decay": 0.1, "bias_correction1": 0.19,
                               "bias_correction2": 0.0975}  # fmt: skip
_TORCH_HYPER = (3e-3, 0.9, 0.95, 1e-8, 0.1, 1.0 / 0.19, 1.0 / 0.0975)


def block_moments(n: int, fmt: blocks.BlockFormat, gen: torch.Generator, magnitude: float) -> Any:
    """([exp_avg codes, exp_avg_sq codes], [their block scales]) of random moments."""
    m = torch.randn(n, generator=gen) * 0.1 * magnitude
    v = torch.rand(n, generator=gen) * magnitude**2
    if n > 40:  # a zero stretch (zero codes beside live ones) and a zero second moment
        m[10:40] = 0
        v[10:40] = 0
        v[3] = 0
    mc, ms = blocks.encode(m, fmt, "exp_avg")
    vc, vs = blocks.encode(v, fmt, "exp_avg_sq")
    return [mc, vc], [ms, vs]


def block_operands(fmt: blocks.BlockFormat, seed: int) -> list[dict[str, Any]]:
    """One parameter per (master kind, gradient dtype), sizes with every kind of tail,
    gradients from 1e-30 to 1e4, a NaN or inf in some."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, (master, g_dtype) in enumerate(
        (m, g) for m in _BLOCK_MASTERS for g in (torch.float32, torch.bfloat16)
    ):
        n = (1, 3, fmt.block_size - 1, fmt.block_size, 3 * fmt.block_size + 17, 5000)[i % 6] + i
        magnitude = (1e-30, 1e-6, 1.0, 1e4)[i % 4]
        param, master_t, _ = param_and_master(torch.randn(n, generator=gen), master)
        g = torch.randn(n, generator=gen) * magnitude
        g[: min(n, 7)] = 0  # zero gradients: second moments that must not round to code 0
        if i % 5 == 3:
            g[n // 2] = (float("nan"), float("inf"))[i % 2]
        codes, scales = block_moments(n, fmt, gen, magnitude)
        out.append({"param": param, "master": master_t, "grad": g.to(g_dtype), "codes": codes,
                    "scales": scales, "kind": master})  # fmt: skip
    return out


def block_reference_step(op: dict[str, Any], fmt: blocks.BlockFormat, adam_w_mode: bool) -> None:
    """The reference: step_blocks on the FP32 value the kernel updates, then the kernel's
    write-back of the parameter (bf16 rounding, remainder split, exact copy)."""
    kind, param, master = op["kind"], op["param"], op["master"]
    if kind == "none":
        value = param
    elif kind == "remainder":
        value = remainders.join_master(param, master)
    else:
        value = master
    blocks.step_blocks(value, op["grad"], tuple(op["codes"]), tuple(op["scales"]), fmt,
                       _TORCH_HYPER, adam_w_mode=adam_w_mode)  # fmt: skip
    if kind == "remainder":
        remainders.split_master_into(value, param, master)
    elif kind != "none":
        param.copy_(value)
        if param.dtype == torch.bfloat16:  # the kernel's NaN is the quiet 0x7FC0 (torch's
            param.view(torch.int16)[value.isnan()] = 0x7FC0  # scalar cast), not a payload


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor (NaNs compared by their bits)."""
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def same_block_results(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    """Asserts two runs of block_operands left the same bits everywhere."""
    for x, y in zip(a, b, strict=True):
        for name in ("param", "master"):
            if x[name] is not None:
                assert torch.equal(bits_of(x[name]), bits_of(y[name])), (x["kind"], name)
        for i in range(2):
            assert torch.equal(x["codes"][i], y["codes"][i]), (x["kind"], "codes", i)
            assert torch.equal(bits_of(x["scales"][i]), bits_of(y["scales"][i])), (x["kind"], i)


def block_kernel_step(
    ops: list[dict[str, Any]], fmt: blocks.BlockFormat, adam_w_mode: bool, threads: int
) -> None:
    """One kernel call stepping every operand of block_operands."""
    cpu_kernel.adamw_step_(
        [o["param"] for o in ops], [o["grad"] for o in ops], [o["codes"][0] for o in ops],
        [o["codes"][1] for o in ops], [o["master"] for o in ops], **BLOCK_HYPER,
        adam_w_mode=adam_w_mode, num_threads=threads,
        exp_avg_scales=[o["scales"][0] for o in ops],
        exp_avg_sq_scales=[o["scales"][1] for o in ops], block_format=fmt,
    )  # fmt: skip
