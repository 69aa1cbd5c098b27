"""The Triton kernel of block-scaled moments (imported only with triton): one program per
block of one tensor, the CPU kernel's one-pass block arithmetic (``_adamw_cpu_blocks.h``,
:mod:`wrapped_optim._formats.blocks`) bit for bit.

A program reads its block's codes and two scales once, computes the new parameter values and
moments in FP32 (a correctly rounded square root and division, launched without fused
multiply-add), takes the block's new amaxes with a reduction, and writes the codes under the
new power-of-two scales. It works on the block as two interleaved halves (elements ``2j`` and
``2j + 1``), so an int4 byte's two nibbles are in hand together and no lane shuffle is needed.

Formats (``FMT``): 0 int8, 1 FP8 E4M3, 2 int4. Masters (``MASTER``): 0 none (an FP32
parameter updated in place), 1 FP32 (the parameter gets its bf16 rounding, ``P_BF16``, or its
exact value), 2 the int16 remainder of a bf16 parameter.
"""
# mypy: disable-error-code="no-untyped-def"

from __future__ import annotations

import triton
import triton.language as tl

from wrapped_optim.optimizers._fused_gpu_kernel import (
    bf16_bits,
    e4m3_bits,
    from_e4m3,
    saturate_e4m3,
)


@triton.jit
def _bits(x):
    return x.to(tl.uint32, bitcast=True)


@triton.jit
def _float(u):
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _decode(codes, b, j, odd: tl.constexpr, mask, scale, FMT: tl.constexpr,
            SECOND: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
    """Values of the block's elements ``2j + odd`` (times the block's scale; squared for
    the integer formats' second moment)."""
    if FMT == 2:
        byte = tl.load(codes + b * HALF + j, mask=mask, other=0).to(tl.uint32)
        nib = (byte >> (4 * odd)) & 0xF
        if SECOND:
            c = nib.to(tl.float32)
        else:
            c = ((nib << 28).to(tl.int32, bitcast=True) >> 28).to(tl.float32)
    else:
        byte = tl.load(codes + b * 2 * HALF + 2 * j + odd, mask=mask, other=0)
        if FMT == 1:
            c = from_e4m3(byte)
        elif SECOND:
            c = byte.to(tl.float32)
        else:
            c = byte.to(tl.int8, bitcast=True).to(tl.float32)
    x = c * scale
    if SECOND and FMT != 1:
        x = x * x
    return x


@triton.jit
def _scale(amax, FMT: tl.constexpr, SECOND: tl.constexpr):
    """(scale, 1/scale) of a block from its amax bits: 2**(floor(log2(amax)) - K), K the
    code's headroom; 0 and 0 below 2**-50; NaN and 0 for an inf or NaN."""
    if FMT == 1:
        k = 8
    elif FMT == 0:
        if SECOND:  # noqa: SIM108 - Triton compiles constexpr branches, not expressions
            k = 7
        else:
            k = 6
    else:
        if SECOND:  # noqa: SIM108 - as above
            k = 3
        else:
            k = 2
    e = (amax >> 23).to(tl.int32)
    live = (amax < 0x7F800000) & (amax >= (77 << 23))
    scale = tl.where(live, _float(((e - k) << 23).to(tl.uint32, bitcast=True)), 0.0)
    scale = tl.where(amax >= 0x7F800000, _float(tl.full((), 0x7FC00000, tl.uint32)), scale)
    inverse = tl.where(live, _float(((254 + k - e) << 23).to(tl.uint32, bitcast=True)), 0.0)
    return scale, inverse


@triton.jit
def _code(x, inverse, FMT: tl.constexpr, SECOND: tl.constexpr):
    """The code (0..255, or a nibble) of x under 1/scale; 0 for a dead block."""
    live = inverse != 0.0
    y = tl.where(live, x * inverse, 0.0)
    if FMT == 1:
        code = e4m3_bits(saturate_e4m3(y)).to(tl.uint32)
    else:
        r = (y + 12582912.0) - 12582912.0  # round to nearest even (|y| < 2**22)
        if FMT == 0:
            if SECOND:
                r = tl.minimum(tl.maximum(r, -255.0), 255.0)
            else:
                r = tl.minimum(tl.maximum(r, -127.0), 127.0)
            code = r.to(tl.int32).to(tl.uint32, bitcast=True) & 0xFF
        else:
            if SECOND:
                r = tl.minimum(tl.maximum(r, -15.0), 15.0)
            else:
                r = tl.minimum(tl.maximum(r, -7.0), 7.0)
            code = r.to(tl.int32).to(tl.uint32, bitcast=True) & 0xF
    if SECOND:
        floor = tl.where(x > 0.0, tl.where(live, 1, 0), 0).to(tl.uint32)
        code = tl.where(code == 0, floor, code)
    return code


@triton.jit
def _value_in(param, master, offs, mask, MASTER: tl.constexpr, P_BF16: tl.constexpr):
    if MASTER == 0:
        p = tl.load(param + offs, mask=mask, other=0.0)
    elif MASTER == 1:
        p = tl.load(master + offs, mask=mask, other=0.0)
    else:
        hi = tl.load(param + offs, mask=mask, other=0).to(tl.uint16, bitcast=True)
        lo = tl.load(master + offs, mask=mask, other=0).to(tl.int32)
        p = _float((hi.to(tl.uint32) << 16) + lo.to(tl.uint32, bitcast=True))
    return p


@triton.jit
def _value_out(param, master, offs, mask, p, MASTER: tl.constexpr, P_BF16: tl.constexpr):
    if MASTER == 0:
        tl.store(param + offs, p, mask=mask)
    elif MASTER == 1:
        tl.store(master + offs, p, mask=mask)
        if P_BF16:
            tl.store(param + offs, bf16_bits(p).to(tl.bfloat16, bitcast=True), mask=mask)
        else:
            tl.store(param + offs, p, mask=mask)
    else:
        bits = _bits(p)
        rem = (bits & 0xFFFF).to(tl.uint16).to(tl.int16, bitcast=True)
        hi = ((bits - rem.to(tl.int32).to(tl.uint32, bitcast=True)) >> 16).to(tl.uint16)
        tl.store(master + offs, rem, mask=mask)
        tl.store(param + offs, hi.to(tl.bfloat16, bitcast=True), mask=mask)


@triton.jit
def _half(param, master, grad, m_codes, v_codes, b, j, odd: tl.constexpr, mask, m_scale,
          v_scale, lr, beta1, omb1, beta2, omb2, eps, wd, inv_bc1, inv_bc2,
          FMT: tl.constexpr, HALF: tl.constexpr, ADAM_W: tl.constexpr, MASTER: tl.constexpr,
          P_BF16: tl.constexpr):  # fmt: skip
    """Update of the block's elements ``2j + odd``: (new m, what is stored of new v)."""
    offs = b * 2 * HALF + 2 * j + odd
    p = _value_in(param, master, offs, mask, MASTER, P_BF16)
    g = tl.load(grad + offs, mask=mask, other=0.0).to(tl.float32)
    if not ADAM_W:
        g = g + wd * p
    m = beta1 * _decode(m_codes, b, j, odd, mask, m_scale, FMT, False, HALF) + omb1 * g
    v = beta2 * _decode(v_codes, b, j, odd, mask, v_scale, FMT, True, HALF) + omb2 * g * g
    denom = tl.sqrt_rn(v * inv_bc2) + eps
    update = tl.div_rn(m * inv_bc1, denom)
    if ADAM_W:
        update = update + wd * p
    _value_out(param, master, offs, mask, p - lr * update, MASTER, P_BF16)
    if FMT == 1:  # noqa: SIM108 - as above
        s = v
    else:
        s = tl.sqrt_rn(v)
    return tl.where(mask, m, 0.0), tl.where(mask, s, 0.0)


@triton.jit
def adamw_block_kernel(param, master, grad, m_codes, v_codes, m_scales, v_scales, n, lr, beta1,
                       omb1, beta2, omb2, eps, wd, inv_bc1, inv_bc2, FMT: tl.constexpr,
                       HALF: tl.constexpr, ADAM_W: tl.constexpr, MASTER: tl.constexpr,
                       P_BF16: tl.constexpr):  # fmt: skip
    """One block (program ``b``) of one tensor of ``n`` elements."""
    b = tl.program_id(0)
    j = tl.arange(0, HALF)
    even = b * 2 * HALF + 2 * j < n
    odd = b * 2 * HALF + 2 * j + 1 < n
    m_old = tl.load(m_scales + b)
    v_old = tl.load(v_scales + b)
    m0, s0 = _half(param, master, grad, m_codes, v_codes, b, j, 0, even, m_old, v_old, lr,
                   beta1, omb1, beta2, omb2, eps, wd, inv_bc1, inv_bc2, FMT, HALF, ADAM_W,
                   MASTER, P_BF16)  # fmt: skip
    m1, s1 = _half(param, master, grad, m_codes, v_codes, b, j, 1, odd, m_old, v_old, lr,
                   beta1, omb1, beta2, omb2, eps, wd, inv_bc1, inv_bc2, FMT, HALF, ADAM_W,
                   MASTER, P_BF16)  # fmt: skip
    m_amax = tl.maximum(tl.max(_bits(m0) & 0x7FFFFFFF, 0), tl.max(_bits(m1) & 0x7FFFFFFF, 0))
    v_amax = tl.maximum(tl.max(_bits(s0) & 0x7FFFFFFF, 0), tl.max(_bits(s1) & 0x7FFFFFFF, 0))
    m_scale, m_inv = _scale(m_amax, FMT, False)
    v_scale, v_inv = _scale(v_amax, FMT, True)
    tl.store(m_scales + b, m_scale)
    tl.store(v_scales + b, v_scale)
    mc0, mc1 = _code(m0, m_inv, FMT, False), _code(m1, m_inv, FMT, False)
    vc0, vc1 = _code(s0, v_inv, FMT, True), _code(s1, v_inv, FMT, True)
    if FMT == 2:
        tl.store(m_codes + b * HALF + j, (mc0 | (mc1 << 4)).to(tl.uint8), mask=even)
        tl.store(v_codes + b * HALF + j, (vc0 | (vc1 << 4)).to(tl.uint8), mask=even)
    else:
        base = b * 2 * HALF + 2 * j
        tl.store(m_codes + base, mc0.to(tl.uint8), mask=even)
        tl.store(m_codes + base + 1, mc1.to(tl.uint8), mask=odd)
        tl.store(v_codes + base, vc0.to(tl.uint8), mask=even)
        tl.store(v_codes + base + 1, vc1.to(tl.uint8), mask=odd)
