"""Megatron-Core's ChainedOptimizer as a structural double, shared by the CPU test doubles.

The real class is constructible on CPU but its ``step`` needs Megatron's parallel state;
``distributed_staged`` and ``distributed_hybrid`` chain their distributed-optimizer
doubles with this one.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ChainedOptimizerDouble"]


class ChainedOptimizerDouble:
    """Shaped like megatron.core.optimizer.ChainedOptimizer (0.16.1): one optimizer's state
    dict is passed through as is, several become a list (a dict of them for sharded ones)."""

    def __init__(self, chained_optimizers: list[Any]) -> None:
        self.chained_optimizers = chained_optimizers
        self.config = getattr(chained_optimizers[0], "config", None) if chained_optimizers else None
        self.is_stub_optimizer = all(
            getattr(o, "is_stub_optimizer", False) for o in chained_optimizers
        )

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.chained_optimizers for g in o.param_groups]

    def step(self) -> None:
        for o in self.chained_optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.chained_optimizers:
            o.zero_grad(set_to_none)

    def state_dict(self) -> Any:
        if len(self.chained_optimizers) == 1:
            return self.chained_optimizers[0].state_dict()
        return [o.state_dict() for o in self.chained_optimizers]

    def sharded_state_dict(
        self, model_sharded_state_dict: Any = None, is_loading: bool = False, **kwargs: Any
    ) -> Any:
        if len(self.chained_optimizers) == 1:
            return self.chained_optimizers[0].sharded_state_dict(
                model_sharded_state_dict, is_loading, **kwargs
            )
        return {
            index: o.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
            for index, o in enumerate(self.chained_optimizers)
        }

    def load_state_dict(self, state_dict: Any) -> None:
        if len(self.chained_optimizers) == 1:
            self.chained_optimizers[0].load_state_dict(state_dict)
            return
        if isinstance(state_dict, dict):
            state_dict = [v for _, v in sorted(state_dict.items())]
        if len(state_dict) != len(self.chained_optimizers):
            raise RuntimeError(
                f"Expected {len(self.chained_optimizers)} entries in state dict, "
                f"but got {len(state_dict)}."
            )
        for o, s in zip(self.chained_optimizers, state_dict, strict=True):
            o.load_state_dict(s)

    def reload_model_params(self, state_dict: Any = None) -> None:
        for o in self.chained_optimizers:
            o.reload_model_params(state_dict)
