"""The stale-copy predicate behind HybridSyncOptimizer's guard looks at every level.

A Megatron-style ``reload_model_params`` that refreshes one level leaves a *fresh master with
a stale copy*: the other scenarios of the suite make the master stale whenever a copy is, so
a predicate that compared the master alone would pass them. Here each level is made stale on
its own, with the master fresh: the host clone (the FP32 copy the sub-optimizer steps) beside
a master a loader restored into the state (the real ``HybridDeviceOptimizer`` and the portable
optimizer), and a distributed optimizer's FP32 main shard. (On a CPU the real optimizer over
main shards keeps no second level: its host copy is the shard itself.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.doubles.distributed import DistributedOptimizerDouble
from wrapped_optim import HybridSyncOptimizer, StaleMasterError
from wrapped_optim._adapters.hybrid import MasterCopies, hybrid_master_copies
from wrapped_optim.optimizers import HybridOffloadOptimizer

BF16 = torch.bfloat16


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2)).to(BF16)


class _FakeStream:
    def wait_stream(self, *args: Any) -> None:
        pass


def _hdo(params: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    cpu_offloading = pytest.importorskip("megatron.core.optimizer.cpu_offloading")
    # The constructor asks CUDA for its current stream; nothing else on this path needs CUDA.
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: _FakeStream())
    return cpu_offloading.HybridDeviceOptimizer(
        params,
        offload_fraction=0.5,
        cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=torch.optim.AdamW,
        param_update_in_fp32=True,
        overlap_cpu_optimizer_d2h_h2d=False,
        lr=1e-3,
    )


def _with_restored_masters(opt: Any, params: Any) -> Any:
    """A loader's restored ``master_param`` in the state (Megatron's precision-aware load path
    puts it there): the optimizer's own FP32 copy becomes a copy that must follow it."""
    for param in params:
        opt.state[param]["master_param"] = param.detach().float().clone()
    return opt


def _hdo_host_clone(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> Any:
    return _with_restored_masters(_hdo(model.parameters(), monkeypatch), model.parameters())


def _portable_host_clone(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> Any:
    opt = HybridOffloadOptimizer(model.parameters(), offload_fraction=0.5, lr=1e-3)
    return _with_restored_masters(opt, model.parameters())


def _portable_main_shard(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> Any:
    return DistributedOptimizerDouble.of_model(
        model, lambda groups: HybridOffloadOptimizer(groups, lr=1e-3), precision_aware=False
    )


STACKS: dict[str, Callable[[torch.nn.Module, pytest.MonkeyPatch], Any]] = {
    "host clone (HybridDeviceOptimizer)": _hdo_host_clone,
    "host clone (HybridOffloadOptimizer)": _portable_host_clone,
    "main shard (DistributedOptimizer over HybridOffloadOptimizer)": _portable_main_shard,
}


def _fresh(level: torch.Tensor, weight: torch.Tensor) -> bool:
    return torch.equal(level.to(weight.dtype), weight.reshape(level.shape).to(level.device))


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_a_fresh_master_with_one_stale_copy_is_stale(
    stack: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()
    opt = HybridSyncOptimizer(STACKS[stack](model, monkeypatch), on_stale="raise")
    opt.reload_model_params()
    assert opt.stale_masters() == []
    entries: list[MasterCopies] = [e for e in hybrid_master_copies(opt) if e.copies]
    assert entries, f"{stack}: no entry has a copy beside its master"
    for entry in entries:
        for index, copy in enumerate(entry.copies):
            kept = copy.clone()
            copy.add_(0.5)  # this level alone goes stale
            assert _fresh(entry.master, entry.weight), "the master must stay fresh"
            assert entry.stale_levels() == [f"copy {index}"]
            stale = opt.stale_masters()
            assert [e.name for e in stale] == [entry.name]
            with pytest.raises(StaleMasterError, match="disagree with the model weights"):
                opt.check_masters()
            copy.copy_(kept)
    assert opt.stale_masters() == []


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_the_guard_refreshes_a_stale_copy_under_a_fresh_master(
    stack: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()
    opt = HybridSyncOptimizer(STACKS[stack](model, monkeypatch), on_stale="refresh")
    opt.reload_model_params()
    entry = next(e for e in hybrid_master_copies(opt) if e.copies)
    entry.copies[-1].add_(0.5)
    assert [e.name for e in opt.check_masters()] == [entry.name]
    assert _fresh(entry.copies[-1], entry.weight) and _fresh(entry.master, entry.weight)
    assert opt.stale_masters() == []
