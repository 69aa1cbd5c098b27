"""What a HybridOffloadOptimizer checkpoint entry must look like, per kind of sub-optimizer.

A precision-aware sub-optimizer (FusedAdam, PrecisionAwareAdamW) takes FusedAdam's portable
format: :func:`wrapped_optim._formats.holder_format.check_holder_entry` checks it. A plain torch
sub-optimizer declares no format: the state names and kinds it keeps are read from its live
state, or from one step of a throwaway instance (:class:`References`). Every fault is raised
through :mod:`wrapped_optim._formats.state_format`, so its wording is that of every other loader.

Internal to :class:`~wrapped_optim.optimizers.HybridOffloadOptimizer` (not public API; its
``load_state_dict`` docstring shows the behaviour these rules give).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from wrapped_optim._formats import holder_format, state_format
from wrapped_optim._formats.errors import OptimizerCheckpointError
from wrapped_optim.optimizers.hybrid_offload._layout import OffloadLayout

__all__ = [
    "Expected",
    "References",
    "agree_on_step",
    "holder_entry",
    "holder_source",
    "plain_entry",
]


Factory = Callable[..., torch.optim.Optimizer]


@attrs.frozen
class Expected:
    """What one state of a plain sub-optimizer looks like (from a live or a probe state)."""

    tensor: bool
    elementwise: bool = False  # shaped like its param
    floating: bool = False
    shape: tuple[int, ...] = ()
    template: torch.Tensor | None = None  # dtype and device of a scalar tensor (a step)

    @classmethod
    def of(cls, value: Any, param_shape: torch.Size) -> Expected:
        """The kind of ``value``, a state of a param of shape ``param_shape``."""
        if not isinstance(value, torch.Tensor):
            return cls(tensor=False)
        return cls(
            tensor=True,
            elementwise=value.shape == param_shape,
            floating=value.is_floating_point(),
            shape=tuple(value.shape),
            template=value if value.dim() == 0 else None,
        )


class References:
    """The state names (and kinds) each copy's sub-optimizer keeps, for validating a load.

    A copy with state: its current state. One without: the state a throwaway instance of
    the sub-optimizer class creates, in one step, for a two-element param of the copy's
    dtype and device under the same group options (probed once per group and dtype; a class
    that cannot be probed so gives ``None``: the names are not checked). ``factories`` are
    the host and device sub-optimizer classes, ``keywords`` their constructor keywords.
    """

    def __init__(
        self,
        layout: OffloadLayout,
        factories: tuple[
            Callable[..., torch.optim.Optimizer], Callable[..., torch.optim.Optimizer]
        ],
        keywords: dict[str, Any],
    ) -> None:
        self.layout = layout
        self.factories = factories
        self.keywords = keywords
        self.sub_of: dict[int, tuple[torch.optim.Optimizer, int]] = {}
        for sub in layout.sub_optimizers:
            for group_index, group in enumerate(sub.param_groups):
                for inner in group["params"]:
                    self.sub_of[id(inner)] = (sub, group_index)
        self.probes: dict[tuple[int, int, torch.dtype, torch.device], Any] = {}

    def owner_name(self, inner: torch.Tensor) -> str:
        """The class name of the sub-optimizer that steps ``inner``."""
        return type(self.sub_of[id(inner)][0]).__name__

    def expected(self, inner: torch.Tensor) -> dict[str, Expected] | None:
        """The states the sub-optimizer of ``inner`` keeps for it (``None``: unknown)."""
        sub, group_index = self.sub_of[id(inner)]
        current = sub.state.get(inner)
        if current:
            return {
                name: Expected.of(value, inner.shape)
                for name, value in current.items()
                if name != "master_param"
            }
        key = (id(sub), group_index, inner.dtype, inner.device)
        if key not in self.probes:
            self.probes[key] = self._probe(sub, group_index, inner)
        probed = self.probes[key]
        if probed is None:
            return None
        return {
            name: attrs.evolve(kind, elementwise=True, shape=tuple(inner.shape))
            if kind.elementwise
            else kind
            for name, kind in probed.items()
        }

    def _probe(
        self, sub: torch.optim.Optimizer, group_index: int, inner: torch.Tensor
    ) -> dict[str, Expected] | None:
        factory = self.factories[0 if sub in self.layout.cpu_optimizers else 1]
        options = {
            k: _clone_value(v) for k, v in sub.param_groups[group_index].items() if k != "params"
        }
        probe = torch.zeros(2, dtype=inner.dtype, device=inner.device, requires_grad=True)
        probe.grad = torch.zeros_like(probe)
        try:
            twin = factory([{**options, "params": [probe]}], **self.keywords)
            twin.step()
            state = dict(twin.state.get(probe) or {})
        except Exception:
            return None
        return {
            name: Expected.of(value, probe.shape)
            for name, value in state.items()
            if name != "master_param"
        }


def plain_entry(
    index: Any,
    param: torch.Tensor,
    entry: Any,
    expected: dict[str, Expected] | None,
    owner: str,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, Any]:
    """Validates one param's saved state for a plain sub-optimizer and copies it."""
    entry = state_format.check_entry(index, entry)
    if expected is not None:
        names = [name for name in entry if name != "master_param"]
        state_format.check_names(index, names, expected, owner, note=" (and master_param)")
    return {
        name: _plain_value(
            index, param, name, value, None if expected is None else expected[name], dtype, device
        )
        if name != "master_param"
        else _master_value(index, param, value, dtype, device)
        for name, value in entry.items()
    }


def _master_value(
    index: Any, param: torch.Tensor, value: Any, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    saved = state_format.check_tensor(index, "master_param", value)
    state_format.check_shape(index, "master_param", saved, param.shape)
    state_format.check_floating(index, "master_param", saved)
    state_format.check_values(index, "master_param", value, dtype)  # cast to dtype below
    copy: torch.Tensor = value.detach().to(device=device, dtype=dtype, copy=True)
    return copy


def _plain_value(
    index: Any,
    param: torch.Tensor,
    name: str,
    value: Any,
    kind: Expected | None,
    dtype: torch.dtype,
    device: torch.device,
) -> Any:
    """One checked, copied state value (never the caller's tensor)."""
    if name == "step":
        return _step_value(index, value, kind)
    if kind is not None and not kind.tensor:
        if isinstance(value, torch.Tensor):
            raise OptimizerCheckpointError(
                f"param {index!r}: state {name!r} must not be a tensor, got {type(value).__name__}"
            )
        return value
    if not isinstance(value, torch.Tensor):
        if kind is None:
            return value
        state_format.check_tensor(index, name, value)
    if kind is not None:
        if kind.elementwise:
            state_format.check_shape(index, name, value, param.shape)
        else:
            state_format.check_shape(index, name, value, kind.shape, "the sub-optimizer keeps")
        if kind.floating:
            state_format.check_floating(index, name, value)
    # What it is cast to below: a template's dtype, nothing (a clone), or the copies' dtype.
    if kind is not None and not kind.elementwise:
        into = None if kind.template is None else kind.template.dtype
    else:
        into = dtype if value.is_floating_point() else None
    state_format.check_values(index, name, value, into)
    if kind is not None and not kind.elementwise:
        template = kind.template
        if template is not None:
            return value.detach().to(dtype=template.dtype, device=template.device, copy=True)
        return value.detach().clone()
    if value.is_floating_point():
        return value.detach().to(device=device, dtype=dtype, copy=True)
    return value.detach().to(device=device, copy=True)


def _step_value(index: Any, value: Any, kind: Expected | None) -> Any:
    """A checked per-param step, as the sub-optimizer keeps it (its template's dtype)."""
    state_format.check_step(f"param {index!r}", value)
    template = kind.template if kind is not None else None
    if isinstance(value, torch.Tensor):
        if template is not None:
            return value.detach().to(dtype=template.dtype, device=template.device, copy=True)
        return value.detach().clone()
    if template is not None:
        return torch.tensor(float(value), dtype=template.dtype, device=template.device)
    return value


def agree_on_step(
    index: Any,
    step: int,
    group_index: int,
    groups: list[dict[str, Any]],
    param_steps: dict[int, tuple[Any, int]],
) -> None:
    """A per-param step (torch's layout) must match its group's (FusedAdam's layout)."""
    if "step" in groups[group_index]:
        group_step = state_format.check_step(
            f"param group {group_index}", groups[group_index]["step"]
        )
        if step != group_step:
            raise OptimizerCheckpointError(
                f"param {index!r}: step {step} disagrees with the step of its param group "
                f"{group_index} ({group_step})"
            )
        return
    first, seen = param_steps.setdefault(group_index, (index, step))
    if seen != step:
        raise OptimizerCheckpointError(
            f"param {index!r}: step {step} disagrees with param {first!r} ({seen}) of the same "
            f"param group {group_index}; a precision-aware sub-optimizer keeps one step a group"
        )


def holder_entry(
    index: Any, inner: torch.Tensor, entry: Any, sub: Any
) -> tuple[int | None, dict[str, torch.Tensor]]:
    """Validates one param's saved state for a precision-aware holder: (its step, states).

    Its ``master_param`` may be the hybrid optimizer's own FP32 copy (accepted even when the
    holder keeps no master); a per-param ``step`` is torch's layout of the group's step.
    """
    rule = holder_format.holder_rule(sub, inner, master_copy=True)
    states = holder_format.check_holder_entry(
        index, entry, rule, tuple(inner.shape), extra=("step",)
    )
    step = None
    if "step" in entry:
        step = state_format.check_step(f"param {index!r}", entry["step"])
    return step, {name: value for name, value in states.items() if isinstance(value, torch.Tensor)}


def holder_source(value: torch.Tensor, inner: torch.Tensor, chunked: bool) -> torch.Tensor:
    """What ``set_scaled_state`` gets: never a tensor it may scale in place.

    A chunk-capable holder never modifies its source and may quantize it from wherever it
    lives (staging relies on that); any other holder gets a private FP32 copy on the
    state's device (TE's fp16 path scales its argument in place).
    """
    if value.dtype == torch.int16:  # a remainder master
        return value.detach() if chunked else value.detach().to(inner.device, copy=True)
    if chunked:
        return value.detach().to(torch.float32)
    return value.detach().to(device=inner.device, dtype=torch.float32, copy=True)


def _clone_value(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def clone_options(group: Mapping[str, Any]) -> dict[str, Any]:
    """A group's options (not its params), tensors cloned."""
    return {k: _clone_value(v) for k, v in group.items() if k != "params"}
