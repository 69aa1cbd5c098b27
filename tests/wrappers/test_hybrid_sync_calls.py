"""HybridSyncOptimizer's entry points on CPU: the errors name what is wrong, Megatron's
checkpoint and reload methods get their arguments, and Core's common-state read is allowed
the optimizer classes from a loading scaffold until the load or the next step ends it."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from wrapped_optim import HybridSyncOptimizer, StaleMasterError
from wrapped_optim.optimizers import HybridOffloadOptimizer

BF16 = torch.bfloat16


class Recording(HybridOffloadOptimizer):
    """A hybrid offload optimizer with Megatron's checkpoint and reload methods, recording
    their arguments."""

    def __init__(self, count: int = 1) -> None:
        params = [torch.nn.Parameter(torch.ones(2, dtype=BF16)) for _ in range(count)]
        super().__init__(params, lr=0.1)
        self.calls: list[tuple[Any, ...]] = []

    def sharded_state_dict(self, model: Any, is_loading: bool = False, **kwargs: Any) -> Any:
        self.calls.append(("sharded", model, is_loading, kwargs))
        return {"sharded": is_loading}

    def load_parameter_state(self, filename: str, **kwargs: Any) -> None:
        self.calls.append(("load_parameter_state", filename, kwargs))

    def reload_model_params(self, *args: Any) -> None:
        self.calls.append(("reload_model_params", *args))


def _params(opt: Any) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def _write_weights_behind_its_back(opt: Any) -> None:
    with torch.no_grad():
        for p in _params(opt):
            p.add_(1.0)


def test_a_stack_with_nothing_to_sync_is_refused_with_the_remedies() -> None:
    message = (
        "HybridSyncOptimizer keeps the FP32 master copies of a hybrid offload optimizer in "
        "step with the model, and this stack has none (its optimizers: {}); drop the layer "
        "(wrap()/StackConfig: leave `hybrid` unset or false), or wrap an optimizer that "
        "offloads: wrapped_optim.optimizers.HybridOffloadOptimizer, or Megatron's "
        "HybridDeviceOptimizer (optimizer_cpu_offload=True)"
    )
    sgd = torch.optim.SGD([torch.ones(1)], lr=1)
    with pytest.raises(ValueError, match=f"^{re.escape(message.format('SGD'))}$"):
        HybridSyncOptimizer(sgd)
    adam = torch.optim.Adam([torch.ones(1)])
    chained = SimpleNamespace(chained_optimizers=[sgd, adam, sgd], step=print, state_dict=dict)
    with pytest.raises(ValueError, match=f"^{re.escape(message.format('Adam, SGD'))}$"):
        HybridSyncOptimizer(chained)
    empty = SimpleNamespace(chained_optimizers=[], step=print, state_dict=dict)
    with pytest.raises(ValueError, match=f"^{re.escape(message.format('none'))}$"):
        HybridSyncOptimizer(empty)


@pytest.mark.parametrize(("count", "listed"), [(5, ""), (6, " and 1 more"), (7, " and 2 more")])
def test_a_stale_master_error_names_five_entries_then_counts_the_rest(
    count: int, listed: str
) -> None:
    opt = HybridSyncOptimizer(Recording(count), on_stale="raise")
    _write_weights_behind_its_back(opt)
    names = ", ".join(f"optimizer 0: group 0 param {i} ((2,))" for i in range(min(count, 5)))
    expected = (
        f"{count} master copies disagree with the model weights they update ({names}{listed}); "
        "the model weights were changed without the optimizer (a model-only load, an RL refit, "
        "a weight swap?). Call reload_model_params() to refresh them from the model, load the "
        "optimizer state, or use on_stale='refresh'"
    )
    with pytest.raises(StaleMasterError, match=f"^{re.escape(expected)}$"):
        opt.check_masters()
    assert opt.guard_armed is True  # the refused check left the guard armed


def test_check_masters_disarms_the_guard_and_step_passes_the_closure_on() -> None:
    opt = HybridSyncOptimizer(Recording())
    assert opt.check_masters() == [] and opt.guard_armed is False
    for p in _params(opt):
        p.grad = torch.ones_like(p)
    assert opt.step(lambda: torch.tensor(2.0)).item() == 2.0


def test_reload_model_params_reloads_through_the_megatron_optimizer_first() -> None:
    inner = Recording()
    opt = HybridSyncOptimizer(inner, on_stale="raise")
    _write_weights_behind_its_back(opt)
    opt.reload_model_params()
    opt.reload_model_params({"model": 1})
    assert inner.calls == [("reload_model_params",), ("reload_model_params", {"model": 1})]
    assert opt.stale_masters() == [] and opt.guard_armed is False
    bare = HybridSyncOptimizer(HybridOffloadOptimizer([torch.nn.Parameter(torch.ones(2))]))
    message = (
        "reload_model_params(state_dict) reloads main params from a model checkpoint through a "
        "Megatron optimizer; this stack has none — load the weights into the model and call "
        "reload_model_params()"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        bare.reload_model_params({"model": 1})


def test_megatron_checkpoint_calls_pass_their_arguments_on() -> None:
    inner = Recording()
    opt = HybridSyncOptimizer(inner)
    model = {"w": 1}
    assert opt.sharded_state_dict(model, metadata={"fmt": 1}) == {"sharded": False}
    assert opt.sharded_state_dict(model, True, metadata={"fmt": 2}) == {"sharded": True}
    opt.load_parameter_state("params.pt", update_legacy_format=True)
    assert inner.calls == [
        ("sharded", model, False, {"metadata": {"fmt": 1}}),
        ("sharded", model, True, {"metadata": {"fmt": 2}}),
        ("load_parameter_state", "params.pt", {"update_legacy_format": True}),
    ]
    assert opt.guard_armed is True  # a committed load re-arms the guard
    bare = HybridSyncOptimizer(HybridOffloadOptimizer([torch.nn.Parameter(torch.ones(2))]))
    with pytest.raises(AttributeError, match=r"^HybridOffloadOptimizer has no sharded_state_"):
        bare.sharded_state_dict()


@pytest.fixture
def load_common() -> Any:
    """Core's registered common-state read, as an attribute lookup sees it now."""
    strategies = pytest.importorskip("megatron.core.dist_checkpointing.strategies.base")
    strategy = strategies.get_default_strategy(strategies.StrategyAction.LOAD_COMMON, "torch", 1)
    return lambda: strategy.load_common


@pytest.mark.parametrize(
    "ends_it", ["step", "load_state_dict", "load_parameter_state", "sharded_state_dict"]
)
def test_a_loading_scaffold_arms_the_common_read_until_the_load_or_the_next_step(
    load_common: Any, ends_it: str
) -> None:
    original = load_common()
    opt = HybridSyncOptimizer(Recording())
    opt.sharded_state_dict({}, is_loading=False)
    assert load_common() == original  # saving arms nothing
    opt.sharded_state_dict({}, is_loading=True)
    assert load_common() != original
    for p in _params(opt):
        p.grad = torch.ones_like(p)
    {
        "step": lambda: opt.step(),
        "load_state_dict": lambda: opt.load_state_dict(opt.state_dict()),
        "load_parameter_state": lambda: opt.load_parameter_state("params.pt"),
        "sharded_state_dict": lambda: opt.sharded_state_dict({}),  # a save after it
    }[ends_it]()
    assert load_common() == original


def test_a_push_that_fails_after_a_load_is_retried_before_the_next_step() -> None:
    """A committed load makes the masters the truth: when pushing them fails (twice: once and
    at the immediate retry) the load raises, and the next step pushes them before stepping."""

    class Flaky(HybridSyncOptimizer):
        failures = 2
        pushes = 0

        def sync_from_masters(self) -> None:
            if self.failures:
                self.failures -= 1
                raise RuntimeError("push failed")
            self.pushes += 1
            super().sync_from_masters()

    opt = Flaky(Recording())
    with pytest.raises(RuntimeError, match="push failed"):
        opt.load_state_dict(opt.state_dict())
    assert opt.pushes == 0
    for p in _params(opt):
        p.grad = torch.ones_like(p)
    opt.step()
    assert opt.pushes == 1
    opt.step()
    assert opt.pushes == 1  # pushed once, not before every step
