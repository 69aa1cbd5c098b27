"""Deferred state: a state dict whose compressed states are expanded only when DCP asks."""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from typing import Any, cast

import attrs
import torch
from torch.distributed.tensor import DTensor

from wrapped_optim._adapters.dtensor import like_param
from wrapped_optim._adapters.precision import is_precision_aware_holder, supports_chunked_state
from wrapped_optim._rollback import deep_clone
from wrapped_optim.patching import patch_attribute

__all__ = ["DeferredState"]


def _compressed_names(leaf: Any) -> frozenset[str]:
    """State names whose storage is not the FP32 tensor the state dict exposes."""
    if not is_precision_aware_holder(leaf):
        return frozenset()
    return frozenset(
        name for name, dtype in leaf.name_to_dtype_map.items() if dtype != torch.float32
    )


def _uses_remainder(leaf: Any, param: torch.Tensor, name: str) -> bool:
    """TE's rule: an int16 remainder master beside a bf16 parameter (FP32 master only)."""
    return (
        name == "master_param"
        and bool(getattr(leaf, "store_param_remainders", False))
        and bool(getattr(leaf, "master_weights", False))
        and leaf.name_to_dtype_map.get("master_param") == torch.float32
        and param.dtype == torch.bfloat16
    )


def _param_index(leaf: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters in torch's state_dict numbering (first occurrence wins, as torch does)."""
    seen: dict[int, torch.Tensor] = {}
    for group in leaf.param_groups:
        for p in group["params"]:
            seen.setdefault(id(p), p)
    return list(seen.values())


def _state_device(leaf: Any, param: torch.Tensor, name: str) -> torch.device:
    """Where a slice is expanded: beside the stored state, or the param for a holder that
    keeps that state outside ``state`` (a deferred state's param always has an entry)."""
    stored = leaf.state[param].get(name)
    return stored.device if isinstance(stored, torch.Tensor) else param.device


@attrs.frozen(eq=False)
class DeferredState:
    """A state tensor the state dict only promises: it is expanded chunk by chunk on demand.

    Attributes:
        holder: the precision-aware optimizer owning the storage.
        param: the parameter the state belongs to.
        name: the state name (``"exp_avg"``, ...).
        dtype: the expansion dtype (float32; int16 for a remainder master).

    Examples:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.zeros(3))
        >>> DeferredState(holder=None, param=p, name="exp_avg", dtype=torch.float32).shape
        torch.Size([3])
    """

    holder: Any
    param: torch.Tensor
    name: str
    dtype: torch.dtype = torch.float32

    @property
    def shape(self) -> torch.Size:
        """The expanded state's shape: the parameter's."""
        return self.param.shape

    def read(self, start: int, numel: int) -> torch.Tensor:
        """Expands a flat slice of the state.

        Args:
            start: The first flat element.
            numel: How many elements.

        Returns:
            Elements ``[start, start + numel)`` of the expansion, as a fresh CPU tensor.
        """
        device = _state_device(self.holder, self.param, self.name)
        if supports_chunked_state(self.holder):
            out = torch.empty(numel, dtype=self.dtype, device=device)
            self.holder.read_unscaled_state_chunk(self.param, self.name, start, out)
        else:
            full = self.holder.get_unscaled_state(self.param, self.name)
            if isinstance(full, DTensor):
                full = full.to_local()
            stored = self.holder.state[self.param].get(self.name)
            aliased = isinstance(stored, torch.Tensor) and (
                stored.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
            )
            if start == 0 and numel == full.numel() and not aliased:
                out = full  # a fresh expansion of the whole tensor: ours to hand out and free
            else:
                out = full.reshape(-1)[start : start + numel].clone()
            del full
        return _owned_cpu_copy(out)


def _owned_cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a compact CPU tensor that nobody else references (a copy unless it is one)."""
    if t.device.type == "cpu" and t.is_contiguous() and t._base is None:
        storage = t.untyped_storage()
        if t.storage_offset() == 0 and storage.nbytes() == t.nbytes and t.requires_grad is False:
            return t
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    out.copy_(t.detach())
    return out


def _is_meta(value: Any) -> bool:
    if isinstance(value, DTensor):
        return bool(value.to_local().is_meta)
    return isinstance(value, torch.Tensor) and value.is_meta


def _placeholder_state_dict(
    leaf: torch.optim.Optimizer,
) -> tuple[dict[str, Any], dict[tuple[int, str], DeferredState]]:
    """``leaf.state_dict()`` with every compressed state replaced by a meta-tensor placeholder.

    The holder's state_dict obtains each state through ``self.get_unscaled_state`` (the
    precision-aware contract), so patching that one instance attribute for the duration of
    the call yields the optimizer's exact layout without expanding anything.
    """
    compressed = _compressed_names(leaf)
    if not compressed:
        return leaf.state_dict(), {}
    original = leaf.get_unscaled_state  # type: ignore[attr-defined]

    def placeholder(param: torch.Tensor, state_name: str) -> torch.Tensor:
        if state_name not in compressed:
            return cast(torch.Tensor, original(param, state_name))
        if isinstance(param, DTensor):  # the local shard's expansion, as a DTensor
            local = torch.empty(param.to_local().shape, dtype=torch.float32, device="meta")
            return like_param(param, local)
        return torch.empty(param.shape, dtype=torch.float32, device="meta")

    with patch_attribute(leaf, "get_unscaled_state", placeholder):
        state_dict = leaf.state_dict()
    params = _param_index(leaf)
    deferred: dict[tuple[int, str], DeferredState] = {}
    for index, entries in state_dict["state"].items():
        for name, value in entries.items():
            if _is_meta(value):
                deferred[(int(index), str(name))] = DeferredState(leaf, params[int(index)], name)
    return state_dict, deferred


def _staged_contents(
    leaf: torch.optim.Optimizer,
) -> tuple[dict[str, Any], dict[tuple[int, str], DeferredState]]:
    """What an asynchronous save writes: the state at this moment, apart from the optimizer.

    A precision-aware holder is copied as it stores its state (compressed moments stay
    compressed, with their scales, and the params a remainder master needs) into a frozen
    twin, which is then expanded chunk by chunk like the live one; any other optimizer's
    ``state_dict()`` is copied where it aliases live tensors, and its param groups always
    (for a hybrid with precision-aware sub-optimizers, that is the FP32 expansion its
    ``state_dict`` produces).
    """
    if _compressed_names(leaf) and not getattr(leaf, "sub_optimizers", None):
        return _placeholder_state_dict(_frozen_twin(leaf))
    state_dict = leaf.state_dict()
    live = {
        t.untyped_storage().data_ptr()
        for entry in leaf.state.values()
        for t in entry.values()
        if isinstance(t, torch.Tensor)
    }
    live |= {p.untyped_storage().data_ptr() for g in leaf.param_groups for p in g["params"]}

    def copied(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            shared = value.untyped_storage().data_ptr() in live
            return value.detach().clone() if shared else value
        if isinstance(value, dict):
            return {k: copied(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(copied(v) for v in value)
        return value

    # Group options are small and schedulers update tensor ones in place (a tensor ``lr``):
    # all of them are copied, whatever they alias.
    staged = {k: deep_clone(v) if k == "param_groups" else copied(v) for k, v in state_dict.items()}
    return staged, {}


@torch.no_grad()
def _frozen_twin(leaf: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A copy of ``leaf`` over cloned params, state and param-keyed tables (such as scales).

    Instance attributes that override a method (patches of a wrapper) are left out: the twin
    reads its state through its class's own accessors; tensor caches keyed by anything else
    (scratch buffers) start empty, so that the twin shares no buffer with the optimizer.
    """
    clones: dict[int, torch.Tensor] = {}
    for group in leaf.param_groups:
        for p in group["params"]:
            clones.setdefault(id(p), p.detach().clone())
    ids = set(clones)

    def keyed_by_params(table: Any) -> bool:
        return (
            isinstance(table, dict)
            and not isinstance(table, OrderedDict)
            and bool(table)
            and all(isinstance(k, torch.Tensor) and id(k) in ids for k in table)
        )

    twin = object.__new__(type(leaf))
    for name, value in vars(leaf).items():
        if callable(value) and hasattr(type(leaf), name):
            continue
        if (
            isinstance(value, dict)
            and not keyed_by_params(value)
            and value
            and all(isinstance(v, torch.Tensor) for v in value.values())
        ):
            value = type(value)()  # a tensor cache (scratch buffers): the twin's own
        elif keyed_by_params(value) or name == "state":
            value = {clones[id(k)]: _cloned(v, clones) for k, v in value.items()}
            if name == "state":
                value = defaultdict(dict, value)
        vars(twin)[name] = value
    vars(twin)["param_groups"] = [
        {k: [clones[id(p)] for p in v] if k == "params" else deep_clone(v) for k, v in g.items()}
        for g in leaf.param_groups
    ]
    return twin


def _cloned(value: Any, clones: dict[int, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor) and id(value) in clones:
        return clones[id(value)]  # a state entry that is the param itself
    if isinstance(value, dict):
        return {k: _cloned(v, clones) for k, v in value.items()}
    return deep_clone(value)
