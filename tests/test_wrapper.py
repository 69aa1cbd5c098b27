from __future__ import annotations

import copy
import io
import pickle
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
