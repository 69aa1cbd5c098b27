"""What every GPU check returns, and how a failed row or a missing requirement is told.

A check's ``run()`` returns a :class:`Section`: its Markdown and the labels of the rows that
failed. A check that cannot run here raises :class:`NotRun` (say, megatron-core missing);
the runner reports it as "not run", never as passed. Only torch is imported here, so every
check module stays importable on a machine without CUDA or megatron-core.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

__all__ = ["NotRun", "Section", "main_of", "require_cuda", "require_megatron", "row_table"]


class NotRun(Exception):
    """A check's requirement is missing on this machine; the message says which."""


@dataclass(frozen=True)
class Section:
    """A check's Markdown and the labels of its failed rows (empty: every row passed).

    Example:
        >>> Section("## x", ["row 2"]).ok
        False
    """

    markdown: str
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every row passed."""
        return not self.failures


def require_cuda(name: str) -> None:
    """Raise :class:`NotRun` without a CUDA device.

    Example:
        >>> import torch
        >>> if not torch.cuda.is_available():
        ...     try:
        ...         require_cuda("gpu_x")
        ...     except NotRun as error:
        ...         print(error)
        ... else:
        ...     print("not run: gpu_x needs a CUDA device")
        not run: gpu_x needs a CUDA device
    """
    import torch

    if not torch.cuda.is_available():
        raise NotRun(f"not run: {name} needs a CUDA device")


def require_megatron() -> None:
    """Raise :class:`NotRun` when megatron-core cannot be imported.

    Example:
        >>> require_megatron.__name__
        'require_megatron'
    """
    if importlib.util.find_spec("megatron") is None:
        raise NotRun("not run: megatron-core missing")
    try:
        importlib.import_module("megatron.core")
    except ImportError as error:
        raise NotRun(f"not run: megatron-core missing ({error})") from error


def row_table(rows: Iterable[tuple[str, bool, str]], title: str) -> Section:
    """A ``| check | result | detail |`` table; each row that did not pass is a failure.

    Example:
        >>> section = row_table([("a", True, ""), ("b", False, "off by one")], "## t")
        >>> section.failures, "| b | FAIL | off by one |" in section.markdown
        (['b'], True)
    """
    rows = list(rows)
    lines = [title, "", "| check | result | detail |", "|---|---|---|"]
    lines += [f"| {name} | {'pass' if ok else 'FAIL'} | {detail} |" for name, ok, detail in rows]
    lines.append("")
    return Section("\n".join(lines), [name for name, ok, _ in rows if not ok])


def main_of(run: Callable[[], Section]) -> int:
    """Run one check as a script: print its section; exit 1 on a failed row, 2 if not run.

    Example:
        >>> main_of(lambda: Section("## fine"))
        ## fine
        0
    """
    try:
        section = run()
    except NotRun as reason:
        print(reason, file=sys.stderr)
        return 2
    print(section.markdown)
    for label in section.failures:
        print(f"FAILED: {label}", file=sys.stderr)
    return 0 if section.ok else 1
