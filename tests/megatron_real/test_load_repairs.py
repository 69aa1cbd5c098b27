"""The scoped repairs of megatron-core's checkpoint loaders
(:mod:`wrapped_optim._adapters.megatron_checkpoint`) on the real classes: each is installed only
while a probe of Core's own code shows its defect, is active only inside a load call, and
leaves nothing behind, also when the load raises."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core.optimizer")

from megatron.core.optimizer import ChainedOptimizer, DistributedOptimizer
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

from tests.distributed.conftest import run_in_this_process
from tests.doubles.distributed import DistributedOptimizerDouble, ddp_config, megatron_config
from tests.doubles.te_fused_adam import te_style
from tests.megatron_real.dist_ckpt import save
from tests.megatron_real.harness import build, leaf, megatron_session, train
from wrapped_optim import compat
from wrapped_optim._adapters.megatron_checkpoint import (
    _common_loader,
    _fp32_update_requires_every_param,
    _scaffold_needs_state,
    _setter_reads_payload_step,
    megatron_load_repairs,
)
from wrapped_optim.hybrid import HybridSyncOptimizer
from wrapped_optim.optimizers import PrecisionAwareAdamW
from wrapped_optim.staged import StagedCheckpointOptimizer

pytestmark = pytest.mark.xdist_group("megatron_real")

SETTER = "_set_main_param_and_optimizer_states"
GETTER = "_get_main_param_and_optimizer_states"
UPDATE = "_update_fp32_params_by_new_state"


def _common_read_patched() -> bool:
    """Whether Core's registered common-state loader carries the scoped allow-list patch."""
    strategy = _common_loader()  # None where Core's own read accepts the classes (0.19.2)
    return strategy is not None and "load_common" in vars(strategy)


def _fixed_setter(self: Any, model_param: Any, tensors: Any) -> None:
    """What a Core without the defect would do: copy only what the payload carries, never a
    per-parameter step."""
    group_index, group_order = self.model_param_group_index_map[model_param]
    main = self.optimizer.param_groups[group_index]["params"][group_order]
    destination = {"param": main, **self.optimizer.state[main]}
    for key, value in tensors.items():
        if key in destination and key != "step" and isinstance(value, torch.Tensor):
            destination[key].copy_(value)


def _fixed_getter(self: Any, model_param: Any) -> dict[str, Any]:
    """What a Core without the defect would hand on: no ``master_param`` alias of ``param``."""
    group_index, group_order = self.model_param_group_index_map[model_param]
    main = self.optimizer.param_groups[group_index]["params"][group_order]
    state = self.optimizer.state[main]
    return {"param": main, **{k: v for k, v in state.items() if k != "master_param"}}


def _fixed_update(self: Any) -> None:
    if self.param_update_in_fp32:
        for param, value in self.state.items():
            fp32 = self.param_to_fp32_param.get(param)
            if fp32 is not None:
                fp32.data.copy_(value["master_param"])


def test_probes_see_the_defects_of_the_installed_core() -> None:
    # megatron-core 0.16.1 and 0.19.2 both have them; a Core that fixes one fails here,
    # which is the signal to drop that repair.
    assert _setter_reads_payload_step(getattr(DistributedOptimizer, SETTER)) is True
    assert _fp32_update_requires_every_param(getattr(HybridDeviceOptimizer, UPDATE)) is True
    assert _scaffold_needs_state(DistributedOptimizer.state_dict) is True


def test_probes_turn_off_for_a_fixed_core() -> None:
    assert _setter_reads_payload_step(_fixed_setter) is False
    assert _fp32_update_requires_every_param(_fixed_update) is False
    # A scaffold that reads the step from the group metadata (Core with TE or Apex installed)
    assert _scaffold_needs_state(lambda self: {"optimizer": self.optimizer.state_dict()}) is False


def _scoping_worker(rank: int, world: int, fixed: bool) -> dict[str, Any]:
    with megatron_session():
        _, optimizer = build("offload_half")
        distributed = leaf(optimizer)
        hybrid = distributed.optimizer
        inside: dict[str, Any] = {}
        with megatron_load_repairs(optimizer) as count:
            inside = {
                "count": count,
                "setter": SETTER in vars(distributed),
                "update": UPDATE in vars(hybrid),
                "scaffold": "sharded_state_dict" in vars(distributed),
                "getter": GETTER in vars(distributed),
                "common_read": _common_read_patched(),
                "allowed": torch.optim.AdamW in torch.serialization.get_safe_globals(),
            }
        after = {
            name: name in vars(obj)
            for obj, name in (
                (distributed, SETTER),
                (hybrid, UPDATE),
                (distributed, "sharded_state_dict"),
                (distributed, GETTER),
            )
        }
        after["common_read"] = _common_read_patched()
        after["allowed"] = torch.optim.AdamW in torch.serialization.get_safe_globals()
        raised = False
        try:
            with megatron_load_repairs(optimizer):
                raise RuntimeError("a load that fails")
        except RuntimeError:
            raised = True
        after_raise = [
            name in vars(obj)
            for obj, name in (
                (distributed, SETTER),
                (hybrid, UPDATE),
                (distributed, "sharded_state_dict"),
                (distributed, GETTER),
            )
        ] + [_common_read_patched()]
        return {"inside": inside, "after": after, "raised": raised, "after_raise": after_raise}


@pytest.mark.parametrize("fixed", [False, True])
def test_repairs_are_scoped_and_off_when_core_is_fixed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fixed: bool
) -> None:
    if fixed:  # a Core release without the three defects
        monkeypatch.setattr(DistributedOptimizer, SETTER, _fixed_setter)
        monkeypatch.setattr(DistributedOptimizer, GETTER, _fixed_getter)
        monkeypatch.setattr(HybridDeviceOptimizer, UPDATE, _fixed_update)
    result = run_in_this_process(_scoping_worker, tmp_path, fixed)
    inside = result["inside"]
    assert inside["setter"] is not fixed and inside["update"] is not fixed
    assert inside["getter"] is not fixed
    # state creation; Core's common read (megatron-core 0.16.1 refuses the HDO's classes)
    common_read = _common_loader() is not None
    assert inside["scaffold"] and inside["common_read"] is common_read
    assert inside["allowed"] is False  # torch's allow-list only during that read
    assert inside["count"] == (1 if fixed else 4) + common_read
    assert result["after"] == {
        SETTER: False,
        UPDATE: False,
        "sharded_state_dict": False,
        GETTER: False,
        "common_read": False,
        "allowed": False,
    }
    assert result["raised"] and result["after_raise"] == [False] * 5


def _session_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    def allowed() -> bool:
        return torch.optim.AdamW in torch.serialization.get_safe_globals()

    seen: dict[str, Any] = {}
    with megatron_session():
        model, optimizer = build("offload_half")
        train(model, optimizer, range(2))
        save(model, optimizer, Path(root), "fully_reshardable")
        fresh_model, fresh = build("offload_half", seed=1)
        wrapped = HybridSyncOptimizer(fresh)
        seen["before"] = (allowed(), _common_read_patched())
        metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
        wrapped.sharded_state_dict(fresh_model.module.sharded_state_dict(), True, metadata=metadata)
        seen["during"] = (allowed(), _common_read_patched())
        train(fresh_model, wrapped, range(2, 3))  # the load was abandoned: the next step ends it
        seen["after_step"] = (allowed(), _common_read_patched())
    return seen


def test_core_common_read_is_armed_only_while_a_load_is_in_progress(tmp_path: Path) -> None:
    # (allow-listed, Core's common loader armed): torch's allow-list is never widened outside
    # Core's read itself (tests/megatron_real/test_allow_list_scope.py)
    seen = run_in_this_process(_session_worker, tmp_path, str(tmp_path / "ckpt"))
    assert seen == {
        "before": (False, False),
        "during": (False, _common_loader() is not None),
        "after_step": (False, False),
    }


def _init_worker(rank: int, world: int) -> dict[str, Any]:
    from wrapped_optim._adapters.hybrid import hybrid_master_copies

    with megatron_session():
        model, optimizer = build("offload_half")
        before = [p.detach().clone() for p in model.parameters()]
        masters = [e.master.detach().clone() for e in hybrid_master_copies(optimizer)]
        created = compat.init_optimizer_state(optimizer)
        hybrid = leaf(optimizer).optimizer
        # DistributedOptimizer.state_dict (the loading scaffold) asserts one step across states
        steps = {float(s["step"]) for s in optimizer.state_dict()["optimizer"]["param_groups"]}
        return {
            "steps": steps,
            "created": created,
            "states": [sorted(state) for state in hybrid.state.values()],
            "weights_kept": all(
                torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
            ),
            "masters_kept": all(
                torch.equal(a, e.master)
                for a, e in zip(masters, hybrid_master_copies(optimizer), strict=True)
            ),
        }


def test_init_optimizer_state_on_a_distributed_hybrid_device_optimizer(tmp_path: Path) -> None:
    # It returned False (no state): the HDO's params are detached FP32 shards whose
    # requires_grad is False, and the initialiser skipped them as frozen.
    result = run_in_this_process(_init_worker, tmp_path)
    assert result["created"] is True
    assert result["steps"] == {0.0}
    assert result["states"] == [["exp_avg", "exp_avg_sq", "master_param", "step"]] * 4
    assert result["weights_kept"] and result["masters_kept"]


# --------------------------------------------------------------------------------------
# TE FusedAdam's layout (one step per group, no per-param step) through the FusedAdam double
# --------------------------------------------------------------------------------------
def _te_stack(seed: int) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2)).to(torch.bfloat16)
    holder = te_style(PrecisionAwareAdamW)(
        model.parameters(), lr=1e-2, master_weights=True, weight_decay=0.01
    )
    distributed = DistributedOptimizerDouble(
        holder, megatron_config(precision_aware=True), ddp_config(), checkpoint="fully_reshardable"
    )
    return model, ChainedOptimizer([distributed])


def _te_steps(model: torch.nn.Module, optimizer: Any, steps: range) -> None:
    for step in steps:
        optimizer.zero_grad()
        x = torch.full((3, 4), 0.1 * (step + 1), dtype=torch.bfloat16)
        model(x).float().square().sum().backward()
        optimizer.step()


@pytest.mark.parametrize("route", ["stack", "compat"])
def test_te_layout_resumes_without_a_per_param_step(route: str) -> None:
    model, optimizer = _te_stack(0)
    _te_steps(model, optimizer, range(2))
    weights = copy.deepcopy(model.state_dict())
    payload = copy.deepcopy(optimizer.state_dict())
    _te_steps(model, optimizer, range(2, 4))

    resumed_model, resumed = _te_stack(1)
    resumed_model.load_state_dict(weights)
    # State to load into, as the scaffold repair creates it for a sharded load (the double's
    # own scaffold is torch.empty, which the portable holder refuses as non-finite).
    compat.init_optimizer_state(resumed)
    if route == "stack":
        resumed = HybridSyncOptimizer(StagedCheckpointOptimizer(resumed))
        resumed.load_state_dict(payload)
    else:
        with compat.memory_efficient_fp32_optimizer_state_loading(resumed):
            resumed.load_state_dict(payload)
    holder = (
        resumed.unwrap().chained_optimizers[0].optimizer
        if route == "wrap"
        else (resumed.chained_optimizers[0].optimizer)
    )
    assert all("step" not in state for state in holder.state.values())
    assert holder.param_groups[0]["step"] == 2
    _te_steps(resumed_model, resumed, range(2, 4))
    for a, b in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(a, b)
