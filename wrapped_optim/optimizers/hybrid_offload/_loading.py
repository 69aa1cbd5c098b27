"""HybridOffloadOptimizer's checkpoints: its portable state dict, validating and loading one.

Functions over the optimizer's :class:`~._offload_layout.OffloadLayout`, its param groups and
the payload. Every check goes through :mod:`wrapped_optim._formats.state_format` (per
sub-optimizer kind, see :mod:`~wrapped_optim.optimizers.hybrid_offload._state_rules`) and every undo
through :mod:`wrapped_optim._rollback`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from wrapped_optim._adapters.precision import is_precision_aware_holder, supports_chunked_state
from wrapped_optim._formats import state_format
from wrapped_optim._rollback import OptimizerSnapshot, copy_all
from wrapped_optim.optimizers.hybrid_offload._layout import OffloadLayout, Placement
from wrapped_optim.optimizers.hybrid_offload._state import exposed_state, plain_dict
from wrapped_optim.optimizers.hybrid_offload._state_rules import (
    References,
    agree_on_step,
    clone_options,
    holder_entry,
    holder_source,
    plain_entry,
)
from wrapped_optim.optimizers.hybrid_offload._step import sync_groups

__all__ = ["LoadUndo", "holder_state_dict", "load_plain", "load_with_holders", "prepare_load"]

Groups = list[dict[str, Any]]
States = dict[torch.Tensor, dict[str, Any]]
HolderStates = dict[torch.Tensor, dict[str, torch.Tensor]]


def holder_state_dict(
    layout: OffloadLayout,
    param_groups: Groups,
    state: dict[torch.Tensor, Any],
    *,
    with_master: bool,
) -> dict[str, Any]:
    """torch's layout, each param's state the sub-optimizer's own dict (never the in-place
    view ``state`` shows); a precision-aware holder's params in FusedAdam's portable format,
    with the stepped copy as ``master_param`` when ``with_master``."""
    holder_of = layout.holder_of()
    index_of: dict[int, int] = {}
    groups = []
    for group in param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = [index_of.setdefault(id(p), len(index_of)) for p in group["params"]]
        groups.append(packed)
    saved: dict[int, dict[str, Any]] = {}
    for group in param_groups:
        for param in group["params"]:
            inner = layout.param_to_inner_param[param]
            sub = holder_of.get(id(inner))
            if sub is None:
                if param in state:  # the live dict, as torch's (loaders write into it)
                    saved[index_of[id(param)]] = plain_dict(state[param])
                continue
            stored = sub.state.get(inner)
            if not stored:
                continue
            read = sub.get_unscaled_state  # type: ignore[attr-defined]
            entry = {name: read(inner, name) for name in list(stored)}
            if with_master:
                entry["master_param"] = inner
            saved[index_of[id(param)]] = entry
    return {"state": saved, "param_groups": groups}


def _full_master(entry: dict[str, torch.Tensor]) -> torch.Tensor | None:
    master = entry.get("master_param")
    return master if master is not None and master.is_floating_point() else None


@torch.no_grad()
def load_plain(
    build: Callable[[Groups], OffloadLayout],
    groups: Groups,
    states: States,
    *,
    with_master: bool,
) -> tuple[OffloadLayout, defaultdict[torch.Tensor, Any]]:
    """The loaded layout (``build`` of ``groups``) and state, built beside the current ones:
    the caller swaps them in; a fault here changes nothing but a param that is its own
    stepped copy (its master is written last)."""
    layout = build(groups)
    orig_of = layout.inner_param_to_orig_param
    # A param that is its own stepped copy takes its master last.
    own_masters: list[tuple[torch.Tensor, torch.Tensor]] = []
    for sub in layout.sub_optimizers:
        for inner in [p for group in sub.param_groups for p in group["params"]]:
            param = orig_of[inner]
            if param not in states:
                continue
            entry = dict(states[param])
            master = entry.pop("master_param", None)
            if master is not None:
                if inner is param:
                    own_masters.append((param, master))
                else:
                    inner.copy_(master.reshape(inner.shape))
                if with_master:
                    entry["master_param"] = inner
            sub.state[inner] = entry
    new_state = exposed_state(layout.cpu_optimizers, layout.gpu_optimizer, orig_of, with_master)
    copy_all(own_masters)
    return layout, new_state


def load_with_holders(
    layout: OffloadLayout,
    param_groups: Groups,
    groups: Groups,
    states: States,
    holder_states: HolderStates,
    *,
    with_master: bool,
) -> None:
    """Loads in place (``param_groups`` takes ``groups``), keeping what it overwrites until it
    has finished and putting it back if anything raises; the caller then re-exposes the
    state."""
    old_groups = list(param_groups)
    # A plain sub-optimizer's state is replaced, a holder's written into.
    snapshots = [
        OptimizerSnapshot.take(sub, clone_state=is_precision_aware_holder(sub))
        for sub in layout.sub_optimizers
    ]
    try:
        param_groups[:] = groups
        _commit_with_holders(layout, param_groups, states, holder_states, with_master)
    except BaseException:
        param_groups[:] = old_groups
        for snapshot in snapshots:
            snapshot.restore()
        raise


class LoadUndo:
    """What a HybridOffloadOptimizer's ``load_state_dict`` changes, kept so that it can be
    undone after that load returned (a larger load that fails later).

    ``overwrites`` are the tensors such a load writes in place: with a precision-aware
    sub-optimizer, every stepped tensor (a copy, or a param that is its own) and every such
    sub-optimizer's stored state; without, only the params that are their own stepped copy
    (the load builds new copies and sub-optimizers beside the old). Their
    bytes are the caller's to keep (an undo journal on disk) and to put back before
    :meth:`restore`, which puts back everything else: the layout, the param groups, each
    sub-optimizer's state dict and entries (by reference), group options and scales (cloned:
    one value per tensor), and then calls ``finish(layout)`` (the optimizer adopts the layout
    and re-exposes its state). Host memory: references, not state.
    """

    def __init__(
        self,
        layout: OffloadLayout,
        param_groups: Groups,
        finish: Callable[[OffloadLayout], None],
    ) -> None:
        self.layout = layout
        self.param_groups = param_groups
        self.groups = list(param_groups)
        self.finish = finish
        self.subs = [
            (
                sub,
                sub.state,
                {inner: dict(entry) for inner, entry in sub.state.items()},
                OptimizerSnapshot.take(sub, clone_state=False, keep_values=False),
            )
            for sub in layout.sub_optimizers
        ]
        # Without holders a load builds new copies: only a param that is its own is written.
        holders = bool(layout.holders())
        inner = {id(t): t for p, t in layout.param_to_inner_param.items() if holders or t is p}
        stored = {
            id(t): t
            for sub in layout.holders()
            for entry in sub.state.values()
            for t in entry.values()
            if isinstance(t, torch.Tensor)
        }
        self.overwrites = [*inner.values(), *(t for k, t in stored.items() if k not in inner)]

    def restore(self) -> None:
        """Puts back all but the bytes of ``overwrites`` (restore those first)."""
        self.param_groups[:] = self.groups
        for sub, state, entries, snapshot in self.subs:
            sub.state = state  # a plain sub-optimizer's loader replaces its dict
            snapshot.restore()
            for inner, entry in entries.items():
                state[inner].clear()
                state[inner].update(entry)
        self.finish(self.layout)


def _load_plain_entry(
    layout: OffloadLayout,
    sub: torch.optim.Optimizer,
    inner: torch.Tensor,
    states: States,
    with_master: bool,
) -> None:
    param = layout.inner_param_to_orig_param[inner]
    if param not in states:
        return
    entry = dict(states[param])
    master = entry.pop("master_param", None)
    if master is not None:
        inner.copy_(master.reshape(inner.shape))
        if with_master:
            entry["master_param"] = inner
    sub.state[inner] = entry


def _refresh_copies(layout: OffloadLayout, holder_states: HolderStates) -> None:
    """Every copy takes its param's value, except where the payload restores a full master:
    that master may be this very copy (``load_state_dict(state_dict())`` aliases it), which
    must keep its FP32 bits."""
    restored = {
        id(param) for param, entry in holder_states.items() if _full_master(entry) is not None
    }
    for param, inner in layout.param_to_inner_param.items():
        if inner is not param and id(param) not in restored:
            inner.copy_(param)


def _write_holder(
    layout: OffloadLayout, sub: torch.optim.Optimizer, holder_states: HolderStates
) -> None:
    """Writes each saved state into holder ``sub`` through its ``set_scaled_state``."""
    keeps_masters = bool(getattr(sub, "master_weights", False))
    chunked = supports_chunked_state(sub)
    write = sub.set_scaled_state  # type: ignore[attr-defined]
    for inner in [p for group in sub.param_groups for p in group["params"]]:
        entry = holder_states.get(layout.inner_param_to_orig_param[inner])
        if entry is None:
            sub.state.pop(inner, None)
            continue
        for name, value in entry.items():
            if name == "master_param":
                if value.is_floating_point():
                    inner.copy_(value.reshape(inner.shape))
                if not keeps_masters:
                    continue
            write(inner, name, holder_source(value, inner, chunked))


@torch.no_grad()
def _commit_with_holders(
    layout: OffloadLayout,
    param_groups: Groups,
    states: States,
    holder_states: HolderStates,
    with_master: bool,
) -> None:
    """Loads in place: holders keep their instances (and any instance-level patches)."""
    _refresh_copies(layout, holder_states)
    for sub in layout.sub_optimizers:
        if is_precision_aware_holder(sub):
            _write_holder(layout, sub, holder_states)
            continue
        sub.state = defaultdict(dict)  # as torch's own loader replaces it
        for inner in [p for group in sub.param_groups for p in group["params"]]:
            _load_plain_entry(layout, sub, inner, states, with_master)
    sync_groups(layout, param_groups)
    for sub, group_indices in layout.with_groups():
        if is_precision_aware_holder(sub):
            for sub_group, group_index in zip(sub.param_groups, group_indices, strict=True):
                if "step" not in param_groups[group_index]:
                    sub_group.pop("step", None)  # a fresh holder has not stepped


def prepare_load(
    layout: OffloadLayout,
    param_groups: Groups,
    state_dict: Any,
    where: Placement,
    references: References,
) -> tuple[Groups, States, HolderStates]:
    """Validates the whole payload against the optimizer's ``layout``, ``param_groups`` and
    their placement ``where``; returns the merged groups and copied states (plain and
    precision-aware holders')."""
    saved_states, saved_groups = state_format.check_structure(state_dict)
    id_map = state_format.check_groups(saved_groups, param_groups)
    groups = []
    for group, saved in zip(param_groups, saved_groups, strict=True):
        # Switches the checkpoint lacks keep this optimizer's value (see
        # state_format.check_hyper_parameters); a step count only ever comes from the checkpoint.
        merged = {k: v for k, v in group.items() if k not in ("params", "step")}
        merged.update(clone_options(saved))
        groups.append({**merged, "params": group["params"]})
    holder_of = layout.holder_of()
    states: States = {}
    holder_states: HolderStates = {}
    param_steps: dict[int, tuple[Any, int]] = {}  # group -> (first param, its step)
    for index, entry in saved_states.items():
        state_format.check_index(index, id_map)
        param, group_index = id_map[index]
        inner = layout.param_to_inner_param[param]
        sub = holder_of.get(id(inner))
        if sub is not None:
            step, states_of = holder_entry(index, inner, entry, sub)
            holder_states[param] = states_of
            if step is not None:
                agree_on_step(index, step, group_index, groups, param_steps)
            continue
        _, dtype, device = where[param]
        states[param] = plain_entry(
            index,
            param,
            entry,
            references.expected(inner),
            references.owner_name(inner),
            dtype,
            device,
        )
    for group_index, (group, saved) in enumerate(zip(param_groups, saved_groups, strict=True)):
        state_format.check_hyper_parameters(group_index, saved, group)
    for group_index, (_, step) in param_steps.items():
        groups[group_index].setdefault("step", step)
    if holder_of:
        for group_index, group in enumerate(groups):
            if "step" in group and any(
                id(layout.param_to_inner_param[p]) in holder_of for p in group["params"]
            ):
                # FusedAdam's group step is an int
                group["step"] = state_format.check_step(f"param group {group_index}", group["step"])
    return groups, states, holder_states
