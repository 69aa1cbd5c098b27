"""Figures for the benchmark pages: matplotlib without a display (an optional dependency)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["pyplot", "save_figure"]


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend (raises ImportError without it).

    Example:
        >>> pyplot().get_backend().lower()
        'agg'
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure: Any, path: Path) -> Path:
    """Lays ``figure`` out, writes it to ``path`` (its folder is made) and closes it.

    Example:
        >>> import pathlib, tempfile
        >>> figure = pyplot().figure()
        >>> save_figure(figure, pathlib.Path(tempfile.mkdtemp()) / "f.png").stat().st_size > 0
        True
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path)
    pyplot().close(figure)
    return path
