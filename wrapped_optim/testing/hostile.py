"""Hostile checkpoints and directories, for users' own suites (bad-input catalogue, part 2).

Each entry of ``HOSTILE_CHECKPOINTS`` builds, inside an empty directory, a file or
directory crafted to break a checkpoint reader (unbounded recursion, reads outside the
checkpoint directory, a read that never returns) and returns the path to hand to
``wrapped-optim inspect`` (``wrapped_optim._cli.run_inspect``) or to a loader: a careful
reader refuses each with a one-line error, promptly. Each entry of ``HOSTILE_SAVE_TARGETS``
plants something beside a checkpoint directory (symlinks at the names a save reserves for
itself, a symlinked target, ``..`` after a symlink) and returns the path to save to and the
directory whose files must survive untouched.
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
"""Builders of hostile checkpoints (see the module doc).

Examples:
    >>> import contextlib, io, tempfile
    >>> from pathlib import Path
    >>> from wrapped_optim._cli import run_inspect
    >>> with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stderr(io.StringIO()) as err:
    ...     path = HOSTILE_CHECKPOINTS["deep-dcp-route"](Path(tmp))
    ...     code = run_inspect(str(path))
    >>> code, len(err.getvalue().splitlines())
    (2, 1)
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
"""Builders of hostile save targets: ``(path to save to, directory whose files must survive)``.
A careful save either refuses (a clear error) or saves where the kernel resolves the path,
and ``precious.txt`` in the second directory is still there, unchanged, afterwards."""
