"""The drop-in functions' signatures against the releases they replace.

Megatron-Bridge 0.6.2 cannot be installed beside this project's test environment (it needs
Python 3.12 and pins its own torch), so its signatures were read from its source
(``megatron/bridge/training/optim.py`` in the 0.6.2 wheel) and are recorded here as data.
Megatron-FSDP is installed by the ``test`` extra, so its ``fully_shard_optimizer`` is compared
with the real function. A Bridge call -- positional or by keyword, relying on any default --
must mean the same here: Bridge's parameters come first, in its order, of its kinds, with its
defaults; anything this project adds is keyword-only with a default.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

from wrapped_optim import compat
from wrapped_optim.integrations import bridge

POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD
NO_DEFAULT = inspect.Parameter.empty

# Megatron-Bridge 0.6.2, megatron/bridge/training/optim.py: (name, kind, default) in order.
BRIDGE_0_6_2: dict[str, list[tuple[str, Any, Any]]] = {
    "setup_optimizer": [
        ("optimizer_config", POSITIONAL, NO_DEFAULT),
        ("scheduler_config", POSITIONAL, NO_DEFAULT),
        ("model", POSITIONAL, NO_DEFAULT),
        ("use_gloo_process_groups", POSITIONAL, False),
        ("pg_collection", POSITIONAL, None),
        ("optimizer_config_override_provider", POSITIONAL, None),
    ],
    "memory_efficient_fp32_optimizer_state_loading": [("optimizer", POSITIONAL, NO_DEFAULT)],
    "sync_hybrid_device_optimizer_fp32_master_copies": [("optimizer", POSITIONAL, NO_DEFAULT)],
}

OURS: dict[str, Callable[..., Any]] = {
    "setup_optimizer": bridge.setup_optimizer,
    "memory_efficient_fp32_optimizer_state_loading": (
        compat.memory_efficient_fp32_optimizer_state_loading
    ),
    "sync_hybrid_device_optimizer_fp32_master_copies": (
        compat.sync_hybrid_device_optimizer_fp32_master_copies
    ),
}

# In no Bridge release up to 0.6.2: this project follows the newer specification for them.
NOT_IN_BRIDGE_0_6_2 = (
    "memory_efficient_precision_aware_optimizer_state_checkpointing",
    "hybrid_optimizer_state_loading",
)


def parameters(function: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("name", sorted(BRIDGE_0_6_2))
def test_bridge_calls_mean_the_same_here(name: str) -> None:
    theirs = BRIDGE_0_6_2[name]
    ours = parameters(OURS[name])
    assert ours[: len(theirs)] == theirs
    for extra, kind, default in ours[len(theirs) :]:
        assert kind is inspect.Parameter.KEYWORD_ONLY, extra
        assert default is not NO_DEFAULT, extra


def test_fully_shard_optimizer_takes_megatron_fsdps_arguments() -> None:
    experimental = pytest.importorskip("megatron_fsdp.experimental")
    assert parameters(compat.fully_shard_optimizer) == parameters(
        experimental.fully_shard_optimizer
    )


@pytest.mark.parametrize("name", NOT_IN_BRIDGE_0_6_2)
def test_helpers_bridge_lacks_say_whose_specification_they_follow(name: str) -> None:
    doc = inspect.getdoc(getattr(compat, name)) or ""
    assert "not in Megatron-Bridge 0.6.2" in " ".join(doc.split())
