"""wrapped_optim._rollback: a snapshot puts back exactly what steps changed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from wrapped_optim._rollback import GroupOptions, OptimizerSnapshot
from wrapped_optim.optimizers import PrecisionAwareAdamW
from wrapped_optim.testing import (
    assert_state_dict_equal,
    checkpoint_roundtrip,
    optimizer_params,
    synthetic_gradients,
)

KINDS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=torch.tensor(0.01)),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "precision-fp8": lambda params: PrecisionAwareAdamW(
        params, lr=0.01, master_weights=True, exp_avg_sq_dtype=torch.uint8
    ),
}


@settings(max_examples=20, deadline=None)
@given(
    kind=st.sampled_from(sorted(KINDS)),
    shapes=st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=2), min_size=1, max_size=3),
    before=st.integers(0, 2),
    after=st.integers(1, 2),
    subset=st.booleans(),
)
# A partial snapshot of an FP8 optimizer whose other param has a scale too (seed 3361071480).
@example(kind="precision-fp8", shapes=[[1], [1]], before=1, after=1, subset=True)
def test_snapshot_restores_exactly(
    kind: str, shapes: list[list[int]], before: int, after: int, subset: bool
) -> None:
    dtype = torch.bfloat16 if kind.startswith("precision") else torch.float32
    params = [torch.nn.Parameter(torch.randn(shape).to(dtype)) for shape in shapes]
    opt = KINDS[kind](params)
    for step in range(before):
        synthetic_gradients(opt, step)
        opt.step()
    synthetic_gradients(opt, before)
    covered: Any = params[:1] if subset else None
    if subset:  # only the first param steps: what a snapshot of it must cover
        for p in params[1:]:
            p.grad = None
    state = checkpoint_roundtrip(opt.state_dict())
    values = [p.detach().clone() for p in optimizer_params(opt)]
    lr = opt.param_groups[0]["lr"]
    snapshot = OptimizerSnapshot.take(opt, covered)
    for _ in range(after):
        opt.step()
    snapshot.restore()
    assert opt.param_groups[0]["lr"] is lr
    assert_state_dict_equal(state, checkpoint_roundtrip(opt.state_dict()))
    for old, new in zip(values, optimizer_params(opt), strict=True):
        assert torch.equal(old, new)


def test_group_options_hands_new_keys_to_the_caller() -> None:
    groups = [{"params": [], "lr": 0.1}]
    saved = GroupOptions.take(groups)
    groups[0].update(lr=0.0, step=5, extra=1)
    seen: list[str] = []
    saved.restore(groups, new_key=lambda group, key: seen.append(key))
    assert groups[0]["lr"] == 0.1 and sorted(seen) == ["extra", "step"]


def _raw_state(opt: PrecisionAwareAdamW, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """``p``'s stored state and scales as they are kept (no expansion to FP32)."""
    raw = {name: value.clone() for name, value in opt.state[p].items()}
    raw.update({f"scale {name}": s.clone() for name, s in opt.scales.get(p, {}).items()})
    return raw


def _assert_raw_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name


def test_partial_snapshot_restores_storage_bytes_and_scales() -> None:
    """A snapshot of some params of an FP8 optimizer whose other params have scales too puts
    back the covered params' stored bytes and per-tensor scales (the scales table holds every
    param, so it must not be passed over as "not keyed by the snapshot's params")."""
    params = [torch.nn.Parameter(torch.randn(3).to(torch.bfloat16)) for _ in range(2)]
    opt = KINDS["precision-fp8"](params)
    synthetic_gradients(opt, 0)
    opt.step()
    synthetic_gradients(opt, 1)
    params[1].grad = None
    before = _raw_state(opt, params[0])
    scale = opt.scales[params[0]]["exp_avg_sq"]
    snapshot = OptimizerSnapshot.take(opt, params[:1])
    opt.step()
    assert not torch.equal(scale, before["scale exp_avg_sq"])  # the step moved the scale
    snapshot.restore()
    _assert_raw_equal(before, _raw_state(opt, params[0]))


def test_atomic_step_with_params_left_out_restores_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    """PrecisionAwareAdamW(atomic_step=True) snapshots only the params with a gradient: a
    step that raises part-way leaves their FP8 bytes and scales as they were."""
    from wrapped_optim.optimizers.precision_adamw import _torch_step

    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(3)]
    opt = PrecisionAwareAdamW(
        params, lr=0.1, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8,
        atomic_step=True, cpu_kernel=False,
    )  # fmt: skip
    opt._pack_small = False  # one sliced update per param, so the fault lands between them
    synthetic_gradients(opt, 0)
    opt.step()
    synthetic_gradients(opt, 1)
    params[2].grad = None  # left out of this step, but its scales stay in the table
    before = [_raw_state(opt, p) for p in params]
    original, calls = _torch_step.update, []

    def failing_update(*args: Any) -> None:
        calls.append(args[3])
        if len(calls) == 2:
            raise RuntimeError("device failure")
        original(*args)

    monkeypatch.setattr(_torch_step, "update", failing_update)
    with pytest.raises(RuntimeError, match="device failure"):
        opt.step()
    assert len(calls) == 2  # the first param was updated before the failure
    for old, p in zip(before, params, strict=True):
        _assert_raw_equal(old, _raw_state(opt, p))
