"""The DeepSpeed universal checkpoint's registry entry (read-only)."""

from __future__ import annotations

from pathlib import Path

from wrapped_optim.checkpoint._convert._deepspeed import (
    DEEPSPEED_UNIVERSAL,
    DeepSpeedUniversalReader,
    is_deepspeed_universal,
)
from wrapped_optim.checkpoint._convert._formats import Format
from wrapped_optim.checkpoint._convert._options import FormatOptions

__all__ = ["FORMATS"]


def _reader(path: Path, options: FormatOptions) -> DeepSpeedUniversalReader:
    return DeepSpeedUniversalReader(path)


FORMATS = (
    Format(
        name=DEEPSPEED_UNIVERSAL,
        summary="DeepSpeed universal checkpoint (ds_to_universal.py's output; reading)",
        reader=_reader,
        writer=None,
        detect=is_deepspeed_universal,
        directory=True,
        priority=10,
    ),
)
