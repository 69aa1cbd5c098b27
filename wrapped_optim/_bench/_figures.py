"""Figures for the benchmark pages: matplotlib without a display (an optional dependency).

Every topic draws its figure from its measured rows with :func:`bar_panels`: one or more
panels of horizontal bars (side by side per configuration, or stacked into the phases of its
time), each with a dashed line at the topic's anchor (torch's fused step, the unstaged save,
the memory budget...).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs


def available() -> bool:
    """True when matplotlib can be imported (figures are drawn only then).

    Example:
        >>> isinstance(available(), bool)
        True
    """
    return importlib.util.find_spec("matplotlib") is not None


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
    figure.savefig(path, dpi=100)
    pyplot().close(figure)
    return path


def _check_series(labels: Sequence[str], series: Mapping[str, Sequence[float | None]]) -> None:
    for name, values in series.items():
        if len(values) != len(labels):
            raise ValueError(
                f"series {name!r} has {len(values)} values for {len(labels)} labels; "
                "give one value (or None) per label"
            )


@attrs.frozen
class Panel:
    """One panel of horizontal bars: a bar (or a group of bars) per label, top to bottom.

    Attributes:
        title: the panel's title.
        labels: one per configuration (a bar, a stack or a group of bars).
        series: name -> one value per label (None: nothing to draw there).
        axis: the value axis' label, with its unit.
        stacked: stack the series into one bar per label (phases of one time) instead of
            drawing them side by side.
        anchor: ``(label, value)`` of a dashed reference line (the topic's anchor).
        log: a logarithmic value axis.

    Example:
        >>> Panel("t", ["a"], {"x": [1.0, 2.0]}, "s")
        Traceback (most recent call last):
        ...
        ValueError: series 'x' has 2 values for 1 labels; give one value (or None) per label
    """

    title: str
    labels: Sequence[str]
    series: Mapping[str, Sequence[float | None]]
    axis: str
    stacked: bool = False
    anchor: tuple[str, float] | None = None
    log: bool = False

    def __attrs_post_init__(self) -> None:
        _check_series(self.labels, self.series)

    @property
    def bars(self) -> int:
        """Bar slots the panel needs (for the figure's height)."""
        return len(self.labels) * (1 if self.stacked else max(1, len(self.series)))


def _draw(axes: Any, panel: Panel) -> None:
    rows = range(len(panel.labels))
    names = list(panel.series)
    height = 0.8 if panel.stacked else 0.8 / max(1, len(names))
    left = [0.0] * len(panel.labels)
    for k, name in enumerate(names):
        values = [math.nan if v is None else float(v) for v in panel.series[name]]
        if panel.stacked:
            axes.barh(list(rows), values, height, left=left, label=name, color=f"C{k}")
            left = [a + (0.0 if math.isnan(b) else b) for a, b in zip(left, values, strict=True)]
        else:
            offset = (k - (len(names) - 1) / 2) * height
            axes.barh([r + offset for r in rows], values, height, label=name, color=f"C{k}")
    if panel.anchor is not None:
        label, value = panel.anchor
        axes.axvline(value, color="black", linestyle="--", linewidth=1.2, label=label)
    axes.set_yticks(list(rows), list(panel.labels))
    if max(map(len, panel.labels), default=0) > 30:
        axes.tick_params(axis="y", labelsize=8)
    axes.invert_yaxis()
    axes.set_xlabel(panel.axis)
    axes.set_title(panel.title, fontsize=11)
    if panel.log:
        axes.set_xscale("log")
    axes.grid(axis="x", alpha=0.3)
    # Beside the bars, never over them.
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def bar_panels(path: Path, panels: Sequence[Panel], *, title: str | None = None) -> Path:
    """Draws ``panels`` one under the other into the PNG ``path`` and returns it.

    Raises:
        ImportError: matplotlib is not installed (:func:`available` tells beforehand).

    Example:
        >>> import pathlib, tempfile
        >>> phases = Panel("one step", ["ours", "ours unfused"],
        ...                {"copy-in": [0.0, 3.8], "host": [8.2, 7.8], "copy-out": [0.0, 3.9]},
        ...                "ms", stacked=True, anchor=("bare fused AdamW", 7.9))
        >>> out = pathlib.Path(tempfile.mkdtemp()) / "demo_time.png"
        >>> bar_panels(out, [phases], title="demo").stat().st_size > 0
        True
    """
    if not panels:
        raise ValueError("no panels to draw")
    plt = pyplot()
    heights = [1.2 + 0.32 * panel.bars for panel in panels]
    figure, axes = plt.subplots(
        len(panels), 1, figsize=(11, sum(heights) + 0.4), height_ratios=heights, squeeze=False
    )
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        _draw(ax, panel)
    if title:
        figure.suptitle(title, fontsize=12)
    return save_figure(figure, Path(path))
