"""Where a Megatron DistributedOptimizer keeps one FP8 scale: each DP rank's piece of a
parameter.

Under the precision-aware optimizer, TE's FusedAdam holds each rank's shard of a parameter as
its own tensor, with its own per-tensor scale. A shard is the part of the parameter's slot in
its grad-buffer bucket that falls in the rank's equal share of the bucket (padded to a
multiple of ``lcm(dp, 128)``): so which elements share a scale depends on the DP size, and a
parameter that straddles two ranks' shares has two scales. Computed from the model's names
and shapes alone (:mod:`._megatron_buckets`): one grad buffer (bf16 params), or one per
dtype where the model gave them; one bucket per buffer unless ``FormatOptions.bucket_size``
gives DDP's (with ``overlap_grad_reduce``); no ``pad_buckets_for_high_nccl_busbw``.
"""

from __future__ import annotations

import math

import torch

from wrapped_optim.checkpoint._convert._canonical import StateIndex
from wrapped_optim.checkpoint._convert._errors import ConversionError
from wrapped_optim.checkpoint._convert._megatron_buckets import BucketSlot, lay_out, model_params
from wrapped_optim.checkpoint._convert._options import FormatOptions

__all__ = ["megatron_fp8_pieces"]


def megatron_fp8_pieces(
    index: StateIndex, options: FormatOptions
) -> dict[str, tuple[tuple[int, int], ...]]:
    """Each parameter's flat ranges holding one FP8 scale at ``options.dp_size`` ranks.

    Example:
        >>> from wrapped_optim.checkpoint._convert._canonical import ParamRecord, GroupRecord
        >>> index = StateIndex([ParamRecord("w", 0, (200,), {})], [GroupRecord({}, ["w"])], "x")
        >>> megatron_fp8_pieces(index, FormatOptions(names=["w"], shapes=[(200,)], dp_size=2))
        {'w': ((0, 128), (128, 200))}
    """
    dp = options.dp_size or 1
    if dp < 1:
        raise ConversionError(f"dp={dp}: the data-parallel size is at least 1")
    if dp == 1:
        return {param.name: ((0, math.prod(param.shape)),) for param in index.params}
    placed = model_params(options)
    if placed is None:
        raise ConversionError(
            f"fp8 moments for a Megatron run at DP {dp}: each rank's shard of a parameter has "
            "its own scale, and where the shards fall follows from the model; name it "
            "(model= / --model, or names= / --names)"
        )
    params, dtypes = placed
    buffers = [params.buffer(torch.bfloat16, torch.float32)] if dtypes is None else None
    by_name: dict[str, tuple[BucketSlot, int]] = {}
    for buffer in buffers or params.buffers(dtypes or ()):
        slots, sizes = lay_out(buffer, bucket_size=options.bucket_size)
        by_name.update((slot.name, (slot, sizes[slot.bucket])) for slot in slots)
    divisor = math.lcm(dp, 128)
    out: dict[str, tuple[tuple[int, int], ...]] = {}
    for param in index.params:
        found = by_name.get(param.name)
        if found is None or math.prod(found[0].shape) != math.prod(param.shape):
            raise ConversionError(
                f"parameter {param.name!r} ({param.shape}) is not among the named model's "
                "parameters with that size; is it the model the run trains?"
            )
        slot, bucket_numel = found
        share = -(-bucket_numel // divisor) * divisor // dp
        pieces = []
        for rank in range(dp):
            start, end = max(slot.start, rank * share), min(slot.end, (rank + 1) * share)
            if start < end:
                pieces.append((start - slot.start, end - slot.start))
        out[param.name] = tuple(pieces)
    return out
