"""FP32 <-> optimizer-state storage formats, bit-compatible with Transformer Engine's FusedAdam.

Precision-aware optimizers keep Adam moments (and sometimes master weights) in a narrow
storage dtype and expand them to FP32 to compute or to checkpoint. This module is the one
place that knows the formats, so the optimizer's step, its checkpoint API and the staging
engine produce the same bits:

==================  =============  ===========================================================
storage dtype       scale          stored value
==================  =============  ===========================================================
``torch.float32``   none           ``x``
``torch.bfloat16``  none           ``x`` rounded to nearest even
``torch.float16``   amax / 32752   ``fp16(x * r)`` with ``r = 1/scale`` (0 when scale is 0)
``torch.uint8``     amax / 448     FP8 E4M3 bits of ``saturate(x * q)``, ``q = 1/scale``
==================  =============  ===========================================================

Decoding multiplies by ``scale`` (fp16) or by ``1/q`` (FP8, TE's ``scale_inv``). A scale is a
float32 tensor of shape ``[1]`` living beside the storage; it is never part of a checkpoint.

Where TE differs, we say so: an all-zero FP8 tensor gets ``q = 0`` and decodes to zeros (TE
computes ``1/0`` and stores NaN). A non-finite amax (a tensor holding inf or NaN) poisons the
whole fp16/FP8 tensor: every element decodes to NaN, as in TE. bf16 keeps inf and NaN per
element. FP32 subnormal inputs are kept (IEEE); CUDA builds with flush-to-zero may differ there.

``store_param_remainders`` splits an FP32 master into a bf16 parameter (the high 16 bits,
rounded half away from zero by magnitude) and an int16 remainder (the low 16 bits):
:mod:`wrapped_optim._formats.remainders` holds TE's exact bit arithmetic for that split.

Everything works on whole tensors or on one flat slice at a time (``*_into`` functions and
:func:`amax_of` + :func:`combine_amax`), so a host buffer can be filled chunk by chunk.

Example:
    >>> import torch
    >>> from wrapped_optim._formats import codecs
    >>> x = torch.tensor([0.5, -2.0, 3.0])
    >>> stored, scale = codecs.encode(x, torch.uint8)
    >>> stored.dtype, [round(v, 3) for v in codecs.decode(stored, torch.uint8, scale).tolist()]
    (torch.uint8, [0.482, -1.929, 3.0])
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import Tensor

__all__ = [
    "FP8_E4M3",
    "FP8_E4M3_RANGE",
    "FP16_RANGE",
    "STORAGE_DTYPES",
    "amax_of",
    "chunk_bounds",
    "combine_amax",
    "decode",
    "decode_into",
    "decode_multiplier",
    "encode",
    "encode_chunked",
    "encode_into",
    "encode_multiplier",
    "exact_scale",
    "is_scaled",
    "scale_from_amax",
    "storage_range",
]

#: TE's marker dtype for FP8 E4M3 state: the bits are kept in a ``torch.uint8`` tensor.
FP8_E4M3 = torch.uint8
#: The fp16 range TE scales into: half of the largest finite fp16 value (65504 / 2).
FP16_RANGE = torch.finfo(torch.float16).max / 2.0
#: The largest finite FP8 E4M3 value; TE scales amax onto it.
FP8_E4M3_RANGE = 448.0
#: Every storage dtype a precision-aware state may use.
STORAGE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, FP8_E4M3)

_E4M3 = torch.float8_e4m3fn


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in STORAGE_DTYPES:
        raise ValueError(
            f"unsupported storage dtype {dtype}; expected one of "
            "torch.float32, torch.bfloat16, torch.float16, torch.uint8 (FP8 E4M3)"
        )


def is_scaled(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` stores values relative to a per-tensor scale (fp16 and FP8).

    Example:
        >>> import torch
        >>> from wrapped_optim._formats.codecs import is_scaled
        >>> is_scaled(torch.float16), is_scaled(torch.bfloat16)
        (True, False)
    """
    _check_dtype(dtype)
    return dtype in (torch.float16, FP8_E4M3)


def storage_range(dtype: torch.dtype) -> float:
    """The magnitude a scaled format maps amax onto (32752 for fp16, 448 for FP8 E4M3).

    Example:
        >>> import torch
        >>> from wrapped_optim._formats.codecs import storage_range
        >>> storage_range(torch.float16), storage_range(torch.uint8)
        (32752.0, 448.0)
    """
    if not is_scaled(dtype):
        raise ValueError(f"{dtype} is not a scaled storage format")
    return FP16_RANGE if dtype == torch.float16 else FP8_E4M3_RANGE


def chunk_bounds(numel: int, chunk_numel: int) -> Iterator[tuple[int, int]]:
    """Yield ``(start, stop)`` flat ranges covering ``numel`` elements, ``chunk_numel`` at a time.

    Example:
        >>> from wrapped_optim._formats.codecs import chunk_bounds
        >>> list(chunk_bounds(5, 2))
        [(0, 2), (2, 4), (4, 5)]
    """
    if chunk_numel <= 0:
        raise ValueError(f"chunk_numel must be positive, got {chunk_numel}")
    for start in range(0, numel, chunk_numel):
        yield start, min(start + chunk_numel, numel)


def amax_of(x: Tensor) -> Tensor:
    """Largest magnitude of ``x`` as a float32 tensor of shape ``[1]`` (NaN if any is NaN).

    Computed as TE does (``max(-min, max)``, no ``|x|`` temporary); ``-0`` is normalised to
    ``+0`` so whole-tensor and chunk-combined results are bitwise equal. Empty input gives 0.

    Example:
        >>> import torch
        >>> from wrapped_optim._formats.codecs import amax_of
        >>> amax_of(torch.tensor([1.0, -3.0, 2.0]))
        tensor([3.])
    """
    if x.numel() == 0:
        return torch.zeros(1, dtype=torch.float32, device=x.device)
    lo, hi = torch.aminmax(x)
    return torch.maximum(-lo, hi).to(torch.float32).abs().reshape(1)


def combine_amax(a: Tensor, b: Tensor) -> Tensor:
    """Combine two chunk amaxes (NaN-propagating, order-independent).

    Example:
        >>> import torch
        >>> from wrapped_optim._formats.codecs import amax_of, combine_amax
        >>> combine_amax(amax_of(torch.tensor([1.0])), amax_of(torch.tensor([-4.0])))
        tensor([4.])
    """
    return torch.maximum(a, b.to(a.device))


def scale_from_amax(amax: Tensor, dtype: torch.dtype) -> Tensor:
    """TE's per-tensor scale ``amax / range`` (float32, shape ``[1]``; one per element for
    several amax values at once), correctly rounded.

    The range is a float32 tensor on ``amax``'s device: divided by a Python number, CUDA
    multiplies by its reciprocal instead, which can differ from TE's division in the last bit.

    Example:
        >>> import torch
        >>> from wrapped_optim._formats.codecs import scale_from_amax
        >>> scale_from_amax(torch.tensor([896.0]), torch.uint8)
        tensor([2.])
    """
    amax = amax.to(torch.float32).reshape(-1)
    return torch.div(amax, _range_tensor(dtype, amax.device))


_RANGES: dict[tuple[torch.dtype, torch.device], Tensor] = {}


def _range_tensor(dtype: torch.dtype, device: torch.device) -> Tensor:
    key = (dtype, device)
    found = _RANGES.get(key)
    if found is None:  # filled on the device (no host copy); kept for the next call
        found = _RANGES[key] = torch.full((1,), storage_range(dtype), device=device)
    return found


def encode_multiplier(scale: Tensor, dtype: torch.dtype) -> Tensor:
    """What values are multiplied by before the cast: ``1/scale``, or 0 where that is unusable.

    The multiplier is 0 for a zero scale (all-zero tensor), a NaN scale, and a subnormal scale
    whose reciprocal overflows (amax below about 1e-36): such tensors are stored as zeros.
    TE uses ``where(scale > 0, 1/scale, 0)`` for fp16 and ``1/scale`` for FP8, which stores
    NaN for an all-zero FP8 tensor and NaN/inf for the overflowing case.

    Example:
        >>> import torch
        >>> from wrapped_optim._formats.codecs import encode_multiplier
        >>> encode_multiplier(torch.tensor([0.5, 0.0]), torch.float16)
        tensor([2., 0.])
    """
    inv = scale.reciprocal()
    return torch.where((scale != 0) & torch.isfinite(inv), inv, torch.zeros_like(inv))


def decode_multiplier(scale: Tensor, dtype: torch.dtype) -> Tensor:
    """What stored values are multiplied by when expanding to FP32.

    fp16: the scale itself. FP8: TE's ``scale_inv``, the reciprocal of the encode multiplier
    ``1/scale`` (which can differ from ``scale`` in the last bit); 0 where the encode
    multiplier is 0 for a finite scale, and the (inf or NaN) scale itself for a non-finite
    one, so a tensor holding inf or NaN decodes to NaN everywhere, as in TE.

    Example:
        >>> import torch
        >>> from wrapped_optim._formats.codecs import decode_multiplier
        >>> decode_multiplier(torch.tensor([0.25]), torch.uint8)
        tensor([0.2500])
    """
    if dtype == torch.float16:
        return scale
    mult = encode_multiplier(scale, dtype)
    inv = mult.reciprocal()
    fallback = torch.where(torch.isfinite(scale), torch.zeros_like(scale), scale)
    return torch.where(mult != 0, inv, fallback)


def encode_into(
    x: Tensor,
    out: Tensor,
    dtype: torch.dtype,
    scale: Tensor | None = None,
    *,
    overwrite_x: bool = False,
    multiplier: Tensor | None = None,
) -> None:
    """Quantize FP32 ``x`` into the storage tensor ``out`` (same number of elements).

    ``x`` may live on any device; it is moved to ``out``'s device. Scaled formats need the
    tensor's ``scale`` (from :func:`scale_from_amax` over the *whole* tensor), so a big tensor
    can be encoded one slice at a time. With ``overwrite_x`` the scaling is done in ``x``
    itself (the caller's scratch buffer) instead of a temporary. ``x`` is otherwise untouched.
    A slice loop may pass ``multiplier=encode_multiplier(scale, dtype)`` computed once.

    Example:
        >>> import torch
        >>> from wrapped_optim._formats.codecs import encode_into
        >>> out = torch.empty(2, dtype=torch.bfloat16)
        >>> encode_into(torch.tensor([1.0, 2.0]), out, torch.bfloat16)
        >>> out
        tensor([1., 2.], dtype=torch.bfloat16)
    """
    if out.dtype != dtype:
        _check_dtype(dtype)
        raise ValueError(f"storage tensor has dtype {out.dtype}, expected {dtype}")
    if x.shape != out.shape:
        if x.numel() != out.numel():
            raise ValueError(f"encode_into: {x.numel()} values for {out.numel()} storage elements")
        x = x.reshape(out.shape)
    if dtype == torch.float32 or dtype == torch.bfloat16:
        out.copy_(x)  # bf16: torch's cast is round-to-nearest-even
        return
    _check_dtype(dtype)
    if multiplier is not None:  # precomputed encode_multiplier(scale), for slice loops
        mult = multiplier
    elif scale is None:
        raise ValueError(f"encoding into {dtype} needs the tensor's scale")
    else:
        mult = encode_multiplier(scale.to(device=out.device, dtype=torch.float32), dtype)
    if overwrite_x and x.device == out.device and x.dtype == torch.float32:
        tmp = x.mul_(mult)
    else:
        tmp = torch.mul(x.to(device=out.device, dtype=torch.float32), mult)
    if dtype == torch.float16:
        out.copy_(tmp)
    else:
        # TE saturates (SATFINITE): beyond +-448, +-inf included, stores +-448; NaN stays NaN.
        # torch 2.13's CPU cast does the same (tests/formats/test_codecs.py checks it), but the
        # clamp keeps that result whatever another backend's cast does with out-of-range values.
        tmp.clamp_(-FP8_E4M3_RANGE, FP8_E4M3_RANGE)
        out.view(_E4M3).copy_(tmp)


def decode_into(
    storage: Tensor,
    out: Tensor,
    dtype: torch.dtype,
    scale: Tensor | None,
    *,
    multiplier: Tensor | None = None,
) -> None:
    """Expand ``storage`` into the float32 tensor ``out`` (same number of elements, any device).

    Allocates nothing of ``out``'s size: ``storage`` on another device is first copied to
    ``out``'s (a temporary of the storage's size, 1 or 2 bytes per element); FP8 on a CPU is a
    table gather through a fixed 64 KiB index block, elsewhere torch's cast. A slice loop may
    pass ``multiplier=decode_multiplier(scale, dtype)`` computed once.

    Example:
        >>> import torch
        >>> from wrapped_optim._formats.codecs import decode_into
        >>> out = torch.empty(2)
        >>> decode_into(torch.tensor([1.0, 2.0], dtype=torch.float16), out, torch.float16,
        ...             torch.tensor([0.5]))
        >>> out
        tensor([0.5000, 1.0000])
    """
    if storage.dtype != dtype:
        _check_dtype(dtype)
        raise ValueError(f"storage tensor has dtype {storage.dtype}, expected {dtype}")
    if out.dtype != torch.float32:
        raise ValueError(f"decode_into writes float32, got an output of dtype {out.dtype}")
    if out.shape == storage.shape:
        view = out
    elif storage.numel() != out.numel():
        raise ValueError(f"decode_into: {storage.numel()} stored values for {out.numel()} outputs")
    else:
        view = out.view(storage.shape) if out.is_contiguous() else out.reshape(storage.shape)
    if dtype == torch.float32 or dtype == torch.bfloat16:
        view.copy_(storage)
        return
    _check_dtype(dtype)
    if storage.device != view.device:
        storage = storage.to(view.device)
    if dtype == FP8_E4M3 and view.is_contiguous() and view.device.type == "cpu":
        _gather_e4m3(storage.reshape(-1), view.view(-1))
    elif dtype == FP8_E4M3:
        view.copy_(storage.view(_E4M3))
    else:
        view.copy_(storage)
    if is_scaled(dtype):
        if multiplier is None:
            if scale is None:
                raise ValueError(f"decoding {dtype} needs the tensor's scale")
            multiplier = decode_multiplier(scale.to(device=out.device, dtype=torch.float32), dtype)
        # A per-tensor multiplier has one element; as a 0-d tensor it broadcasts into any
        # view in place, 0-d parameters included.
        view.mul_(multiplier.reshape(()) if multiplier.numel() == 1 else multiplier)
    if view.data_ptr() != out.data_ptr():  # pragma: no cover - reshape of a strided out
        out.copy_(view.reshape(out.shape))


_E4M3_TABLES: dict[torch.device, Tensor] = {}
#: Elements per FP8 table-gather block on CPU (its int32 index is the only temporary).
GATHER_BLOCK = 16 * 1024


def _gather_e4m3(codes: Tensor, out: Tensor) -> None:
    """torch's E4M3 -> FP32 cast is scalar code on CPU (~8 ns/element); a gather from the
    256-entry table of exactly those casts gives the same bits several times faster. The
    int32 index is built one block at a time, so it never grows with the tensor."""
    table = _e4m3_table(out.device)
    n = out.numel()
    index = torch.empty(min(n, GATHER_BLOCK), dtype=torch.int32, device=out.device)
    for start in range(0, n, GATHER_BLOCK):
        stop = min(start + GATHER_BLOCK, n)
        block = index[: stop - start]
        block.copy_(codes[start:stop])
        torch.index_select(table, 0, block, out=out[start:stop])


def _e4m3_table(device: torch.device) -> Tensor:
    table = _E4M3_TABLES.get(device)
    if table is None:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        table = codes.view(_E4M3).to(torch.float32).to(device)
        _E4M3_TABLES[device] = table
    return table


def _bitwise_equal(a: Tensor, b: Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.int32), b.reshape(-1).view(torch.int32))


def _next_float(scale: Tensor, ulps: int) -> Tensor:
    bits = scale.view(torch.int32) + ulps
    return bits.view(torch.float32)


def exact_scale(
    chunks: Callable[[], Iterable[Tensor]], dtype: torch.dtype, device: torch.device
) -> Tensor:
    """The scale for a tensor given as a re-iterable sequence of FP32 chunks.

    TE's rule is ``amax / range``. When the values are exactly representable under a scale
    one or two ulps away (they are the expansion of stored state, e.g. from a checkpoint), that
    scale is returned instead, so decode -> encode -> decode is lossless and training resumes
    bit-identically. Otherwise TE's scale is returned unchanged. Chunks may be on any device;
    each is moved to ``device`` before use, and only chunk-sized temporaries are allocated.

    Example:
        >>> import torch
        >>> from wrapped_optim._formats import codecs
        >>> stored, scale = codecs.encode(torch.tensor([0.1, -0.3]), torch.float16)
        >>> x = codecs.decode(stored, torch.float16, scale)
        >>> bool(codecs.exact_scale(lambda: [x], torch.float16, x.device) == scale)
        True
    """
    amax = torch.zeros(1, dtype=torch.float32, device=device)
    for chunk in chunks():
        amax = combine_amax(amax, amax_of(chunk.to(device=device, dtype=torch.float32)))
    te_scale = scale_from_amax(amax, dtype)
    if not bool(torch.isfinite(te_scale).all()) or float(te_scale) == 0.0:
        return te_scale
    for ulps in (0, 1, -1, 2, -2):
        candidate = _next_float(te_scale, ulps)
        if _round_trips(chunks, dtype, candidate, device):
            return candidate
    return te_scale


def _round_trips(
    chunks: Callable[[], Iterable[Tensor]], dtype: torch.dtype, scale: Tensor, device: torch.device
) -> bool:
    for chunk in chunks():
        x = chunk.to(device=device, dtype=torch.float32).reshape(-1)
        stored = torch.empty(x.numel(), dtype=dtype, device=device)
        encode_into(x, stored, dtype, scale)
        back = torch.empty_like(x)
        decode_into(stored, back, dtype, scale)
        if not _bitwise_equal(back, x):
            return False
    return True


#: Device bytes per element a scaled chunked encode holds at once: the values moved to the
#: device (4), a copy of them that is encoded in place and decoded back (4), the trial
#: encoding (up to 2), and the bool mask CUDA's ``torch.equal`` makes to compare them (1).
ENCODE_BYTES_PER_ELEMENT = 11


def encode_chunked(source: Tensor, out: Tensor, dtype: torch.dtype, chunk_numel: int) -> Tensor:
    """Quantize the flat FP32 ``source`` (any device) into the flat scaled storage ``out``.

    Returns the scale: :func:`exact_scale`'s choice (TE's ``amax / range``, or a neighbour
    under which the values round-trip exactly). Every device temporary together stays within
    ``chunk_numel`` FP32 elements (``4 * chunk_numel`` bytes): the work goes in blocks of
    ``4 * chunk_numel // ENCODE_BYTES_PER_ELEMENT`` elements. ``source`` is never modified.
    The bits are those of :func:`encode` with ``exact=True``.

    Example:
        >>> import torch
        >>> from wrapped_optim._formats import codecs
        >>> out = torch.empty(5, dtype=torch.uint8)
        >>> scale = codecs.encode_chunked(torch.tensor([1.0, 2, 3, 4, 448]), out, torch.uint8, 3)
        >>> out.tolist(), scale.tolist()
        ([56, 64, 68, 72, 126], [1.0])
    """
    if not is_scaled(dtype) or out.dtype != dtype:
        raise ValueError(f"encode_chunked writes a scaled format into {dtype} storage")
    if source.numel() != out.numel() or source.dtype != torch.float32:
        raise ValueError("encode_chunked needs as many float32 values as storage elements")
    device = out.device
    n = out.numel()
    block = max(1, min(n, 4 * chunk_numel // ENCODE_BYTES_PER_ELEMENT))
    values = torch.empty(2 * block, dtype=torch.float32, device=device)
    moved, trial = values[:block], values[block:]
    stored = torch.empty(block, dtype=dtype, device=device)
    flat_source, flat_out = source.reshape(-1), out.reshape(-1)

    def blocks() -> Iterator[Tensor]:
        for start, stop in chunk_bounds(n, block):
            yield moved[: stop - start].copy_(flat_source[start:stop])

    amax = torch.zeros(1, dtype=torch.float32, device=device)
    for x in blocks():
        amax = combine_amax(amax, amax_of(x))
    scale = te_scale = scale_from_amax(amax, dtype)
    if bool(torch.isfinite(te_scale).all()) and float(te_scale) != 0.0:
        for ulps in (0, 1, -1, 2, -2):
            candidate = _next_float(te_scale, ulps)
            if all(_round_trips_in(x, trial, stored, dtype, candidate) for x in blocks()):
                scale = candidate
                break
    mult = encode_multiplier(scale, dtype)
    for (start, stop), x in zip(chunk_bounds(n, block), blocks(), strict=True):
        encode_into(x, flat_out[start:stop], dtype, overwrite_x=True, multiplier=mult)
    return scale


def _round_trips_in(
    x: Tensor, trial: Tensor, stored: Tensor, dtype: torch.dtype, scale: Tensor
) -> bool:
    """Whether ``x`` survives encode -> decode under ``scale``, in the given buffers."""
    k = x.numel()
    back = trial[:k].copy_(x)
    encode_into(back, stored[:k], dtype, scale, overwrite_x=True)
    decode_into(stored[:k], back, dtype, scale)
    return _bitwise_equal(back, x)


def encode(
    x: Tensor, dtype: torch.dtype, scale: Tensor | None = None, *, exact: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Quantize a whole FP32 tensor; returns ``(storage, scale)`` (scale None if unscaled).

    Without a given ``scale`` a scaled format uses TE's ``amax / range``, or with
    ``exact=True`` the lossless choice of :func:`exact_scale`. ``x`` is never modified.

    Example:
        >>> import torch
        >>> from wrapped_optim._formats.codecs import encode
        >>> stored, scale = encode(torch.tensor([0.0, 0.0]), torch.uint8)
        >>> stored.tolist(), scale.tolist()
        ([0, 0], [0.0])
    """
    _check_dtype(dtype)
    if x.dtype != torch.float32:
        raise ValueError(f"encode expects float32 values, got {x.dtype}")
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if is_scaled(dtype) and scale is None:
        if exact:
            scale = exact_scale(lambda: [x], dtype, x.device)
        else:
            scale = scale_from_amax(amax_of(x), dtype)
    encode_into(x, out, dtype, scale)
    return out, (scale if is_scaled(dtype) else None)


def decode(storage: Tensor, dtype: torch.dtype, scale: Tensor | None = None) -> Tensor:
    """Expand a whole stored tensor to a fresh float32 tensor of the same shape.

    Example:
        >>> import torch
        >>> from wrapped_optim._formats.codecs import decode
        >>> decode(torch.tensor([1.5], dtype=torch.bfloat16), torch.bfloat16)
        tensor([1.5000])
    """
    out = torch.empty(storage.shape, dtype=torch.float32, device=storage.device)
    decode_into(storage, out, dtype, scale)
    return out
