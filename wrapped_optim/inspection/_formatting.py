"""Rendering a ``CheckpointReport`` as text."""

from __future__ import annotations

from collections.abc import Sequence

from wrapped_optim.inspection._model import (
    CheckpointReport,
    _by_name,
    _dtype_name,
    _shape_text,
)


def format_report(report: CheckpointReport, *, per_param: bool = True) -> str:
    """Renders a ``CheckpointReport`` as plain text for a terminal.

    Args:
        report: What ``inspect_checkpoint`` returned.
        per_param: List every state tensor; ``False`` shows only the summary per state name
            (short output for models with thousands of parameters).

    Returns:
        The report as lines of text (what ``wrapped-optim inspect`` prints).

    Examples:
        >>> import torch
        >>> from pathlib import Path
        >>> from wrapped_optim.inspection import format_report
        >>> from wrapped_optim.inspection._model import (CheckpointReport, OptimizerReport,
        ...     ParamGroupReport, StateFormat, StateTensor)
        >>> opt = OptimizerReport(
        ...     location="", format=StateFormat.PRECISION_AWARE,
        ...     tensors=(StateTensor("0", "exp_avg", torch.float32, (2, 2), 16),
        ...              StateTensor("0", "exp_avg_sq", torch.float32, (2, 2), 16)),
        ...     steps=(7,), step_source="param_groups",
        ...     param_groups=(ParamGroupReport(0, 1, (("lr", "0.001"), ("step", "7"))),),
        ...     notes=())
        >>> text = format_report(CheckpointReport(Path("ckpt.pt"), "torch.save", 900, (opt,)))
        >>> print(text.splitlines()[0])
        ckpt.pt: torch.save file, 900 B on disk, 1 optimizer state dict
        >>> "steps: 7 (param_groups)" in text
        True
    """
    count = len(report.optimizers)
    kind = "torch.save file" if report.kind == "torch.save" else "DCP checkpoint directory"
    lines = [
        f"{report.path}: {kind}, {_human_bytes(report.file_bytes)} on disk, "
        f"{count} optimizer state dict{'' if count == 1 else 's'}"
    ]
    for opt in report.optimizers:
        lines.append("")
        where = opt.location or "(top level)"
        lines.append(f"optimizer state at {where}")
        lines.append(f"  format: {opt.description}")
        lines.append(
            f"  state: {opt.num_params} params, {len(opt.tensors)} tensors, "
            f"{_human_bytes(opt.total_bytes)}"
        )
        if opt.steps:
            lines.append(f"  steps: {', '.join(map(str, opt.steps))} ({opt.step_source})")
        else:
            lines.append("  steps: none recorded")
        lines.extend(f"  note: {note}" for note in opt.notes)
        if opt.tensors:
            lines.append("  per state name:")
            rows: list[tuple[str, ...]] = [("name", "count", "dtypes", "bytes")]
            for name, entries in _by_name(opt.tensors).items():
                dtypes = ", ".join(sorted({_dtype_name(t.dtype) for t in entries}))
                rows.append(
                    (name, str(len(entries)), dtypes, _human_bytes(sum(t.nbytes for t in entries)))
                )
            lines.extend("    " + line for line in _table(rows))
        if per_param and opt.tensors:
            lines.append("  per parameter:")
            rows = [("param", "state", "dtype", "shape", "bytes")]
            rows += [
                (t.param, t.name, _dtype_name(t.dtype), _shape_text(t.shape), str(t.nbytes))
                for t in opt.tensors
            ]
            lines.extend("    " + line for line in _table(rows))
        lines.append(f"  param groups: {len(opt.param_groups)}")
        for group in opt.param_groups:
            options = ", ".join(f"{k}={v}" for k, v in group.options)
            lines.append(f"    [{group.index}] {group.num_params} params; {options}")
    return "\n".join(lines)


def _human_bytes(count: int) -> str:
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{count} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
