"""TE's ``store_param_remainders`` bit arithmetic: an FP32 master as a bf16 param + int16.

With ``store_param_remainders`` a precision-aware optimizer keeps no FP32 master beside a
bf16 parameter: the parameter holds the master's high 16 bits (rounded half away from zero by
magnitude) and an int16 tensor the low 16 bits, so the master is rebuilt exactly from both.
A NaN master is the exception: its bits would round to any bf16 (the quiet NaN 0x7FFFFFFF that
CUDA arithmetic produces rounds to -0.0, so the model would compute on a zero while its master
is NaN), so it is split into the bf16 quiet NaN 0x7FC0 and a zero remainder: the parameter
shows the NaN, and the join gives a NaN back (the payload is not kept).
This is integer bit arithmetic only, separate from the scaled moment formats of
:mod:`wrapped_optim._formats.codecs` (which re-exports these functions; use them from there).

Example:
    >>> import torch
    >>> from wrapped_optim._formats.remainders import join_master, split_master
    >>> hi, rem = split_master(torch.tensor([1.0 + 2**-20]))
    >>> join_master(hi, rem).item() == 1.0 + 2**-20
    True
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["join_master", "split_master", "split_master_into"]

# The bf16 bits a NaN master's parameter takes (the quiet NaN), with remainder 0.
_NAN_PARAM_BITS = 0x7FC0


def split_master(master: Tensor) -> tuple[Tensor, Tensor]:
    """Split FP32 values into TE's ``(bf16 parameter, int16 remainder)`` pair.

    The remainder is the low 16 bits; the bf16 bits are the high 16 bits, plus one when the
    remainder is negative (bit 15 set), i.e. rounded half away from zero in magnitude
    (16-bit wrap-around, like TE's int16 arithmetic). A NaN splits into the bf16 quiet NaN
    0x7FC0 and remainder 0 (see the module's note).

    Example:
        >>> import torch
        >>> from wrapped_optim._formats.remainders import join_master, split_master
        >>> x = torch.tensor([1.0 + 2**-20, -3.3])
        >>> hi, rem = split_master(x)
        >>> bool((join_master(hi, rem) == x).all())
        True
    """
    if master.dtype != torch.float32:
        raise ValueError(f"split_master expects float32, got {master.dtype}")
    bits = master.contiguous().view(torch.int32)
    low = bits.to(torch.int16)  # the low 16 bits, sign-extended back below (wrap-around)
    # bits - sext(low) == (high + [low < 0]) << 16, so one subtraction does TE's rounding.
    high = torch.sub(bits, low).bitwise_right_shift_(16).to(torch.int16)
    nan = master.isnan()
    high.masked_fill_(nan, _NAN_PARAM_BITS)
    low.masked_fill_(nan, 0)
    return high.view(torch.bfloat16), low


def split_master_into(
    master: Tensor, param: Tensor, remainder: Tensor, *, scratch: Tensor | None = None
) -> None:
    """:func:`split_master` writing into existing tensors (a bf16 parameter slice and its
    int16 remainder slice); ``scratch`` is an optional int32 buffer of the same size.

    Example:
        >>> import torch
        >>> from wrapped_optim._formats.remainders import split_master_into
        >>> param = torch.empty(1, dtype=torch.bfloat16)
        >>> rem = torch.empty(1, dtype=torch.int16)
        >>> split_master_into(torch.tensor([1.0]), param, rem)
        >>> param, rem
        (tensor([1.], dtype=torch.bfloat16), tensor([0], dtype=torch.int16))
    """
    if master.dtype != torch.float32 or param.dtype != torch.bfloat16:
        raise ValueError("split_master_into expects float32 values and a bf16 parameter")
    if remainder.dtype != torch.int16:
        raise ValueError(f"remainder must be int16, got {remainder.dtype}")
    bits = master.contiguous().view(torch.int32).reshape(remainder.shape)
    remainder.copy_(bits)  # int32 -> int16 keeps the low 16 bits
    # Explicit int32 operands: a mixed int32/int16 op would allocate a promoted temporary.
    high = torch.empty_like(bits) if scratch is None else scratch.view(bits.shape)
    high.copy_(remainder)  # sign-extends
    torch.sub(bits, high, out=high)
    torch.bitwise_right_shift(high, 16, out=high)  # the out= form is the vectorized one
    param.view(torch.int16).copy_(high.view(param.shape))
    nan = master.isnan()
    param.view(torch.int16).masked_fill_(nan.view(param.shape), _NAN_PARAM_BITS)
    remainder.masked_fill_(nan.view(remainder.shape), 0)


def join_master(
    param: Tensor, remainder: Tensor, out: Tensor | None = None, *, scratch: Tensor | None = None
) -> Tensor:
    """Rebuild FP32 values from a bf16 parameter and its int16 remainder (TE's bit arithmetic).

    With ``out`` (contiguous float32) nothing is allocated when an int32-sized ``scratch``
    buffer is given too.

    Example:
        >>> import torch
        >>> from wrapped_optim._formats.remainders import join_master
        >>> param = torch.tensor([2.0], dtype=torch.bfloat16)
        >>> join_master(param, torch.zeros(1, dtype=torch.int16))
        tensor([2.])
    """
    if param.dtype != torch.bfloat16 or remainder.dtype != torch.int16:
        raise ValueError(
            f"join_master expects a bf16 parameter and int16 remainder, got {param.dtype} "
            f"and {remainder.dtype}"
        )
    if param.numel() != remainder.numel():
        raise ValueError(
            f"join_master: the parameter has {param.numel()} elements and the remainder "
            f"{remainder.numel()}; pass the remainder split from this parameter's master"
        )
    # (high << 16) + sext(remainder) == (high - [remainder < 0]) << 16 | (remainder & 0xFFFF)
    if out is not None and out.is_contiguous() and out.dtype == torch.float32:
        bits = out.view(torch.int32).view(param.shape)
        bits.copy_(param.view(torch.int16))
        torch.bitwise_left_shift(bits, 16, out=bits)  # the out= form is the vectorized one
        if scratch is None:
            bits.add_(remainder.reshape(bits.shape))
        else:  # an int32 copy of the remainder avoids a promoted temporary
            low = scratch.view(torch.int32).view(bits.shape)
            low.copy_(remainder.reshape(bits.shape))
            bits.add_(low)
        return out
    bits = torch.bitwise_left_shift(param.contiguous().view(torch.int16).to(torch.int32), 16)
    bits.add_(remainder.reshape(bits.shape))
    values = bits.view(torch.float32).reshape(param.shape)
    if out is None:
        return values
    out.copy_(values.reshape(out.shape))
    return out
