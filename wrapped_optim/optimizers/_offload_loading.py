"""HybridOffloadOptimizer's checkpoints: its portable state dict, validating and loading one.

Split from :mod:`~wrapped_optim.optimizers._hybrid_offload` (layout and step): the optimizer's
``state_dict`` / ``load_state_dict`` call :func:`holder_state_dict` and :func:`load`. Every
check goes through :mod:`wrapped_optim._formats.state_format` (per sub-optimizer kind, see
:mod:`~wrapped_optim.optimizers._offload_state_rules`) and every undo through
:mod:`wrapped_optim._rollback`. Internal to the optimizer (not public API): use its
``state_dict`` / ``load_state_dict``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch

from wrapped_optim._adapters.precision import is_precision_aware_holder, supports_chunked_state
from wrapped_optim._formats import state_format
from wrapped_optim._rollback import OptimizerSnapshot, copy_all
from wrapped_optim.optimizers._offload_state import exposed_state, plain_dict
from wrapped_optim.optimizers._offload_state_rules import (
    References,
    agree_on_step,
    clone_options,
    holder_entry,
    holder_source,
    plain_entry,
)

if TYPE_CHECKING:
    from wrapped_optim.optimizers._hybrid_offload import HybridOffloadOptimizer

__all__ = ["holder_state_dict", "load", "prepare_load"]


def holder_state_dict(
    opt: HybridOffloadOptimizer, holder_of: dict[int, torch.optim.Optimizer]
) -> dict[str, Any]:
    """torch's layout, each param's state the sub-optimizer's own dict (never the in-place
    view :attr:`state` shows); a precision-aware holder's params in FusedAdam's portable
    format."""
    index_of: dict[int, int] = {}
    groups = []
    for group in opt.param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = [index_of.setdefault(id(p), len(index_of)) for p in group["params"]]
        groups.append(packed)
    state: dict[int, dict[str, Any]] = {}
    for group in opt.param_groups:
        for param in group["params"]:
            inner = opt.param_to_inner_param[param]
            sub = holder_of.get(id(inner))
            if sub is None:
                if param in opt.state:  # the live dict, as torch's (loaders write into it)
                    state[index_of[id(param)]] = plain_dict(opt.state[param])
                continue
            stored = sub.state.get(inner)
            if not stored:
                continue
            read = sub.get_unscaled_state  # type: ignore[attr-defined]
            entry = {name: read(inner, name) for name in list(stored)}
            if opt.param_update_in_fp32:
                entry["master_param"] = inner
            state[index_of[id(param)]] = entry
    return {"state": state, "param_groups": groups}


def _full_master(entry: dict[str, torch.Tensor]) -> torch.Tensor | None:
    master = entry.get("master_param")
    return master if master is not None and master.is_floating_point() else None


def load(opt: HybridOffloadOptimizer, state_dict: dict[str, Any]) -> None:
    """Validates ``state_dict`` whole, then loads it (see its ``load_state_dict``)."""
    groups, states, holder_states = prepare_load(opt, state_dict)
    if opt._holders():
        _load_with_holders(opt, groups, states, holder_states)
    else:
        _load_plain(opt, groups, states)


@torch.no_grad()
def _load_plain(
    opt: HybridOffloadOptimizer,
    groups: list[dict[str, Any]],
    states: dict[torch.Tensor, dict[str, Any]],
) -> None:
    """Builds the loaded layout beside the current one, then swaps it in."""
    layout = opt._new_layout(groups)
    subs = list(layout["cpu_optimizers"])
    if layout["gpu_optimizer"] is not None:
        subs.append(layout["gpu_optimizer"])
    orig_of = layout["inner_param_to_orig_param"]
    # A param that is its own stepped copy takes its master last, undone on a fault.
    own_masters: list[tuple[torch.Tensor, torch.Tensor]] = []
    for sub in subs:
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
                if opt.param_update_in_fp32:
                    entry["master_param"] = inner
            sub.state[inner] = entry
    new_state = exposed_state(
        layout["cpu_optimizers"], layout["gpu_optimizer"], orig_of, opt.param_update_in_fp32
    )
    copy_all(own_masters)
    # Commit: plain assignments only.
    opt.param_groups[:] = groups
    opt._adopt(layout)
    opt.state = new_state
    opt._copy_back_pending = False


def _load_with_holders(
    opt: HybridOffloadOptimizer,
    groups: list[dict[str, Any]],
    states: dict[torch.Tensor, dict[str, Any]],
    holder_states: dict[torch.Tensor, dict[str, torch.Tensor]],
) -> None:
    """Loads in place, keeping what it overwrites until it has finished."""
    old_groups = list(opt.param_groups)
    # A plain sub-optimizer's state is replaced, a holder's written into.
    snapshots = [
        OptimizerSnapshot.take(sub, clone_state=is_precision_aware_holder(sub))
        for sub in opt.sub_optimizers
    ]
    try:
        opt.param_groups[:] = groups
        _commit_with_holders(opt, states, holder_states)
    except BaseException:
        opt.param_groups[:] = old_groups
        for snapshot in snapshots:
            snapshot.restore()
        opt._expose_state()
        raise
    opt._copy_back_pending = False


def _load_plain_entry(
    opt: HybridOffloadOptimizer,
    sub: torch.optim.Optimizer,
    inner: torch.Tensor,
    states: dict[torch.Tensor, dict[str, Any]],
) -> None:
    param = opt.inner_param_to_orig_param[inner]
    if param not in states:
        return
    entry = dict(states[param])
    master = entry.pop("master_param", None)
    if master is not None:
        inner.copy_(master.reshape(inner.shape))
        if opt.param_update_in_fp32:
            entry["master_param"] = inner
    sub.state[inner] = entry


@torch.no_grad()
def _commit_with_holders(
    opt: HybridOffloadOptimizer,
    states: dict[torch.Tensor, dict[str, Any]],
    holder_states: dict[torch.Tensor, dict[str, torch.Tensor]],
) -> None:
    """Loads in place: holders keep their instances (and any instance-level patches)."""
    # What a rebuild from the current weights would hold, except where the payload restores a
    # master: the payload's master may be this very copy (``load_state_dict(state_dict())``
    # aliases it), which must keep its FP32 bits.
    restored = {
        id(param) for param, entry in holder_states.items() if _full_master(entry) is not None
    }
    for param, inner in opt.param_to_inner_param.items():
        if inner is not param and id(param) not in restored:
            inner.copy_(param)
    for sub in opt.sub_optimizers:
        inners = [p for group in sub.param_groups for p in group["params"]]
        if not is_precision_aware_holder(sub):
            sub.state = defaultdict(dict)  # as torch's own loader replaces it
            for inner in inners:
                _load_plain_entry(opt, sub, inner, states)
            continue
        keeps_masters = bool(getattr(sub, "master_weights", False))
        chunked = supports_chunked_state(sub)
        write = sub.set_scaled_state  # type: ignore[attr-defined]
        for inner in inners:
            entry = holder_states.get(opt.inner_param_to_orig_param[inner])
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
    opt._sync_groups_to_sub_optimizers()
    for sub, group_indices in opt._sub_optimizers_with_groups():
        if is_precision_aware_holder(sub):
            for sub_group, group_index in zip(sub.param_groups, group_indices, strict=True):
                if "step" not in opt.param_groups[group_index]:
                    sub_group.pop("step", None)  # a fresh holder has not stepped
    opt._expose_state()


def prepare_load(
    opt: HybridOffloadOptimizer, state_dict: Any
) -> tuple[
    list[dict[str, Any]],
    dict[torch.Tensor, dict[str, Any]],
    dict[torch.Tensor, dict[str, torch.Tensor]],
]:
    """Validates the whole payload; returns the merged groups and copied states."""
    saved_states, saved_groups = state_format.check_structure(state_dict)
    id_map = state_format.check_groups(saved_groups, opt.param_groups)
    groups = []
    for group, saved in zip(opt.param_groups, saved_groups, strict=True):
        # Switches the checkpoint lacks keep this optimizer's value (see
        # state_format.check_hyper_parameters); a step count only ever comes from the checkpoint.
        merged = {k: v for k, v in group.items() if k not in ("params", "step")}
        merged.update(clone_options(saved))
        groups.append({**merged, "params": group["params"]})
    placement = opt._placement()
    holder_of = opt._holder_of()
    references = References(opt)
    states: dict[torch.Tensor, dict[str, Any]] = {}
    holder_states: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
    param_steps: dict[int, tuple[Any, int]] = {}  # group -> (first param, its step)
    for index, entry in saved_states.items():
        state_format.check_index(index, id_map)
        param, group_index = id_map[index]
        inner = opt.param_to_inner_param[param]
        sub = holder_of.get(id(inner))
        if sub is not None:
            step, states_of = holder_entry(index, inner, entry, sub)
            holder_states[param] = states_of
            if step is not None:
                agree_on_step(index, step, group_index, groups, param_steps)
            continue
        _, dtype, device = placement[param]
        states[param] = plain_entry(
            index,
            param,
            entry,
            references.expected(inner),
            references.owner_name(inner),
            dtype,
            device,
        )
    for group_index, (group, saved) in enumerate(zip(opt.param_groups, saved_groups, strict=True)):
        state_format.check_hyper_parameters(group_index, saved, group)
    for group_index, (_, step) in param_steps.items():
        groups[group_index].setdefault("step", step)
    if holder_of:
        for group_index, group in enumerate(groups):
            if "step" in group and any(
                id(opt.param_to_inner_param[p]) in holder_of for p in group["params"]
            ):
                # FusedAdam's group step is an int
                group["step"] = state_format.check_step(f"param group {group_index}", group["step"])
    return groups, states, holder_states
