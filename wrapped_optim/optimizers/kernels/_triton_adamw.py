"""The Triton kernels of :mod:`wrapped_optim.optimizers.precision_adamw._fused_gpu` (imported
only with triton).

One launch of :func:`adamw_group_kernel` updates every tensor of one parameter group that
shares a format combination. The tensors are described by a device table (one row of int64
per tensor: the addresses of its operands, its element count, its first program and the
addresses of its scales; :data:`COLUMNS`) and a block map (the table row of each program), as
torch's and apex's multi-tensor kernels do. A program updates ``BLOCK`` elements of one
tensor: it reads each operand once in its stored format, applies TE's FusedAdam update in
FP32 exactly as the CPU kernel does (the bias corrections as multiplications by their float32
reciprocals, a correctly rounded square root and division, no fused multiply-add: launched
with ``enable_fp_fusion=False``) and writes each result back in its stored format.

Every format is converted by integer and exactly rounded FP32 arithmetic on its bits (the CPU
kernel's conversions, which are c10's): bf16 (round to nearest even, NaN as 0x7FC0), fp16
(round to nearest even, overflow to inf, subnormals, NaN as 0x7E00 with its sign) and FP8
E4M3 (saturated to +-448 first, round to nearest even, subnormals, NaN as 0x7F with its
sign), so a GPU and Triton's CPU interpreter give the same bits.

fp16/FP8 moments and fp16 masters are stored relative to a per-tensor scale whose new value
needs the amax of the whole updated tensor, so such a combination takes three launches:
pass 1 (``PASS=1``) computes the update without writing anything and folds each tensor's
largest ``|new value|`` into an int32 slot with an atomic max over FP32 bits (``bits &
0x7FFFFFFF``: the unsigned order of those bits is the order of the magnitudes, a NaN above
inf, so a NaN poisons the tensor as in the codecs); :func:`finalize_kernel` turns each amax
into the codecs' new scale (``amax / range`` correctly rounded), its encode multiplier and the
old scale's decode multiplier, writes the new scale and clears the amax; pass 2 (``PASS=0``)
redoes the identical arithmetic and writes everything.

Kinds: values 0 FP32, 1 bf16, 2 fp16, 3 FP8 E4M3 (moments of kinds 2 and 3 are scaled);
masters 0 none, 1 FP32, 2 int16 remainder of a bf16 parameter, 3 scaled fp16. An FP32
parameter with a master is updated from itself and its master is written as a copy (FP32)
or an encoding (fp16) of it, as the torch path does.
"""
# mypy: disable-error-code="no-untyped-def"

from __future__ import annotations

import triton
import triton.language as tl

# Columns of a table row (int64): operand addresses, element count, first program, scale
# addresses. Kernels read globals only as constexprs.
COLUMNS = tl.constexpr(10)
COL_PARAM = tl.constexpr(0)
COL_MASTER = tl.constexpr(1)
COL_GRAD = tl.constexpr(2)
COL_M = tl.constexpr(3)
COL_V = tl.constexpr(4)
COL_NUMEL = tl.constexpr(5)
COL_FIRST = tl.constexpr(6)
COL_M_SCALE = tl.constexpr(7)
COL_V_SCALE = tl.constexpr(8)
COL_MASTER_SCALE = tl.constexpr(9)
# Scaled slots per tensor (exp_avg, exp_avg_sq, master): an amax and two multipliers each.
SLOTS = tl.constexpr(3)


# ----------------------------------------------------------------------------- bit casts


@triton.jit
def _bits(x):
    return x.to(tl.uint32, bitcast=True)


@triton.jit
def _float(u):
    return u.to(tl.float32, bitcast=True)


# ----------------------------------------------------------------------------- formats


@triton.jit
def bf16_bits(x):
    """FP32 -> bf16 bits: round to nearest even, NaN as 0x7FC0 (torch's cast)."""
    u = _bits(x)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16)


@triton.jit
def from_bf16(h):
    return _float(h.to(tl.uint32) << 16)


@triton.jit
def f16_bits(x):
    """FP32 -> fp16 bits as c10's fp16_ieee_from_fp32_value: round to nearest even, overflow
    to inf, NaN to 0x7E00 with the sign kept; below 2**-14 the FP32 adder rounds into the
    subnormal (an exact magic-number add)."""
    f = _bits(x)
    sign = f & 0x80000000
    f = f ^ sign
    big = tl.where(f > 0x7F800000, 0x7E00, 0x7C00).to(tl.uint32)
    small = _bits(_float(f) + 0.5) - 0x3F000000
    normal = (f - (112 << 23) + 0xFFF + ((f >> 13) & 1)) >> 13
    out = tl.where(f >= (143 << 23), big, tl.where(f < (113 << 23), small, normal))
    return (out | (sign >> 16)).to(tl.uint16)


@triton.jit
def from_f16(h):
    """fp16 bits -> FP32, exact (c10's fp16_ieee_to_fp32_value; NaN payloads kept)."""
    h = h.to(tl.uint32)
    o = (h & 0x7FFF) << 13
    exp = o & (0x7C00 << 13)
    normal = o + (112 << 23)
    special = normal + (112 << 23)  # inf and NaN
    sub = _bits(_float(normal + (1 << 23)) - 6.103515625e-05)  # exact: minus 2**-14
    out = tl.where(exp == (0x7C00 << 13), special, tl.where(exp == 0, sub, normal))
    return _float(out | ((h & 0x8000) << 16))


@triton.jit
def e4m3_bits(x):
    """FP32 (already within +-448, or NaN) -> FP8 E4M3 bits as c10's
    fp8e4m3fn_from_fp32_value: round to nearest even, subnormals by an exact magic-number
    add, NaN as 0x7F with the sign kept."""
    f = _bits(x)
    sign = f & 0x80000000
    f = f ^ sign
    small = _bits(_float(f) + 16384.0) - (141 << 23)
    normal = (f - (120 << 23) + 0x7FFFF + ((f >> 20) & 1)) >> 20
    normal = tl.where((normal & 0xFF) == 0x7F, 0x7E, normal)
    top = tl.where(f > 0x7F800000, 0x7F, 0x7E).to(tl.uint32)
    out = tl.where(f >= (1087 << 20), top, tl.where(f < (121 << 23), small, normal))
    return ((out & 0xFF) | (sign >> 24)).to(tl.uint8)


@triton.jit
def from_e4m3(b):
    """FP8 E4M3 bits -> FP32, exact (0x7F/0xFF are NaN)."""
    b = b.to(tl.uint32)
    e = (b >> 3) & 0xF
    m = b & 7
    sub = _bits(m.to(tl.float32) * 0.001953125)  # m * 2**-9, exact
    normal = ((e + 120) << 23) | (m << 20)
    mag = tl.where((b & 0x7F) == 0x7F, 0x7FC00000, tl.where(e == 0, sub, normal))
    return _float(mag.to(tl.uint32) | ((b & 0x80) << 24))


@triton.jit
def saturate_e4m3(x):
    """Clamp to +-448 (TE's SATFINITE), NaN stays NaN."""
    return tl.where(x > 448.0, 448.0, tl.where(x < -448.0, -448.0, x))


# ----------------------------------------------------------------------------- scales


@triton.jit
def _finite(x):
    return (_bits(x) & 0x7F800000) != 0x7F800000


@triton.jit
def encode_multiplier(scale):
    """The codecs' encode multiplier: ``1/scale``, 0 for a zero or NaN scale and where the
    reciprocal overflows."""
    inv = tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    return tl.where((scale != 0.0) & _finite(inv), inv, 0.0)


@triton.jit
def decode_multiplier(scale, KIND: tl.constexpr):
    """The codecs' decode multiplier: fp16 the scale; FP8 the reciprocal of the encode
    multiplier, 0 where that is 0 for a finite scale, the (inf/NaN) scale itself otherwise."""
    if KIND == 2:
        out = scale
    else:
        mult = encode_multiplier(scale)
        inv = tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), mult)
        out = tl.where(mult != 0.0, inv, tl.where(_finite(scale), 0.0, scale))
    return out


# ----------------------------------------------------------------------------- operands


@triton.jit
def _address(row, column: tl.constexpr, dtype: tl.constexpr, ALIGNED: tl.constexpr):
    ptr = tl.load(row + column).to(tl.pointer_type(dtype))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _load(ptr, offs, mask, MASKED: tl.constexpr):
    if MASKED:  # noqa: SIM108 - Triton compiles constexpr branches, not expressions
        out = tl.load(ptr + offs, mask=mask, other=0)
    else:
        out = tl.load(ptr + offs)
    return out


@triton.jit
def _store(ptr, offs, mask, x, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + offs, x, mask=mask)
    else:
        tl.store(ptr + offs, x)


@triton.jit
def _read(row, column: tl.constexpr, offs, mask, KIND: tl.constexpr,
          MASKED: tl.constexpr, ALIGNED: tl.constexpr):  # fmt: skip
    """One operand in FP32, decoded from its kind (unscaled)."""
    if KIND == 0:
        x = _load(_address(row, column, tl.float32, ALIGNED), offs, mask, MASKED)
    elif KIND == 1:
        x = from_bf16(_load(_address(row, column, tl.uint16, ALIGNED), offs, mask, MASKED))
    elif KIND == 2:
        x = from_f16(_load(_address(row, column, tl.uint16, ALIGNED), offs, mask, MASKED))
    else:
        x = from_e4m3(_load(_address(row, column, tl.uint8, ALIGNED), offs, mask, MASKED))
    return x


@triton.jit
def _write(row, column: tl.constexpr, offs, mask, x, KIND: tl.constexpr,
           MASKED: tl.constexpr, ALIGNED: tl.constexpr):  # fmt: skip
    """Store FP32 ``x`` (already scaled, for a scaled slot) in its kind; FP8 is saturated
    to +-448 first."""
    if KIND == 0:
        _store(_address(row, column, tl.float32, ALIGNED), offs, mask, x, MASKED)
    elif KIND == 1:
        _store(_address(row, column, tl.uint16, ALIGNED), offs, mask, bf16_bits(x), MASKED)
    elif KIND == 2:
        _store(_address(row, column, tl.uint16, ALIGNED), offs, mask, f16_bits(x), MASKED)
    else:
        bits = e4m3_bits(saturate_e4m3(x))
        _store(_address(row, column, tl.uint8, ALIGNED), offs, mask, bits, MASKED)


@triton.jit
def _decode_mult(row, mults, t, slot: tl.constexpr, KIND: tl.constexpr, PASS: tl.constexpr):
    """A scaled slot's decode multiplier: pass 1 derives it from the old scale (untouched
    until the finalize kernel), pass 2 reads what the finalize kernel derived from it."""
    if PASS == 1:
        scale_ptr = tl.load(row + COL_M_SCALE + slot).to(tl.pointer_type(tl.float32))
        out = decode_multiplier(tl.load(scale_ptr), KIND)
    else:
        out = tl.load(mults + t * (2 * SLOTS) + 2 * slot)
    return out


@triton.jit
def _encode_mult(mults, t, slot: tl.constexpr):
    return tl.load(mults + t * (2 * SLOTS) + 2 * slot + 1)


@triton.jit
def _fold_amax(amax, t, slot: tl.constexpr, x, mask, MASKED: tl.constexpr):
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    if MASKED:
        bits = tl.where(mask, bits, 0)
    # What tl.max does for int32, called directly: tl.max is itself a jit function, which a
    # process that imported triton before setting TRITON_INTERPRET cannot interpret, and the
    # interpreter has a vectorized path for this combine function only.
    tl.atomic_max(amax + t * SLOTS + slot, tl.reduce(bits, 0, tl.standard._elementwise_max))


@triton.jit
def _param_in(row, t, offs, mask, mults, NEED_P: tl.constexpr, READS_MASTER: tl.constexpr,
              MASTER: tl.constexpr, P_KIND: tl.constexpr, PASS: tl.constexpr,
              MASKED: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """The FP32 parameter the update starts from: the parameter, its FP32 master, the bf16
    parameter joined with its int16 remainder or the decoded fp16 master (zeros where pass 1
    does not need it)."""
    if not NEED_P:
        p = tl.full([BLOCK], 0.0, tl.float32)
    elif not READS_MASTER:
        p = _read(row, COL_PARAM, offs, mask, P_KIND, MASKED, ALIGNED)
    elif MASTER == 1:
        p = _read(row, COL_MASTER, offs, mask, 0, MASKED, ALIGNED)
    elif MASTER == 2:
        high = _load(_address(row, COL_PARAM, tl.int16, ALIGNED), offs, mask, MASKED)
        low = _load(_address(row, COL_MASTER, tl.int16, ALIGNED), offs, mask, MASKED)
        p = ((high.to(tl.int32) << 16) + low.to(tl.int32)).to(tl.float32, bitcast=True)
    else:
        p = _read(row, COL_MASTER, offs, mask, 2, MASKED, ALIGNED)
        p = p * _decode_mult(row, mults, t, 2, 2, PASS)
    return p


@triton.jit
def _moment_in(row, column: tl.constexpr, t, offs, mask, mults, slot: tl.constexpr,
               KIND: tl.constexpr, PASS: tl.constexpr, MASKED: tl.constexpr,
               ALIGNED: tl.constexpr):  # fmt: skip
    """One moment in FP32 (decoded with its scale's multiplier where scaled)."""
    x = _read(row, column, offs, mask, KIND, MASKED, ALIGNED)
    if KIND >= 2:
        x = x * _decode_mult(row, mults, t, slot, KIND, PASS)
    return x


@triton.jit
def _stepped(p, m, v, lr_ptr, lr, eps, wd, inv_bc1, inv_bc2, ADAM_W: tl.constexpr,
             LR_TENSOR: tl.constexpr):  # fmt: skip
    """TE's parameter update from the new moments."""
    if LR_TENSOR:  # noqa: SIM108 - Triton compiles constexpr branches, not expressions
        step_size = tl.load(lr_ptr).to(tl.float32)
    else:
        step_size = lr
    denom = tl.sqrt_rn(v * inv_bc2) + eps
    update = tl.div_rn(m * inv_bc1, denom)
    if ADAM_W:
        update = update + wd * p
    return p - step_size * update


@triton.jit
def _fold_amaxes(amax, t, p, m, v, mask, MASTER: tl.constexpr, M_KIND: tl.constexpr,
                 V_KIND: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """Pass 1: the new values' amaxes of the scaled slots."""
    if M_KIND >= 2:
        _fold_amax(amax, t, 0, m, mask, MASKED)
    if V_KIND >= 2:
        _fold_amax(amax, t, 1, v, mask, MASKED)
    if MASTER == 3:
        _fold_amax(amax, t, 2, p, mask, MASKED)


@triton.jit
def _write_back(row, t, offs, mask, mults, p, m, v, MASTER: tl.constexpr,
                P_KIND: tl.constexpr, M_KIND: tl.constexpr, V_KIND: tl.constexpr,
                MASKED: tl.constexpr, ALIGNED: tl.constexpr):  # fmt: skip
    """Pass 2: every result in its stored format (scaled slots with their new multipliers)."""
    if M_KIND >= 2:
        m = m * _encode_mult(mults, t, 0)
    _write(row, COL_M, offs, mask, m, M_KIND, MASKED, ALIGNED)
    if V_KIND >= 2:
        v = v * _encode_mult(mults, t, 1)
    _write(row, COL_V, offs, mask, v, V_KIND, MASKED, ALIGNED)
    if MASTER == 2:
        bits = p.to(tl.int32, bitcast=True)
        nan = p != p  # the bf16 quiet NaN, remainder 0 (remainders' NaN rule)
        remainder = tl.where(nan, 0, bits.to(tl.int16)).to(tl.int16)
        high = tl.where(nan, 0x7FC0, ((bits - remainder.to(tl.int32)) >> 16)).to(tl.int16)
        _store(_address(row, COL_MASTER, tl.int16, ALIGNED), offs, mask, remainder, MASKED)
        _store(_address(row, COL_PARAM, tl.int16, ALIGNED), offs, mask, high, MASKED)
    else:
        _write(row, COL_PARAM, offs, mask, p, P_KIND, MASKED, ALIGNED)
        if MASTER == 1:
            _write(row, COL_MASTER, offs, mask, p, 0, MASKED, ALIGNED)
        elif MASTER == 3:
            encoded = p * _encode_mult(mults, t, 2)
            _write(row, COL_MASTER, offs, mask, encoded, 2, MASKED, ALIGNED)


@triton.jit
def _program(row, t, start, n, mults, amax, lr_ptr, lr, beta1, omb1, beta2, omb2, eps, wd,
             inv_bc1, inv_bc2, ADAM_W: tl.constexpr, MASTER: tl.constexpr,
             P_KIND: tl.constexpr, G_KIND: tl.constexpr, M_KIND: tl.constexpr,
             V_KIND: tl.constexpr, LR_TENSOR: tl.constexpr, PASS: tl.constexpr,
             MASKED: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    # An FP32 parameter's master is never read (it is written as a copy of the parameter).
    READS_MASTER: tl.constexpr = MASTER != 0 and P_KIND != 0
    # Pass 1 needs the parameter only where the amax depends on it.
    NEED_P: tl.constexpr = PASS == 0 or not ADAM_W or MASTER == 3
    NEW_P: tl.constexpr = PASS == 0 or MASTER == 3
    p = _param_in(row, t, offs, mask, mults, NEED_P, READS_MASTER, MASTER, P_KIND, PASS,
                  MASKED, ALIGNED, BLOCK)  # fmt: skip
    g = _read(row, COL_GRAD, offs, mask, G_KIND, MASKED, ALIGNED)
    m = _moment_in(row, COL_M, t, offs, mask, mults, 0, M_KIND, PASS, MASKED, ALIGNED)
    v = _moment_in(row, COL_V, t, offs, mask, mults, 1, V_KIND, PASS, MASKED, ALIGNED)
    if not ADAM_W:
        g = g + wd * p
    m = beta1 * m + omb1 * g
    v = beta2 * v + omb2 * g * g
    if NEW_P:
        p = _stepped(p, m, v, lr_ptr, lr, eps, wd, inv_bc1, inv_bc2, ADAM_W, LR_TENSOR)
    if PASS == 1:
        _fold_amaxes(amax, t, p, m, v, mask, MASTER, M_KIND, V_KIND, MASKED)
    else:
        _write_back(row, t, offs, mask, mults, p, m, v, MASTER, P_KIND, M_KIND, V_KIND, MASKED,
                    ALIGNED)  # fmt: skip


@triton.jit
def adamw_group_kernel(table, block_map, mults, amax, lr_ptr, lr, beta1, omb1, beta2, omb2,
                       eps, wd, inv_bc1, inv_bc2, ADAM_W: tl.constexpr, MASTER: tl.constexpr,
                       P_KIND: tl.constexpr, G_KIND: tl.constexpr, M_KIND: tl.constexpr,
                       V_KIND: tl.constexpr, LR_TENSOR: tl.constexpr, PASS: tl.constexpr,
                       ALIGNED: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """One program: ``BLOCK`` elements of the tensor the block map names; pass 0 updates and
    writes, pass 1 only folds the new amaxes of the scaled slots."""
    pid = tl.program_id(0)
    t = tl.load(block_map + pid).to(tl.int64)
    row = table + t * COLUMNS
    n = tl.load(row + COL_NUMEL)
    start = (pid - tl.load(row + COL_FIRST)) * BLOCK
    if start + BLOCK <= n:  # a full block: no mask, so loads and stores can be vectorized
        _program(row, t, start, n, mults, amax, lr_ptr, lr, beta1, omb1, beta2, omb2, eps, wd,
                 inv_bc1, inv_bc2, ADAM_W, MASTER, P_KIND, G_KIND, M_KIND, V_KIND,
                 LR_TENSOR, PASS, False, ALIGNED, BLOCK)  # fmt: skip
    else:
        _program(row, t, start, n, mults, amax, lr_ptr, lr, beta1, omb1, beta2, omb2, eps, wd,
                 inv_bc1, inv_bc2, ADAM_W, MASTER, P_KIND, G_KIND, M_KIND, V_KIND,
                 LR_TENSOR, PASS, True, ALIGNED, BLOCK)  # fmt: skip


@triton.jit
def _finalize_slot(table, mults, amax, t, mask, slot: tl.constexpr, KIND: tl.constexpr):
    bits = tl.load(amax + t * SLOTS + slot, mask=mask, other=0)
    value = bits.to(tl.float32, bitcast=True)
    if KIND == 2:
        scale = tl.div_rn(value, tl.full(value.shape, 32752.0, tl.float32))
    else:
        scale = tl.div_rn(value, tl.full(value.shape, 448.0, tl.float32))
    scale_ptr = tl.load(table + t * COLUMNS + COL_M_SCALE + slot, mask=mask, other=0).to(
        tl.pointer_type(tl.float32)
    )
    old = tl.load(scale_ptr, mask=mask, other=1.0)
    tl.store(mults + t * (2 * SLOTS) + 2 * slot, decode_multiplier(old, KIND), mask=mask)
    tl.store(mults + t * (2 * SLOTS) + 2 * slot + 1, encode_multiplier(scale), mask=mask)
    tl.store(scale_ptr, scale, mask=mask)
    tl.store(amax + t * SLOTS + slot, tl.full(bits.shape, 0, tl.int32), mask=mask)


@triton.jit
def finalize_kernel(table, mults, amax, count, M_KIND: tl.constexpr, V_KIND: tl.constexpr,
                    MASTER: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Between the passes, per tensor and scaled slot: the new scale (``amax / range``), its
    encode multiplier, the old scale's decode multiplier; the new scale is written and the
    amax cleared for the next step."""
    t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = t < count
    if M_KIND >= 2:
        _finalize_slot(table, mults, amax, t, mask, 0, M_KIND)
    if V_KIND >= 2:
        _finalize_slot(table, mults, amax, t, mask, 1, V_KIND)
    if MASTER == 3:
        _finalize_slot(table, mults, amax, t, mask, 2, 2)


@triton.jit
def convert_kernel(src, dst, n, OP: tl.constexpr, BLOCK: tl.constexpr):
    """The format conversions alone, for their exhaustive tests: OP 0 FP32 -> fp16 bits,
    1 fp16 bits -> FP32, 2 FP32 -> saturated E4M3 bits, 3 E4M3 bits -> FP32, 4 FP32 -> bf16
    bits, 5 bf16 bits -> FP32."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src + offs, mask=mask, other=0)
    if OP == 0:
        y = f16_bits(x)
    elif OP == 1:
        y = from_f16(x)
    elif OP == 2:
        y = e4m3_bits(saturate_e4m3(x))
    elif OP == 3:
        y = from_e4m3(x)
    elif OP == 4:
        y = bf16_bits(x)
    else:
        y = from_bf16(x)
    tl.store(dst + offs, y, mask=mask)


# ----------------------------------------------------------------------------- block-scaled
# Block-scaled moments (PrecisionAwareAdamW(block_moments=...)): one program per block of one
# tensor, the CPU kernel's one-pass block arithmetic (_adamw_cpu_blocks.h,
# wrapped_optim._formats.blocks) bit for bit. A program reads its block's codes and two
# scales once, computes the new parameter values and moments in FP32, takes the block's new
# amaxes with a reduction and writes the codes under the new power-of-two scales. It works on
# the block as two interleaved halves (elements 2j and 2j + 1), so an int4 byte's two nibbles
# are in hand together. Formats (FMT): 0 int8, 1 FP8 E4M3, 2 int4. Masters (MASTER): 0 none
# (an FP32 parameter updated in place), 1 FP32 (the parameter gets its bf16 rounding, P_BF16,
# or its exact value), 2 the int16 remainder of a bf16 parameter.


@triton.jit
def _int4_code(y, tables, SECOND: tl.constexpr):
    """int4 codes of y (x times 1/scale): the count of table midpoints below it (exp_avg: of
    |y|, with y's sign, as a nibble); ``tables`` as blocks.int4_tables lays them out."""
    n = tl.zeros(y.shape, tl.int32)
    if SECOND:
        for t in tl.static_range(15):
            n += tl.where(y > tl.load(tables + 39 + t), 1, 0)
        return n.to(tl.uint32, bitcast=True)
    a = tl.abs(y)
    for t in tl.static_range(7):
        n += tl.where(a > tl.load(tables + 32 + t), 1, 0)
    return tl.where(y < 0.0, -n, n).to(tl.uint32, bitcast=True) & 0xF


@triton.jit
def _decode(codes, tables, b, j, odd: tl.constexpr, mask, scale, FMT: tl.constexpr,
            SECOND: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
    """Values of the block's elements ``2j + odd`` (times the block's scale; squared for
    the integer formats' second moment)."""
    if FMT == 2:
        byte = tl.load(codes + b * HALF + j, mask=mask, other=0).to(tl.uint32)
        nib = (byte >> (4 * odd)) & 0xF
        c = tl.load(tables + nib + (16 if SECOND else 0))
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
        k = 0  # int4 scales by the amax itself (below)
    e = (amax >> 23).to(tl.int32)
    live = (amax < 0x7F800000) & (amax >= (77 << 23))
    if FMT == 2:
        a = _float(amax.to(tl.uint32, bitcast=True))
        scale = tl.where(live, a, 0.0)
        scale = tl.where(amax >= 0x7F800000, _float(tl.full((), 0x7FC00000, tl.uint32)), scale)
        inverse = tl.where(live, tl.div_rn(1.0, tl.where(live, a, 1.0)), 0.0)
        return scale, inverse
    scale = tl.where(live, _float(((e - k) << 23).to(tl.uint32, bitcast=True)), 0.0)
    scale = tl.where(amax >= 0x7F800000, _float(tl.full((), 0x7FC00000, tl.uint32)), scale)
    inverse = tl.where(live, _float(((254 + k - e) << 23).to(tl.uint32, bitcast=True)), 0.0)
    return scale, inverse


@triton.jit
def _code(x, inverse, tables, FMT: tl.constexpr, SECOND: tl.constexpr):
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
            return _int4_code(y, tables, SECOND)
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
        nan = p != p  # the bf16 quiet NaN, remainder 0 (remainders' NaN rule)
        rem = tl.where(nan, 0, (bits & 0xFFFF).to(tl.uint16).to(tl.int16, bitcast=True))
        rem = rem.to(tl.int16)
        hi = ((bits - rem.to(tl.int32).to(tl.uint32, bitcast=True)) >> 16).to(tl.uint16)
        hi = tl.where(nan, 0x7FC0, hi).to(tl.uint16)
        tl.store(master + offs, rem, mask=mask)
        tl.store(param + offs, hi.to(tl.bfloat16, bitcast=True), mask=mask)


@triton.jit
def _half(param, master, grad, m_codes, v_codes, tables, b, j, odd: tl.constexpr, mask, m_scale,
          v_scale, lr, beta1, omb1, beta2, omb2, eps, wd, inv_bc1, inv_bc2,
          FMT: tl.constexpr, HALF: tl.constexpr, ADAM_W: tl.constexpr, MASTER: tl.constexpr,
          P_BF16: tl.constexpr):  # fmt: skip
    """Update of the block's elements ``2j + odd``: (new m, what is stored of new v)."""
    offs = b * 2 * HALF + 2 * j + odd
    p = _value_in(param, master, offs, mask, MASTER, P_BF16)
    g = tl.load(grad + offs, mask=mask, other=0.0).to(tl.float32)
    if not ADAM_W:
        g = g + wd * p
    m = beta1 * _decode(m_codes, tables, b, j, odd, mask, m_scale, FMT, False, HALF) + omb1 * g
    v = beta2 * _decode(v_codes, tables, b, j, odd, mask, v_scale, FMT, True, HALF) + omb2 * g * g
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
def adamw_block_kernel(param, master, grad, m_codes, v_codes, m_scales, v_scales, tables, n, lr,
                       beta1, omb1, beta2, omb2, eps, wd, inv_bc1, inv_bc2, FMT: tl.constexpr,
                       HALF: tl.constexpr, ADAM_W: tl.constexpr, MASTER: tl.constexpr,
                       P_BF16: tl.constexpr):  # fmt: skip
    """One block (program ``b``) of one tensor of ``n`` elements."""
    b = tl.program_id(0)
    j = tl.arange(0, HALF)
    even = b * 2 * HALF + 2 * j < n
    odd = b * 2 * HALF + 2 * j + 1 < n
    m_old = tl.load(m_scales + b)
    v_old = tl.load(v_scales + b)
    m0, s0 = _half(param, master, grad, m_codes, v_codes, tables, b, j, 0, even, m_old, v_old, lr,
                   beta1, omb1, beta2, omb2, eps, wd, inv_bc1, inv_bc2, FMT, HALF, ADAM_W,
                   MASTER, P_BF16)  # fmt: skip
    m1, s1 = _half(param, master, grad, m_codes, v_codes, tables, b, j, 1, odd, m_old, v_old, lr,
                   beta1, omb1, beta2, omb2, eps, wd, inv_bc1, inv_bc2, FMT, HALF, ADAM_W,
                   MASTER, P_BF16)  # fmt: skip
    m_amax = tl.maximum(tl.max(_bits(m0) & 0x7FFFFFFF, 0), tl.max(_bits(m1) & 0x7FFFFFFF, 0))
    v_amax = tl.maximum(tl.max(_bits(s0) & 0x7FFFFFFF, 0), tl.max(_bits(s1) & 0x7FFFFFFF, 0))
    m_scale, m_inv = _scale(m_amax, FMT, False)
    v_scale, v_inv = _scale(v_amax, FMT, True)
    tl.store(m_scales + b, m_scale)
    tl.store(v_scales + b, v_scale)
    mc0, mc1 = _code(m0, m_inv, tables, FMT, False), _code(m1, m_inv, tables, FMT, False)
    vc0, vc1 = _code(s0, v_inv, tables, FMT, True), _code(s1, v_inv, tables, FMT, True)
    if FMT == 2:
        tl.store(m_codes + b * HALF + j, (mc0 | (mc1 << 4)).to(tl.uint8), mask=even)
        tl.store(v_codes + b * HALF + j, (vc0 | (vc1 << 4)).to(tl.uint8), mask=even)
    else:
        base = b * 2 * HALF + 2 * j
        tl.store(m_codes + base, mc0.to(tl.uint8), mask=even)
        tl.store(m_codes + base + 1, mc1.to(tl.uint8), mask=odd)
        tl.store(v_codes + base, vc0.to(tl.uint8), mask=even)
        tl.store(v_codes + base + 1, vc1.to(tl.uint8), mask=odd)
