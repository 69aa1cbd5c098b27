"""HybridOffloadOptimizer's fused host step: grad in, AdamW update and param out in one pass.

:func:`plan` picks the offloaded params whose formats the CPU kernel of
:mod:`~wrapped_optim.optimizers.kernels.cpu_kernel` takes (a contiguous bf16 or FP32 CPU param
with an FP32 host copy) under a host optimizer it reproduces: PrecisionAwareAdamW, bitwise, for a
copy it would itself hand to the kernel; torch's ``AdamW`` with the implementation left to
HybridOffloadOptimizer, within FP32 rounding of torch's. :func:`run` updates them after the
host optimizer's own ``step`` has stepped the others. See docs/hybrid.md, "The fused host
step", for the rules and the bytes it saves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor

import wrapped_optim.optimizers.hybrid_offload._layout as offload_layout
from wrapped_optim.optimizers.kernels import cpu_kernel
from wrapped_optim.optimizers.precision_adamw import (
    PrecisionAwareAdamW,
    kernel_step_copies,
    kernel_steps_copy,
)

__all__ = ["FusedEntry", "grad_of", "plan", "run"]

# (param, host copy, grad) of a PrecisionAwareAdamW copy.
_Update = tuple[Tensor, Tensor, Tensor]

# torch AdamW group switches the kernel has no counterpart for.
_TORCH_SWITCHES = ("amsgrad", "maximize", "capturable", "differentiable")


@attrs.frozen(eq=False)
class FusedEntry:
    """One offloaded parameter the fused host step updates: the param (written), its host
    copy (the FP32 master), the grad read, and the host sub-optimizer and its group holding
    the copy.

    Example:
        >>> import torch
        >>> param = torch.zeros(2, dtype=torch.bfloat16)
        >>> inner = param.float()
        >>> host = torch.optim.AdamW([inner])
        >>> entry = FusedEntry(param, inner, torch.ones(2), host, host.param_groups[0])
        >>> entry.inner.dtype, entry.param.dtype
        (torch.float32, torch.bfloat16)
    """

    param: Tensor
    inner: Tensor
    grad: Tensor
    optimizer: torch.optim.Optimizer
    group: dict[str, Any]


def grad_of(param: Tensor) -> Tensor | None:
    """The gradient HybridOffloadOptimizer steps ``param`` with: ``decoupled_grad`` (Megatron's
    precision-aware optimizers) before ``grad``.

    Example:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> p.decoupled_grad = torch.ones(2)
        >>> grad_of(p).tolist()
        [1.0, 1.0]
    """
    grad: Tensor | None = getattr(param, "decoupled_grad", None)
    return param.grad if grad is None else grad


def _host_groups(
    layout: offload_layout.OffloadLayout,
) -> Iterator[tuple[torch.optim.Optimizer, int, dict[str, Any]]]:
    for sub in layout.cpu_optimizers:
        for sub_group, index in zip(sub.param_groups, layout.host_group_index, strict=True):
            yield sub, index, sub_group


def _kind(sub: torch.optim.Optimizer, torch_default: bool) -> str | None:
    """How the fused step updates copies of ``sub``, or None; ``torch_default``: the host
    optimizer is torch's AdamW with the implementation left to HybridOffloadOptimizer."""
    if isinstance(sub, PrecisionAwareAdamW):
        return "precision"  # for each copy its own step would hand the kernel
    if type(sub) is not torch.optim.AdamW or not torch_default:
        return None  # not torch's AdamW, or the caller picked its implementation: they get it
    return "torch"


def _torch_group_allows(group: dict[str, Any]) -> bool:
    """No option the kernel lacks, and AdamW's decoupled decay (``decoupled_weight_decay=False``
    is torch's L2 mode)."""
    return (
        not any(group.get(k) for k in _TORCH_SWITCHES)
        and group.get("decoupled_weight_decay", True) is not False
    )


# Param dtype -> the grad dtypes the fused step reads for it (its host copy is FP32).
_GRAD_DTYPES = {
    torch.bfloat16: (torch.bfloat16, torch.float32),
    torch.float32: (torch.float32,),
}


def _formats_allow(param: Tensor, inner: Tensor, grad: Tensor) -> bool:
    return (
        param.dtype in _GRAD_DTYPES
        and param.device.type == "cpu"
        and param.is_contiguous()
        and inner.dtype == torch.float32
        and inner.is_contiguous()
        and grad.dtype in _GRAD_DTYPES[param.dtype]
        and grad.device.type == "cpu"
        and not grad.is_sparse
        and grad.numel() == param.numel()
    )


def _torch_state_allows(state: dict[str, Any], inner: Tensor) -> bool:
    moments = [state.get("exp_avg"), state.get("exp_avg_sq")]
    step = state.get("step")
    return (
        isinstance(step, Tensor)
        and step.numel() == 1
        and step.device.type == "cpu"
        and all(
            isinstance(t, Tensor)
            and t.dtype == torch.float32
            and t.device.type == "cpu"
            and t.is_contiguous()
            and t.numel() == inner.numel()
            for t in moments
        )
    )


def plan(
    layout: offload_layout.OffloadLayout,
    param_groups: Sequence[dict[str, Any]],
    *,
    enabled: bool | None = None,
    cpu_optimizer_cls: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
    keywords: Iterable[str] = (),
) -> list[FusedEntry]:
    """The offloaded parameters of ``layout`` the fused host step updates in this step.

    Args:
        layout: the optimizer's layout (its host copies and host sub-optimizer).
        param_groups: its outer param groups (an implementation choice in one counts).
        enabled: its ``fused_host_step`` (``False``: nothing is fused).
        cpu_optimizer_cls: the host optimizer class it was given.
        keywords: its sub-optimizer keywords (``fused``/``foreach`` there count).

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import HybridOffloadOptimizer
        >>> from wrapped_optim.optimizers.kernels import cpu_kernel
        >>> p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        >>> opt = HybridOffloadOptimizer([p], offload_fraction=1.0, lr=0.1)
        >>> p.grad = torch.ones(4, dtype=torch.bfloat16)
        >>> len(plan(opt.layout, opt.param_groups)) == (1 if cpu_kernel.available() else 0)
        True
        >>> plan(opt.layout, opt.param_groups, enabled=False)
        []
    """
    if enabled is False or not layout.cpu_optimizers:
        return []
    if not cpu_kernel.available():
        return []
    entries = []
    for sub, index, sub_group in _host_groups(layout):
        torch_default = (
            cpu_optimizer_cls is torch.optim.AdamW
            and not offload_layout.implementation_chosen(keywords, param_groups[index])
        )
        kind = _kind(sub, torch_default)
        if kind is None or (kind == "torch" and not _torch_group_allows(sub_group)):
            continue
        for inner in sub_group["params"]:
            param = layout.cpu_copys_map_gpu_param[inner]
            grad = grad_of(param)
            state = sub.state.get(inner)
            if grad is None or not _formats_allow(param, inner, grad):
                continue
            if kind == "torch" and state and not _torch_state_allows(state, inner):
                continue
            # A PrecisionAwareAdamW copy is fused only where its own step (given an FP32
            # grad, as the unfused path gives it: ``inner`` stands in for it) would use the
            # kernel, so the fused step is bitwise its update.
            if kind == "precision" and not (
                isinstance(sub, PrecisionAwareAdamW) and kernel_steps_copy(sub, inner, sub_group)
            ):
                continue
            entries.append(FusedEntry(param, inner, grad, sub, sub_group))
    return entries


def run(entries: Sequence[FusedEntry]) -> None:
    """Updates every entry of :func:`plan`, once the host sub-optimizer has stepped the rest.

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import HybridOffloadOptimizer
        >>> p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        >>> opt = HybridOffloadOptimizer([p], offload_fraction=1.0, lr=0.5, weight_decay=0.0)
        >>> for _ in range(2):
        ...     p.grad = torch.ones(4, dtype=torch.bfloat16)
        ...     opt.step()  # the second one runs the fused step where the kernel exists
        >>> master = opt.state[p]["master_param"]  # the host copy, stepped twice
        >>> torch.equal(p, master.to(torch.bfloat16)), opt.state[p]["step"].item()
        (True, 2.0)
    """
    precision: dict[int, tuple[PrecisionAwareAdamW, dict[str, Any], list[_Update]]] = {}
    plain: dict[tuple[int, float], list[FusedEntry]] = {}
    for entry in entries:
        sub = entry.optimizer
        if isinstance(sub, PrecisionAwareAdamW):
            update = (entry.param, entry.inner, entry.grad)
            precision.setdefault(id(entry.group), (sub, entry.group, []))[2].append(update)
        else:
            state = sub.state.get(entry.inner)
            step = float(state["step"]) + 1 if state else 1.0
            plain.setdefault((id(entry.group), step), []).append(entry)
    for sub, group, updates in precision.values():
        kernel_step_copies(sub, group, updates)  # its group step: advanced by sub.step
    for (_, step), same_step in plain.items():
        _torch_adamw(same_step, step)


def _torch_adamw(entries: Sequence[FusedEntry], step: float) -> None:
    """torch AdamW's update of ``entries`` (one group, one step count) by the kernel; their
    step counts advance as torch's would."""
    group = entries[0].group
    beta1, beta2 = group["betas"]
    states = [entry.optimizer.state[entry.inner] for entry in entries]
    for state, entry in zip(states, entries, strict=True):
        if not state:
            _torch_initial_state(state, entry.inner, group)
    cpu_kernel.adamw_step_(
        [entry.param.view(-1) for entry in entries],
        [entry.grad.reshape(-1).contiguous() for entry in entries],
        [state["exp_avg"].view(-1) for state in states],
        [state["exp_avg_sq"].view(-1) for state in states],
        [entry.inner.view(-1) for entry in entries],
        lr=float(group["lr"]), betas=(float(beta1), float(beta2)), eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]),
        bias_correction1=1.0 - float(beta1) ** step,
        bias_correction2=1.0 - float(beta2) ** step,
        adam_w_mode=True,
    )  # fmt: skip
    torch._foreach_add_([state["step"] for state in states], 1)


def _torch_initial_state(state: dict[str, Any], inner: Tensor, group: dict[str, Any]) -> None:
    """The state torch's AdamW creates for a param on its first step (torch 2.13's
    ``Adam._init_group``): a 0-d ``step`` (float32 for the fused implementation, else the
    default scalar dtype) and zero moments shaped like the param, so that the checkpoint
    format and every later step are the ones torch's own first step would give."""
    fused = bool(group.get("fused"))
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    state["step"] = torch.zeros((), dtype=torch.float32 if fused else scalar, device="cpu")
    state["exp_avg"] = torch.zeros_like(inner, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(inner, memory_format=torch.preserve_format)
