"""What HybridSyncOptimizer restores in a Megatron-style payload before loading it, and
which objects it treats as hybrid offload optimizers."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from wrapped_optim._adapters.hybrid import is_hybrid_offload, restore_omitted_state


def _payload(states: Any, groups: Any) -> dict[str, Any]:
    return {"state": states, "param_groups": groups}


def test_other_formats_come_back_untouched() -> None:
    for payload in ({"state": {}, "param_groups": "nested"}, {"state": [], "param_groups": []}):
        assert restore_omitted_state(payload) is payload


def test_the_groups_step_fills_only_missing_steps_as_a_float32_tensor() -> None:
    """Entries that keep a step of their own keep it; an entry that is not a dict is passed
    through and the ones after it are still restored; a group without params is fine."""
    groups = [{"params": [0, 1, 2], "step": torch.tensor(3)}, {"step": 9}]
    states = {0: {"step": torch.tensor(7.0)}, 1: "opaque", 2: {"exp_avg": torch.zeros(1)}}
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the step is float32 whatever the default
    try:
        restored = restore_omitted_state(_payload(states, groups))["state"]
    finally:
        torch.set_default_dtype(previous)
    assert restored[0]["step"].item() == 7.0 and restored[1] == "opaque"
    assert restored[2]["step"].dtype == torch.float32 and restored[2]["step"].item() == 3.0
    assert "step" not in states[2]  # the caller's entries are not modified
    kept = restore_omitted_state(_payload(states, groups), per_param_step=False)["state"]
    assert "step" not in kept[2]


def test_the_fp32_param_becomes_the_master_unless_there_is_one() -> None:
    fp32, master = torch.ones(2), torch.zeros(2)
    states = {0: {"fp32_param": fp32}, 1: {"fp32_param": fp32, "master_param": master}}
    restored = restore_omitted_state(_payload(states, [{"params": [0, 1]}]))["state"]
    assert restored[0] == {"master_param": fp32}
    assert restored[1]["master_param"] is master and restored[1]["fp32_param"] is fp32


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        (None, False),
        (SimpleNamespace(sub_optimizers=[], master_copies=list), True),
        (SimpleNamespace(sub_optimizers=[], master_copies=None), False),  # not callable
        (SimpleNamespace(master_copies=list), False),  # no sub-optimizers
    ],
)
def test_a_hybrid_offload_optimizer_lists_its_sub_optimizers_and_master_copies(
    obj: Any, expected: bool
) -> None:
    assert is_hybrid_offload(obj) is expected
