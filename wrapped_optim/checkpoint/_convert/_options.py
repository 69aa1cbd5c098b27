"""What a reader or writer is told besides the path: names, DP size, trust."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import attrs


def _names(value: Sequence[str] | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(value)


def _shapes(value: Sequence[Sequence[int]] | None) -> tuple[tuple[int, ...], ...] | None:
    return None if value is None else tuple(tuple(int(s) for s in shape) for shape in value)


@attrs.frozen
class FormatOptions:
    """Options every format factory receives; each uses those that concern it.

    Attributes:
        names: parameter names in the optimizer's index order (index-keyed formats: the
            torch ``state_dict()`` layout); None keeps the indices as names.
        shapes: each named parameter's shape, checked against the state when given.
        dp_size: the data-parallel size a sharded destination is written for (None: the
            source's, or the format's default).
        trusted: let a reader unpickle objects other than tensors and plain containers.
        location: where in a checkpoint holding several optimizers the one to read is (as
            ``wrapped-optim inspect`` names it); a DCP writer's key prefix.
        flavour: the state-dict layout a writer of that shape writes: torch.optim's
            (``step`` per parameter) or the precision-aware one (TE FusedAdam's portable
            format: the step in each group); None keeps the source's.
        dtypes: each named parameter's dtype (``str(torch.dtype)``), where a model gave
            them: bucket-space Megatron writers name the grad buffers by them.
        param_remainders: the source keeps each FP32 master as the bf16 model weight plus
            an int16 remainder (``store_param_remainders``); a reader that can, rebuilds the
            master from both.
        bucket_size: the DDP bucket size of the Megatron run a bucket-space checkpoint
            (``dp_reshardable``, legacy) comes from or is written for (None: one bucket per
            grad buffer, Megatron's layout without ``overlap_grad_reduce``).
        model_order: the model's parameter names in ``model.parameters()`` order, where a
            ``(model, optimizer)`` pair gave ``names`` in the optimizer's order: DDP lays
            the buckets out in the model's order, an index-keyed format numbers by the
            optimizer's.
    """

    names: tuple[str, ...] | None = attrs.field(default=None, converter=_names)
    shapes: tuple[tuple[int, ...], ...] | None = attrs.field(default=None, converter=_shapes)
    dp_size: int | None = None
    trusted: bool = False
    location: str | None = None
    flavour: Literal["torch", "precision-aware"] | None = None
    dtypes: tuple[str, ...] | None = attrs.field(default=None, converter=_names)
    param_remainders: bool = False
    bucket_size: int | None = None
    model_order: tuple[str, ...] | None = attrs.field(default=None, converter=_names)
