"""HybridOffloadOptimizer's layout: which params are offloaded, their copies, the sub-optimizers.

:class:`OffloadLayout` is the one value the optimizer's step, loading and state rules take
besides their tensors and options. :func:`placement` decides where each param is stepped and
:func:`build_layout` makes the copies and sub-optimizers for it; neither changes anything of
the optimizer, so a loader can build a layout aside and the optimizer swap it in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import attrs
import torch
from torch import Tensor

from wrapped_optim._adapters.precision import is_precision_aware_holder

__all__ = [
    "OffloadLayout",
    "Placement",
    "adopt_sub_defaults",
    "build_layout",
    "host_keywords",
    "implementation_chosen",
    "placement",
]

_LOW_PRECISION = (torch.bfloat16, torch.float16)
# Sub-optimizer defaults that are implementation switches: they stay the caller's.
_NOT_ADOPTED = frozenset({"params", "fused", "foreach", "capturable", "differentiable"})
_ABSENT = object()

#: For every param: (offloaded, dtype of its stepped copy, device of that copy).
Placement = dict[Tensor, tuple[bool, torch.dtype, torch.device]]


@attrs.frozen(eq=False)
class OffloadLayout:
    """The copies and sub-optimizers of one HybridOffloadOptimizer (Megatron's attribute names).

    ``host_group_index[i]`` is the outer group of the host sub-optimizer's group ``i``
    (``device_group_index`` alike); ``borrowed_grads`` holds the host copies whose ``grad`` is
    currently their param's own grad (see :func:`~._offload_grads.give_grads`).

    Example:
        >>> import torch
        >>> p, q = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
        >>> groups = [{"params": [p, q], "lr": 0.1}]
        >>> layout = build_layout(groups, placement(groups, 0.5, True), torch.optim.SGD, {},
        ...                       torch.optim.SGD, {"lr": 0.1})
        >>> [x in layout.gpu_params_map_cpu_copy for x in (p, q)], layout.host_group_index
        ([True, False], (0,))
        >>> len(layout.sub_optimizers)
        2
    """

    gpu_params_map_cpu_copy: dict[Tensor, Tensor]
    cpu_copys_map_gpu_param: dict[Tensor, Tensor]
    param_to_fp32_param: dict[Tensor, Tensor]
    param_to_inner_param: dict[Tensor, Tensor]
    inner_param_to_orig_param: dict[Tensor, Tensor]
    host_group_index: tuple[int, ...]
    device_group_index: tuple[int, ...]
    cpu_optimizers: list[torch.optim.Optimizer]
    gpu_optimizer: torch.optim.Optimizer | None
    borrowed_grads: set[Tensor] = attrs.field(factory=set)

    @property
    def sub_optimizers(self) -> list[torch.optim.Optimizer]:
        """The host sub-optimizer (if any), then the device one."""
        device = [] if self.gpu_optimizer is None else [self.gpu_optimizer]
        return [*self.cpu_optimizers, *device]

    def with_groups(self) -> list[tuple[torch.optim.Optimizer, tuple[int, ...]]]:
        """Each sub-optimizer with the outer group index of each of its groups."""
        pairs = [(cpu, self.host_group_index) for cpu in self.cpu_optimizers]
        if self.gpu_optimizer is not None:
            pairs.append((self.gpu_optimizer, self.device_group_index))
        return pairs

    def holders(self) -> list[torch.optim.Optimizer]:
        """The precision-aware sub-optimizers (FusedAdam's state format)."""
        return [sub for sub in self.sub_optimizers if is_precision_aware_holder(sub)]

    def holder_of(self) -> dict[int, torch.optim.Optimizer]:
        """id(stepped copy) -> the precision-aware sub-optimizer stepping it."""
        return {
            id(inner): sub
            for sub in self.holders()
            for group in sub.param_groups
            for inner in group["params"]
        }


def placement(
    param_groups: Iterable[dict[str, Any]], offload_fraction: float, fp32_copies: bool
) -> Placement:
    """Offloads params in group order until ``offload_fraction`` of the numel is reached;
    a 16-bit param's copy is FP32 when ``fp32_copies``.

    Example:
        >>> import torch
        >>> params = [torch.zeros(3, dtype=torch.bfloat16), torch.zeros(1)]
        >>> [where[:2] for where in placement([{"params": params}], 0.5, True).values()]
        [(True, torch.float32), (False, torch.float32)]
    """
    params = [p for group in param_groups for p in group["params"]]
    threshold = offload_fraction * sum(p.numel() for p in params)
    offloaded_numel = 0
    result: Placement = {}
    for param in params:
        dtype = torch.float32 if fp32_copies and param.dtype in _LOW_PRECISION else param.dtype
        if offloaded_numel < threshold:
            offloaded_numel += param.numel()
            result[param] = (True, dtype, torch.device("cpu"))
        else:
            result[param] = (False, dtype, param.device)
    return result


def implementation_chosen(keywords: Iterable[str], group: Iterable[str] = ()) -> bool:
    """Whether the caller picked torch's AdamW implementation (a ``fused`` or ``foreach``
    keyword, among the constructor ``keywords`` or the options of a ``group``): then they
    get exactly it (no fused CPU default, no fused host step).

    Example:
        >>> implementation_chosen({"lr": 0.1}), implementation_chosen({}, {"foreach": False})
        (False, True)
    """
    return bool({*keywords, *group} & {"fused", "foreach"})


def host_keywords(
    cpu_optimizer_cls: Callable[..., torch.optim.Optimizer], keywords: dict[str, Any]
) -> dict[str, Any]:
    """The host sub-optimizer's keywords: torch's AdamW (the default) gets its fused CPU
    kernel unless the caller chose ``fused`` or ``foreach`` themselves.

    Example:
        >>> import torch
        >>> host_keywords(torch.optim.AdamW, {"lr": 0.1}), host_keywords(torch.optim.SGD, {})
        ({'lr': 0.1, 'fused': True}, {})
    """
    options = dict(keywords)
    if cpu_optimizer_cls is torch.optim.AdamW and not implementation_chosen(keywords):
        options["fused"] = True
    return options


def _copy_of(
    param: Tensor, where: tuple[bool, torch.dtype, torch.device], pin_cpu_params: bool
) -> Tensor:
    """The tensor that is stepped for ``param``: a host copy, an FP32 working copy, or itself."""
    offloaded, dtype, _ = where
    if offloaded:
        pin = param.is_cuda and pin_cpu_params
        inner = torch.empty(param.shape, dtype=dtype, device="cpu", pin_memory=pin)
        inner.copy_(param.detach())
        return inner
    if dtype != param.dtype:
        return param.detach().to(dtype=dtype, copy=True)
    return param


@torch.no_grad()
def build_layout(
    param_groups: list[dict[str, Any]],
    where: Placement,
    cpu_optimizer_cls: Callable[..., torch.optim.Optimizer],
    cpu_keywords: dict[str, Any],
    gpu_optimizer_cls: Callable[..., torch.optim.Optimizer],
    gpu_keywords: dict[str, Any],
    *,
    pin_cpu_params: bool = True,
) -> OffloadLayout:
    """New copies of the params of ``param_groups`` placed as ``where`` says, and new
    sub-optimizers over them with those groups' options (see :class:`OffloadLayout`)."""
    to_host: dict[Tensor, Tensor] = {}
    to_param: dict[Tensor, Tensor] = {}
    to_fp32: dict[Tensor, Tensor] = {}
    to_inner: dict[Tensor, Tensor] = {}
    to_orig: dict[Tensor, Tensor] = {}
    host_groups: list[dict[str, Any]] = []
    device_groups: list[dict[str, Any]] = []
    host_group_index: list[int] = []
    device_group_index: list[int] = []
    for group_index, group in enumerate(param_groups):
        options = {k: v for k, v in group.items() if k != "params"}
        host_params, device_params = [], []
        for param in group["params"]:
            inner = _copy_of(param, where[param], pin_cpu_params)
            if where[param][0]:
                to_host[param] = inner
                to_param[inner] = param
                host_params.append(inner)
            else:
                device_params.append(inner)
            if inner.dtype != param.dtype:
                to_fp32[param] = inner
            to_inner[param] = inner
            to_orig[inner] = param
        if host_params:
            host_groups.append({**options, "params": host_params})
            host_group_index.append(group_index)
        if device_params:
            device_groups.append({**options, "params": device_params})
            device_group_index.append(group_index)
    return OffloadLayout(
        gpu_params_map_cpu_copy=to_host,
        cpu_copys_map_gpu_param=to_param,
        param_to_fp32_param=to_fp32,
        param_to_inner_param=to_inner,
        inner_param_to_orig_param=to_orig,
        host_group_index=tuple(host_group_index),
        device_group_index=tuple(device_group_index),
        cpu_optimizers=[cpu_optimizer_cls(host_groups, **cpu_keywords)] if host_groups else [],
        gpu_optimizer=gpu_optimizer_cls(device_groups, **gpu_keywords) if device_groups else None,
    )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    try:
        return bool(a == b)
    except Exception:  # values without a plain comparison: not adopted
        return False


def adopt_sub_defaults(
    layout: OffloadLayout, defaults: dict[str, Any], param_groups: list[dict[str, Any]]
) -> None:
    """``defaults`` and ``param_groups`` gain the hyper-parameters the sub-optimizers filled
    in (``betas``, ``eps``, ...) and agree on; implementation switches stay the caller's."""
    subs = layout.with_groups()
    if not subs:
        return
    common = set.intersection(*(set(sub.defaults) for sub, _ in subs)) - _NOT_ADOPTED
    for key in sorted(common - set(defaults)):
        values = [sub.defaults[key] for sub, _ in subs]
        if all(_same(v, values[0]) for v in values):
            defaults[key] = values[0]
    for group_index, group in enumerate(param_groups):
        found: dict[str, list[Any]] = {}
        for sub, group_indices in subs:
            if group_index in group_indices:
                sub_group = sub.param_groups[group_indices.index(group_index)]
                for key in common - set(group):
                    found.setdefault(key, []).append(sub_group.get(key, _ABSENT))
        for key, values in sorted(found.items()):
            if values[0] is not _ABSENT and all(_same(v, values[0]) for v in values):
                group[key] = values[0]
