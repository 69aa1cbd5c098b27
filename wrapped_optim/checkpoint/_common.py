"""What the streaming save and load share: the error type, the leaf finder, DCP plumbing."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from wrapped_optim._adapters.walk import walk_leaves
from wrapped_optim._formats.errors import OptimizerCheckpointError, UndoJournalError

__all__ = ["DEFAULT_CHUNK_BYTES", "OptimizerCheckpointError"]

DEFAULT_CHUNK_BYTES = 64 << 20
"""Largest tensor chunk (in expanded bytes) that is materialised at once: 64 MiB."""

_NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def _leaf_of(optimizer: Any) -> torch.optim.Optimizer:
    leaves = list(walk_leaves(optimizer))
    if len(leaves) != 1 or leaves[0].container is not None or leaves[0].optimizer is None:
        kinds = ", ".join(type(leaf.optimizer).__name__ for leaf in leaves) or "none"
        raise TypeError(
            "save_optimizer/load_optimizer stream the state of one torch optimizer (possibly "
            f"wrapped); this stack holds {len(leaves)} leaf optimizer(s) ({kinds}) inside "
            "Megatron containers. Checkpoint Megatron optimizers through sharded_state_dict."
        )
    return cast(torch.optim.Optimizer, leaves[0].optimizer)


@contextmanager
def _quiet_no_dist() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
        yield


def _raise_ours(exc: CheckpointException) -> None:
    for failure in exc.failures.values():
        error = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(error, OptimizerCheckpointError | UndoJournalError | KeyboardInterrupt):
            raise error from None


def _path_of(metadata: Metadata, fqn: str) -> tuple[Any, ...]:
    planner_data = metadata.planner_data or {}
    path = planner_data.get(fqn) if isinstance(planner_data, Mapping) else None
    return tuple(path) if path is not None else (fqn,)


def _int_key(key: Any) -> Any:
    return int(key) if isinstance(key, str) and key.lstrip("-").isdigit() else key
