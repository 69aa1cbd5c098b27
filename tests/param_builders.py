"""Random parameter groups shared by the hybrid tests (one builder, so both files agree on
what a layout means)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def random_groups(
    layout: Sequence[Sequence[tuple[int, ...]]], dtypes: Sequence[torch.dtype], seed: int = 0
) -> list[dict[str, Any]]:
    """One param group per entry of ``layout`` (a list of shapes), dtypes cycling over all
    params in order, group ``g`` with lr ``0.01 * (g + 1)``."""
    gen = torch.Generator().manual_seed(seed)
    groups, index = [], 0
    for group_index, shapes in enumerate(layout):
        params = []
        for shape in shapes:
            value = torch.randn(shape, generator=gen).to(dtypes[index % len(dtypes)])
            params.append(torch.nn.Parameter(value))
            index += 1
        groups.append({"params": params, "lr": 0.01 * (group_index + 1)})
    return groups


def train_on_random_grads(
    opt: Any, params: Sequence[torch.nn.Parameter], steps: int, seed: int
) -> None:
    """``steps`` optimizer steps on random grads drawn from ``seed`` (the same in every run)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()
