"""Block-scaled moment storage: FP32 <-> int8, FP8 E4M3 and int4 codes with one scale per block.

TE's per-tensor formats scale a whole moment by its amax, so a step must know the new amax
before it stores anything (two passes over memory). Here each block of ``block_size`` values
(counted from the tensor's start) has a scale of its own, so a step stores each block as soon
as it has computed it. The formats, one for both moments of a tensor:

=========  =====================================  ===========================================
format     ``exp_avg``                            ``exp_avg_sq``
=========  =====================================  ===========================================
``int8``   signed linear, codes -127..127         its square root, unsigned linear, 0..255
``fp8``    FP8 E4M3 (saturated at 448)            FP8 E4M3 of the value itself
``int4``   signed 16-value table, two a byte       its square root, 16-value table
=========  =====================================  ===========================================

Codes live in a flat ``torch.uint8`` tensor (int8: two's complement bytes; int4: element
``2i`` in the low nibble of byte ``i``); scales in a flat float32 tensor, one per block.

For int8 and FP8 a block's scale is ``2 ** (floor(log2(amax)) - K)``, ``K`` the code's
headroom (int8: 6 and 7, FP8: 8), so its largest code lies in the code's top binade. int4 is
too coarse for linear codes (the first moment of most elements of a block would round to 0 or
to one step): its codes index tables (:data:`INT4_MAGNITUDES`, about geometric near zero,
with the value's sign; :data:`INT4_ROOTS`, linear and zero-free) under a scale that is the
block's amax itself, so the top code decodes to the amax exactly. Either way decoding and
encoding again gives the same codes and scale, and a checkpoint in FP32 resumes exactly. A
block whose amax is below ``2**-50`` is stored as zeros (scale 0); one holding inf or NaN as
codes 0 under a NaN scale (it decodes to NaN). A positive second moment never decodes to zero
(int8, FP8: it takes the smallest nonzero code; int4's table has no zero): no update divides
by a second moment rounded away.

The compiled CPU kernel (``_adamw_cpu_blocks.h``) implements the same arithmetic bit for bit;
:func:`step_blocks` is the torch implementation of that one-pass step.

Example:
    >>> import torch
    >>> from wrapped_optim._formats import blocks
    >>> fmt = blocks.BlockFormat("int8", 32)
    >>> codes, scales = blocks.encode(torch.tensor([0.5, -1.0, 0.25, 0.0]), fmt, "exp_avg")
    >>> blocks.decode(codes, scales, fmt, "exp_avg", 4).tolist()
    [0.5, -1.0, 0.25, 0.0]
"""

from __future__ import annotations

import itertools

import attrs
import torch
from torch import Tensor

__all__ = [
    "BLOCK_FORMATS",
    "BlockFormat",
    "decode",
    "decode_into",
    "encode",
    "encode_into",
    "int4_tables",
    "step_blocks",
]

#: The block formats, by name.
BLOCK_FORMATS = ("int8", "fp8", "int4")
#: Block sizes accepted: powers of two in this range (the kernel keeps a block on its stack).
MIN_BLOCK, MAX_BLOCK = 32, 2048
_FLUSH = 2.0**-50
_HEADROOM = {("int8", False): 6, ("int8", True): 7, ("fp8", False): 8, ("fp8", True): 8,
             ("int4", False): 2, ("int4", True): 3}  # fmt: skip
_TOP = {("int8", False): 127.0, ("int8", True): 255.0, ("int4", False): 7.0,
        ("int4", True): 15.0}  # fmt: skip
_E4M3 = torch.float8_e4m3fn
#: int4 ``exp_avg``: the magnitudes of codes 0..7 (a value's code is its sign and the index of
#: the nearest magnitude; nibbles 8..15 are the negatives, 8 never written). Close to zero
#: they grow about geometrically (a dynamic-exponent code), near the top about linearly.
INT4_MAGNITUDES = tuple(k / 128 for k in (0, 6, 16, 30, 48, 72, 100, 128))
#: int4 ``exp_avg_sq``: the square root's values of codes 0..15 (no zero: a second moment
#: never decodes to zero in a live block, so no update divides by a moment rounded away).
INT4_ROOTS = tuple((i + 1) / 16 for i in range(16))


def _midpoints(values: tuple[float, ...]) -> tuple[float, ...]:
    """The float32 midpoints between neighbouring table values: a value's code counts the
    midpoints it is above."""
    pairs = itertools.pairwise(values)
    return tuple(float(torch.tensor((a + b) / 2, dtype=torch.float32)) for a, b in pairs)


_MAG_MIDS = _midpoints(INT4_MAGNITUDES)
_ROOT_MIDS = _midpoints(INT4_ROOTS)


@attrs.frozen
class BlockFormat:
    """A block format (``"int8"``, ``"fp8"`` or ``"int4"``) and its block size.

    Example:
        >>> BlockFormat("int4", 128).code_bytes(5), BlockFormat("int4", 128).blocks(300)
        (3, 3)
    """

    name: str = attrs.field()
    block_size: int = attrs.field()

    @name.validator
    def _check_name(self, _: object, value: str) -> None:
        if value not in BLOCK_FORMATS:
            raise ValueError(f"unknown block format {value!r}; expected one of {BLOCK_FORMATS}")

    @block_size.validator
    def _check_size(self, _: object, value: int) -> None:
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not MIN_BLOCK <= value <= MAX_BLOCK
            or value & (value - 1)
        ):
            raise ValueError(
                f"block_size must be a power of two from {MIN_BLOCK} to {MAX_BLOCK}, got {value!r}"
            )

    def code_bytes(self, numel: int) -> int:
        """Bytes of codes for ``numel`` values (two a byte for int4)."""
        return (numel + 1) // 2 if self.name == "int4" else numel

    def blocks(self, numel: int) -> int:
        """Blocks (scales) for ``numel`` values."""
        return (numel + self.block_size - 1) // self.block_size


def _second(state_name: str) -> bool:
    if state_name not in ("exp_avg", "exp_avg_sq"):
        raise ValueError(f"block formats store exp_avg and exp_avg_sq, not {state_name!r}")
    return state_name == "exp_avg_sq"


def _padded(x: Tensor, block: int) -> Tensor:
    """``x`` (flat) as rows of ``block`` values, zero-padded."""
    n = x.numel()
    rows = (n + block - 1) // block
    if rows * block == n:
        return x.reshape(rows, block)
    out = torch.zeros(rows * block, dtype=x.dtype, device=x.device)
    out[:n] = x
    return out.reshape(rows, block)


def _scales_of(stored: Tensor, fmt: BlockFormat, second: bool) -> tuple[Tensor, Tensor]:
    """(scale, inverse) per block of the FP32 values ``stored`` (what the codes represent):
    powers of two from the amax's exponent; 0 and 0 below 2**-50; NaN and 0 for inf/NaN."""
    amax = _padded(stored, fmt.block_size).abs().amax(dim=1)
    finite = torch.isfinite(amax)
    live = finite & (amax >= _FLUSH)
    if fmt.name == "int4":  # the amax itself: the table's top value decodes to it exactly
        scale = torch.where(live, amax, torch.where(finite, 0.0, float("nan")))
        return scale, torch.where(live, 1.0 / torch.where(live, amax, 1.0), 0.0)
    bits = amax.view(torch.int32)
    exponent = torch.bitwise_right_shift(bits, 23)
    k = _HEADROOM[fmt.name, second]
    scale = torch.bitwise_left_shift(exponent - k, 23).view(torch.float32)
    inverse = torch.bitwise_left_shift(254 + k - exponent, 23).view(torch.float32)
    scale = torch.where(live, scale, torch.where(finite, 0.0, float("nan")))
    inverse = torch.where(live, inverse, 0.0)
    return scale, inverse


def _codes(y: Tensor, fmt: BlockFormat, second: bool, positive: Tensor) -> Tensor:
    """Codes (0..255 in int32) of the already scaled values ``y`` (finite)."""
    if fmt.name == "fp8":
        code = y.clamp(-448.0, 448.0).to(_E4M3).view(torch.uint8).to(torch.int32)
    elif fmt.name == "int4":  # the nearest table value's index (ties: the smaller magnitude)
        if second:
            return torch.bucketize(y, torch.tensor(_ROOT_MIDS, device=y.device)).to(torch.int32)
        index = torch.bucketize(y.abs(), torch.tensor(_MAG_MIDS, device=y.device))
        return torch.where(y < 0, -index, index).to(torch.int32) & 0xF
    else:
        top = _TOP[fmt.name, second]
        code = torch.round(y).clamp_(-top, top).to(torch.int32)
        code = code & (0xFF if fmt.name == "int8" else 0xF)
    if second:
        code = torch.where(positive & (code == 0), 1, code)
    return code


def _sqrt(x: Tensor) -> Tensor:
    """The correctly rounded float32 square root (torch's own CPU ``sqrt`` may be one ulp
    off: it goes through a vector math library; the float64 root rounded once is exact)."""
    return torch.sqrt(x.double()).float()


def _stored_values(x: Tensor, fmt: BlockFormat, second: bool) -> Tensor:
    """What the codes represent: the moment, or the square root of the second moment."""
    return _sqrt(x) if second and fmt.name != "fp8" else x


def _encode_rows(x: Tensor, fmt: BlockFormat, second: bool) -> tuple[Tensor, Tensor]:
    """Codes (int32, flat, ``x.numel()`` of them) and scales of flat FP32 ``x``."""
    n = x.numel()
    stored = _stored_values(x, fmt, second)
    scale, inverse = _scales_of(stored, fmt, second)
    rows = _padded(stored, fmt.block_size)
    inv = inverse.unsqueeze(1)
    y = torch.where(inv != 0, rows * inv, 0.0)
    positive = (rows > 0) & (inv != 0)
    return _codes(y, fmt, second, positive).reshape(-1)[:n], scale


def _pack(codes: Tensor, fmt: BlockFormat) -> Tensor:
    if fmt.name != "int4":
        return codes.to(torch.uint8)
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    pairs = codes.reshape(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8)


def _unpack(packed: Tensor, fmt: BlockFormat, numel: int) -> Tensor:
    """Codes as int32, one per value."""
    c = packed.to(torch.int32)
    if fmt.name == "int4":
        c = torch.stack([c & 0xF, c >> 4], dim=1).reshape(-1)
    return c[:numel]


def encode(x: Tensor, fmt: BlockFormat, state_name: str) -> tuple[Tensor, Tensor]:
    """Flat FP32 values of one moment -> (codes, scales), fresh tensors on ``x``'s device.

    Example:
        >>> import torch
        >>> codes, scales = encode(torch.tensor([4.0, 1.0]), BlockFormat("int8", 32),
        ...                        "exp_avg_sq")
        >>> codes.tolist(), scales.tolist()
        ([128, 64], [0.015625])
    """
    second = _second(state_name)
    flat = x.reshape(-1).to(torch.float32)
    codes, scales = _encode_rows(flat, fmt, second)
    return _pack(codes, fmt), scales


def encode_into(
    x: Tensor, codes: Tensor, scales: Tensor, fmt: BlockFormat, state_name: str, start: int = 0
) -> None:
    """Encode flat FP32 ``x`` (any device) as the values from ``start`` on (a multiple of the
    block size) into ``codes`` and ``scales``; ``x`` ends at the tensor's end or a block
    boundary. Blocks are independent, so a tensor can be encoded one slice at a time.

    Example:
        >>> import torch
        >>> fmt = BlockFormat("int4", 32)
        >>> codes, scales = torch.empty(32, dtype=torch.uint8), torch.empty(2)
        >>> encode_into(torch.ones(32), codes, scales, fmt, "exp_avg", start=32)
        >>> codes[16:].tolist() == [0x77] * 16, scales[1].item()
        (True, 1.0)
    """
    block = fmt.block_size
    if start % block:
        raise ValueError(f"a slice starts at a block boundary (multiple of {block}), got {start}")
    packed, new = encode(x.to(codes.device), fmt, state_name)
    first = fmt.code_bytes(start) if fmt.name != "int4" else start // 2
    codes.view(-1)[first : first + packed.numel()].copy_(packed)
    scales.view(-1)[start // block : start // block + new.numel()].copy_(new)


def _table(second: bool, device: torch.device) -> Tensor:
    """The 16 float32 values of int4 codes, by nibble."""
    if second:
        return torch.tensor(INT4_ROOTS, dtype=torch.float32, device=device)
    signed = INT4_MAGNITUDES + tuple(-m for m in INT4_MAGNITUDES[:0:-1])
    return torch.tensor((*signed[:8], -1.0, *signed[8:]), dtype=torch.float32, device=device)


def int4_tables(device: torch.device | str = "cpu") -> Tensor:
    """The int4 tables as one float32 tensor (what the Triton kernel reads): ``exp_avg``'s
    values by nibble (0..15), ``exp_avg_sq``'s square roots by code (16..31), the
    midpoints of the ``exp_avg`` magnitudes (32..38) and of the square roots (39..53).

    Example:
        >>> t = int4_tables()
        >>> t.numel(), t[7].item(), t[9].item(), t[16].item()
        (54, 1.0, -1.0, 0.0625)
    """
    values = torch.cat([_table(False, torch.device("cpu")), _table(True, torch.device("cpu")),
                        torch.tensor(_MAG_MIDS + _ROOT_MIDS, dtype=torch.float32)])  # fmt: skip
    return values.to(device)


def _decode_codes(c: Tensor, scale: Tensor, fmt: BlockFormat, second: bool) -> Tensor:
    """Values of int32 codes ``c`` (rows of one block) under per-row ``scale``."""
    if fmt.name == "fp8":
        value = c.to(torch.uint8).view(_E4M3).to(torch.float32)
    elif fmt.name == "int4":
        value = _table(second, c.device)[c.long()]
    elif second:
        value = c.to(torch.float32)
    else:
        bits = 8 if fmt.name == "int8" else 4
        value = torch.where(c >= (1 << (bits - 1)), c - (1 << bits), c).to(torch.float32)
    x = value * scale
    return x * x if second and fmt.name != "fp8" else x


def decode_into(
    codes: Tensor, scales: Tensor, fmt: BlockFormat, state_name: str, start: int, out: Tensor
) -> None:
    """Fill the flat float32 ``out`` with values ``[start, start + out.numel())``; the
    temporaries cover the blocks the slice touches (at most ``out.numel() + 2 * block``).

    Example:
        >>> import torch
        >>> fmt = BlockFormat("int8", 32)
        >>> codes, scales = encode(torch.arange(40.0), fmt, "exp_avg")
        >>> out = torch.empty(3)
        >>> decode_into(codes, scales, fmt, "exp_avg", 30, out)
        >>> out.tolist()
        [30.0, 31.0, 32.0]
    """
    second = _second(state_name)
    n = out.numel()
    if n == 0:
        return
    block = fmt.block_size
    first, last = start // block, (start + n - 1) // block + 1
    lo = first * block
    if fmt.name == "int4":
        packed = codes.view(-1)[lo // 2 : (last * block + 1) // 2]
    else:
        packed = codes.view(-1)[lo : last * block]
    c = _unpack(packed.to(out.device), fmt, packed.numel() * (2 if fmt.name == "int4" else 1))
    c = torch.nn.functional.pad(c, (0, (last - first) * block - c.numel()))
    scale = scales.view(-1)[first:last].to(device=out.device, dtype=torch.float32)
    values = _decode_codes(c.reshape(-1, block), scale.unsqueeze(1), fmt, second).reshape(-1)
    out.view(-1).copy_(values[start - lo : start - lo + n])


def decode(codes: Tensor, scales: Tensor, fmt: BlockFormat, state_name: str, numel: int) -> Tensor:
    """The flat FP32 values of one stored moment (a fresh tensor on the codes' device).

    Example:
        >>> import torch
        >>> fmt = BlockFormat("fp8", 32)
        >>> codes, scales = encode(torch.tensor([3.0, -0.5]), fmt, "exp_avg")
        >>> decode(codes, scales, fmt, "exp_avg", 2).tolist()
        [3.0, -0.5]
    """
    out = torch.empty(numel, dtype=torch.float32, device=codes.device)
    decode_into(codes, scales, fmt, state_name, 0, out)
    return out


def step_blocks(
    p: Tensor,
    g: Tensor,
    codes: tuple[Tensor, Tensor],
    scales: tuple[Tensor, Tensor],
    fmt: BlockFormat,
    hyper: tuple[float, float, float, float, float, float, float],
    *,
    adam_w_mode: bool,
) -> None:
    """One AdamW step of flat FP32 ``p`` (in place) and its block-scaled moments (codes and
    scales written in place), the compiled kernel's arithmetic in torch: every operation in
    float32, rounded on its own, in the kernel's order; the new moments are encoded under
    the scales of their own blocks. ``hyper``: (lr, beta1, beta2, eps, weight_decay,
    1/bias_correction1, 1/bias_correction2), each rounded to float32 as the kernel takes it.

    Example:
        >>> import torch
        >>> fmt = BlockFormat("int8", 32)
        >>> p, codes = torch.ones(3), (torch.zeros(3, dtype=torch.uint8),) * 2
        >>> codes = (codes[0], codes[0].clone())
        >>> scales = (torch.zeros(1), torch.zeros(1))
        >>> step_blocks(p, torch.ones(3), codes, scales, fmt,
        ...             (0.1, 0.9, 0.999, 1e-8, 0.0, 10.0, 1000.0), adam_w_mode=True)
        >>> [round(x, 4) for x in p.tolist()], codes[0].tolist(), scales[0].item()
        ([0.9, 0.9, 0.9], [102, 102, 102], 0.0009765625)
    """
    n = p.numel()
    lr, b1, b2, eps, wd, inv_bc1, inv_bc2 = (torch.tensor(v, dtype=torch.float32) for v in hyper)
    omb1 = torch.tensor(1.0 - hyper[1], dtype=torch.float32)
    omb2 = torch.tensor(1.0 - hyper[2], dtype=torch.float32)
    m_old = decode(codes[0], scales[0], fmt, "exp_avg", n)
    v_old = decode(codes[1], scales[1], fmt, "exp_avg_sq", n)
    grad = g.reshape(-1).to(torch.float32)
    if not adam_w_mode:
        grad = grad + wd * p
    m = b1 * m_old + omb1 * grad
    v = b2 * v_old + (omb2 * grad) * grad
    denom = _sqrt(v * inv_bc2) + eps
    update = (m * inv_bc1) / denom
    if adam_w_mode:
        update = update + wd * p
    p.copy_(p - lr * update)
    for i, (name, value) in enumerate((("exp_avg", m), ("exp_avg_sq", v))):
        encode_into(value, codes[i], scales[i], fmt, name)
