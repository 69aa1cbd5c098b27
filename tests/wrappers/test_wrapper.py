from __future__ import annotations

import copy
import io
import pickle
import re
from typing import Any

import pytest
import torch

from wrapped_optim import OptimizerWrapper


class Tagged(OptimizerWrapper):
    """A trivial subclass, to see layers and repr."""

    def __init__(self, inner: Any, tag: str = "t") -> None:
        super().__init__(inner)
        self.tag = tag

    def _extra_repr(self) -> str:
        return f"tag={self.tag!r}"


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]


def set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def train(opt: Any, params: list[torch.nn.Parameter], steps: range) -> None:
    for step in steps:
        set_grads(params, step)
        opt.step()
        opt.zero_grad()


def test_is_an_optimizer_without_own_state() -> None:
    params = make_params()
    inner = torch.optim.AdamW(params, lr=0.1)
    opt = OptimizerWrapper(inner)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups
    assert opt.state is inner.state
    assert opt.defaults is inner.defaults
    assert "param_groups" not in vars(opt) and "state" not in vars(opt)


def test_setters_forward() -> None:
    inner = torch.optim.SGD(make_params(), lr=0.1)
    opt = OptimizerWrapper(inner)
    groups = [dict(g) for g in inner.param_groups]
    opt.param_groups = groups
    assert inner.param_groups is groups
    new_state: Any = {}
    opt.state = new_state
    assert inner.state is new_state
    opt.defaults = {"lr": 3.0}
    assert inner.defaults == {"lr": 3.0}


def test_unknown_attributes_forward_and_own_attributes_stay() -> None:
    inner = torch.optim.SGD(make_params(), lr=0.1)
    inner.custom_api = lambda: "megatron-ish"  # type: ignore[attr-defined]
    opt = OptimizerWrapper(inner)
    assert opt.custom_api() == "megatron-ish"
    opt.own = 1
    assert not hasattr(inner, "own")
    with pytest.raises(AttributeError, match="missing_thing"):
        _ = opt.missing_thing


def test_rejects_non_optimizers() -> None:
    with pytest.raises(TypeError, match="None"):
        OptimizerWrapper(None)
    with pytest.raises(TypeError, match="list"):
        OptimizerWrapper([1, 2])


@pytest.mark.parametrize("depth", [1, 3])
def test_training_through_stack_is_bit_identical(depth: int) -> None:
    bare_params, wrapped_params = make_params(), make_params()
    bare = torch.optim.AdamW(bare_params, lr=0.05, weight_decay=0.1)
    wrapped: Any = torch.optim.AdamW(wrapped_params, lr=0.05, weight_decay=0.1)
    for _ in range(depth):
        wrapped = Tagged(wrapped)
    train(bare, bare_params, range(5))
    train(wrapped, wrapped_params, range(5))
    for a, b in zip(bare_params, wrapped_params, strict=True):
        assert torch.equal(a, b)
    bare_sd, wrapped_sd = bare.state_dict(), wrapped.state_dict()
    assert bare_sd["param_groups"] == wrapped_sd["param_groups"]
    for index, entry in bare_sd["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, wrapped_sd["state"][index][name]), (index, name)


def test_checkpoints_cross_wrapped_and_bare() -> None:
    ref_params = make_params()
    ref = torch.optim.Adam(ref_params, lr=0.05)
    train(ref, ref_params, range(6))

    # bare -> wrapped
    params = make_params()
    bare = torch.optim.Adam(params, lr=0.05)
    train(bare, params, range(3))
    wrapped = Tagged(torch.optim.Adam(params, lr=0.05))
    wrapped.load_state_dict(copy.deepcopy(bare.state_dict()))
    train(wrapped, params, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params, strict=True))

    # wrapped -> bare
    params = make_params()
    wrapped = Tagged(torch.optim.Adam(params, lr=0.05))
    train(wrapped, params, range(3))
    bare = torch.optim.Adam(params, lr=0.05)
    bare.load_state_dict(copy.deepcopy(wrapped.state_dict()))
    train(bare, params, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params, strict=True))


def test_closure_and_zero_grad_and_add_param_group() -> None:
    params = make_params()
    opt = OptimizerWrapper(torch.optim.SGD(params[:1], lr=0.1))
    extra = torch.nn.Parameter(torch.ones(2))
    opt.add_param_group({"params": [extra], "lr": 0.5})
    assert len(opt.inner.param_groups) == 2

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (params[0] ** 2).sum() + extra.sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor)
    assert torch.equal(extra.detach(), torch.full((2,), 0.5))
    opt.zero_grad(set_to_none=False)
    assert extra.grad is not None and torch.equal(extra.grad, torch.zeros(2))
    opt.zero_grad()
    assert extra.grad is None


def test_layers_unwrap_find_repr() -> None:
    sgd = torch.optim.SGD(make_params(), lr=0.1)
    middle = Tagged(sgd, "inner")
    outer = OptimizerWrapper(middle)
    assert outer.layers() == [outer, middle, sgd]
    assert outer.unwrap() is sgd
    assert outer.find_layer(Tagged) is middle
    assert outer.find_layer(OptimizerWrapper) is outer
    assert outer.find_layer(torch.optim.Adam) is None
    text = repr(outer)
    assert text.splitlines() == [
        "OptimizerWrapper()",
        "└─ Tagged(tag='inner')",
        "   └─ SGD(param_groups=1)",
    ]


def test_hooks_fire_on_the_wrapper() -> None:
    params = make_params()
    inner = torch.optim.SGD(params, lr=0.1)
    opt = OptimizerWrapper(inner)
    seen: list[tuple[str, Any]] = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(("pre", o)))
    opt.register_step_post_hook(lambda o, a, k: seen.append(("post", o)))
    inner.register_step_pre_hook(lambda o, a, k: seen.append(("inner-pre", o)))
    opt.register_state_dict_pre_hook(lambda o: seen.append(("sd-pre", o)))

    def add_marker(o: Any, sd: dict[str, Any]) -> dict[str, Any]:
        return {**sd, "marker": 1}

    opt.register_state_dict_post_hook(add_marker)
    loaded: list[Any] = []
    opt.register_load_state_dict_pre_hook(
        lambda o, sd: {k: v for k, v in sd.items() if k != "marker"}
    )
    opt.register_load_state_dict_post_hook(lambda o: loaded.append(o))

    set_grads(params, 0)
    opt.step()
    assert seen == [("pre", opt), ("inner-pre", inner), ("post", opt)]
    sd = opt.state_dict()
    assert sd["marker"] == 1 and ("sd-pre", opt) in seen
    opt.load_state_dict(sd)  # the pre-hook strips the marker the bare loader would reject
    assert loaded == [opt]


def test_global_hooks_fire_once_per_torch_step() -> None:
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    params = make_params()
    opt = Tagged(OptimizerWrapper(torch.optim.SGD(params, lr=0.1)))
    calls: list[Any] = []
    handle = register_optimizer_step_pre_hook(lambda o, a, k: calls.append(o))
    try:
        set_grads(params, 0)
        opt.step()
    finally:
        handle.remove()
    assert calls == [opt.unwrap()]


def test_step_pre_hook_may_replace_closure() -> None:
    params = make_params()
    opt = OptimizerWrapper(torch.optim.SGD(params, lr=0.1))

    def replacement() -> torch.Tensor:
        return torch.tensor(7.0)

    opt.register_step_pre_hook(lambda o, a, k: ((replacement,), {}))
    set_grads(params, 0)
    assert opt.step(lambda: torch.tensor(1.0)).item() == 7.0


def test_deepcopy_and_pickle() -> None:
    params = make_params()
    opt = Tagged(OptimizerWrapper(torch.optim.Adam(params, lr=0.1)), "x")
    train(opt, params, range(2))
    torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5)  # patches opt.step

    clone = copy.deepcopy(opt)
    assert isinstance(clone, Tagged) and clone.tag == "x"
    assert clone.unwrap() is not opt.unwrap()
    assert "step" not in vars(clone)  # the scheduler's patch is not copied
    clone_params = clone.param_groups[0]["params"]
    train(clone, clone_params, range(2, 3))  # clone is a working optimizer
    train(opt, params, range(2, 3))
    assert all(torch.equal(a, b) for a, b in zip(params, clone_params, strict=True))

    restored = pickle.loads(pickle.dumps(opt))
    assert repr(restored) == repr(opt)
    assert torch.equal(
        restored.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]
    )
    buffer = io.BytesIO()
    torch.save(opt, buffer)
    buffer.seek(0)
    assert isinstance(torch.load(buffer, weights_only=False), Tagged)


def test_sync_after_load_notifies_every_layer_innermost_first() -> None:
    seen: list[str] = []

    class Noting(OptimizerWrapper):
        def __init__(self, inner: Any, name: str) -> None:
            super().__init__(inner)
            self.name = name

        def _on_state_loaded(self) -> None:
            seen.append(self.name)

    sgd = torch.optim.SGD(make_params(), lr=0.1)
    stack = Noting(OptimizerWrapper(Noting(sgd, "inner")), "outer")
    stack.sync_after_load()
    assert seen == ["inner", "outer"]


def test_a_layer_of_the_package_stacked_twice_by_hand_is_refused() -> None:
    from wrapped_optim import StagedCheckpointOptimizer, find_layer, layers

    sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    staged = StagedCheckpointOptimizer(sgd)
    with pytest.raises(
        ValueError,
        match=r"StagedCheckpointOptimizer is already in this "
        r"optimizer's stack \(StagedCheckpointOptimizer -> SGD\); wrap it once",
    ):
        StagedCheckpointOptimizer(staged)
    with pytest.raises(ValueError, match="already in this optimizer's stack"):
        StagedCheckpointOptimizer(OptimizerWrapper(staged))  # also below another layer
    assert layers(staged) == [staged, sgd]
    assert find_layer(staged, StagedCheckpointOptimizer) is staged
    # the pass-through base may repeat (users' own wrappers too)
    assert layers(OptimizerWrapper(OptimizerWrapper(sgd)))[-1] is sgd


# ----------------------------------------------------------------------------------------
# Behaviour mutation testing found unchecked (docs/contributing/mutation.md)
# ----------------------------------------------------------------------------------------
def test_errors_name_the_wrapper_and_what_it_was_given() -> None:
    class StepOnly:
        def step(self) -> None:
            pass

    with pytest.raises(TypeError, match=r"^Tagged needs an optimizer to wrap, got None$"):
        Tagged(None)
    with pytest.raises(TypeError, match=r"^Tagged wraps optimizers \(objects with step and "):
        Tagged(StepOnly())  # a step is not enough: a checkpoint needs state_dict too
    sgd = torch.optim.SGD(make_params(), lr=0.1)
    from wrapped_optim import StagedCheckpointOptimizer

    hint = (
        "wrap it once. wrapped_optim.wrap(optimizer, config) builds or updates a stack without "
        "doubling a layer, and find_layer(optimizer, StagedCheckpointOptimizer) returns the one "
        "there"
    )
    with pytest.raises(ValueError, match=re.escape(hint) + "$"):
        StagedCheckpointOptimizer(StagedCheckpointOptimizer(sgd))


def test_dunder_lookups_are_never_forwarded() -> None:
    """Protocol lookups (copy's ``__deepcopy__``, pickle's ``__getnewargs_ex__``...) must see
    the wrapper, not the inner optimizer's, or a copy of the stack would be a copy of its leaf."""
    inner = torch.optim.SGD(make_params(), lr=0.1)
    inner.__deepcopy__ = lambda memo: "the leaf's copy"  # type: ignore[method-assign]
    opt = OptimizerWrapper(inner)
    with pytest.raises(AttributeError, match=r"^OptimizerWrapper has no attribute '__deepcopy__'$"):
        _ = opt.__deepcopy__
    assert isinstance(copy.deepcopy(opt), OptimizerWrapper)


def test_step_hooks_get_torchs_arguments_and_may_pass_the_closure_by_keyword() -> None:
    params = make_params()
    opt = OptimizerWrapper(torch.optim.SGD(params, lr=0.1))
    seen: list[tuple[str, Any, Any]] = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(("pre", a, k)))
    opt.register_step_post_hook(lambda o, a, k: seen.append(("post", a, k)))
    set_grads(params, 0)
    opt.step()

    def closure() -> torch.Tensor:
        return torch.tensor(1.0)

    opt.step(closure)
    assert seen == [("pre", (), {}), ("post", (), {}), ("pre", (closure,), {}),
                    ("post", (closure,), {})]  # fmt: skip
    opt.register_step_pre_hook(lambda o, a, k: ((), {"closure": lambda: torch.tensor(5.0)}))
    assert opt.step(closure).item() == 5.0


def test_repr_of_a_foreign_leaf_without_param_groups() -> None:
    class Foreign:
        def step(self) -> None:
            pass

        def state_dict(self) -> dict[str, Any]:
            return {}

    assert repr(Tagged(Foreign(), "f")).splitlines() == [
        "Tagged(tag='f')",
        "└─ Foreign(param_groups=?)",
    ]


def test_grad_scaler_attributes_live_on_the_leaf() -> None:
    inner = torch.optim.SGD(make_params(), lr=0.1)
    opt = Tagged(OptimizerWrapper(inner))
    scale, found = torch.tensor(4.0), torch.tensor(0.0)
    opt.grad_scale, opt.found_inf = scale, found
    assert inner.grad_scale is scale and inner.found_inf is found  # type: ignore[attr-defined]
    assert opt.grad_scale is scale and opt.found_inf is found
    assert "grad_scale" not in vars(opt) and "found_inf" not in vars(opt)
    del opt.grad_scale, opt.found_inf
    assert not hasattr(inner, "grad_scale") and not hasattr(inner, "found_inf")


def test_grad_scaler_steps_a_fused_leaf_through_a_wrapper_like_the_bare_leaf() -> None:
    """GradScaler hands a fused leaf its scale and inf flag through the wrapper: the wrapped
    run matches the bare one bit for bit, including the skipped step of an inf grad."""

    def run(wrapped: bool) -> list[torch.Tensor]:
        params = make_params()
        leaf = torch.optim.AdamW(params, lr=0.1, fused=True)
        opt: Any = Tagged(leaf) if wrapped else leaf
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for step in range(3):
            loss = sum((p * (step + 1)).sum() for p in params)
            scaler.scale(loss).backward()
            if step == 1:
                params[0].grad[0, 0] = float("inf")  # type: ignore[index]
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert not hasattr(leaf, "grad_scale") and not hasattr(leaf, "found_inf")
        return [p.detach().clone() for p in params]

    bare, wrapped = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(bare, wrapped, strict=True))
    assert not torch.equal(bare[0], make_params()[0])  # the finite steps moved the params


def test_a_pickled_wrapper_is_new_to_a_new_scheduler_like_a_pickled_leaf() -> None:
    """An LR scheduler marks the optimizer it patched as stepped; a pickled copy, like a
    pickled torch optimizer, is unstepped for a scheduler built on it."""

    def warnings_of(wrapped: bool) -> list[str]:
        params = make_params()
        opt: Any = torch.optim.SGD(params, lr=0.1)
        opt = OptimizerWrapper(opt) if wrapped else opt
        torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5)
        set_grads(params, 0)
        opt.step()
        restored = pickle.loads(pickle.dumps(opt))
        scheduler = torch.optim.lr_scheduler.LambdaLR(restored, lambda epoch: 0.5)
        with pytest.warns(UserWarning) as caught:
            scheduler.step()
        return [str(w.message)[:40] for w in caught]

    assert warnings_of(True) == warnings_of(False)
    assert warnings_of(True) == ["Detected call of `lr_scheduler.step()` b"]
