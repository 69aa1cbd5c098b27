"""HybridOffloadOptimizer's step, phase by phase, as functions over its layout.

A step syncs the outer group options into the sub-optimizers (:func:`sync_groups`), gives
the copies their grads (:func:`~._offload_grads.give_grads`), steps the sub-optimizers
(:func:`step_sub_optimizers`, the fused host step included) and copies the results back
into the params (:func:`copy_back`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch

from wrapped_optim._adapters.precision import is_precision_aware_holder
from wrapped_optim._rollback import OptimizerSnapshot
from wrapped_optim.optimizers.hybrid_offload._host_step import FusedEntry, run
from wrapped_optim.optimizers.hybrid_offload._layout import OffloadLayout
from wrapped_optim.optimizers.hybrid_offload._transfers import copy_all

# The step's phases as torch.profiler ranges (docs/hybrid.md): a trace shows where an
# offloaded step spends its time, and the benchmark reads its breakdown from them.
COPY_IN = "HybridOffloadOptimizer.copy_in"
HOST_STEP = "HybridOffloadOptimizer.host_step"
DEVICE_STEP = "HybridOffloadOptimizer.device_step"
COPY_OUT = "HybridOffloadOptimizer.copy_out"

__all__ = ["copy_back", "step_sub_optimizers", "sync_groups", "sync_steps_from_holders"]


def sync_groups(layout: OffloadLayout, param_groups: list[dict[str, Any]]) -> None:
    """Every sub-optimizer group takes the options of its outer group (LR schedules).

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import HybridOffloadOptimizer
        >>> opt = HybridOffloadOptimizer([torch.nn.Parameter(torch.ones(2))], lr=0.1)
        >>> opt.param_groups[0]["lr"] = 0.5
        >>> sync_groups(opt.layout, opt.param_groups)
        >>> opt.layout.cpu_optimizers[0].param_groups[0]["lr"]
        0.5
    """
    for sub, group_indices in layout.with_groups():
        for sub_group, group_index in zip(sub.param_groups, group_indices, strict=True):
            for key, value in param_groups[group_index].items():
                if key != "params":
                    sub_group[key] = value


def sync_steps_from_holders(layout: OffloadLayout, param_groups: list[dict[str, Any]]) -> None:
    """A precision-aware holder counts steps per group: its counts go into the outer groups."""
    for sub, group_indices in layout.with_groups():
        if not is_precision_aware_holder(sub):
            continue
        for sub_group, group_index in zip(sub.param_groups, group_indices, strict=True):
            if "step" in sub_group:
                param_groups[group_index]["step"] = sub_group["step"]


def step_sub_optimizers(
    layout: OffloadLayout, fused: Sequence[FusedEntry], *, atomic: bool = False
) -> None:
    """Steps the host sub-optimizer (then the ``fused`` entries of it), then the device one.

    With ``atomic`` and two sub-optimizers, the host one's params, state and the params the
    fused step wrote are kept until the device one has stepped, and put back if it raises.
    """
    subs = layout.sub_optimizers  # the host one first: its snapshot lives in host memory
    atomic = atomic and len(subs) > 1 and subs[0] in layout.cpu_optimizers
    snapshot = OptimizerSnapshot.take(subs[0]) if atomic else None
    # The fused host step writes its params before the step commits: kept too.
    written = [(e.param, e.param.detach().clone()) for e in fused] if atomic else []
    try:
        for sub in subs:
            on_host = sub in layout.cpu_optimizers
            with torch.profiler.record_function(HOST_STEP if on_host else DEVICE_STEP):
                sub.step()
                if on_host:
                    run([entry for entry in fused if entry.optimizer is sub])
    except BaseException:
        if snapshot is not None:
            snapshot.restore()
            with torch.no_grad():
                for param, value in written:
                    param.copy_(value)
        raise


@torch.no_grad()
def copy_back(layout: OffloadLayout, skip: Collection[torch.Tensor] = frozenset()) -> None:
    """Copies each stepped copy into its param, except the params in ``skip`` (those the
    fused host step wrote itself).

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import HybridOffloadOptimizer
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> opt = HybridOffloadOptimizer([p], offload_fraction=1.0)
        >>> _ = opt.gpu_params_map_cpu_copy[p].fill_(2.0)
        >>> copy_back(opt.layout)
        >>> p.tolist()
        [2.0, 2.0]
    """
    copy_all(
        [
            (p, inner)
            for p, inner in layout.param_to_inner_param.items()
            if inner is not p and p not in skip
        ]
    )
