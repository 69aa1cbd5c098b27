"""Stale masters are caught at every step, not only the first (issue #36, item 2).

A weight written behind the optimizer's back between two steps (an RL refit: a
``model.load_state_dict`` of new weights, then ``step()``) moves its version counter; the next
step compares those weights with their masters, on every route that owns a hybrid offload
optimizer: ``HybridSyncOptimizer`` (each ``on_stale`` mode), the compat sync and Megatron's
real ``HybridDeviceOptimizer`` class through the adapter.
"""

from __future__ import annotations

import copy

import pytest
import torch

from wrapped_optim.compat import sync_hybrid_device_optimizer_fp32_master_copies
from wrapped_optim.hybrid import HybridSyncOptimizer, StaleMasterError
from wrapped_optim.optimizers import HybridOffloadOptimizer, PrecisionAwareAdamW

BF16 = torch.bfloat16


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(
        BF16
    )


def _backward(model: torch.nn.Module) -> None:
    model.zero_grad()
    model(torch.ones(4, 8, dtype=BF16)).float().pow(2).mean().backward()


def _refit(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """New policy weights, loaded into the model without the optimizer (an RL refit)."""
    new = {k: (v + 1.0).to(BF16) for k, v in model.state_dict().items()}
    model.load_state_dict(new)
    return copy.deepcopy(new)


def _hybrid(model: torch.nn.Module, host: str, fraction: float) -> HybridOffloadOptimizer:
    keywords = {"exp_avg_dtype": BF16} if host == "precision" else {}
    cls = PrecisionAwareAdamW if host == "precision" else torch.optim.AdamW
    return HybridOffloadOptimizer(
        model.parameters(), offload_fraction=fraction, lr=1e-2, cpu_optimizer_cls=cls,
        gpu_optimizer_cls=cls, **keywords,
    )  # fmt: skip


HOSTS = ["torch", "precision"]


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("host", HOSTS)
def test_raise_catches_a_refit_between_two_later_steps(host: str, fraction: float) -> None:
    model = _model()
    opt = HybridSyncOptimizer(_hybrid(model, host, fraction), on_stale="raise")
    for _ in range(2):  # past the first step's guard
        _backward(model)
        opt.step()
    new = _refit(model)
    _backward(model)
    with pytest.raises(StaleMasterError, match="RL refit"):
        opt.step()
    for name, value in model.state_dict().items():  # nothing was stepped
        assert torch.equal(value, new[name]), name
    with pytest.raises(StaleMasterError):  # still caught: nothing refreshed them
        opt.step()
    opt.reload_model_params()
    opt.step()


@pytest.mark.parametrize("host", HOSTS)
def test_refresh_steps_from_the_new_weights(host: str) -> None:
    """The documented order (docs/hybrid.md): refit, then step; the new weights survive."""
    model = _model()
    opt = HybridSyncOptimizer(_hybrid(model, host, 1.0), on_stale="refresh")
    _backward(model)
    opt.step()
    _backward(model)
    opt.step()
    new = _refit(model)
    _backward(model)
    opt.step()
    for name, value in model.state_dict().items():  # one small step from the new weights
        assert (value.float() - new[name].float()).abs().max() < 0.05, name
    for entry in opt.stale_masters():
        pytest.fail(f"{entry.name} still stale")


def test_steps_without_outside_writes_compare_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The watch costs a version read per weight: no value comparison when nobody wrote."""
    from wrapped_optim._adapters.hybrid import MasterCopies

    model = _model()
    opt = HybridSyncOptimizer(_hybrid(model, "torch", 0.5), on_stale="raise")
    _backward(model)
    opt.step()  # the first step's full guard
    calls = []
    original = MasterCopies.stale_levels
    monkeypatch.setattr(
        MasterCopies, "stale_levels", lambda self: calls.append(self) or original(self)
    )
    for _ in range(3):
        _backward(model)
        opt.step()
    assert calls == []
    with torch.no_grad():
        model[0].weight.add_(0)  # a write that changes nothing: compared, not stale
    _backward(model)
    opt.step()
    assert len(calls) == 1


def test_ignore_steps_the_stale_masters_as_the_bare_optimizer_does() -> None:
    model = _model()
    opt = HybridSyncOptimizer(_hybrid(model, "torch", 1.0), on_stale="ignore")
    _backward(model)
    opt.step()
    _refit(model)
    _backward(model)
    opt.step()  # no error: the caller asked for the bare behaviour
    assert opt.stale_masters() == []  # the stale host copies were copied back


@pytest.mark.parametrize("host", HOSTS)
def test_compat_sync_catches_a_later_refit(host: str) -> None:
    model = _model()
    opt = _hybrid(model, host, 1.0)
    assert sync_hybrid_device_optimizer_fp32_master_copies(opt)
    for _ in range(2):
        _backward(model)
        opt.step()
    new = _refit(model)
    _backward(model)
    with pytest.raises(StaleMasterError, match="sync_hybrid_device_optimizer_fp32_master_copies"):
        opt.step()
    assert all(torch.equal(v, new[k]) for k, v in model.state_dict().items())
    assert sync_hybrid_device_optimizer_fp32_master_copies(opt)  # the documented remedy
    opt.step()
    assert all(
        (v.float() - new[k].float()).abs().max() < 0.05 for k, v in model.state_dict().items()
    )


class _FakeStream:
    def wait_stream(self, *args: object) -> None:
        pass


def test_megatron_hybrid_device_optimizer_refit_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    optimizer_module = pytest.importorskip("megatron.core.optimizer.cpu_offloading")
    # The constructor asks CUDA for its current stream; nothing else on this path needs CUDA.
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: _FakeStream())
    model = _model()
    hdo = optimizer_module.HybridDeviceOptimizer(
        model.parameters(), offload_fraction=0.5, cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=torch.optim.AdamW, param_update_in_fp32=True,
        overlap_cpu_optimizer_d2h_h2d=False, lr=1e-2,
    )  # fmt: skip
    # Core's own step needs CUDA (its CPU copies map only device params): a step that writes
    # nothing stands in for it; the masters, copies and the adapter's levels are Core's.
    monkeypatch.setattr(hdo, "step", lambda closure=None: None)
    opt = HybridSyncOptimizer(hdo, on_stale="raise")
    for _ in range(2):
        opt.step()
    _refit(model)
    with pytest.raises(StaleMasterError, match="4 master copies"):
        opt.step()
    opt.reload_model_params()
    opt.step()
