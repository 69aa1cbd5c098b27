"""StagedCheckpointOptimizer's Megatron entry points on CPU: what it passes on to the inner
optimizer, the stats it keeps, its errors, and when Core's common-state read is allowed the
optimizer classes (armed by a loading scaffold, released by the load or the next step)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from wrapped_optim import PrecisionAwareAdamW, StagedCheckpointOptimizer
from wrapped_optim._staging.engine import StagingStats


class Recording(torch.optim.SGD):
    """A torch optimizer with Megatron's checkpoint methods, recording their arguments."""

    def __init__(self) -> None:
        super().__init__([torch.nn.Parameter(torch.ones(2))], lr=0.1)
        self.calls: list[tuple[Any, ...]] = []

    def sharded_state_dict(self, model: Any, is_loading: bool = False, **kwargs: Any) -> Any:
        self.calls.append(("sharded", model, is_loading, kwargs))
        return {"sharded": is_loading}

    def load_parameter_state(self, filename: str, **kwargs: Any) -> None:
        self.calls.append(("load_parameter_state", filename, kwargs))


def test_megatron_calls_pass_their_arguments_on_and_renew_the_stats() -> None:
    inner = Recording()
    stack = StagedCheckpointOptimizer(inner)
    assert stack.last_stats == StagingStats()  # before any checkpoint call
    first = stack.last_stats
    model = {"w": 1}
    assert stack.sharded_state_dict(model, metadata={"fmt": 1}) == {"sharded": False}
    assert stack.last_stats is not first
    second = stack.last_stats
    stack.load_parameter_state("params.pt", update_legacy_format=True)
    assert stack.last_stats is not second
    assert inner.calls == [
        ("sharded", model, False, {"metadata": {"fmt": 1}}),
        ("load_parameter_state", "params.pt", {"update_legacy_format": True}),
    ]


def test_errors_name_what_is_wrong() -> None:
    with pytest.raises(TypeError, match=r"^chunk_bytes must be an int, got str$"):
        StagedCheckpointOptimizer(Recording(), chunk_bytes="64MiB")  # type: ignore[arg-type]
    with pytest.raises(AttributeError, match=r"^SGD has no sharded_state_dict"):
        StagedCheckpointOptimizer(torch.optim.SGD([torch.ones(1)], lr=1)).sharded_state_dict()


def test_step_passes_the_closure_on() -> None:
    stack = StagedCheckpointOptimizer(Recording())
    assert stack.step(lambda: torch.tensor(3.0)).item() == 3.0


@pytest.fixture
def load_common() -> Any:
    """Core's registered common-state read, as an attribute lookup sees it now."""
    strategies = pytest.importorskip("megatron.core.dist_checkpointing.strategies.base")
    strategy = strategies.get_default_strategy(strategies.StrategyAction.LOAD_COMMON, "torch", 1)
    return lambda: strategy.load_common


@pytest.mark.parametrize("ends_it", ["step", "load_state_dict", "load_parameter_state"])
def test_a_loading_scaffold_arms_the_common_read_until_the_load_or_the_next_step(
    load_common: Any, ends_it: str
) -> None:
    """Core 0.16.1's weights-only common read refuses optimizer classes: a scaffold built with
    ``is_loading=True`` arms an allowance for that read, and whatever ends the load disarms it."""
    original = load_common()
    stack = StagedCheckpointOptimizer(Recording())
    stack.sharded_state_dict({}, is_loading=False)
    assert load_common() == original  # saving arms nothing
    stack.sharded_state_dict({}, is_loading=True)
    assert load_common() != original
    {
        "step": lambda: stack.step(),
        "load_state_dict": lambda: stack.load_state_dict(stack.state_dict()),
        "load_parameter_state": lambda: stack.load_parameter_state("params.pt"),
    }[ends_it]()
    assert load_common() == original


class RecordingHolder(PrecisionAwareAdamW):
    """A precision-aware holder with Megatron's scaffold method, recording whether the staged
    load's chunked writer is in place while the scaffold is built."""

    def __init__(self) -> None:
        super().__init__([torch.nn.Parameter(torch.ones(8))], lr=0.1, exp_avg_dtype=torch.bfloat16)
        self.writer_patched: list[bool] = []

    def sharded_state_dict(self, model: Any, is_loading: bool = False, **kwargs: Any) -> Any:
        self.writer_patched.append("set_scaled_state" in vars(self))
        return {}


def test_only_a_loading_scaffold_is_built_under_the_loading_scopes() -> None:
    """A save's scaffold must not run under the staged load: its writer would quantize
    whatever Megatron writes into the holder meanwhile chunk by chunk, as if it were a load."""
    holder = RecordingHolder()
    stack = StagedCheckpointOptimizer(holder)
    stack.sharded_state_dict({}, is_loading=False)
    stack.sharded_state_dict({}, is_loading=True)
    assert holder.writer_patched == [False, True]
    assert "set_scaled_state" not in vars(holder)  # both scopes ended
