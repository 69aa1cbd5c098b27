"""How the hybrid adapter reads the layouts of megatron-core's HybridDeviceOptimizer and of a
DistributedOptimizer around it, and what it pushes into the sub-optimizers after a load.

The real ``HybridDeviceOptimizer`` on a CPU fills its three maps in one fixed pattern and puts
every copy on the params' device; ``_HDO`` below carries the same attributes with chosen
layouts (one map filled at a time, a copy on another device via ``meta``), so each map and
each device fix-up is checked on its own. The containers are shaped like Megatron's.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.doubles.distributed import Range
from wrapped_optim._adapters.hybrid import (
    hybrid_master_copies,
    keeps_per_param_step,
    push_state_to_sub_optimizers,
)
from wrapped_optim.optimizers import HybridOffloadOptimizer, PrecisionAwareAdamW


def _param(*values: float, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Any:
    return torch.nn.Parameter(torch.tensor(values, dtype=dtype, device=device))


class _HDO(torch.optim.SGD):
    """megatron-core HybridDeviceOptimizer's attributes over chosen maps."""

    def __init__(
        self,
        params: list[Any],
        *,
        subs: list[Any] = (),  # type: ignore[assignment]
        cpu_copy: dict[Any, Any] | None = None,
        fp32: dict[Any, Any] | None = None,
        **optional: dict[Any, Any],
    ) -> None:
        super().__init__(params, lr=0.1)
        self.sub_optimizers = list(subs)
        self.gpu_params_map_cpu_copy = cpu_copy or {}
        self.param_to_fp32_param = fp32 or {}
        for name, mapping in optional.items():  # param_to_inner_param, inner_param_to_orig_param
            setattr(self, name, mapping)

    def update_fp32_param_by_new_param(self) -> None:
        pass


class _Container:
    """A Megatron optimizer around a leaf, with a DistributedOptimizer's main-shard groups."""

    def __init__(self, optimizer: Any, **attributes: Any) -> None:
        self.optimizer = optimizer
        for name, value in attributes.items():
            setattr(self, name, value)


def _names(entries: list[Any]) -> list[str]:
    return [entry.name for entry in entries]


def test_each_map_of_a_megatron_hdo_gives_a_level_and_params_without_one_are_skipped() -> None:
    p0, p1, p2, p3 = (_param(1.0, 2.0) for _ in range(4))
    host, fp32, inner = (_param(1.0, 2.0) for _ in range(3))
    hdo = _HDO(
        [p0, p1, p2, p3],
        cpu_copy={p1: host},
        fp32={p2: fp32},
        param_to_inner_param={p3: inner},
    )
    entries = hybrid_master_copies(hdo)
    assert _names(entries) == [f"optimizer 0: group 0 param {i}" for i in (1, 2, 3)]
    assert [(e.weight, e.master, e.copies) for e in entries] == [
        (p1, host, ()),
        (p2, fp32, ()),
        (p3, inner, ()),
    ]


def test_a_megatron_hdo_without_an_inner_map_reads_the_other_two() -> None:
    p0, p1 = _param(1.0), _param(2.0)
    host, fp32 = _param(1.0), _param(2.0)
    hdo = _HDO([p0, p1], cpu_copy={p0: host, p1: host}, fp32={p1: fp32})
    entries = hybrid_master_copies(hdo)
    assert [(e.weight, e.master, e.copies) for e in entries] == [
        (p0, host, ()),
        (p1, fp32, (host,)),
    ]


def _distributed(**without: bool) -> tuple[Any, list[Any]]:
    """A DistributedOptimizer over an HDO: model params m0 (precision-aware: no main shard),
    m1 (its shard s1 is an HDO param with a host copy) and m2 (its shard s2 is not an HDO
    param); the HDO also steps x, an FP32 param that is no main shard."""
    m0, m1, m2 = (_param(1.0, 2.0, 3.0, 4.0, dtype=torch.bfloat16) for _ in range(3))
    s1, s2, x = _param(2.0, 3.0), _param(2.0, 3.0), _param(5.0)
    host_x, host_s1 = _param(5.0), _param(2.0, 3.0)
    hdo = _HDO([x, s1], cpu_copy={x: host_x, s1: host_s1})
    attributes = {
        "model_float16_groups": [[m0, m1, m2]],
        "shard_fp32_from_float16_groups": [[None, s1, s2]],
        "_get_model_param_range_map": lambda param: {"param": Range(1, 3)},
    }
    for name in without:
        del attributes[name]
    return _Container(hdo, **attributes), [m0, m1, m2, s1, s2, x, host_x, host_s1]


def test_a_distributed_optimizer_adds_its_main_shards_as_a_level() -> None:
    container, (_, m1, m2, s1, s2, x, host_x, host_s1) = _distributed()
    entries = hybrid_master_copies(container)
    assert _names(entries) == [
        "optimizer 0: group 0 param 0",
        "optimizer 0: group 0 param 1",
        "optimizer 0: main shard 0",
    ]
    plain, sharded, shard_only = entries
    assert (plain.weight, plain.master, plain.copies) == (x, host_x, ())
    assert (sharded.master, sharded.copies) == (host_s1, (s1,))
    assert (shard_only.master, shard_only.copies) == (s2, ())
    for entry, model in ((sharded, m1), (shard_only, m2)):  # the rank's slice of the weight
        assert entry.weight.data_ptr() == model.data_ptr() + model.element_size()
        assert entry.weight.tolist() == [2.0, 3.0]


@pytest.mark.parametrize(
    "missing",
    ["model_float16_groups", "shard_fp32_from_float16_groups", "_get_model_param_range_map"],
)
def test_a_container_without_any_main_shard_attribute_adds_no_level(missing: str) -> None:
    container, (*_, host_x, host_s1) = _distributed(**{missing: True})
    entries = hybrid_master_copies(container)
    assert [(e.master, e.copies) for e in entries] == [(host_x, ()), (host_s1, ())]


@pytest.mark.parametrize("ragged", ["groups", "params"])
def test_main_shard_groups_that_disagree_with_the_model_groups_are_refused(ragged: str) -> None:
    container, (m0, m1, m2, s1, *_) = _distributed()
    if ragged == "groups":
        container.model_float16_groups = [[m0, m1, m2], [m0]]
    else:
        container.shard_fp32_from_float16_groups = [[None, s1]]
    with pytest.raises(ValueError, match="zip"):
        hybrid_master_copies(container)


class _OwnCopies(torch.optim.SGD):
    """A hybrid optimizer that lists its copies itself and has none of Megatron's maps."""

    sub_optimizers: list[Any] = []

    def master_copies(self) -> list[Any]:
        return []


def test_pushed_state_moves_to_each_copys_device_and_links_the_sub_optimizer() -> None:
    # Sub-optimizer copies on another device (``meta``) than the restored state (CPU).
    orig = _param(1.0, 2.0)
    empty_copy, mapped_copy, own_copy = (_param(0.0, 0.0, device="meta") for _ in range(3))
    held = _param(1.0, 2.0)
    holder = PrecisionAwareAdamW([held])
    adam = torch.optim.Adam([empty_copy, mapped_copy])
    mapped = _HDO(
        [orig],
        subs=[holder, adam],
        inner_param_to_orig_param={mapped_copy: orig, empty_copy: _param(0.0)},
    )
    unmapped = _HDO([orig], subs=[torch.optim.Adam([own_copy])])  # its copies key the state
    step = torch.tensor(4.0)
    mapped.state[orig] = {"exp_avg": torch.ones(2), "step": step, "note": "kept"}
    mapped.state[held] = {"exp_avg": torch.ones(2)}
    unmapped.state[own_copy] = {"exp_avg_sq": torch.ones(2)}
    own = _OwnCopies([_param(1.0)], lr=0.1)  # no Megatron maps: nothing to push, skipped
    stack = SimpleNamespace(chained_optimizers=[own, mapped, unmapped])

    push_state_to_sub_optimizers(stack)

    restored = mapped.state[orig]
    assert restored["exp_avg"].device.type == "meta"
    assert restored["step"] is step  # the step stays where the optimizer counts it
    assert restored["note"] == "kept"
    assert adam.state[mapped_copy] is restored
    assert empty_copy not in adam.state
    assert held not in holder.state  # a precision-aware holder loads through its own API
    assert unmapped.state[own_copy]["exp_avg_sq"].device.type == "meta"
    assert unmapped.sub_optimizers[0].state[own_copy] is unmapped.state[own_copy]


def test_pushing_into_the_portable_optimizer_keeps_its_sub_optimizers_own_dicts() -> None:
    params = [_param(1.0, 2.0), _param(3.0)]
    opt = HybridOffloadOptimizer(params, offload_fraction=1.0, lr=0.1)
    for param in params:
        param.grad = torch.ones_like(param)
    opt.step()
    before = {id(sub): {copy: sub.state[copy] for copy in sub.state} for sub in opt.sub_optimizers}
    push_state_to_sub_optimizers(opt)
    for sub in opt.sub_optimizers:
        for copy, entry in sub.state.items():
            assert type(entry) is dict
            assert entry is before[id(sub)][copy]


def _stepped(optimizer: Any) -> Any:
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.ones_like(param)
    optimizer.step()
    return optimizer


def test_a_stub_ranks_leftover_optimizer_does_not_decide_the_step_layout() -> None:
    adamw = _stepped(torch.optim.AdamW([_param(1.0)]))  # keeps a per-param step
    stub = _Container(adamw, is_stub_optimizer=True)
    holder = _stepped(PrecisionAwareAdamW([_param(1.0)]))
    assert keeps_per_param_step(SimpleNamespace(chained_optimizers=[stub, holder])) is False
    assert keeps_per_param_step(SimpleNamespace(chained_optimizers=[adamw, holder])) is True


def test_a_precision_aware_holder_with_a_per_param_step_keeps_one() -> None:
    param = _param(1.0)
    holder = _stepped(PrecisionAwareAdamW([param]))
    assert keeps_per_param_step(holder) is False
    holder.state[param]["step"] = torch.tensor(1.0)  # as a torch-format load leaves it
    assert keeps_per_param_step(holder) is True
