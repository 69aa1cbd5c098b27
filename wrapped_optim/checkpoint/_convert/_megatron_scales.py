"""Where a Megatron DistributedOptimizer keeps one FP8 scale: each DP rank's piece of a
parameter.

Under the precision-aware optimizer, TE's FusedAdam holds each rank's shard of a parameter as
its own tensor, with its own per-tensor scale. A shard is the part of the parameter's slot in
its grad-buffer bucket that falls in the rank's equal share of the bucket (padded to a
multiple of ``lcm(dp, 128)``): so which elements share a scale depends on the DP size, and a
parameter that straddles two ranks' shares has two scales. Computed from the model's names
and shapes alone (:mod:`._megatron_buckets`), one bucket per buffer (DDP without
``overlap_grad_reduce``; no ``pad_buckets_for_high_nccl_busbw``).
"""

from __future__ import annotations

import math

import torch

from wrapped_optim.checkpoint._convert._canonical import StateIndex
from wrapped_optim.checkpoint._convert._errors import ConversionError
from wrapped_optim.checkpoint._convert._megatron_buckets import ParamList, lay_out
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
    if options.names is None or options.shapes is None:
        raise ConversionError(
            f"fp8 moments for a Megatron run at DP {dp}: each rank's shard of a parameter has "
            "its own scale, and where the shards fall follows from the model; name it "
            "(model= / --model, or names= / --names)"
        )
    slots, sizes = lay_out(
        ParamList(options.names, options.shapes).buffer(torch.bfloat16, torch.float32)
    )
    by_name = {slot.name: slot for slot in slots}
    divisor = math.lcm(dp, 128)
    out: dict[str, tuple[tuple[int, int], ...]] = {}
    for param in index.params:
        slot = by_name.get(param.name)
        if slot is None or math.prod(slot.shape) != math.prod(param.shape):
            raise ConversionError(
                f"parameter {param.name!r} ({param.shape}) is not among the named model's "
                "parameters with that size; is it the model the run trains?"
            )
        share = -(-sizes[slot.bucket] // divisor) * divisor // dp
        pieces = []
        for rank in range(dp):
            start, end = max(slot.start, rank * share), min(slot.end, (rank + 1) * share)
            if start < end:
                pieces.append((start - slot.start, end - slot.start))
        out[param.name] = tuple(pieces)
    return out
