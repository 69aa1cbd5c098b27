"""Where each parameter sits in Megatron's grad-buffer buckets, computed from the model alone.

Megatron-Core's ``dp_reshardable`` checkpoints and the legacy ``save_parameter_state`` files
store a DistributedOptimizer's state in *bucket space*: one flat tensor per bucket (or per
buffer, buckets concatenated) with the parameters at the offsets DDP gave them, and nothing
that says which parameter is where. Those offsets follow from the model's parameters alone:
DDP makes one buffer per (param dtype, grad dtype) in order of first appearance, lays its
parameters out in reverse order, each start aligned to 64 elements, and pads each bucket's end
to a multiple of ``lcm(dp, 128)`` (which does not move a parameter within its bucket, so the
layout is the same at every DP size). Bucket boundaries come from the checkpoint
(``per_bucket_numel_unpadded``) or, for legacy files, from the bucket size. The model may live
on the meta device: only names, shapes, dtypes and ``requires_grad`` are read.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch

from wrapped_optim.checkpoint._convert._megatron_files import MegatronFormatError
from wrapped_optim.checkpoint._convert._options import FormatOptions

__all__ = ["BucketSlot", "Buffer", "ParamList", "buffers_of", "lay_out", "model_params"]

_ALIGN = 64  # Core's param start alignment under the distributed optimizer (0.16.1, 0.19.2)


@attrs.frozen
class BucketSlot:
    """One parameter's place: bucket ``bucket``, elements ``[start, end)`` of that bucket."""

    name: str
    shape: tuple[int, ...]
    bucket: int
    start: int
    end: int


@attrs.frozen
class Buffer:
    """One grad buffer's parameters, in the model's order, with its dtypes."""

    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    params: tuple[tuple[str, tuple[int, ...]], ...]


@attrs.frozen
class ParamList:
    """A model given by its trainable parameters' names and shapes alone (in
    ``model.parameters()`` order, as ``wrapped-optim names`` writes them): enough to place
    them when they share one dtype, which the checkpoint then says.

    Example:
        >>> ParamList(("w",), ((2, 3),)).buffer(torch.float32, torch.float32).params
        (('w', (2, 3)),)
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    def buffer(self, param_dtype: torch.dtype, grad_dtype: torch.dtype) -> Buffer:
        if len(self.names) != len(self.shapes):
            raise MegatronFormatError("names and shapes differ in length")
        pairs = zip(self.names, self.shapes, strict=True)
        params = tuple((name.removeprefix("module."), tuple(shape)) for name, shape in pairs)
        return Buffer(param_dtype, grad_dtype, params)

    def buffers(self, dtypes: Sequence[str], *, grad_reduce_in_fp32: bool = True) -> list[Buffer]:
        """The grad buffers DDP makes of these parameters, each of dtype ``dtypes[i]``
        (``str(torch.dtype)``): one per (param dtype, grad dtype), in order of first
        appearance, as :func:`buffers_of` makes them from a module.

        Example:
            >>> params = ParamList(("w", "b"), ((2, 3), (2,)))
            >>> [b.param_dtype for b in params.buffers(["torch.bfloat16", "torch.float32"])]
            [torch.bfloat16, torch.float32]
        """
        if len(dtypes) != len(self.names) or len(self.shapes) != len(self.names):
            raise MegatronFormatError(
                f"{len(dtypes)} dtypes and {len(self.shapes)} shapes for {len(self.names)} names"
            )
        grouped: dict[tuple[torch.dtype, torch.dtype], list[tuple[str, tuple[int, ...]]]] = {}
        for name, shape, label in zip(self.names, self.shapes, dtypes, strict=True):
            param_dtype = _dtype(label)
            grad_dtype = torch.float32 if grad_reduce_in_fp32 else param_dtype
            grouped.setdefault((param_dtype, grad_dtype), []).append(
                (name.removeprefix("module."), tuple(shape))
            )
        return [Buffer(p, g, tuple(params)) for (p, g), params in grouped.items()]


def model_params(options: FormatOptions) -> tuple[ParamList, tuple[str, ...] | None] | None:
    """The named parameters in the model's order (DDP's, which places them in the buckets),
    with their dtypes where a model gave them; None when no names were given.

    Example:
        >>> options = FormatOptions(names=["b", "w"], shapes=[(2,), (2, 3)], model_order=["w", "b"])
        >>> model_params(options)[0].names
        ('w', 'b')
    """
    names, shapes, dtypes = options.names, options.shapes, options.dtypes
    if names is None or shapes is None:
        return None
    if options.model_order is not None:  # names in an optimizer's order
        at = {name: i for i, name in enumerate(names)}
        order = [at[name] for name in options.model_order]
        names = tuple(names[i] for i in order)
        shapes = tuple(shapes[i] for i in order)
        dtypes = None if dtypes is None else tuple(dtypes[i] for i in order)
    return ParamList(names, shapes), dtypes


def _dtype(name: str) -> torch.dtype:
    found = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise MegatronFormatError(f"unknown parameter dtype {name!r}")
    return found


def _modules(model: Any) -> list[torch.nn.Module]:
    chunks = list(model) if isinstance(model, Sequence) else [model]
    for chunk in chunks:
        if not isinstance(chunk, torch.nn.Module):
            raise MegatronFormatError(
                f"model= takes a torch module or a list of model chunks, not {type(chunk).__name__}"
            )
    return chunks


def buffers_of(model: Any, *, grad_reduce_in_fp32: bool = True) -> list[Buffer]:
    """The DistributedOptimizer's grad buffers of ``model`` (one module or a list of model
    chunks, DDP-wrapped or not, on any device), in its ``gbuf_idx`` order.

    Example:
        >>> net = torch.nn.Linear(3, 2)
        >>> [b.params for b in buffers_of(net)]
        [(('weight', (2, 3)), ('bias', (2,)))]
    """
    out: list[Buffer] = []
    for chunk in _modules(model):
        by_dtype: dict[tuple[torch.dtype, torch.dtype], list[tuple[str, tuple[int, ...]]]] = {}
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            if not getattr(param, "allreduce", True):
                raise MegatronFormatError(
                    f"parameter {name!r} is expert-parallel; expert buffers are not supported"
                )
            grad_dtype = torch.float32 if grad_reduce_in_fp32 else param.dtype
            key = (param.dtype, grad_dtype)
            by_dtype.setdefault(key, []).append((name.removeprefix("module."), tuple(param.shape)))
        out += [Buffer(p, g, tuple(params)) for (p, g), params in by_dtype.items()]
    return out


def _numel(shape: Iterable[int]) -> int:
    return math.prod(shape)


def lay_out(
    buffer: Buffer,
    *,
    bucket_numels: Sequence[int] | None = None,
    bucket_size: int | None = None,
) -> tuple[list[BucketSlot], list[int]]:
    """Each parameter's slot and each bucket's unpadded size.

    ``bucket_numels``: the unpadded bucket sizes a checkpoint recorded (checked against the
    layout); else ``bucket_size``, DDP's (None: one bucket).

    Example:
        >>> buffer = Buffer(torch.float32, torch.float32, (("w", (2, 3)), ("b", (2,))))
        >>> slots, sizes = lay_out(buffer)
        >>> [(s.name, s.start, s.end) for s in slots], sizes
        ([('b', 0, 2), ('w', 64, 70)], [70])
    """
    slots: list[BucketSlot] = []
    sizes: list[int] = []
    bucket, cursor, members = 0, 0, 0

    def close(end: int) -> None:
        nonlocal bucket, cursor, members
        if bucket_numels is not None and (
            bucket >= len(bucket_numels) or bucket_numels[bucket] != end
        ):
            raise MegatronFormatError(
                f"the model's parameters do not fit the checkpoint's buckets (bucket {bucket}: "
                f"{end} elements by the model, {list(bucket_numels)} in the checkpoint); is it "
                "the model the checkpoint was saved from?"
            )
        sizes.append(end)
        bucket, cursor, members = bucket + 1, 0, 0

    for name, shape in reversed(buffer.params):
        start = -(-cursor // _ALIGN) * _ALIGN
        if (
            members
            and bucket_numels is not None
            and bucket < len(bucket_numels)
            and start == bucket_numels[bucket]
        ):
            close(start)  # a parameter that opens its own bucket (a shared embedding)
            start = 0
        end = start + _numel(shape)
        slots.append(BucketSlot(name, shape, bucket, start, end))
        members += 1
        if bucket_numels is not None:
            full = bucket < len(bucket_numels) and end >= bucket_numels[bucket]
        else:
            full = bucket_size is not None and end >= bucket_size
        if full:
            close(end)
        else:
            cursor = end
    if members:
        close(cursor)
    if bucket_numels is not None and len(sizes) != len(bucket_numels):
        raise MegatronFormatError(
            f"the model fills {len(sizes)} buckets, the checkpoint has {len(bucket_numels)}"
        )
    return slots, sizes
