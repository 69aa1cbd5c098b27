"""The small model and data set the Accelerate and Lightning examples train (no downloads).

The guide shows these functions inside each framework's program (the ``toy`` section).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["build_model", "make_loader"]


# --8<-- [start:toy]
def build_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A small regression MLP, the same weights every time."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    return model.to(dtype)


def make_loader(batches: int = 8, batch_size: int = 8) -> torch.utils.data.DataLoader[Any]:
    """A fixed synthetic data set, in a fixed order (no hub downloads)."""
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(batches * batch_size, 8, generator=generator)
    targets = torch.randn(batches * batch_size, 4, generator=generator)
    dataset = torch.utils.data.TensorDataset(inputs, targets)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size)
    # --8<-- [end:toy]
