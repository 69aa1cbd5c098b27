"""What the streaming save and load share: the error type, the leaf finder, DCP plumbing."""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from wrapped_optim._adapters.walk import walk_leaves
from wrapped_optim._formats.errors import OptimizerCheckpointError, UndoJournalError

__all__ = ["DEFAULT_CHUNK_BYTES", "OptimizerCheckpointError", "unreadable_checkpoint"]

DEFAULT_CHUNK_BYTES = 64 << 20
"""Largest tensor chunk (in expanded bytes) that is materialised at once: 64 MiB."""

_NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"
_INT = re.compile(r"-?[0-9]+")


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
    """A saved key that was an int (``"3"``, ``"-1"``) as that int; any other key as it is."""
    return int(key) if isinstance(key, str) and _INT.fullmatch(key) else key


def _failures(exc: CheckpointException) -> Iterator[tuple[int, BaseException]]:
    for rank, failure in exc.failures.items():
        error = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(error, BaseException):
            yield rank, error


def _describe_failure(where: str, error: BaseException) -> str:
    """``file: Type: message`` of one read failure; a path under the pinned directory
    (``/proc/self/fd/N/...``) is named under ``where``."""
    filename = getattr(error, "filename", None)
    if isinstance(filename, str | os.PathLike) and os.fspath(filename):
        name = os.fspath(filename)
        file = os.path.join(where, os.path.basename(name)) if name.startswith("/proc/") else name
        detail = getattr(error, "strerror", None) or str(error)
    else:
        file, detail = where, str(error)
    lines = re.sub(r"/proc/self/fd/\d+/", where.rstrip("/") + "/", detail).strip().splitlines()
    first = lines[0][:300] if lines else ""
    return f"{file}: {type(error).__name__}: {first}"


def unreadable_checkpoint(where: str, exc: BaseException) -> OptimizerCheckpointError:
    """The error for a checkpoint that could not be read (``exc``: DCP's
    ``CheckpointException`` with each rank's failure, or the failure itself), naming the
    file and the cause of each failure; the caller chains ``exc`` to it.

    Example:
        >>> error = unreadable_checkpoint("ckpt", IsADirectoryError(21, "Is a directory", "x"))
        >>> str(error).splitlines()[0]
        'cannot read the checkpoint ckpt: x: IsADirectoryError: Is a directory'
    """
    if isinstance(exc, CheckpointException):
        failures = list(_failures(exc))
        ranks = len(failures) > 1
        causes = "; ".join(
            f"{_describe_failure(where, error)}{f' (rank {rank})' if ranks else ''}"
            for rank, error in failures
        )
    else:
        causes = _describe_failure(where, exc)
    return OptimizerCheckpointError(
        f"cannot read the checkpoint {where}: {causes}\nNothing was loaded: the optimizer is "
        "as it was. The checkpoint is damaged or incomplete; load another one (the previous "
        "checkpoint) or save it again."
    )
