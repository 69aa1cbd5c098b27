"""The Megatron formats' registry entries."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from wrapped_optim.checkpoint._convert._formats import Format, ReaderFactory
from wrapped_optim.checkpoint._convert._megatron import (
    DP_RESHARDABLE,
    FULLY_RESHARDABLE,
    LEGACY,
    MegatronFullyReshardableReader,
    MegatronFullyReshardableWriter,
    detect_megatron,
)
from wrapped_optim.checkpoint._convert._megatron_bucket_writers import (
    MegatronDpReshardableWriter,
    MegatronLegacyWriter,
)
from wrapped_optim.checkpoint._convert._megatron_bucketed import (
    MegatronDpReshardableReader,
    MegatronLegacyReader,
)
from wrapped_optim.checkpoint._convert._megatron_buckets import ParamList, model_params
from wrapped_optim.checkpoint._convert._megatron_files import MegatronFormatError
from wrapped_optim.checkpoint._convert._megatron_scales import megatron_fp8_pieces
from wrapped_optim.checkpoint._convert._options import FormatOptions

__all__ = ["FORMATS"]


def _reader(path: Path, options: FormatOptions) -> MegatronFullyReshardableReader:
    return MegatronFullyReshardableReader(
        path, key=options.location or "optimizer", param_remainders=options.param_remainders
    )


def _writer(path: Path, options: FormatOptions) -> MegatronFullyReshardableWriter:
    return MegatronFullyReshardableWriter(path, key=options.location or "optimizer")


def _params(path: Path, options: FormatOptions) -> tuple[ParamList, tuple[str, ...] | None]:
    placed = model_params(options)
    if placed is None:
        raise MegatronFormatError(
            f"{path}: a bucket-space Megatron checkpoint; name the model it was saved from "
            "(model= / --model, or names= / --names)"
        )
    return placed


def _dp_reader(path: Path, options: FormatOptions) -> MegatronDpReshardableReader:
    # Bucket boundaries come from the checkpoint (per_bucket_numel_unpadded).
    params, dtypes = _params(path, options)
    return MegatronDpReshardableReader(path, model=params, dtypes=dtypes)


def _legacy_reader(path: Path, options: FormatOptions) -> MegatronLegacyReader:
    params, dtypes = _params(path, options)
    return MegatronLegacyReader(path, model=params, bucket_size=options.bucket_size, dtypes=dtypes)


def _dp_writer(path: Path, options: FormatOptions) -> MegatronDpReshardableWriter:
    params, dtypes = _params(path, options)
    return MegatronDpReshardableWriter(
        path,
        model=params,
        dp_size=options.dp_size or 1,
        key=options.location or "optimizer",
        dtypes=dtypes,
        bucket_size=options.bucket_size,
    )


def _legacy_writer(path: Path, options: FormatOptions) -> MegatronLegacyWriter:
    params, dtypes = _params(path, options)
    return MegatronLegacyWriter(path, model=params, dtypes=dtypes, bucket_size=options.bucket_size)


def _detects(name: str) -> Callable[[Path], bool]:
    return lambda path: path.is_dir() and detect_megatron(path) == name


def _format(
    name: str,
    summary: str,
    reader: ReaderFactory,
    writer: Any = None,
    *,
    sharded: bool = False,
    remainders: bool = False,
    bucketed: bool = False,
) -> Format:
    return Format(
        name=name,
        summary=summary,
        reader=reader,
        writer=writer,
        detect=_detects(name),
        directory=True,
        priority=10,  # before the plain DCP check
        sharded=sharded,
        remainders=remainders,
        fp8_scales=megatron_fp8_pieces if writer is not None else None,
        bucketed=bucketed,
    )


FORMATS = (
    _format(
        FULLY_RESHARDABLE,
        "Megatron-Core dist_checkpointing, fully_reshardable (model space, any DP size; names "
        "are the model's sharded keys)",
        _reader,
        _writer,
        remainders=True,
    ),
    _format(
        DP_RESHARDABLE,
        "Megatron-Core dist_checkpointing, dp_reshardable (bucket space, any DP size; the "
        "model places the state: --model, or --names to read; --bucket-size to write)",
        _dp_reader,
        _dp_writer,
        sharded=True,
        bucketed=True,
    ),
    _format(
        LEGACY,
        "Megatron-LM's legacy optimizer files (optimizer_common.pt + param_state.pt, any DP "
        "size; the model places the state: --model, or --names to read; --bucket-size: the "
        "run's DDP bucket size, when it had several buckets)",
        _legacy_reader,
        _legacy_writer,
        bucketed=True,
    ),
)
