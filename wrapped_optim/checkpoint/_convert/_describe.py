"""A checkpoint's canonical index as text: what ``wrapped-optim inspect`` shows of a format
that only the converter reads (Megatron's, DeepSpeed's)."""

from __future__ import annotations

from collections import Counter

from wrapped_optim.checkpoint._convert._canonical import StateIndex


def describe_index(index: StateIndex, format_name: str, *, per_param: bool = True) -> str:
    """Format, groups (options and member count), state names with dtypes and bytes, steps.

    Example:
        >>> import torch
        >>> from wrapped_optim.checkpoint._convert._canonical import (
        ...     GroupRecord, ParamRecord, StateIndex, TensorSpec)
        >>> spec = TensorSpec((2, 3), torch.float32)
        >>> index = StateIndex([ParamRecord("w", 0, (2, 3), {"exp_avg": spec}, 4.0)],
        ...                    [GroupRecord({"lr": 0.1}, ["w"])], "megatron")
        >>> print(describe_index(index, "megatron-fully-reshardable", per_param=False))
        format: megatron-fully-reshardable (read by the converter)
        parameters: 1 in 1 group(s); steps: 4
        group 0: 1 parameter(s); lr=0.1
        exp_avg: 1 tensor(s), float32, 24 bytes
    """
    steps = sorted({p.step for p in index.params if p.step is not None})
    step_text = ", ".join(f"{s:g}" for s in steps) if steps else "none"
    lines = [
        f"format: {format_name} (read by the converter)",
        f"parameters: {len(index.params)} in {len(index.groups)} group(s); steps: {step_text}",
    ]
    for number, group in enumerate(index.groups):
        options = ", ".join(f"{k}={v}" for k, v in sorted(group.options.items()))
        lines.append(f"group {number}: {len(group.names)} parameter(s); {options}")
    counts: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    dtypes: dict[str, set[str]] = {}
    for param in index.params:
        for key, spec in param.state.items():
            counts[key] += 1
            sizes[key] += spec.numel * spec.dtype.itemsize
            dtypes.setdefault(key, set()).add(str(spec.dtype).removeprefix("torch."))
    for key in counts:
        kinds = "/".join(sorted(dtypes[key]))
        lines.append(f"{key}: {counts[key]} tensor(s), {kinds}, {sizes[key]} bytes")
    if per_param:
        for param in index.params:
            states = ", ".join(
                f"{k} {str(s.dtype).removeprefix('torch.')}" for k, s in param.state.items()
            )
            step = "-" if param.step is None else f"{param.step:g}"
            lines.append(
                f"  {param.name} {tuple(param.shape)} group {param.group} step {step}: {states}"
            )
    return "\n".join(lines)
