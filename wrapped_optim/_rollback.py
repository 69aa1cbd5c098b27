"""Snapshots that undo a failed step or load exactly: one utility for every optimizer
(docs/concepts.md, "One validator, one rollback"). It imports nothing of the package.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

__all__ = ["GroupOptions", "OptimizerSnapshot", "copy_all", "deep_clone"]


def deep_clone(value: Any) -> Any:
    """A copy of ``value`` that shares no tensor with it (containers are copied too).

    Example:
        >>> import torch
        >>> state = {"exp_avg": torch.ones(2), "betas": (0.9, torch.tensor(0.99))}
        >>> copy = deep_clone(state)
        >>> copy["exp_avg"] is state["exp_avg"], torch.equal(copy["exp_avg"], state["exp_avg"])
        (False, True)
    """
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return type(value)((k, deep_clone(v)) for k, v in value.items())
    if isinstance(value, list | tuple):
        return type(value)(deep_clone(v) for v in value)
    return value


class GroupOptions:
    """The options of some param groups (everything but ``params``), restorable in place.

    A tensor option (a scheduler's tensor ``lr``) is copied back into the same tensor, so
    whoever holds it sees the old value again; any other option is put back as the object it
    was. An option the group gained since is handed to ``new_key`` (default: deleted).

    Example:
        >>> import torch
        >>> groups = [{"params": [], "lr": torch.tensor(0.1), "step": 3}]
        >>> lr = groups[0]["lr"]
        >>> saved = GroupOptions.take(groups)
        >>> _ = lr.zero_(); groups[0].update(step=4, extra=True)
        >>> saved.restore(groups)
        >>> groups[0]["lr"] is lr, float(lr), groups[0]["step"], "extra" in groups[0]
        (True, 0.1..., 3, False)
    """

    def __init__(self, saved: list[dict[str, tuple[Any, torch.Tensor | None]]]) -> None:
        self.saved = saved

    @classmethod
    def take(cls, groups: Iterable[Mapping[str, Any]]) -> GroupOptions:
        """Copies the options of ``groups`` (tensors are cloned)."""
        return cls(
            [
                {
                    key: (
                        value,
                        value.detach().clone() if isinstance(value, torch.Tensor) else None,
                    )
                    for key, value in group.items()
                    if key != "params"
                }
                for group in groups
            ]
        )

    @torch.no_grad()
    def restore(
        self,
        groups: list[dict[str, Any]],
        new_key: Callable[[dict[str, Any], str], None] | None = None,
    ) -> None:
        """Puts the options back into ``groups`` (the same groups, in the same order)."""
        for group, saved in zip(groups, self.saved, strict=True):
            for key in [key for key in group if key != "params" and key not in saved]:
                if new_key is None:
                    del group[key]
                else:
                    new_key(group, key)
            for key, (value, copy) in saved.items():
                same = key in group and group[key] is value
                if isinstance(value, torch.Tensor) and copy is not None and same:
                    value.copy_(copy)  # a tensor option stays the same object
                else:
                    group[key] = value


class OptimizerSnapshot:
    """What a step or a load of ``optimizer`` may change, kept so that it can be undone.

    Kept: the values of ``params`` (default: every param of the optimizer), their entries of
    ``optimizer.state`` (cloned; with ``clone_state=False``, for a caller that replaces
    entries instead of writing into them, only referenced), the group options, and the
    entries for those params of every instance dict keyed by its params (a precision-aware
    optimizer's scales). :meth:`restore` writes the params back in place and refills those
    dicts in place: no attribute of the optimizer is reassigned.

    Example:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.AdamW([p], lr=0.1)
        >>> snapshot = OptimizerSnapshot.take(opt)
        >>> p.grad = torch.ones(2); opt.step()
        >>> snapshot.restore()
        >>> p.tolist(), len(opt.state)
        ([1.0, 1.0], 0)
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: list[torch.Tensor],
        values: list[torch.Tensor] | None,
        state: dict[int, Any],
        options: GroupOptions,
        tables: dict[str, dict[int, Any]],
        whole: bool,
    ) -> None:
        self.optimizer = optimizer
        self.params = params
        self.values = values
        self.state = state  # id(param) -> its saved entry (absent: it had none)
        self.options = options
        self.tables = tables  # attribute name -> id(param) -> saved value
        self.whole = whole

    @classmethod
    @torch.no_grad()
    def take(
        cls,
        optimizer: torch.optim.Optimizer,
        params: Iterable[torch.Tensor] | None = None,
        *,
        clone_state: bool = True,
        keep_values: bool = True,
    ) -> OptimizerSnapshot:
        """Copies what ``optimizer`` keeps for ``params`` (default: all of its params).

        ``keep_values=False`` leaves the params' values out (a caller that never writes them,
        such as a streaming load into a precision-aware holder, saves a copy of every param).
        """
        whole = params is None
        if params is None:
            params = (p for group in optimizer.param_groups for p in group["params"])
        unique = list({id(p): p for p in params}.values())
        ids = {id(p) for p in unique}
        values = [p.detach().clone() for p in unique] if keep_values else None
        state: dict[int, Any] = {}
        for param, entry in optimizer.state.items():
            if id(param) not in ids:
                continue
            if clone_state:
                entry = {
                    name: value if value is param else deep_clone(value)
                    for name, value in entry.items()
                }
            state[id(param)] = entry
        # A table keyed by any of the optimizer's params (a precision-aware optimizer's
        # scales hold every stepped param, not only those of a partial snapshot).
        everyone = {id(p) for group in optimizer.param_groups for p in group["params"]}
        tables = {
            name: {id(key): deep_clone(value) for key, value in table.items() if id(key) in ids}
            for name, table in vars(optimizer).items()
            if name != "state" and _keyed_by_params(table, everyone)
        }
        return cls(
            optimizer, unique, values, state, GroupOptions.take(optimizer.param_groups), tables,
            whole,
        )  # fmt: skip

    @torch.no_grad()
    def restore(self) -> None:
        """Puts everything kept back (params, state, group options, param-keyed dicts)."""
        optimizer = self.optimizer
        for param, value in zip(self.params, self.values or (), strict=self.values is not None):
            param.copy_(value)
        self.options.restore(optimizer.param_groups)
        covered = {id(p): p for p in self.params}
        if self.whole:
            for param in [p for p in optimizer.state if id(p) not in self.state]:
                del optimizer.state[param]
        for key, param in covered.items():
            if key in self.state:
                optimizer.state[param] = self.state[key]
            else:
                optimizer.state.pop(param, None)
        for name, saved in self.tables.items():
            table = vars(optimizer).get(name)
            if not isinstance(table, dict):
                continue
            for key, param in covered.items():
                if key in saved:
                    table[param] = saved[key]
                else:
                    table.pop(param, None)


def _keyed_by_params(table: Any, ids: set[int]) -> bool:
    """A plain dict (not a hook registry) whose keys are all params of the optimizer."""
    return (
        isinstance(table, dict)
        and not isinstance(table, OrderedDict)
        and all(isinstance(key, torch.Tensor) and id(key) in ids for key in table)
    )


def copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``target.copy_(source)`` for every pair, all or nothing.

    Example:
        >>> import torch
        >>> a, b = torch.zeros(2), torch.zeros(3)
        >>> copy_all([(a, torch.ones(2)), (b, torch.ones(2))])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        RuntimeError: ...
        >>> a.tolist()  # the first copy was undone
        [0.0, 0.0]
    """
    if not pairs:
        return
    kept = [(target, target.detach().clone()) for target, _ in pairs]
    try:
        with torch.no_grad():
            for target, source in pairs:
                target.copy_(source.reshape(target.shape))
    except BaseException:
        # Every target goes back, written or not: one not yet written gets its own value.
        with torch.no_grad():
            for target, old in kept:
                target.copy_(old)
        raise
