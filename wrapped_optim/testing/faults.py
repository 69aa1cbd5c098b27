"""Process death at exact points of a checkpoint commit, for users' own test suites."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["COMMIT_CRASH_POINTS", "crash_save_at"]

COMMIT_CRASH_POINTS: dict[str, str] = {
    "writing": "old",  # DCP is writing the staging directory (first data item)
    "staged": "old",  # staging complete, the commit not begun
    "linking": "old",  # the first side file linked into staging, the rest not yet
    "renaming-aside": "old",  # before the target is renamed to .<name>.old
    "between-renames": "old",  # target renamed aside, staging not yet renamed in
    "renamed": "new",  # both renames done; nothing moved back or removed yet
    "removing-old": "new",  # side files rescued; before .<name>.old is removed
}
"""Each kill point of ``crash_save_at`` and the checkpoint the next load returns (``"old"``:
the one the directory held before, ``"new"``: the one being saved).

The points, in commit order: ``writing`` (DCP writes the staging directory), ``staged``
(staging complete), ``linking`` (the first side file linked into staging), ``renaming-aside``
(before the target is renamed aside), ``between-renames`` (target aside, staging not yet in
place), ``renamed`` (both renames done), ``removing-old`` (before the old copy is removed).
In every case the files saved beside the checkpoint are still there after the next save.
"""


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _install(point: str) -> None:
    """Patches the commit module (and DCP's item writer) of this child process only."""
    from torch.distributed.checkpoint import filesystem

    from wrapped_optim.checkpoint import _commit as commit

    def before(
        module: Any, name: str, when: Callable[..., bool] = lambda *a: True, after: int = 0
    ) -> None:
        original = getattr(module, name)
        calls = [0]

        def hooked(*args: Any, **kwargs: Any) -> Any:
            if when(*args):
                calls[0] += 1
                if calls[0] > after:
                    _die()
            return original(*args, **kwargs)

        setattr(module, name, hooked)

    def named(position: int, suffix: str) -> Callable[..., bool]:
        return lambda *paths: Path(paths[position]).name.endswith(suffix)

    hooks: dict[str, Callable[[], None]] = {
        "writing": lambda: before(filesystem, "_write_item"),
        "staged": lambda: before(commit, "_link_side_files"),
        "linking": lambda: before(commit, "_link_or_copy", after=1),
        "renaming-aside": lambda: before(commit, "_rename", named(1, ".old")),
        "between-renames": lambda: before(commit, "_rename", named(0, ".saving")),
        "renamed": lambda: before(commit, "_rescue_side_files"),
        "removing-old": lambda: before(commit, "_remove", named(0, ".old")),
    }
    hooks[point]()


def crash_save_at(point: str, save: Callable[[], Any], *, timeout: float = 300.0) -> None:
    """Runs a save in a forked child process killed with ``SIGKILL`` at one point of the commit.

    The caller's objects are untouched (the child is a copy); load from the directory
    afterwards to see what survived. POSIX only (``os.fork``).

    Args:
        point: A key of ``COMMIT_CRASH_POINTS``.
        save: Saves the checkpoint (e.g. a ``save_optimizer`` call), run in the child.
        timeout: Seconds to wait for the child.

    Raises:
        AssertionError: the child was not killed at ``point`` (never reached, or ``save``
            raised), or it outlived ``timeout``.
        ValueError: ``point`` is not a known kill point.

    Examples:
        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> from wrapped_optim.checkpoint import load_optimizer, save_optimizer
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.SGD([p], lr=0.1)
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     save_optimizer(opt, Path(tmp) / "ckpt") and None
        ...     (Path(tmp) / "ckpt" / "config.json").write_text("{}") and None
        ...     crash_save_at("between-renames", lambda: save_optimizer(opt, Path(tmp) / "ckpt"))
        ...     load_optimizer(opt, Path(tmp) / "ckpt")  # the old one, read from .ckpt.old
        ...     save_optimizer(opt, Path(tmp) / "ckpt") and None
        ...     sorted(p.name for p in Path(tmp).iterdir())
        ...     (Path(tmp) / "ckpt" / "config.json").read_text()
        ['ckpt']
        '{}'
    """
    if point not in COMMIT_CRASH_POINTS:
        raise ValueError(f"unknown crash point {point!r}; one of {sorted(COMMIT_CRASH_POINTS)}")
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        code = 3
        try:
            _install(point)
            save()
        except BaseException:
            code = 4
        os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"the save did not reach {point!r} within {timeout} s")
        time.sleep(0.01)
    if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
        reason = {3: "finished without reaching it", 4: "raised before it"}.get(
            os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1, f"status {status}"
        )
        raise AssertionError(f"the save was not killed at {point!r}: it {reason}")
