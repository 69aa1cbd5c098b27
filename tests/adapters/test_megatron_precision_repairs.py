"""The precision-aware repairs of Core's parameter-state loader
(:mod:`wrapped_optim._adapters.megatron_precision`): probed on Core's own function, named with
the Core version, off for a setter without the defects, and refusing what they cannot repair.
tests/megatron_real/test_precision_aware.py runs them on Core's real DistributedOptimizer.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core.optimizer.distrib_optimizer")

from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from wrapped_optim._adapters import megatron_precision as repairs
from wrapped_optim.optimizers import PrecisionAwareAdamW

CORE_SETTER = DistributedOptimizer._set_main_param_and_optimizer_states


def _container(setter: Any, *, remainders: bool = True) -> tuple[Any, torch.Tensor]:
    """A precision-aware container (Core's config flag, a real PrecisionAwareAdamW inside)
    whose class carries ``setter``."""
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]).to(torch.bfloat16))
    inner = PrecisionAwareAdamW(
        [param],
        master_weights=True,
        store_param_remainders=remainders,
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16,
    )
    inner.initialize_state(param, remainders)
    cls = type("Container", (), {"_set_main_param_and_optimizer_states": setter})
    container = cls()
    container.model_param_group_index_map = {param: (0, 0)}
    container.config = SimpleNamespace(
        use_precision_aware_optimizer_no_fp8_or_ds_fp8=True,
        store_param_remainders=remainders,
        bf16=True,
    )
    container.optimizer = inner
    return container, param


def _payload(remainder: torch.Tensor) -> dict[str, Any]:
    """A dp_reshardable entry of a remainder config as Core's dp_zero buffers carry it."""
    return {
        "param": remainder.to(torch.float32),
        "exp_avg": torch.tensor([0.5, 0.25, -1.0]),
        "exp_avg_sq": torch.tensor([1.0, 2.0, 4.0]),
        "padding": False,
    }


# What the suite has seen: (forwards padding, hands back a float32 remainder).
KNOWN = {"0.16.1": (True, True), "0.19.2": (False, True)}


def test_the_probe_sees_what_cores_setter_does_and_names_the_version() -> None:
    from megatron.core import __version__

    padding, remainder = repairs._setter_defects(CORE_SETTER)
    if __version__ in KNOWN:
        assert (padding, remainder) == KNOWN[__version__]
    source = torch.tensor([-7, 0, 32767], dtype=torch.int16)
    container, param = _container(CORE_SETTER)
    without_remainder = {k: v for k, v in _payload(source).items() if k != "param"}
    try:
        CORE_SETTER(container, param, without_remainder)
    except ValueError as error:
        assert padding and "padding" in str(error)
    else:
        assert not padding
    try:
        CORE_SETTER(container, param, {"param": source.to(torch.float32)})
    except ValueError as error:
        assert remainder and "expected torch.int16" in str(error)
    else:
        assert not remainder
    names, setter = repairs.precision_setter_repairs(container)
    assert len(names) == padding + remainder and (setter is None) == (not names)
    assert all(name.endswith(f"(megatron-core {__version__})") for name in names)


def test_the_repaired_setter_restores_exactly() -> None:
    remainder = torch.tensor([-7, 0, 32767], dtype=torch.int16)
    container, param = _container(CORE_SETTER)
    _, setter = repairs.precision_setter_repairs(container)
    assert setter is not None
    setter(param, _payload(remainder))
    state = container.optimizer.state[param]
    assert torch.equal(state["master_param"], remainder)
    assert torch.equal(state["exp_avg_sq"].float(), torch.tensor([1.0, 2.0, 4.0]))


def test_a_float32_that_is_no_remainder_is_refused() -> None:
    container, param = _container(CORE_SETTER)
    _, setter = repairs.precision_setter_repairs(container)
    assert setter is not None
    payload = {**_payload(torch.zeros(3, dtype=torch.int16)), "param": torch.tensor([0.5, 1, 2])}
    before = container.optimizer.state[param]["master_param"].clone()
    with pytest.raises(ValueError, match="store_param_remainders=False"):
        setter(param, payload)
    assert torch.equal(container.optimizer.state[param]["master_param"], before)


def _fixed_setter(self: Any, model_param: Any, tensors: Any) -> None:
    """A Core without the defects: only state names, the remainder back in int16."""
    group_index, group_order = self.model_param_group_index_map[model_param]
    target = self.optimizer.param_groups[group_index]["params"][group_order]
    for key, value in tensors.items():
        if key == "padding":
            continue
        name = "master_param" if key == "param" else key
        if name == "master_param" and self.config.store_param_remainders:
            value = value.to(torch.int16)
        self.optimizer.set_scaled_state(target, name, value)


def test_off_where_core_has_no_defect() -> None:
    assert repairs._setter_defects(_fixed_setter) == (False, False)
    container, _ = _container(_fixed_setter)
    assert repairs.precision_setter_repairs(container) == ([], None)


def test_not_for_a_container_that_is_not_precision_aware() -> None:
    container, _ = _container(CORE_SETTER)
    container.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = False
    assert repairs.precision_setter_repairs(container) == ([], None)
