"""FP32 PrecisionAwareAdamW against ``torch.optim.AdamW(fused=True)`` when a parameter is
frozen for some steps (issue #36, item 5): the difference docs/precision_adam.md states, and
the warning the first time a group steps with some of its params skipped."""

from __future__ import annotations

import warnings

import torch

from wrapped_optim.optimizers import PrecisionAwareAdamW


def _run(frozen_steps: set[int]) -> tuple[list[torch.Tensor], list[torch.Tensor], list[str]]:
    torch.manual_seed(0)
    start = [torch.randn(8), torch.randn(8)]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    ref = [torch.nn.Parameter(t.clone()) for t in start]
    opt = PrecisionAwareAdamW(ours, lr=0.1, weight_decay=0.01)
    torch_opt = torch.optim.AdamW(ref, lr=0.1, weight_decay=0.01, fused=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(5):
            for params in (ours, ref):
                params[0].grad = torch.full((8,), 0.5)
                params[1].grad = None if step in frozen_steps else torch.full((8,), 0.25)
            opt.step()
            torch_opt.step()
    messages = [str(w.message) for w in caught if "counted per group" in str(w.message)]
    return ours, ref, messages


def test_params_stepped_every_time_match_torch_bitwise_without_a_warning() -> None:
    ours, ref, messages = _run(set())
    assert all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True))
    assert messages == []


def test_a_frozen_param_differs_as_documented_and_the_group_warns_once() -> None:
    ours, ref, messages = _run({1, 2})
    assert torch.equal(ours[0], ref[0])  # stepped every time: torch's values
    assert not torch.allclose(ours[1], ref[1])  # skipped twice: the group's bias correction
    assert len(messages) == 1 and "param group 0 steps with 1 of its 2 params" in messages[0]
