"""PrecisionAwareAdamW's portable checkpoint: the FP32 state dict, and its load in place.

``state_dict()`` expands every state to FP32 through the instance's ``get_unscaled_state``.
``load_state_dict()`` first has the one validator (:mod:`~wrapped_optim._formats.state_format`)
accept the *whole* incoming state, so a rejected checkpoint changes nothing; then it quantizes each
incoming tensor into the storage the optimizer already has, through the instance's
``set_scaled_state`` (which works in bounded slices). New storage is allocated only where a
state is missing or its format or shape differs, one tensor at a time, after freeing the old.
The extra memory of a load of FP32 values is therefore one slice, not a second copy of the
state (values in another float dtype are first converted to FP32 one whole tensor at a time).

Without that second copy a failure half-way cannot be rolled back; it is rolled *forward*
instead: the caller's state dict is validated and never modified, so the load is completed
from it before the exception propagates (an interrupt, or an error of a patched writer), and
the optimizer holds its old state or the whole checkpoint, never a mix. Only when completing
fails as well is it left partly loaded, which the exception's note says.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch import Tensor

from wrapped_optim._adapters.dtensor import local_tensor
from wrapped_optim._formats import holder_format, state_format
from wrapped_optim._rollback import deep_clone
from wrapped_optim.optimizers.precision_adamw import _state
from wrapped_optim.optimizers.precision_adamw._layout import PrecisionLayout

__all__ = ["issued_by", "load_own_scaffold", "load_portable", "portable_state_dict"]

_Write = tuple[Tensor, str, Tensor]  # (param, state name, FP32 or int16 source)
_Tables = MutableMapping[Tensor, dict[str, Tensor]]


def portable_state_dict(
    param_groups: Sequence[Mapping[str, Any]],
    state: Mapping[Tensor, Mapping[str, Tensor]],
    read: Callable[[Tensor, str], Tensor],
) -> dict[str, Any]:
    """torch's state-dict layout of ``param_groups`` with every state of ``state`` read
    through ``read(param, state_name)`` (the optimizer's ``get_unscaled_state``).

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> opt = PrecisionAwareAdamW([p], exp_avg_dtype=torch.bfloat16)
        >>> opt.initialize_state(p, False)
        >>> sd = portable_state_dict(opt.param_groups, opt.state, opt.get_unscaled_state)
        >>> sorted(sd["state"][0])
        ['exp_avg', 'exp_avg_sq']
    """
    groups = []
    param_index: dict[int, int] = {}
    for group in param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        indices = []
        for p in group["params"]:
            param_index.setdefault(id(p), len(param_index))
            indices.append(param_index[id(p)])
        packed["params"] = indices
        groups.append(packed)
    saved: dict[int, dict[str, Tensor]] = {}
    for group in param_groups:
        for p in group["params"]:
            entry = state.get(p)
            if not entry:
                continue
            saved[param_index[id(p)]] = {name: read(p, name) for name in list(entry)}
    return {"state": saved, "param_groups": groups}


def issued_by(state_dict: Mapping[str, Any], issued: Sequence[list[int]]) -> bool:
    """Whether ``state_dict``'s parameter groups hold, in order, the very index lists
    (``issued``) of the optimizer's last ``state_dict()``: a state dict built in this process
    from the optimizer's own (Megatron's loading scaffold), never one read from a file.

    Example:
        >>> import copy
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
        >>> opt = PrecisionAwareAdamW([torch.nn.Parameter(torch.zeros(2))])
        >>> own = opt.state_dict()
        >>> issued = [g["params"] for g in own["param_groups"]]
        >>> issued_by(own, issued), issued_by(copy.deepcopy(own), issued)
        (True, False)
    """
    groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
    if not issued or not isinstance(groups, list) or len(groups) != len(issued):
        return False
    return all(
        isinstance(group, Mapping) and group.get("params") is ids
        for group, ids in zip(groups, issued, strict=True)
    )


_Holder = tuple[PrecisionLayout, _Tables, Callable[[Tensor, str, Tensor], None]]


def load_own_scaffold(
    opt: torch.optim.Optimizer, state_dict: dict[str, Any], holder: _Holder
) -> None:
    """Loads a state dict :func:`issued_by` the optimizer itself, as TE's FusedAdam loads any.

    Megatron's ``DistributedOptimizer.load_state_dict`` builds its loading scaffold from the
    inner optimizer's own ``state_dict()``: its groups (the checkpoint's options around the
    optimizer's own index lists) and either the optimizer's own state or, for an optimizer
    without state, ``torch.empty`` placeholders in the *storage* dtypes (bf16, uint8 for FP8,
    int16 remainders) that the parameter-state load overwrites next. FusedAdam quantizes
    whatever they hold. Here a tensor in the expansion dtype (FP32, int16 for a remainder
    master) is written as TE writes it; a placeholder in the storage dtype is not read at all
    (uninitialised memory): the state gets zeroed storage of its format. Group options are
    merged as in :func:`load_portable`; only what a state write itself checks (tensor,
    dtype, element count) is checked. ``holder``: the optimizer's layout, scales and
    ``set_scaled_state``.

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> opt = PrecisionAwareAdamW([p], exp_avg_dtype=torch.bfloat16)
        >>> own = opt.state_dict()
        >>> own["state"] = {0: {"exp_avg": torch.empty(2, dtype=torch.bfloat16),
        ...                     "exp_avg_sq": torch.empty(2)}}
        >>> load_own_scaffold(opt, own, (opt.layout, opt.scales, opt.set_scaled_state))
        >>> opt.state[p]["exp_avg"]
        tensor([0., 0.], dtype=torch.bfloat16)
    """
    layout, scales, write = holder
    params = [p for group in opt.param_groups for p in group["params"]]
    saved_groups = state_dict["param_groups"]
    index_of = {
        index: param
        for group, saved in zip(opt.param_groups, saved_groups, strict=True)
        for index, param in zip(saved["params"], group["params"], strict=True)
    }
    if len(index_of) != len(params):
        raise ValueError("the scaffold's parameter groups do not match the optimizer's")
    groups = _merged_groups(opt.param_groups, saved_groups)
    writes: list[_Write] = []
    for key, entry in state_dict["state"].items():
        param = index_of[key]
        for name, value in entry.items():
            if isinstance(value, Tensor) and _is_placeholder(layout, param, name, value):
                _state.check_name(name)
                if value.numel() != local_tensor(param).numel():
                    raise ValueError(
                        f"the scaffold's {name!r} of parameter {key} has {value.numel()} "
                        f"elements, the parameter {local_tensor(param).numel()}"
                    )
                opt.state[param].pop(name, None)
                scales.get(param, {}).pop(name, None)
                _state.create(layout, opt.state[param], scales, param, name, zero=True)
            writes.append((param, name, value))
    writes = [w for w in _unaliased(opt.state, writes) if not _placeholder_write(layout, w)]
    _install(writes, layout, write)
    _drop_others(opt.state, scales, _scaffold_kept(state_dict, index_of))
    opt.param_groups = groups


def _is_placeholder(layout: PrecisionLayout, param: Tensor, name: str, value: Tensor) -> bool:
    """A scaffold tensor in the state's storage dtype (not its expansion dtype)."""
    if name not in ("exp_avg", "exp_avg_sq", "master_param"):
        return False
    expansion = layout.expansion_dtype(param, name)
    return value.dtype != expansion and value.dtype == layout.storage_dtype(param, name)


def _placeholder_write(layout: PrecisionLayout, write: _Write) -> bool:
    param, name, value = write
    return _is_placeholder(layout, param, name, value)


def _scaffold_kept(state_dict: Mapping[str, Any], index_of: Mapping[Any, Tensor]) -> list[_Write]:
    """(param, name, -) of every state the scaffold names: what :func:`_drop_others` keeps."""
    empty = torch.empty(0)
    return [
        (index_of[key], name, empty) for key, entry in state_dict["state"].items() for name in entry
    ]


def load_portable(
    opt: torch.optim.Optimizer,
    state_dict: dict[str, Any],
    *,
    layout: PrecisionLayout,
    scales: _Tables,
    write: Callable[[Tensor, str, Tensor], None],
) -> None:
    """Validates ``state_dict`` whole, then writes it into ``opt``'s existing storage.

    Args:
        opt: the optimizer loaded (its ``state`` and ``param_groups``).
        state_dict: the portable checkpoint (never modified).
        layout: the optimizer's storage layout.
        scales: its per-parameter scales (those of dropped states are removed).
        write: quantizes one FP32 (or int16) source into a state (``set_scaled_state``).

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> opt = PrecisionAwareAdamW([p], exp_avg_dtype=torch.bfloat16)
        >>> opt.initialize_state(p, False)
        >>> storage = opt.state[p]["exp_avg"]
        >>> sd = {"state": {0: {"exp_avg": torch.ones(2), "exp_avg_sq": torch.ones(2)}},
        ...       "param_groups": [{**opt.param_groups[0], "params": [0]}]}
        >>> load_portable(opt, sd, layout=opt.layout, scales=opt.scales,
        ...               write=opt.set_scaled_state)
        >>> opt.state[p]["exp_avg"] is storage, storage.tolist()
        (True, [1.0, 1.0])
    """
    resolved, saved_groups = holder_format.check_holder_state_dict(opt, state_dict)
    groups = _merged_groups(opt.param_groups, saved_groups)
    writes = _unaliased(
        opt.state,
        [
            (param, name, value)
            for key, param in resolved.items()
            for name, value in state_dict["state"][key].items()
        ],
    )

    def install() -> None:
        _install(writes, layout, write)
        _drop_others(opt.state, scales, writes)
        opt.param_groups = groups

    try:
        install()
    except BaseException as error:
        try:
            install()
        except BaseException:
            error.add_note(
                f"{type(opt).__name__}.load_state_dict: completing the interrupted load failed "
                "too, so the optimizer may hold part of its old state and part of the "
                "checkpoint's; load a checkpoint again before stepping"
            )
            raise error from None
        error.add_note(
            f"{type(opt).__name__}.load_state_dict: the checkpoint was loaded completely "
            "before this exception propagated"
        )
        raise


def _merged_groups(
    groups: Sequence[Mapping[str, Any]], saved_groups: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The new param groups: ours, updated with the checkpoint's options (copied)."""
    merged_groups = []
    for i, (saved, group) in enumerate(zip(saved_groups, groups, strict=True)):
        merged = {k: v for k, v in group.items() if k != "params"}
        merged.update(
            {k: deep_clone(v) for k, v in saved.items() if k not in ("params", "param_names")}
        )
        if "step" in saved:  # FusedAdam's group step is an int
            merged["step"] = state_format.check_step(f"param group {i}", saved["step"])
        merged["params"] = group["params"]
        if "param_names" in group:
            merged["param_names"] = group["param_names"]
        merged_groups.append(merged)
    return merged_groups


def _unaliased(states: Mapping[Tensor, Mapping[str, Any]], writes: list[_Write]) -> list[_Write]:
    """The writes, with a copy of any source that shares memory with live state other than
    its own destination (a crafted state dict): writing in place must not change a source
    before it is read. ``load_state_dict(state_dict())`` shares only with the destinations
    themselves (FP32 states and remainders are their live tensors), which costs nothing."""
    live = {
        t.untyped_storage().data_ptr()
        for entry in states.values()
        for t in entry.values()
        if isinstance(t, Tensor) and t.numel()
    }
    result = []
    for param, name, value in writes:
        local = local_tensor(value)
        if local.numel() and local.untyped_storage().data_ptr() in live:
            destination = states.get(param, {}).get(name)
            if not _same_view(local, destination):
                value = local.detach().clone()
        result.append((param, name, value))
    return result


def _same_view(a: Tensor, b: Any) -> bool:
    return (
        isinstance(b, Tensor)
        and a.data_ptr() == b.data_ptr()
        and a.dtype == b.dtype
        and a.numel() == b.numel()
        and a.is_contiguous()
        and b.is_contiguous()
    )


def _install(
    writes: list[_Write], layout: PrecisionLayout, write: Callable[[Tensor, str, Tensor], None]
) -> None:
    """Every write (a fresh FP32 conversion, one at a time, for other float dtypes). Running
    it twice gives the same result."""
    for param, name, value in writes:
        if value.dtype != torch.float32 and not layout.uses_remainder(param, name):
            value = value.float()
        write(param, name, value)
        del value


def _drop_others(
    states: MutableMapping[Tensor, Any], scales: _Tables, writes: list[_Write]
) -> None:
    """Removes state (and scales) the checkpoint has no value for, as torch's loader does."""
    kept: dict[int, set[str]] = {}
    for param, name, _ in writes:
        kept.setdefault(id(param), set()).add(name)
    tables: tuple[MutableMapping[Tensor, Any], ...] = (states, scales)
    for table in tables:
        for param in list(table):
            names = kept.get(id(param), set())
            entry = table[param]
            for name in [n for n in entry if n not in names]:
                del entry[name]
            if not entry:
                del table[param]
