"""The per-parameter state rules of a PrecisionAwareAdamW: creating storage, checking a
source, quantizing FP32 values into storage and reading them back.

Each function takes the optimizer's
:class:`~wrapped_optim.optimizers.precision_adamw._layout.PrecisionLayout`, one parameter's
``state`` (state name -> storage) and the optimizer's ``scales`` table (parameter -> state name ->
one-element float32 scale, or one scale per block of a block-scaled moment; an entry exists
only for parameters with a scaled state).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch import Tensor

from wrapped_optim._adapters.dtensor import local_tensor
from wrapped_optim._formats import blocks, codecs
from wrapped_optim.optimizers.precision_adamw._layout import STATE_NAMES, PrecisionLayout

__all__ = [
    "check_blocked",
    "check_name",
    "check_source",
    "create",
    "encode_into_state",
    "read_chunk",
    "scale_of",
    "stored",
    "unscaled",
]

_Scales = MutableMapping[Tensor, dict[str, Tensor]]


def check_name(state_name: str) -> None:
    """Rejects a state name the optimizer does not have."""
    if state_name not in STATE_NAMES:
        raise ValueError(
            f"unknown optimizer state {state_name!r}; expected one of {list(STATE_NAMES)}"
        )


def stored(state: Mapping[str, Tensor] | None, state_name: str) -> Tensor:
    """The storage of one state, or an error saying it was never created."""
    check_name(state_name)
    if not state or state_name not in state:
        raise ValueError(f"parameter has no optimizer state {state_name!r} (not initialized)")
    return state[state_name]


def scale_of(
    layout: PrecisionLayout, scales: Mapping[Tensor, Mapping[str, Tensor]], param: Tensor,
    state_name: str,
) -> Tensor | None:  # fmt: skip
    """The per-tensor scale of ``param``'s state (a block-scaled moment's block scales), None
    for an unscaled format."""
    if layout.is_blocked(state_name):
        return scales[param][state_name]
    if not layout.is_scaled(param, state_name):
        return None
    return scales[param][state_name]


def create(
    layout: PrecisionLayout,
    state: MutableMapping[str, Tensor],
    scales: _Scales,
    param: Tensor,
    state_name: str,
    *,
    zero: bool,
) -> None:
    """New storage of ``param``'s state (zeros if ``zero``; a remainder always), and a scale
    of one for a scaled format.

    Example:
        >>> import torch
        >>> layout = PrecisionLayout(exp_avg_dtype=torch.uint8)
        >>> p, state, scales = torch.zeros(3), {}, {}
        >>> create(layout, state, scales, p, "exp_avg", zero=True)
        >>> state["exp_avg"].dtype, scales[p]["exp_avg"]
        (torch.uint8, tensor([1.]))
    """
    local = local_tensor(param)
    fmt = layout.blocks
    if fmt is not None and layout.is_blocked(state_name):
        # Zero codes under zero scales: zeros, whatever ``zero`` asks (the codes of a
        # partial block's missing half-byte must be defined).
        n = local.numel()
        state[state_name] = torch.zeros(fmt.code_bytes(n), dtype=torch.uint8, device=local.device)
        scales.setdefault(param, {})[state_name] = torch.zeros(
            fmt.blocks(n), dtype=torch.float32, device=local.device
        )
        return
    dtype = layout.storage_dtype(param, state_name)
    make = torch.zeros if zero or dtype == torch.int16 else torch.empty
    state[state_name] = make(local.shape, dtype=dtype, device=local.device)
    if dtype != torch.int16 and codecs.is_scaled(dtype):
        scales.setdefault(param, {})[state_name] = torch.ones(
            1, dtype=torch.float32, device=local.device
        )


def _fits(
    layout: PrecisionLayout,
    state: Mapping[str, Tensor],
    scales: _Scales,
    param: Tensor,
    state_name: str,
) -> bool:
    """Whether ``param``'s storage of the state exists with the format and shape it needs."""
    storage = state.get(state_name)
    local = local_tensor(param)
    if layout.is_blocked(state_name):
        return (
            _blocked_problem(layout, storage, scales.get(param, {}).get(state_name), local) is None
        )
    dtype = layout.storage_dtype(param, state_name)
    if not (
        isinstance(storage, Tensor)
        and storage.dtype == dtype
        and storage.shape == local.shape
        and storage.device == local.device
        and storage.is_contiguous()
    ):
        return False
    return (
        dtype == torch.int16 or not codecs.is_scaled(dtype) or (state_name in scales.get(param, {}))
    )


def _blocked_problem(
    layout: PrecisionLayout, storage: object, scale: object, local: Tensor
) -> str | None:
    """What is wrong with a block-scaled moment's codes and scales, or None."""
    fmt = layout.blocks
    assert fmt is not None
    n = local.numel()
    if not isinstance(storage, Tensor) or storage.dtype != torch.uint8 or storage.dim() != 1:
        return "its codes are not a 1-D uint8 tensor"
    if storage.numel() != fmt.code_bytes(n) or not storage.is_contiguous():
        return f"it has {storage.numel()} code bytes, {fmt.name} needs {fmt.code_bytes(n)}"
    if storage.device != local.device:
        return f"its codes are on {storage.device}, the parameter on {local.device}"
    if not isinstance(scale, Tensor) or scale.dtype != torch.float32:
        return "its block scales are missing"
    if scale.numel() != fmt.blocks(n) or scale.device != local.device:
        return f"it has {scale.numel()} block scales on {scale.device}, expected {fmt.blocks(n)}"
    return None


def check_blocked(
    layout: PrecisionLayout, state: Mapping[str, Tensor], scales: Mapping[str, Tensor],
    param: Tensor,
) -> str | None:  # fmt: skip
    """What is wrong with ``param``'s block-scaled moments (codes and block scales), or None.

    Example:
        >>> import torch
        >>> layout = PrecisionLayout(block_format="int4", block_size=32)
        >>> p, state, scales = torch.zeros(5), {}, {}
        >>> create(layout, state, scales, p, "exp_avg", zero=True)
        >>> create(layout, state, scales, p, "exp_avg_sq", zero=True)
        >>> check_blocked(layout, state, scales[p], p) is None, state["exp_avg"].shape
        (True, torch.Size([3]))
    """
    local = local_tensor(param)
    for name in ("exp_avg", "exp_avg_sq"):
        if name in state:
            problem = _blocked_problem(layout, state[name], scales.get(name), local)
            if problem is not None:
                return f"state {name!r} ({layout.block_format} blocks): {problem}"
    return None


def check_source(
    layout: PrecisionLayout, param: Tensor, state_name: str, value: Any, what: str
) -> Tensor:
    """The local tensor of ``value``, once it is a valid source of ``param``'s state: a
    tensor of the expansion dtype with the parameter's (local) element count."""
    check_name(state_name)
    if state_name == "master_param" and not layout.master_weights:
        raise ValueError("'master_param' state needs master_weights=True")
    if not isinstance(value, Tensor):
        raise TypeError(f"{what} for state {state_name!r} must be a tensor, got {type(value)}")
    local = local_tensor(value)
    expected = layout.expansion_dtype(param, state_name)
    if local.dtype != expected:
        raise ValueError(
            f"{what} for state {state_name!r} has dtype {local.dtype}, expected {expected}"
        )
    if local.numel() != local_tensor(param).numel():
        raise ValueError(
            f"{what} for state {state_name!r} has {local.numel()} elements, the parameter "
            f"(local shard) has {local_tensor(param).numel()}"
        )
    return local


def encode_into_state(
    layout: PrecisionLayout,
    state: MutableMapping[str, Tensor],
    scales: _Scales,
    param: Tensor,
    state_name: str,
    flat: Tensor,
    chunk_numel: int,
) -> None:
    """Quantize the flat FP32 (or int16) source into storage, chunk by chunk: into the
    existing storage, unless it is missing or no longer fits (then the old is freed first).

    Example:
        >>> import torch
        >>> layout = PrecisionLayout(exp_avg_dtype=torch.float16)
        >>> p, state, scales = torch.zeros(2), {}, {}
        >>> encode_into_state(layout, state, scales, p, "exp_avg", torch.tensor([1.0, 2.0]), 1)
        >>> state["exp_avg"], scales[p]["exp_avg"] * 32752
        (tensor([16376., 32752.], dtype=torch.float16), tensor([2.]))
    """
    if not _fits(layout, state, scales, param, state_name):
        if state_name in state:  # free the old first; the state keeps its place
            state[state_name] = torch.empty(0)
        scales.get(param, {}).pop(state_name, None)
        create(layout, state, scales, param, state_name, zero=False)
    out = state[state_name].view(-1)
    fmt = layout.blocks
    if fmt is not None and layout.is_blocked(state_name):
        # Blocks are independent: each slice (whole blocks) is encoded on its own; the
        # encode's temporaries are a few times the slice, so slices are a quarter chunk.
        step = max(fmt.block_size, chunk_numel // 4 // fmt.block_size * fmt.block_size)
        block_scales = scales[param][state_name]
        for s in range(0, flat.numel(), step):
            piece = flat[s : s + step]
            blocks.encode_into(piece, out, block_scales, fmt, state_name, start=s)
        return
    if layout.is_scaled(param, state_name):
        # Every device temporary within chunk_numel FP32 elements (the staging bound).
        scale = codecs.encode_chunked(flat, out, layout.dtype_of(state_name), chunk_numel)
        scales[param][state_name].copy_(scale)
        return
    for s, e in codecs.chunk_bounds(flat.numel(), chunk_numel):
        out[s:e].copy_(flat[s:e])


def unscaled(
    layout: PrecisionLayout, storage: Tensor, scale: Tensor | None, param: Tensor, state_name: str
) -> Tensor:
    """The local FP32 value of a state: the storage itself when FP32 or a remainder, else a
    fresh expansion."""
    dtype = layout.dtype_of(state_name)
    fmt = layout.blocks
    if fmt is not None and layout.is_blocked(state_name):
        assert scale is not None
        local = local_tensor(param)
        return blocks.decode(storage, scale, fmt, state_name, local.numel()).view(local.shape)
    if layout.uses_remainder(param, state_name) or dtype == torch.float32:
        return storage
    return codecs.decode(storage, dtype, scale)


def read_chunk(
    layout: PrecisionLayout,
    storage: Tensor,
    scale: Tensor | None,
    param: Tensor,
    state_name: str,
    start: int,
    out: Tensor,
) -> None:
    """Fill ``out`` with flat elements ``[start, start + out.numel())`` of the expansion."""
    expected = layout.expansion_dtype(param, state_name)
    if out.dtype != expected or out.dim() != 1 or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous 1-D {expected} tensor, got {out.dtype} with shape "
            f"{tuple(out.shape)}"
        )
    if out.device != storage.device:
        raise ValueError(f"out is on {out.device}, the state lives on {storage.device}")
    stop = start + out.numel()
    numel = local_tensor(param).numel() if layout.is_blocked(state_name) else storage.numel()
    if start < 0 or stop > numel:
        raise ValueError(
            f"chunk [{start}, {stop}) is outside state {state_name!r} of {numel} elements"
        )
    fmt = layout.blocks
    if fmt is not None and layout.is_blocked(state_name):
        assert scale is not None
        blocks.decode_into(storage, scale, fmt, state_name, start, out)
        return
    piece = storage.view(-1)[start:stop]
    dtype = layout.dtype_of(state_name)
    if expected == torch.int16 or dtype == torch.float32:
        out.copy_(piece)
    else:
        codecs.decode_into(piece, out, dtype, scale)
