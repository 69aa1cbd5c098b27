"""What a streaming load overwrites in place, kept until the load has finished.

Internal to :func:`wrapped_optim.checkpoint.load_optimizer` (see its docs for the memory this
costs and ``atomic=False`` to go without it).
"""

from __future__ import annotations

from typing import Any

import torch

from wrapped_optim.adapters.precision import is_precision_aware_holder
from wrapped_optim.rollback import GroupOptions, OptimizerSnapshot

__all__: list[str] = []


class _Undo:
    """What a streaming load overwrites in place, kept until it has finished.

    A precision-aware holder's state is kept by the rollback utility's snapshot (its storage as
    stored, its scales, its params). Otherwise the live state tensors that the checkpoint is
    read into are cloned and copied back into the same tensors (which sub-optimizers or
    wrappers may alias), the state entries and the group options are put back as they were;
    under a wrapper, whose ``state_loaded()`` may write the weights, the params are kept too.
    """

    def __init__(self, leaf: torch.optim.Optimizer, targets: Any, with_params: bool) -> None:
        self.leaf = leaf
        self.snapshot: OptimizerSnapshot | None = None
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.entries = {param: dict(entry) for param, entry in leaf.state.items()}
        self.options = GroupOptions.take(leaf.param_groups)
        self.params: list[tuple[torch.Tensor, torch.Tensor]] = []
        if is_precision_aware_holder(leaf):
            # The holder's loader writes its storage and scales, never the params: those are
            # kept only for a wrapper's state_loaded(), which may write weights.
            self.snapshot = OptimizerSnapshot.take(leaf, keep_values=with_params)
            return
        live = {id(t): t for entry in leaf.state.values() for t in entry.values()}
        for target in targets:
            tensor = target.live
            if isinstance(tensor, torch.Tensor) and id(tensor) in live:
                self.copies.append((tensor, tensor.detach().clone()))
        if with_params:  # a wrapper's state_loaded() writes weights (HybridSyncOptimizer)
            unique = {id(p): p for g in leaf.param_groups for p in g["params"]}
            self.params = [(p, p.detach().clone()) for p in unique.values()]

    @classmethod
    def take(cls, leaf: torch.optim.Optimizer, targets: Any, with_params: bool) -> _Undo:
        """Keeps what loading ``targets`` into ``leaf`` may change (and its params)."""
        return cls(leaf, targets, with_params)

    @torch.no_grad()
    def restore(self) -> None:
        """Puts it all back."""
        if self.snapshot is not None:
            self.snapshot.restore()
            return
        for tensor, copy in self.copies + self.params:
            tensor.copy_(copy)
        state = self.leaf.state
        for param in [p for p in state if p not in self.entries]:
            del state[param]
        for param, entry in self.entries.items():
            state[param].clear()
            state[param].update(entry)
        self.options.restore(self.leaf.param_groups)
