"""The public testing kit itself: each assertion passes on equal state and fails, precisely,
on a planted difference; the strategies draw what they promise."""

from __future__ import annotations

import ast
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wrapped_optim import OptimizerWrapper
from wrapped_optim.testing import (
    StateMismatchError,
    assert_resume_equivalent,
    assert_state_dict_equal,
    assert_transparent,
    checkpoint_roundtrip,
    optimizer_params,
    state_dict_differences,
    synthetic_gradients,
)
from wrapped_optim.testing import strategies as ws


def stepped_adam(steps: int = 2, **options: Any) -> torch.optim.Optimizer:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 2))]
    opt = torch.optim.Adam(
        [{"params": params[:1]}, {"params": params[1:], "lr": 0.5}], lr=0.1, **options
    )
    for step in range(steps):
        synthetic_gradients(opt, step)
        opt.step()
    return opt


def reach(strategy: Any, predicate: Any) -> Any:
    """The first drawn example satisfying ``predicate`` (no shrinking: only reachability)."""
    from hypothesis import Phase, find

    return find(
        strategy,
        predicate,
        settings=settings(phases=[Phase.generate], max_examples=1000, database=None),
    )


def mismatch(a: Any, b: Any, **kwargs: Any) -> StateMismatchError:
    with pytest.raises(StateMismatchError) as info:
        assert_state_dict_equal(a, b, **kwargs)
    return info.value


# ----------------------------------------------------------------------------------------------
# assert_state_dict_equal
# ----------------------------------------------------------------------------------------------
def test_equal_state_dicts_pass_including_roundtrip() -> None:
    opt = stepped_adam()
    assert_state_dict_equal(opt.state_dict(), checkpoint_roundtrip(opt.state_dict()))


def test_one_flipped_bit_names_param_state_and_element() -> None:
    sd = checkpoint_roundtrip(stepped_adam().state_dict())
    other = checkpoint_roundtrip(sd)
    flat = other["state"][1]["exp_avg_sq"].view(-1).view(torch.int32)
    flat[3] ^= 1  # the lowest mantissa bit of element (1, 1)
    error = mismatch(sd, other)
    assert (error.param_index, error.state_name) == (1, "exp_avg_sq")
    message = str(error)
    assert "param 1, state 'exp_avg_sq'" in message
    assert "1 of 4 elements differ bitwise" in message
    assert "index (1, 1)" in message


@pytest.mark.parametrize(
    ("plant", "expected"),
    [
        (
            lambda sd: sd["state"][0].update(exp_avg=sd["state"][0]["exp_avg"].bfloat16()),
            "param 0, state 'exp_avg': dtype torch.float32 != torch.bfloat16",
        ),
        (
            lambda sd: sd["state"][1].update(exp_avg=sd["state"][1]["exp_avg"].reshape(4)),
            "param 1, state 'exp_avg': shape (2, 2) != (4,)",
        ),
        (
            lambda sd: sd["state"][0].update(step=2.0),
            "param 0, state 'step': type Tensor",
        ),
        (
            lambda sd: sd["state"][1].pop("exp_avg_sq"),
            "param 1, state 'exp_avg_sq': present in a, missing in b",
        ),
        (
            lambda sd: sd["state"][0].update(extra=torch.zeros(1)),
            "param 0, state 'extra': missing in a, present in b",
        ),
        (lambda sd: sd["state"].pop(1), "param 1: present in a, missing in b"),
        (
            lambda sd: sd["param_groups"][1].update(lr=0.25),
            "param_groups[1]['lr']: 0.5 != 0.25",
        ),
        (
            lambda sd: sd["param_groups"][0].update(betas=list(sd["param_groups"][0]["betas"])),
            "param_groups[0]['betas']: type tuple != list",
        ),
        (
            lambda sd: sd["param_groups"][0].update(weight_decay=0.0),
            "param_groups[0]['weight_decay']: type int (0) != float (0.0)",
        ),
        (lambda sd: sd["param_groups"].pop(), "param_groups: length 2 != 1"),
        (lambda sd: sd.update(extra_top_level=1), "extra_top_level: missing in a, present in b"),
    ],
)
def test_planted_difference_message(plant: Any, expected: str) -> None:
    sd = checkpoint_roundtrip(stepped_adam().state_dict())
    other = checkpoint_roundtrip(sd)
    plant(other)
    error = mismatch(sd, other)
    assert expected in str(error), str(error)


def test_negative_zero_and_nan_are_compared_bitwise() -> None:
    zero = {"state": {0: {"x": torch.tensor([0.0, 1.0])}}}
    negative_zero = {"state": {0: {"x": torch.tensor([-0.0, 1.0])}}}
    assert "index (0,)" in str(mismatch(zero, negative_zero))
    nan = {"state": {0: {"x": torch.tensor([math.nan]), "f": math.nan}}}
    assert_state_dict_equal(nan, checkpoint_roundtrip(nan))
    assert "(bitwise)" in str(mismatch({"f": 0.0}, {"f": -0.0}))


def test_zero_dim_and_empty_tensors() -> None:
    assert_state_dict_equal({"x": torch.zeros(0, 3)}, {"x": torch.zeros(0, 3)})
    assert "shape (0, 3) != (3, 0)" in str(
        mismatch({"x": torch.zeros(0, 3)}, {"x": torch.zeros(3, 0)})
    )
    assert "(0-d)" in str(mismatch({"x": torch.tensor(1.0)}, {"x": torch.tensor(2.0)}))


def test_devices_differ_unless_ignored() -> None:
    a = {"state": {0: {"exp_avg": torch.zeros(2)}}}
    b = {"state": {0: {"exp_avg": torch.zeros(2, device="meta")}}}
    assert "device cpu != meta" in str(mismatch(a, b))


def test_many_differences_are_summarised_and_named() -> None:
    a = {"state": {i: {"v": torch.zeros(1)} for i in range(12)}}
    b = {"state": {i: {"v": torch.ones(1)} for i in range(12)}}
    error = mismatch(a, b, names=("saved", "loaded"), headline="custom headline")
    assert len(error.differences) == 12
    assert str(error).startswith("custom headline: 12 difference(s)")
    assert "... and 4 more" in str(error)


def test_tensor_versus_non_tensor() -> None:
    error = mismatch({"state": {0: {"step": torch.tensor(1.0)}}}, {"state": {0: {"step": 1}}})
    assert (error.param_index, error.state_name) == (0, "step")


@given(
    st.lists(st.floats(allow_nan=True, width=32), min_size=1, max_size=6),
    st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
    st.data(),
)
def test_any_single_changed_element_is_found(values: list[float], dtype: Any, data: Any) -> None:
    a = torch.tensor(values, dtype=torch.float32).to(dtype)
    b = a.clone()
    index = data.draw(st.integers(0, len(values) - 1))
    bits = b.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[b.element_size()])
    bits[index] ^= 1
    differences = state_dict_differences({"state": {7: {"s": a}}}, {"state": {7: {"s": b}}})
    assert len(differences) == 1
    assert differences[0].param_index == 7 and differences[0].state_name == "s"
    assert f"index ({index},)" in differences[0].detail


# ----------------------------------------------------------------------------------------------
# synthetic gradients and helpers
# ----------------------------------------------------------------------------------------------
def test_synthetic_gradients_are_seeded_typed_and_skip_frozen() -> None:
    fp32_bf16_grads = torch.nn.Parameter(torch.zeros(4))
    fp32_bf16_grads.grad_dtype = torch.bfloat16
    frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    half = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    opt = torch.optim.SGD([fp32_bf16_grads, frozen, half], lr=0.1)
    synthetic_gradients(opt, step=3, seed=1)
    assert fp32_bf16_grads.grad is not None and fp32_bf16_grads.grad.dtype == torch.bfloat16
    assert frozen.grad is None
    assert half.grad is not None and half.grad.dtype == torch.float16
    first = [fp32_bf16_grads.grad.clone(), half.grad.clone()]
    synthetic_gradients(opt, step=3, seed=1)
    assert torch.equal(first[0], fp32_bf16_grads.grad) and torch.equal(first[1], half.grad)
    synthetic_gradients(opt, step=4, seed=1)
    assert not torch.equal(first[0], fp32_bf16_grads.grad)
    synthetic_gradients(opt, step=3, seed=2)
    assert not torch.equal(first[0], fp32_bf16_grads.grad)


def test_optimizer_params_follow_state_dict_order_through_wrappers() -> None:
    opt = stepped_adam()
    wrapped = OptimizerWrapper(OptimizerWrapper(opt))
    assert [id(p) for p in optimizer_params(wrapped)] == [id(p) for p in optimizer_params(opt)]


def test_checkpoint_roundtrip_does_not_alias() -> None:
    sd = stepped_adam().state_dict()
    copy = checkpoint_roundtrip(sd)
    copy["state"][0]["exp_avg"].add_(1)
    assert "param 0, state 'exp_avg'" in str(mismatch(sd, copy))


# ----------------------------------------------------------------------------------------------
# assert_resume_equivalent
# ----------------------------------------------------------------------------------------------
def make_linear(opt_cls: Any = torch.optim.AdamW, wrapper: Any = None) -> Any:
    def make() -> tuple[torch.nn.Module, Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
        opt = opt_cls(model.parameters(), lr=0.05)
        return model, (wrapper(opt) if wrapper else opt)

    return make


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW])
def test_resume_passes_for_torch_optimizers_bare_and_wrapped(opt_cls: Any) -> None:
    assert_resume_equivalent(make_linear(opt_cls), 2, 2)
    assert_resume_equivalent(make_linear(opt_cls, OptimizerWrapper), 0, 2)
    assert_resume_equivalent(make_linear(opt_cls, OptimizerWrapper), 2, 0)


def test_resume_with_a_loss_function() -> None:
    inputs = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))

    def loss_fn(model: torch.nn.Module, step: int) -> torch.Tensor:
        return (model(inputs) ** 2).mean() * (step + 1)

    assert_resume_equivalent(make_linear(), 2, 3, loss_fn=loss_fn)


class LossyCheckpoint(OptimizerWrapper):
    """Planted bug: saves exp_avg of param 1 rounded to bf16 (same dtype, fewer bits)."""

    def _state_dict(self) -> dict[str, Any]:
        sd = checkpoint_roundtrip(self.inner.state_dict())
        if 1 in sd["state"]:
            exp_avg = sd["state"][1]["exp_avg"]
            sd["state"][1]["exp_avg"] = exp_avg.bfloat16().float()
        return sd


class SideEffectOnSave(OptimizerWrapper):
    """Planted bug: taking a state dict resets the last group's learning rate."""

    def _state_dict(self) -> dict[str, Any]:
        sd = self.inner.state_dict()
        self.inner.param_groups[-1]["lr"] = 1e-3
        return sd


def test_resume_fails_on_a_lossy_checkpoint_naming_param_and_state() -> None:
    with pytest.raises(StateMismatchError) as info:
        assert_resume_equivalent(make_linear(torch.optim.Adam, LossyCheckpoint), 2, 2)
    error = info.value
    assert "resumed run differs from the uninterrupted one after 2 + 2 steps" in str(error)
    assert (error.param_index, error.state_name) == (1, "exp_avg")
    assert "(uninterrupted vs resumed)" not in str(error)  # names used in key messages only
    assert any(d.path[0] == "model" for d in error.differences)


def test_resume_fails_when_saving_changes_training() -> None:
    with pytest.raises(StateMismatchError, match="taking a checkpoint changed training") as info:
        assert_resume_equivalent(make_linear(torch.optim.SGD, SideEffectOnSave), 1, 1)
    assert "param_groups[0]['lr']: 0.05 != 0.001" in str(info.value)


def test_resume_rejects_a_nondeterministic_make() -> None:
    def make() -> tuple[torch.nn.Module, Any]:
        model = torch.nn.Linear(2, 2)  # no seed
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    with pytest.raises(StateMismatchError, match="make\\(\\) is not deterministic"):
        assert_resume_equivalent(make, 1, 1)


def test_resume_rejects_negative_steps() -> None:
    with pytest.raises(ValueError, match="steps_before"):
        assert_resume_equivalent(make_linear(), -1, 1)


# ----------------------------------------------------------------------------------------------
# assert_transparent
# ----------------------------------------------------------------------------------------------
class AddsAKey(OptimizerWrapper):
    def _state_dict(self) -> dict[str, Any]:
        sd = self.inner.state_dict()
        # torch's state_dict shares the per-param dicts with the live state: copy first.
        sd["state"][0] = dict(sd["state"][0], wrapper_only=torch.zeros(1))
        return sd


class CastsOnSave(OptimizerWrapper):
    def _state_dict(self) -> dict[str, Any]:
        sd = checkpoint_roundtrip(self.inner.state_dict())
        sd["state"][1]["exp_avg_sq"] = sd["state"][1]["exp_avg_sq"].bfloat16()
        return sd


class ZeroesOnLoad(OptimizerWrapper):
    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)
        self.inner.state[optimizer_params(self)[0]]["exp_avg"].zero_()


def test_transparent_passes_for_plain_wrappers() -> None:
    assert_transparent(OptimizerWrapper(stepped_adam()))
    assert_transparent(OptimizerWrapper(OptimizerWrapper(stepped_adam(amsgrad=True))))
    assert_transparent(OptimizerWrapper(stepped_adam(steps=0)))


@pytest.mark.parametrize(
    ("wrapper", "expected"),
    [
        (AddsAKey, "param 0, state 'wrapper_only': present in wrapped, missing in bare"),
        (CastsOnSave, "param 1, state 'exp_avg_sq': dtype torch.bfloat16 != torch.float32"),
        (ZeroesOnLoad, "loading the bare checkpoint into the stack changed the state"),
    ],
)
def test_transparent_fails_on_planted_bugs(wrapper: Any, expected: str) -> None:
    with pytest.raises(StateMismatchError) as info:
        assert_transparent(wrapper(stepped_adam()))
    assert expected in str(info.value), str(info.value)


def test_transparent_needs_a_stack() -> None:
    with pytest.raises(TypeError, match="needs a wrapped stack"):
        assert_transparent(stepped_adam())


# ----------------------------------------------------------------------------------------------
# strategies
# ----------------------------------------------------------------------------------------------
def test_shape_strategy_reaches_zero_dim_and_empty() -> None:
    assert reach(ws.shapes(), lambda s: s == ()) == ()
    assert 0 in reach(ws.shapes(), lambda s: len(s) >= 2 and 0 in s)


def test_param_set_strategy_reaches_frozen_groups_and_dtypes() -> None:
    dtypes = (torch.float32, torch.bfloat16)
    spec = reach(
        ws.param_sets(dtypes=dtypes, options=ws.group_options("adam")),
        lambda s: (
            len(s.groups) >= 2
            and any(p.frozen for p in s.params)
            and {p.dtype for p in s.params} == set(dtypes)
            and any(opts for _, opts in s.groups)
        ),
    )
    model = spec.build()
    assert [p.dtype for p in model.params] == [p.dtype for p in spec.params]
    assert [not p.requires_grad for p in model.params] == [p.frozen for p in spec.params]


@given(ws.param_sets(dtypes=(torch.float32, torch.float16), grad_dtypes=(torch.bfloat16,)))
def test_param_sets_build_deterministically(spec: ws.ParamSetSpec) -> None:
    a, b = spec.build(), spec.build()
    assert_state_dict_equal(a.state_dict(), b.state_dict())
    assert any(p.requires_grad for p in a.params)
    for param, param_spec in zip(a.params, spec.params, strict=True):
        assert tuple(param.shape) == param_spec.shape
        expected = param_spec.grad_dtype or param_spec.dtype
        assert param.grad_dtype == expected


@settings(max_examples=15)
@given(ws.setups(kinds=ws.TORCH_KINDS, layers=[]))
def test_torch_setups_resume_exactly(setup: ws.Setup) -> None:
    assert_resume_equivalent(setup.make, 2, 1)


@settings(max_examples=10)
@given(ws.setups(kinds=ws.TORCH_KINDS, layers=[]))
def test_torch_setups_are_transparent_under_the_base_wrapper(setup: ws.Setup) -> None:
    _model, opt = setup.make()
    stack = OptimizerWrapper(opt)
    for step in range(2):
        synthetic_gradients(stack, step)
        stack.step()
    assert_transparent(stack)
    # Frozen parameters never get state.
    frozen = [i for i, p in enumerate(optimizer_params(stack)) if not p.requires_grad]
    assert not set(frozen) & set(stack.state_dict()["state"])


def test_optimizer_configs_cover_every_torch_kind() -> None:
    for kind in ws.TORCH_KINDS:
        spec = reach(ws.optimizer_configs(kinds=[kind]), lambda s: True)
        opt = spec.build([torch.nn.Parameter(torch.ones(1))])
        assert type(opt).__name__.lower() == kind


def test_every_kind_and_layer_is_available_and_unknown_kinds_are_named() -> None:
    """The package's own optimizers and layers are never silently missing from the draws."""
    assert set(ws.available_optimizer_kinds()) == {
        *ws.TORCH_KINDS,
        "precision_adamw",
        "hybrid_offload",
    }
    assert ws.LAYER_ORDER == ("fsdp", "hybrid", "staged")
    assert ws.DrawnOptimizer("precision_adamw").cls.__name__ == "PrecisionAwareAdamW"
    with pytest.raises(ValueError, match="unknown optimizer kind 'lamb'"):
        ws.DrawnOptimizer("lamb").build([torch.nn.Parameter(torch.ones(1))])


def test_the_strategies_and_suite_targets_swallow_no_import_error() -> None:
    """No ``except ImportError`` in the kit's strategies or the suites' targets: a broken module
    of the package fails the suite instead of silently dropping what it would have drawn."""
    root = Path(__file__).resolve().parents[2]
    for path in (root / "wrapped_optim/testing/strategies.py", root / "tests/_suite_targets.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ExceptHandler) and node.type is not None:
                caught = ast.unparse(node.type)
                assert "ImportError" not in caught and "ModuleNotFoundError" not in caught, (
                    f"{path.name}:{node.lineno} catches {caught}"
                )


_ALL_SETUPS = ws.setups(kinds=ws.available_optimizer_kinds(), max_groups=2, max_params=2)


@settings(max_examples=10)
@given(_ALL_SETUPS)
def test_every_drawn_setup_builds_steps_and_checkpoints(setup: ws.Setup) -> None:
    """Every optimizer kind and stack the strategies can draw is a valid, working setup."""
    _model, stack = setup.make()
    for step in range(2):
        synthetic_gradients(stack, step)
        stack.step()
    sd = checkpoint_roundtrip(stack.state_dict())
    assert set(sd["state"]) <= set(range(len(optimizer_params(stack))))
    assert len(sd["param_groups"]) == len(setup.params.groups)


def test_strategies_reach_every_available_kind_and_layer() -> None:
    for kind in ws.available_optimizer_kinds():
        reach(ws.setups(kinds=[kind], layers=[]), lambda s, kind=kind: s.optimizer.kind == kind)
    for layer in ws.LAYER_ORDER:
        spec = reach(ws.stack_configs(layers=[layer], require_all=True), lambda s: True)
        assert spec.names == (layer,)
