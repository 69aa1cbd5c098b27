"""The Triton kernel of :mod:`wrapped_optim.optimizers.fused_gpu` (imported only with triton).

One program updates ``BLOCK`` elements of one parameter: it reads each operand once in its
stored format, applies TE's FusedAdam update in FP32 exactly as the CPU kernel does (the
bias corrections as multiplications by their float32 reciprocals, a correctly rounded
square root and division, no fused multiply-add: launched with ``enable_fp_fusion=False``)
and writes each result back in its stored format. bf16 is handled as its bits (exact decode;
round-to-nearest-even encode with NaN as 0x7FC0, as torch's cast), so the kernel gives the
same bits on a GPU and in Triton's CPU interpreter. Kinds: 0 FP32, 1 bf16, 2 fp16; masters:
0 none, 1 FP32, 2 int16 remainder of a bf16 parameter.
"""
# mypy: disable-error-code="no-untyped-def"

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _bf16_bits(x):
    u = x.to(tl.uint32, bitcast=True)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.int16)


@triton.jit
def _load_f32(ptr, offs, mask, KIND: tl.constexpr):
    if KIND == 1:
        bits = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32)
        value = (bits << 16).to(tl.float32, bitcast=True)
    else:
        value = tl.load(ptr + offs, mask=mask, other=0).to(tl.float32)
    return value


@triton.jit
def _store_f32(ptr, offs, mask, x, KIND: tl.constexpr):
    if KIND == 1:
        tl.store(ptr + offs, _bf16_bits(x), mask=mask)
    elif KIND == 2:
        tl.store(ptr + offs, x.to(tl.float16), mask=mask)
    else:
        tl.store(ptr + offs, x, mask=mask)


@triton.jit
def adamw_kernel(
    param_ptr,
    master_ptr,
    grad_ptr,
    m_ptr,
    v_ptr,
    lr_ptr,
    n,
    lr,
    beta1,
    omb1,
    beta2,
    omb2,
    eps,
    wd,
    inv_bc1,
    inv_bc2,
    ADAM_W: tl.constexpr,
    MASTER: tl.constexpr,
    P_KIND: tl.constexpr,
    G_KIND: tl.constexpr,
    M_KIND: tl.constexpr,
    V_KIND: tl.constexpr,
    LR_TENSOR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if MASTER == 0:
        p = _load_f32(param_ptr, offs, mask, P_KIND)
    elif MASTER == 1:
        p = tl.load(master_ptr + offs, mask=mask, other=0.0)
    else:
        high = tl.load(param_ptr + offs, mask=mask, other=0).to(tl.int32) << 16
        low = tl.load(master_ptr + offs, mask=mask, other=0).to(tl.int32)
        p = (high + low).to(tl.float32, bitcast=True)
    g = _load_f32(grad_ptr, offs, mask, G_KIND)
    m = _load_f32(m_ptr, offs, mask, M_KIND)
    v = _load_f32(v_ptr, offs, mask, V_KIND)
    if LR_TENSOR:  # noqa: SIM108 - Triton compiles constexpr branches, not expressions
        step_size = tl.load(lr_ptr).to(tl.float32)
    else:
        step_size = lr
    if not ADAM_W:
        g = g + wd * p
    m = beta1 * m + omb1 * g
    v = beta2 * v + omb2 * g * g
    denom = tl.sqrt_rn(v * inv_bc2) + eps
    update = tl.div_rn(m * inv_bc1, denom)
    if ADAM_W:
        update = update + wd * p
    p = p - step_size * update
    _store_f32(m_ptr, offs, mask, m, M_KIND)
    _store_f32(v_ptr, offs, mask, v, V_KIND)
    if MASTER == 0:
        _store_f32(param_ptr, offs, mask, p, P_KIND)
    elif MASTER == 1:
        tl.store(master_ptr + offs, p, mask=mask)
        _store_f32(param_ptr, offs, mask, p, P_KIND)
    else:
        bits = p.to(tl.int32, bitcast=True)
        remainder = bits.to(tl.int16)
        tl.store(master_ptr + offs, remainder, mask=mask)
        tl.store(param_ptr + offs, ((bits - remainder.to(tl.int32)) >> 16).to(tl.int16), mask=mask)
