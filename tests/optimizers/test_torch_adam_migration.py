"""Switching between torch.optim.AdamW/Adam and PrecisionAwareAdamW: checkpoints both ways
(property-tested round trips), the errors that say how to convert, FP8 spelled
torch.float8_e4m3fn, and torch's AdamW defaults."""

from __future__ import annotations

import inspect
import io
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from wrapped_optim.optimizers import (
    PrecisionAwareAdamW,
    TorchAdamFormatError,
    from_torch_adam,
    to_torch_adam,
)


def through_a_file(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint as it comes back from disk (a state dict shares the live state)."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def make_params(sizes: list[int], seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]


def set_grads(params: list[torch.nn.Parameter], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def train(
    opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int, seed: int
) -> None:
    for i in range(steps):
        set_grads(params, seed + i)
        opt.step()


hyper = st.fixed_dictionaries(
    {
        "lr": st.sampled_from([1e-3, 1e-2, 0.1]),
        "betas": st.sampled_from([(0.9, 0.999), (0.8, 0.95)]),
        "eps": st.sampled_from([1e-8, 1e-6]),
        "weight_decay": st.sampled_from([0.0, 0.01, 0.1]),
    }
)
sizes = st.lists(st.integers(1, 40), min_size=1, max_size=4)


@given(sizes=sizes, hyper=hyper, steps=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_a_torch_adamw_checkpoint_continues_in_precision_aware_adamw(
    sizes: list[int], hyper: dict[str, Any], steps: int, seed: int
) -> None:
    """torch AdamW for some steps, its checkpoint into PrecisionAwareAdamW (FP32 moments),
    then both continue: the same state and (up to rounding of the two formulas) the same
    parameters; and back into torch's AdamW, the moments and step are exactly torch's."""
    params = make_params(sizes, seed)
    torch_opt = torch.optim.AdamW(params, **hyper)
    train(torch_opt, params, steps, seed)
    saved = through_a_file(torch_opt.state_dict())
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = PrecisionAwareAdamW(twins, **hyper)
    ours.load_state_dict(saved)
    assert ours.param_groups[0]["step"] == steps
    for p, q in zip(params, twins, strict=True):
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ours.state[q][name], torch_opt.state[p][name])
    # back to torch: exactly what torch saved
    back = to_torch_adam(ours.state_dict())
    for index, entry in saved["state"].items():
        assert set(back["state"][index]) == set(entry)
        for name, value in entry.items():
            assert torch.equal(back["state"][index][name], value)
    train(torch_opt, params, 2, seed + 100)
    train(ours, twins, 2, seed + 100)
    for p, q in zip(params, twins, strict=True):
        torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-5, atol=1e-6)


@given(
    sizes=sizes,
    hyper=hyper,
    steps=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    moments=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_a_precision_aware_checkpoint_continues_in_torch_adamw(
    sizes: list[int], hyper: dict[str, Any], steps: int, seed: int, moments: torch.dtype
) -> None:
    params = make_params(sizes, seed)
    ours = PrecisionAwareAdamW(params, **hyper, exp_avg_dtype=moments, exp_avg_sq_dtype=moments)
    train(ours, params, steps, seed)
    saved = through_a_file(ours.state_dict())
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    torch_opt = torch.optim.AdamW(twins, **hyper)
    torch_opt.load_state_dict(to_torch_adam(saved))
    for i, q in enumerate(twins):
        assert torch_opt.state[q]["step"] == steps
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(torch_opt.state[q][name], saved["state"][i][name])
    # and the round trip back is the checkpoint we started from
    again = from_torch_adam(torch_opt.state_dict())
    assert again["param_groups"][0]["step"] == saved["param_groups"][0]["step"]
    for i, entry in saved["state"].items():
        for name, value in entry.items():
            assert torch.equal(again["state"][i][name], value)
    train(torch_opt, twins, 2, seed + 100)
    train(ours, params, 2, seed + 100)
    if moments == torch.float32:
        for p, q in zip(params, twins, strict=True):
            torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-5, atol=1e-6)


def test_a_torch_adam_checkpoint_needs_l2_mode() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    adam = torch.optim.Adam([p], weight_decay=0.1)
    p.grad = torch.ones(3)
    adam.step()
    saved = adam.state_dict()
    ours = PrecisionAwareAdamW([torch.nn.Parameter(torch.ones(3))])
    before = ours.state_dict()
    with pytest.raises(TorchAdamFormatError, match="construct it with adam_w_mode=False"):
        ours.load_state_dict(saved)
    assert ours.state_dict() == before  # refused: nothing changed
    l2 = PrecisionAwareAdamW([torch.nn.Parameter(torch.ones(3))], adam_w_mode=False)
    l2.load_state_dict(saved)
    assert l2.param_groups[0]["step"] == 1


def test_what_cannot_be_carried_over_is_refused_with_the_way_out() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    ams = torch.optim.AdamW([p], amsgrad=True)
    p.grad = torch.ones(3)
    ams.step()
    with pytest.raises(TorchAdamFormatError, match=r"amsgrad=True.*train with amsgrad=False"):
        from_torch_adam(ams.state_dict())

    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    partial = torch.optim.AdamW([a, b])
    a.grad = torch.ones(2)
    partial.step()
    b.grad = torch.ones(2)
    partial.step()
    with pytest.raises(TorchAdamFormatError, match=r"different numbers of steps \(\[1, 2\]\)"):
        from_torch_adam(partial.state_dict())

    low = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    mastered = PrecisionAwareAdamW([low], master_weights=True)
    low.grad = torch.ones(2, dtype=torch.bfloat16)
    mastered.step()
    with pytest.raises(TorchAdamFormatError, match=r"master_param.*drop_masters=True"):
        to_torch_adam(mastered.state_dict())
    dropped = to_torch_adam(mastered.state_dict(), drop_masters=True)
    assert set(dropped["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}

    no_bc = PrecisionAwareAdamW([torch.nn.Parameter(torch.ones(2))], bias_correction=False)
    with pytest.raises(TorchAdamFormatError, match="bias_correction=False"):
        to_torch_adam(no_bc.state_dict())


def test_float8_e4m3fn_means_fp8_moments() -> None:
    a, b = torch.nn.Parameter(torch.ones(5)), torch.nn.Parameter(torch.ones(5))
    spelled = PrecisionAwareAdamW([a], exp_avg_sq_dtype=torch.float8_e4m3fn)
    marker = PrecisionAwareAdamW([b], exp_avg_sq_dtype=torch.uint8)
    assert spelled.exp_avg_sq_dtype == torch.uint8
    for p, opt in ((a, spelled), (b, marker)):
        p.grad = torch.linspace(-1, 1, 5)
        opt.step()
    assert torch.equal(spelled.state[a]["exp_avg_sq"], marker.state[b]["exp_avg_sq"])
    assert torch.equal(a.detach(), b.detach())
    with pytest.raises(RuntimeError, match=r"FP8 E4M3 \(torch.uint8 or torch.float8_e4m3fn\)"):
        PrecisionAwareAdamW([a], exp_avg_dtype=torch.float8_e5m2)


def test_defaults_are_torch_adamws() -> None:
    ours = inspect.signature(PrecisionAwareAdamW).parameters
    theirs = inspect.signature(torch.optim.AdamW).parameters
    for name in ("lr", "betas", "eps", "weight_decay", "amsgrad"):
        assert ours[name].default == theirs[name].default, name
    # the same update as torch's AdamW with only the class swapped
    p, q = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    mine, torch_opt = PrecisionAwareAdamW([p]), torch.optim.AdamW([q])
    for opt, param in ((mine, p), (torch_opt, q)):
        param.grad = torch.full((4,), 0.5)
        opt.step()
    torch.testing.assert_close(p.detach(), q.detach())


def test_torch_adamws_keywords_are_taken() -> None:
    """Every keyword of torch's AdamW is one of ours: honoured, ignored or refused by value."""
    ours = set(inspect.signature(PrecisionAwareAdamW).parameters)
    theirs = set(inspect.signature(torch.optim.AdamW).parameters)
    assert theirs <= ours, sorted(theirs - ours)


@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16, torch.uint8])
def test_maximize_steps_up_the_gradient(moments: torch.dtype) -> None:
    grad = torch.linspace(-1, 1, 6)
    up, down = torch.nn.Parameter(torch.ones(6)), torch.nn.Parameter(torch.ones(6))
    kw: dict[str, Any] = {"lr": 0.1, "exp_avg_dtype": moments, "exp_avg_sq_dtype": moments}
    maximizing = PrecisionAwareAdamW([up], maximize=True, **kw)
    negated = PrecisionAwareAdamW([down], **kw)
    for _ in range(3):
        up.grad, down.grad = grad.clone(), -grad
        maximizing.step()
        negated.step()
    assert torch.equal(up.grad, grad)  # the caller's gradient is left as it was
    assert torch.equal(up.detach(), down.detach())
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(maximizing.state[up][name], negated.state[down][name])
    if moments == torch.float32:  # the same update as torch's own maximize
        q = torch.nn.Parameter(torch.ones(6))
        torch_opt = torch.optim.AdamW([q], lr=0.1, maximize=True)
        for _ in range(3):
            q.grad = grad.clone()
            torch_opt.step()
        torch.testing.assert_close(up.detach(), q.detach())


def test_foreach_is_taken_and_differentiable_refused_with_the_way_out() -> None:
    results = []
    for foreach in (None, True, False):
        p = torch.nn.Parameter(torch.ones(4))
        opt = PrecisionAwareAdamW([p], foreach=foreach, exp_avg_dtype=torch.bfloat16)
        p.grad = torch.full((4,), 0.5)
        opt.step()
        results.append(p.detach().clone())
    assert all(torch.equal(r, results[0]) for r in results)
    with pytest.raises(RuntimeError, match=r"differentiable=True.*torch.optim.AdamW"):
        PrecisionAwareAdamW([torch.nn.Parameter(torch.ones(2))], differentiable=True)
