"""The per-parameter ``state`` HybridOffloadOptimizer exposes, whose host entries take writes
in place.

A host-side param's state is an :class:`InPlaceState`: a tensor written over a state tensor
of the same shape and dtype is copied into it, so generic "move the optimizer state to the
device" code leaves the host state on the host (see docs/hybrid.md).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, MutableMapping
from typing import Any

import torch

from wrapped_optim._adapters.precision import is_precision_aware_holder

__all__ = ["InPlaceState", "exposed_state", "plain_dict"]


class InPlaceState(MutableMapping[str, Any]):
    """One param's state: reads give the live tensors; a tensor written over a tensor of the
    same shape and dtype is copied into it (keeping its device); other writes are dict writes.

    A meta tensor carries no values: written over a tensor, it leaves that tensor as it is.

    Example:
        >>> import torch
        >>> moment = torch.zeros(2)
        >>> state = InPlaceState({"exp_avg": moment})
        >>> state["exp_avg"] = torch.ones(2)  # e.g. a "moved" copy
        >>> state["exp_avg"] is moment, moment.tolist()
        (True, [1.0, 1.0])
        >>> state["exp_avg"] = torch.ones(2, dtype=torch.float64)  # not a copy: replaces it
        >>> state["exp_avg"].dtype
        torch.float64
        >>> state["exp_avg"] = torch.ones(2, device="meta")
        >>> moment.device, moment.tolist()
        (device(type='cpu'), [1.0, 1.0])
    """

    def __init__(self, entries: dict[str, Any]) -> None:
        self.entries = entries

    def __getitem__(self, key: str) -> Any:
        return self.entries[key]

    @torch.no_grad()
    def __setitem__(self, key: str, value: Any) -> None:
        current = self.entries.get(key)
        if (
            isinstance(current, torch.Tensor)
            and isinstance(value, torch.Tensor)
            and value.shape == current.shape
            and value.dtype == current.dtype
        ):
            if value is not current and not value.is_meta:
                current.copy_(value)
            return
        self.entries[key] = value

    def __delitem__(self, key: str) -> None:
        del self.entries[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return f"InPlaceState({self.entries!r})"


def plain_dict(entry: Any) -> Any:
    """The dict behind an :class:`InPlaceState` (``entry`` itself otherwise): what a state
    dict holds, so that it pickles as plain dicts and aliases the live state as torch's does.

    Example:
        >>> live = {"step": 1}
        >>> plain_dict(InPlaceState(live)) is live, plain_dict(live) is live
        (True, True)
    """
    return entry.entries if isinstance(entry, InPlaceState) else entry


def exposed_state(
    cpu_optimizers: list[torch.optim.Optimizer],
    gpu_optimizer: torch.optim.Optimizer | None,
    orig_of: dict[torch.Tensor, torch.Tensor],
    with_master: bool,
) -> defaultdict[torch.Tensor, Any]:
    """The sub-optimizers' state under the original params (``orig_of``), with the stepped
    copy as ``"master_param"`` when ``with_master``: host-side entries as :class:`InPlaceState`,
    device-side ones as the sub-optimizer's own dict (a move to their device keeps them where
    their params are). A precision-aware holder's entry is a new dict of its live tensors
    (its own dict keeps only what it stores), wrapped the same way.

    Example:
        >>> import torch
        >>> copy = torch.zeros(2)
        >>> host = torch.optim.SGD([copy], lr=0.1, momentum=0.9)
        >>> host.state[copy]["momentum_buffer"] = torch.zeros(2)
        >>> param = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
        >>> state = exposed_state([host], None, {copy: param}, with_master=True)
        >>> sorted(state[param]), state[param]["master_param"] is copy
        (['master_param', 'momentum_buffer'], True)
    """
    state: defaultdict[torch.Tensor, Any] = defaultdict(dict)
    subs = [*cpu_optimizers, *([gpu_optimizer] if gpu_optimizer is not None else [])]
    for sub in subs:
        holder = is_precision_aware_holder(sub)
        for inner, inner_state in sub.state.items():
            if holder:
                if not inner_state:
                    continue
                inner_state = dict(inner_state)
            if with_master:
                inner_state["master_param"] = inner
            on_host = any(sub is cpu for cpu in cpu_optimizers)
            state[orig_of[inner]] = InPlaceState(inner_state) if on_host else inner_state
    return state
