"""The torch.save format's registry entry."""

from __future__ import annotations

__all__ = ["FORMATS"]

from wrapped_optim.checkpoint._convert._formats import Format
from wrapped_optim.checkpoint._convert._torch_save import (
    TorchSaveReader,
    TorchSaveWriter,
    looks_like,
)

FORMATS = (
    Format(
        name="torch-save",
        summary="a torch.save file of optimizer.state_dict() (torch.optim, PrecisionAwareAdamW "
        "/ TE FusedAdam portable; transformers' optimizer.pt, Accelerate's optimizer.bin, "
        "Lightning's .ckpt when read)",
        reader=TorchSaveReader,
        writer=TorchSaveWriter,
        detect=looks_like,
        directory=False,
    ),
)
