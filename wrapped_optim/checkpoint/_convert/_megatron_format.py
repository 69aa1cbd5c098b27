"""The Megatron formats' registry entries."""

from __future__ import annotations

from pathlib import Path

from wrapped_optim.checkpoint._convert._formats import Format
from wrapped_optim.checkpoint._convert._megatron import (
    FULLY_RESHARDABLE,
    MegatronFullyReshardableReader,
    MegatronFullyReshardableWriter,
    detect_megatron,
)
from wrapped_optim.checkpoint._convert._options import FormatOptions

__all__ = ["FORMATS"]


def _reader(path: Path, options: FormatOptions) -> MegatronFullyReshardableReader:
    return MegatronFullyReshardableReader(path, key=options.location or "optimizer")


def _writer(path: Path, options: FormatOptions) -> MegatronFullyReshardableWriter:
    return MegatronFullyReshardableWriter(path, key=options.location or "optimizer")


def _is_fully_reshardable(path: Path) -> bool:
    return path.is_dir() and detect_megatron(path) == FULLY_RESHARDABLE


FORMATS = (
    Format(
        name=FULLY_RESHARDABLE,
        summary="Megatron-Core dist_checkpointing, fully_reshardable (model space, any DP size; "
        "names are the model's sharded keys)",
        reader=_reader,
        writer=_writer,
        detect=_is_fully_reshardable,
        directory=True,
        priority=10,
    ),
)
