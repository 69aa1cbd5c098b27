"""wrapped_optim._rollback: a snapshot puts back exactly what steps changed."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
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
