"""One entry point for every Megatron optimizer checkpoint: the format is detected."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from wrapped_optim.checkpoint._convert._canonical import StateReader
from wrapped_optim.checkpoint._convert._megatron import (
    DP_RESHARDABLE,
    FULLY_RESHARDABLE,
    LEGACY,
    GroupOf,
    MegatronFullyReshardableReader,
    detect_megatron,
)
from wrapped_optim.checkpoint._convert._megatron_bucketed import (
    MegatronDpReshardableReader,
    MegatronLegacyReader,
)
from wrapped_optim.checkpoint._convert._megatron_files import MegatronFormatError

__all__ = ["megatron_reader"]


def megatron_reader(
    path: str | Path,
    *,
    model: Any = None,
    key: str = "optimizer",
    group_of: GroupOf | None = None,
    bucket_size: int | None = None,
    param_remainders: bool = False,
) -> StateReader:
    """A Megatron optimizer checkpoint at ``path``, opened for reading in the canonical form.

    ``fully_reshardable`` needs nothing more; ``dp_reshardable`` and the legacy files store
    bucket space and need ``model`` (the module, or list of model chunks, the checkpoint was
    saved from; the meta device will do), the legacy files also the run's DDP
    ``bucket_size`` when it had several buckets. ``key``: where the optimizer's state sits
    (``"optimizer"`` in Megatron-LM and Bridge). ``group_of``: which param group each
    parameter is in, where Megatron's standard grouping does not apply. ``param_remainders``:
    a ``fully_reshardable`` checkpoint of a precision-aware run with ``store_param_remainders``
    (Core's default there) holds int16 remainders where the FP32 main param would be; the
    master is then rebuilt from them and the bf16 model weights saved beside them.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     try:
        ...         megatron_reader(d)
        ...     except MegatronFormatError as error:
        ...         "not a Megatron" in str(error)
        True
    """
    fmt = detect_megatron(path)
    if fmt in (None, FULLY_RESHARDABLE):
        return MegatronFullyReshardableReader(
            path, key=key, group_of=group_of, param_remainders=param_remainders
        )
    if model is None:
        raise MegatronFormatError(
            f"{path}: a {fmt} checkpoint stores the optimizer in bucket space; pass model= "
            "(the model it was saved from; built on the meta device will do)"
        )
    if fmt == DP_RESHARDABLE:
        return MegatronDpReshardableReader(path, model=model, group_of=group_of)
    if fmt == LEGACY:
        return MegatronLegacyReader(path, model=model, bucket_size=bucket_size, group_of=group_of)
    raise MegatronFormatError(f"{path}: {fmt} checkpoints are not readable")
