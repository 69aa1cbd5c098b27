"""Hostile checkpoints and save targets, for users' own test suites: inputs crafted to make
a checkpoint reader recurse without bound, read outside its directory or hang, and a saver
write through planted symlinks.
"""

from __future__ import annotations

import os
import pickle
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["HOSTILE_CHECKPOINTS", "HOSTILE_SAVE_TARGETS"]

_MARK = "__hostile_nested__"


def _small_state_dict() -> dict[str, Any]:
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=0.5)
    p.grad = torch.ones(4)
    opt.step()
    return opt.state_dict()


def _dcp_checkpoint(directory: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    path = directory / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_small_state_dict(), checkpoint_id=path, no_dist=True)
    return path


def _rewrite_metadata(path: Path, change: Callable[[Any], None]) -> None:
    metadata = pickle.loads((path / ".metadata").read_bytes())
    change(metadata)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


def deep_param_group(directory: Path, depth: int = 20_000) -> Path:
    """A ``torch.save`` file (legacy format) whose param group holds a list nested ``depth``
    deep: plain pickle opcodes, which ``weights_only`` accepts, built without recursion."""
    sd = _small_state_dict()
    sd["param_groups"][0]["nested"] = _MARK
    path = directory / "deep.pt"
    torch.save(sd, path, _use_new_zipfile_serialization=False)
    raw = path.read_bytes()
    marker = b"X" + len(_MARK).to_bytes(4, "little") + _MARK.encode()
    assert raw.count(marker) == 1, "the marker string was not pickled as one BINUNICODE"
    nested = b"]" * depth + b"a" * (depth - 1)  # EMPTY_LIST x depth, then APPEND each inward
    path.write_bytes(raw.replace(marker, nested))
    return path


def deep_dcp_route(directory: Path, parts: int = 5_000) -> Path:
    """A DCP checkpoint whose ``.metadata`` routes one object through ``parts`` levels."""
    path = _dcp_checkpoint(directory)

    def change(metadata: Any) -> None:
        key = next(iter(metadata.planner_data))
        metadata.planner_data[key] = tuple(f"k{i}" for i in range(parts))

    _rewrite_metadata(path, change)
    return path


def storage_outside(directory: Path) -> Path:
    """A DCP checkpoint whose ``.metadata`` names ``../outside/...`` for every data file."""
    path = _dcp_checkpoint(directory)
    (directory / "outside").mkdir()
    names = {p.name for p in path.glob("*.distcp")}
    for name in names:
        (path / name).rename(directory / "outside" / name)

    def change(metadata: Any) -> None:
        for info in metadata.storage_data.values():
            info.relative_path = f"../outside/{info.relative_path}"

    _rewrite_metadata(path, change)
    return path


def fifo_data_file(directory: Path) -> Path:
    """A DCP checkpoint whose data files are FIFOs (opening one for reading blocks)."""
    path = _dcp_checkpoint(directory)
    for data in path.glob("*.distcp"):
        data.unlink()
        os.mkfifo(data)
    return path


def fifo_checkpoint(directory: Path) -> Path:
    """A FIFO where the checkpoint should be."""
    path = directory / "ckpt.pt"
    os.mkfifo(path)
    return path


HOSTILE_CHECKPOINTS: dict[str, Callable[[Path], Path]] = {
    "deep-param-group": deep_param_group,
    "deep-dcp-route": deep_dcp_route,
    "storage-outside-directory": storage_outside,
    "fifo-data-file": fifo_data_file,
    "fifo-checkpoint": fifo_checkpoint,
}
"""Builders of hostile checkpoints, by name: each takes an empty directory and returns the
path to hand to a reader (``inspect_checkpoint``, a loader), which should refuse it promptly
with a one-line error.

The entries: ``deep-param-group`` (containers nested thousands of levels deep),
``deep-dcp-route`` (a DCP key routed through thousands of levels), ``storage-outside-directory``
(DCP metadata naming a data file outside the checkpoint), ``fifo-data-file`` and
``fifo-checkpoint`` (a FIFO where a file is expected: a read that never returns).

Examples:
    >>> import tempfile
    >>> from pathlib import Path
    >>> from wrapped_optim.inspection import InspectError, inspect_checkpoint
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     path = HOSTILE_CHECKPOINTS["deep-dcp-route"](Path(tmp))
    ...     try:
    ...         inspect_checkpoint(path)
    ...     except InspectError as error:
    ...         print("refused:", "levels" in str(error))
    refused: True
"""


def _victim(directory: Path) -> Path:
    victim = directory / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep")
    return victim


def planted_old_link(directory: Path) -> tuple[Path, Path]:
    """``.ckpt.old`` is a symlink to another directory."""
    victim = _victim(directory)
    (directory / ".ckpt.old").symlink_to(victim)
    return directory / "ckpt", victim


def planted_staging_link(directory: Path) -> tuple[Path, Path]:
    """``.ckpt.saving`` is a symlink to another directory."""
    victim = _victim(directory)
    (directory / ".ckpt.saving").symlink_to(victim)
    return directory / "ckpt", victim


def symlinked_target(directory: Path) -> tuple[Path, Path]:
    """``latest`` is a symlink to a directory (``step_100``) with files in it."""
    victim = _victim(directory)
    (directory / "latest").symlink_to(victim.name)
    return directory / "latest", victim


def dotdot_after_link(directory: Path) -> tuple[Path, Path]:
    """``link/../ckpt`` where ``link`` points into a subdirectory (textually: ``ckpt``)."""
    victim = _victim(directory)
    (directory / "a" / "b").mkdir(parents=True)
    (directory / "link").symlink_to(directory / "a" / "b")
    return directory / "link" / ".." / "ckpt", victim


HOSTILE_SAVE_TARGETS: dict[str, Callable[[Path], tuple[Path, Path]]] = {
    "planted-old-symlink": planted_old_link,
    "planted-staging-symlink": planted_staging_link,
    "symlinked-target": symlinked_target,
    "dotdot-after-symlink": dotdot_after_link,
}
"""Builders of hostile save targets, by name: each takes an empty directory and returns
``(path to save to, directory whose files must survive)``.

A careful save either refuses (a clear error) or saves where the kernel resolves the path,
and ``precious.txt`` in the second directory is still there, unchanged, afterwards. The
entries: ``planted-old-symlink`` and ``planted-staging-symlink`` (symlinks at the names a save
reserves for itself), ``symlinked-target`` (the target is a symlink to a directory with files)
and ``dotdot-after-symlink`` (``link/../ckpt``).
"""
