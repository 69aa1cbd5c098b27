"""Single-process tests of FSDPAwareOptimizer, init_optimizer_state and the sharded-param adapter.

Parameters with ``Tensor.grad_dtype`` behave on a CPU exactly as Megatron-FSDP's sharded
parameters do (FP32 data, bf16 grads); the multi-process DTensor cases live in
tests/distributed.
"""

from __future__ import annotations

import copy
import functools
import pickle
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.staging.device_shim import DeviceOnCpu
from wrapped_optim._adapters.megatron_fsdp import (
    fsdp_parameter_group_of,
    grad_dtype_of,
    iter_params,
    needs_grad_cast,
    swap_grad,
)
from wrapped_optim.fsdp import (
    FSDPAwareOptimizer,
    _restore_grads,
    _zero_counter,
    init_optimizer_state,
)
from wrapped_optim.wrapper import OptimizerWrapper

LOW = [torch.bfloat16, torch.float16]


def make_params(
    shapes: list[tuple[int, ...]], grad_dtype: torch.dtype | None, seed: int = 0
) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        param = torch.nn.Parameter(torch.randn(shape, generator=generator))
        if grad_dtype is not None:
            param.grad_dtype = grad_dtype
        params.append(param)
    return params


def give_grads(params: list[torch.nn.Parameter], seed: int) -> None:
    """Fresh grad objects in each param's grad dtype, as a backward pass would produce."""
    generator = torch.Generator().manual_seed(seed)
    for param in params:
        grad = torch.randn(param.shape, generator=generator).to(grad_dtype_of(param))
        param.grad = grad


def clone_params(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).clone()


def assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(bits(a), bits(b))


class RecordingSGD(torch.optim.SGD):
    """SGD that records what its step saw (grad dtypes and storage addresses)."""

    def __init__(self, params: Any, **kw: Any) -> None:
        super().__init__(params, **kw)
        self.seen: list[list[tuple[torch.dtype, int]]] = []
        self.hyper: list[tuple[Any, float, float]] = []  # (lr object, lr value, weight decay)
        self.grad_dtypes: list[list[Any]] = []  # each param's grad_dtype during the step
        self.fail_next = False

    def step(self, closure: Any = None) -> Any:
        self.seen.append(
            [
                (p.grad.dtype, p.grad.data_ptr())
                for g in self.param_groups
                for p in g["params"]
                if p.grad is not None
            ]
        )
        self.grad_dtypes.append(
            [p.grad_dtype for g in self.param_groups for p in g["params"] if p.grad is not None]
        )
        group = self.param_groups[0]
        self.hyper.append((group["lr"], float(group["lr"]), float(group["weight_decay"])))
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected failure inside the step")
        return super().step(closure)


# ----------------------------------------------------------------------------------------
# adapter
# ----------------------------------------------------------------------------------------
def test_grad_dtype_of_follows_grad_dtype_then_grad_then_data() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    assert grad_dtype_of(p) == torch.float32
    p.grad_dtype = torch.bfloat16
    assert grad_dtype_of(p) == torch.bfloat16
    p.grad_dtype = None  # "any dtype": the current grad decides
    assert grad_dtype_of(p) == torch.float32
    p.grad = torch.zeros(2, dtype=torch.float16)
    assert grad_dtype_of(p) == torch.float16


def test_needs_grad_cast_walks_wrapper_stacks_and_megatron_containers() -> None:
    plain, low = make_params([(2,)], None) + make_params([(3,)], torch.bfloat16)
    assert not needs_grad_cast(OptimizerWrapper(torch.optim.SGD([plain])))
    chained = SimpleNamespace(
        chained_optimizers=[
            SimpleNamespace(optimizer=torch.optim.SGD([plain])),
            SimpleNamespace(optimizer=torch.optim.SGD([low])),
        ]
    )
    assert needs_grad_cast(chained)
    assert [p is q for p, q in zip(iter_params(chained), [plain, low], strict=True)] == [True] * 2


def test_swap_grad_installs_a_grad_of_another_dtype_and_back() -> None:
    (p,) = make_params([(3,)], torch.bfloat16)
    original = torch.ones(3, dtype=torch.bfloat16)
    p.grad = original
    with pytest.raises(RuntimeError, match="grad_dtype"):
        p.grad = torch.ones(3)  # what the adapter exists to get around
    swap_grad(p, torch.ones(3), torch.float32)
    assert p.grad.dtype == torch.float32
    swap_grad(p, original, torch.bfloat16)
    assert p.grad is original and p.grad_dtype == torch.bfloat16


def test_megatron_fsdp_owner_is_found_from_the_param_and_synced_once() -> None:
    pytest.importorskip("megatron_fsdp.experimental.parameter_group")
    # A structural double of an FsdpParameterGroup, attached the way Megatron-FSDP attaches
    # its real groups (the real ones are exercised in tests/distributed).
    calls: list[str] = []
    owner = SimpleNamespace(sync_model_weight_from_main_weight=lambda: calls.append("sync"))
    a, b, c = make_params([(2,), (2,), (2,)], torch.bfloat16)
    for p in (a, b):
        p._mfsdp_parameter_group = owner
    assert fsdp_parameter_group_of(a) is owner and fsdp_parameter_group_of(c) is None
    refreshed: list[int] = []
    opt = FSDPAwareOptimizer(
        torch.optim.SGD([{"params": [a]}, {"params": [b, c]}], lr=0.1),
        refresh=lambda group: refreshed.append(len(group["params"])),
    )
    give_grads([a, b, c], seed=1)
    opt.step()
    assert calls == ["sync"]  # one FSDP group spanning two optimizer groups: one sync
    assert refreshed == [2]  # only the optimizer group holding a non-FSDP param


def test_every_megatron_fsdp_group_is_synced_once() -> None:
    pytest.importorskip("megatron_fsdp.experimental.parameter_group")
    calls: list[str] = []
    owners = [
        SimpleNamespace(sync_model_weight_from_main_weight=functools.partial(calls.append, name))
        for name in ("first", "second")
    ]
    a, b, c = make_params([(2,), (2,), (2,)], torch.bfloat16)
    for param, owner in ((a, owners[0]), (b, owners[1]), (c, owners[1])):
        param._mfsdp_parameter_group = owner
    opt = FSDPAwareOptimizer(torch.optim.SGD([{"params": [a, b]}, {"params": [c]}], lr=0.1))
    give_grads([a, b, c], seed=2)
    opt.step()
    assert calls == ["first", "second"]  # two FSDP groups: each synced, once


# ----------------------------------------------------------------------------------------
# FSDPAwareOptimizer
# ----------------------------------------------------------------------------------------
def test_unwrapped_adamw_fails_on_low_precision_grads_as_upstream_reports() -> None:
    params = make_params([(4, 3)], torch.bfloat16)
    give_grads(params, seed=0)
    with pytest.raises(RuntimeError, match="expected dtype"):
        torch.optim.AdamW(params, lr=1e-2).step()


@pytest.mark.parametrize("grad_dtype", LOW)
def test_wrapped_adamw_equals_adamw_on_cast_grads_bitwise(grad_dtype: torch.dtype) -> None:
    shapes = [(5, 3), (7,), (2, 2, 2)]
    params = make_params(shapes, grad_dtype)
    reference = clone_params(params)
    opt = FSDPAwareOptimizer(torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1))
    ref_opt = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1)
    for step in range(4):
        give_grads(params, seed=step)
        originals = [p.grad for p in params]
        for p, q in zip(params, reference, strict=True):
            q.grad = p.grad.to(torch.float32)
        opt.step()
        ref_opt.step()
        for p, q, g in zip(params, reference, originals, strict=True):
            assert_bitwise(p.data, q.data)
            assert p.grad is g and p.grad.dtype == grad_dtype and p.grad_dtype == grad_dtype
    for p, q in zip(params, reference, strict=True):
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert_bitwise(opt.state[p][name], ref_opt.state[q][name])


def test_cast_buffers_are_reused_across_steps() -> None:
    params = make_params([(64, 32), (32,)], torch.bfloat16)
    inner = RecordingSGD(params, lr=0.01, momentum=0.9)
    opt = FSDPAwareOptimizer(inner)
    for step in range(5):
        give_grads(params, seed=step)  # new grad objects every step, like backward
        opt.step()
    addresses = [[ptr for _, ptr in seen] for seen in inner.seen]
    assert all(dtype == torch.float32 for seen in inner.seen for dtype, _ in seen)
    assert all(a == addresses[0] for a in addresses), "a step allocated new cast buffers"
    assert opt._cast_buffers.allocations == len(params)
    assert opt.cast_buffer_bytes == sum(p.numel() * 4 for p in params)
    opt.release_cast_buffers()
    assert opt.cast_buffer_bytes == 0


class _MarkedGrad(torch.Tensor):
    """A tensor subclass standing for a grad of another tensor type."""


class _SeenLayouts(torch.optim.SGD):
    """SGD that records the type, dtype, shape and device of the grad its step sees."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.1)
        self.seen: list[tuple[type, torch.dtype, tuple[int, ...], str]] = []

    def step(self, closure: Any = None) -> Any:
        grad = self.param_groups[0]["params"][0].grad
        self.seen.append((type(grad), grad.dtype, tuple(grad.shape), grad.device.type))
        return super().step(closure)


def test_a_cast_buffer_is_replaced_when_the_grads_type_or_the_params_layout_changes() -> None:
    param = torch.nn.Parameter(torch.ones(4))
    param.grad_dtype = torch.bfloat16
    inner = _SeenLayouts([param])
    opt = FSDPAwareOptimizer(inner)
    mode = DeviceOnCpu(torch.device("cuda", 0))  # the CPU stand-in for device memory
    allocations = []
    changes: list[tuple[torch.Tensor | None, torch.Tensor]] = [
        (None, torch.ones(4)),
        (None, torch.ones(4)),  # the same layout: the buffer is reused
        (torch.ones(4, dtype=torch.float64), torch.ones(4)),  # the model cast to float64
        (None, torch.ones(4).as_subclass(_MarkedGrad)),
        (torch.ones(2, 3, dtype=torch.float64), torch.ones(2, 3)),  # resized
        (torch.ones(2, 3, dtype=torch.float64), torch.ones(2, 3)),  # moved to the device
    ]
    for step, (data, grad) in enumerate(changes):
        param.grad = None  # as zero_grad() leaves it between steps
        if data is not None:
            param.data = data
        grad = grad.to(torch.bfloat16)
        if step == len(changes) - 1:
            mode.put_on_device(param)
            mode.put_on_device(grad)
        with mode:
            param.grad = grad
            opt.step()
        allocations.append(opt._cast_buffers.allocations)
    assert allocations == [1, 1, 2, 3, 4, 5]
    assert inner.seen == [
        (torch.Tensor, torch.float32, (4,), "cpu"),
        (torch.Tensor, torch.float32, (4,), "cpu"),
        (torch.Tensor, torch.float64, (4,), "cpu"),
        (_MarkedGrad, torch.float64, (4,), "cpu"),
        (torch.Tensor, torch.float64, (2, 3), "cpu"),
        (torch.Tensor, torch.float64, (2, 3), "cuda"),
    ]


def test_a_raising_step_puts_original_grads_back_and_does_not_refresh() -> None:
    params = make_params([(3, 2), (4,)], torch.bfloat16)
    inner = RecordingSGD(params, lr=0.1)
    refreshed: list[Any] = []
    opt = FSDPAwareOptimizer(inner, refresh=refreshed.append)
    give_grads(params, seed=0)
    originals = [p.grad for p in params]
    before = [bits(p) for p in params]
    inner.fail_next = True
    with pytest.raises(RuntimeError, match="injected failure"):
        opt.step()
    assert inner.seen[-1][0][0] == torch.float32  # the step did see cast grads
    for p, g, b in zip(params, originals, before, strict=True):
        assert p.grad is g and p.grad_dtype == torch.bfloat16
        assert torch.equal(bits(p), b)
    assert refreshed == []
    opt.step()  # and the next step works normally
    assert len(refreshed) == 1 and refreshed[0] is inner.param_groups[0]


def test_refresh_is_called_once_per_param_group_after_each_step() -> None:
    a, b, c = make_params([(2,), (2,), (2,)], torch.bfloat16)
    calls: list[int] = []
    opt = FSDPAwareOptimizer(
        torch.optim.SGD([{"params": [a, b]}, {"params": [c]}], lr=0.1),
        refresh=lambda group: calls.append(len(group["params"])),
    )
    for step in range(3):
        give_grads([a, b, c], seed=step)
        opt.step()
    assert calls == [2, 1] * 3


def test_precision_aware_passes_low_precision_grads_through() -> None:
    params = make_params([(3,)], torch.bfloat16)
    inner = RecordingSGD(params, lr=0.1)
    opt = FSDPAwareOptimizer(inner, precision_aware=True)
    give_grads(params, seed=0)
    grad = params[0].grad
    # SGD itself accepts the mixed dtypes; a precision-aware optimizer would too.
    opt.step()
    assert inner.seen == [[(torch.bfloat16, grad.data_ptr())]]
    assert opt.cast_buffer_bytes == 0


def test_closure_grads_are_cast_after_the_closure_runs() -> None:
    # Lightning's automatic optimization always steps with a closure (forward, backward,
    # clipping): the inner optimizer must see the closure's grads cast, the closure the
    # originals, and the caller the original grad objects afterwards.
    params = make_params([(3,)], None) + make_params([(2, 2)], torch.bfloat16, seed=1)
    reference = clone_params(params)
    inner = RecordingSGD(params, lr=0.1)
    opt = FSDPAwareOptimizer(inner)
    give_grads(params, seed=0)  # stale grads the closure replaces
    seen_in_closure: list[list[torch.dtype]] = []
    produced: list[torch.Tensor | None] = []

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = sum((p * (i + 2)).square().sum() for i, p in enumerate(params))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        seen_in_closure.append([p.grad.dtype for p in params])
        produced[:] = [p.grad for p in params]
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.grad_fn is not None
    assert seen_in_closure == [[torch.float32, torch.bfloat16]]
    assert [dtype for dtype, _ in inner.seen[0]] == [torch.float32, torch.float32]
    assert all(p.grad is g for p, g in zip(params, produced, strict=True))
    assert params[1].grad.dtype == torch.bfloat16 and params[1].grad_dtype == torch.bfloat16
    # The same update as casting the clipped grads by hand.
    for ref, grad in zip(reference, produced, strict=True):
        ref.grad = grad.float()
    torch.optim.SGD(reference, lr=0.1).step()
    assert all(torch.equal(p, r) for p, r in zip(params, reference, strict=True))


def test_closure_evaluated_several_times_is_cast_each_time() -> None:
    # LBFGS evaluates its closure many times inside one step: every evaluation's grads must
    # reach it cast, exactly as bf16-rounded grads on plain FP32 parameters would.
    params = make_params([(4,), (3, 2)], torch.bfloat16, seed=3)
    reference = clone_params(params)
    targets = [torch.full_like(p, 0.5) for p in params]

    def make_closure(
        opt: torch.optim.Optimizer, ps: list[torch.nn.Parameter], round_grads: bool
    ) -> Any:
        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = sum(((p - t) ** 4).sum() for p, t in zip(ps, targets, strict=True))
            loss.backward()
            if round_grads:
                for p in ps:
                    p.grad = p.grad.to(torch.bfloat16).float()
            return loss

        return closure

    opt = FSDPAwareOptimizer(torch.optim.LBFGS(params, lr=0.5, max_iter=5))
    ref_opt = torch.optim.LBFGS(reference, lr=0.5, max_iter=5)
    for _ in range(2):
        opt.step(make_closure(opt, params, round_grads=False))
        ref_opt.step(make_closure(ref_opt, reference, round_grads=True))
    assert all(p.grad.dtype == torch.bfloat16 for p in params)
    assert all(torch.equal(p, r) for p, r in zip(params, reference, strict=True))


def test_closure_that_raises_leaves_the_original_grads() -> None:
    params = make_params([(2, 2)], torch.bfloat16)
    opt = FSDPAwareOptimizer(torch.optim.SGD(params, lr=0.1))
    give_grads(params, seed=0)
    grads = [p.grad for p in params]
    before = [bits(p) for p in params]

    def closure() -> torch.Tensor:
        assert all(p.grad is g for p, g in zip(params, grads, strict=True))
        raise RuntimeError("closure failed")

    with pytest.raises(RuntimeError, match="closure failed"):
        opt.step(closure)
    assert all(p.grad is g for p, g in zip(params, grads, strict=True))
    assert all(p.grad_dtype == torch.bfloat16 for p in params)
    assert all(torch.equal(bits(p), b) for p, b in zip(params, before, strict=True))


def test_closure_passes_through_when_nothing_needs_a_cast() -> None:
    (p,) = make_params([(3,)], None)
    opt = FSDPAwareOptimizer(torch.optim.SGD([p], lr=0.5))

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (p * 2).sum()
        loss.backward()
        return loss

    before = p.detach().clone()
    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor)
    assert torch.equal(p.data, before - 1.0)


def test_wrapper_is_a_transparent_no_op_without_mixed_grads() -> None:
    params = make_params([(4, 4), (4,)], None)
    reference = clone_params(params)
    opt = FSDPAwareOptimizer(torch.optim.AdamW(params, lr=1e-2))
    ref_opt = torch.optim.AdamW(reference, lr=1e-2)
    for step in range(3):
        give_grads(params, seed=step)
        give_grads(reference, seed=step)
        grads = [p.grad for p in params]
        opt.step()
        ref_opt.step()
        assert all(p.grad is g for p, g in zip(params, grads, strict=True))
    for p, q in zip(params, reference, strict=True):
        assert_bitwise(p.data, q.data)
        assert_bitwise(opt.state[p]["exp_avg"], ref_opt.state[q]["exp_avg"])
    assert opt.cast_buffer_bytes == 0


def test_constructor_validates_refresh_and_repr_shows_options() -> None:
    sgd = torch.optim.SGD(make_params([(1,)], None), lr=0.1)
    with pytest.raises(TypeError, match=r"refresh must be a callable .*, got int"):
        FSDPAwareOptimizer(sgd, refresh=3)  # type: ignore[arg-type]
    assert "precision_aware=True" in repr(FSDPAwareOptimizer(sgd, precision_aware=True))


class _Chained:
    """Shaped like Megatron's ChainedOptimizer: its children and the two calls a wrapper needs."""

    def __init__(self, *children: Any) -> None:
        self.chained_optimizers = list(children)

    def step(self) -> None:
        pass

    def state_dict(self) -> list[Any]:
        return []


def test_refresh_skips_a_stub_rank_and_refreshes_the_later_leaves() -> None:
    sgd = torch.optim.SGD(make_params([(2,)], None), lr=0.1)
    stub = SimpleNamespace(optimizer=None, is_stub_optimizer=True)  # a Megatron stub rank
    seen: list[dict[str, Any]] = []
    opt = FSDPAwareOptimizer(_Chained(stub, sgd), refresh=seen.append)
    opt.refresh_compute_weights()
    assert seen == [sgd.param_groups[0]]


def _refresh_nothing(group: dict[str, Any]) -> None:
    pass


def test_repr_names_the_refresh_function_or_shows_the_callable() -> None:
    sgd = torch.optim.SGD(make_params([(1,)], None), lr=0.1)
    named = repr(FSDPAwareOptimizer(sgd, refresh=_refresh_nothing))
    assert "refresh=_refresh_nothing" in named
    partial = functools.partial(_refresh_nothing)
    assert f"refresh={partial!r}" in repr(FSDPAwareOptimizer(sgd, refresh=partial))


def test_pickling_drops_the_cast_buffers() -> None:
    params = make_params([(8,)], torch.bfloat16)
    opt = FSDPAwareOptimizer(torch.optim.SGD(params, lr=0.1))
    give_grads(params, seed=0)
    opt.step()
    assert opt.cast_buffer_bytes > 0
    clone = pickle.loads(pickle.dumps(opt))
    assert clone.cast_buffer_bytes == 0 and clone.precision_aware is False


@given(
    shapes=st.lists(
        st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple), min_size=1, max_size=3
    ),
    grad_dtype=st.sampled_from([*LOW, torch.float32]),
    steps=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_state_dict_round_trip_continues_bitwise(
    shapes: list[tuple[int, ...]], grad_dtype: torch.dtype, steps: int, seed: int
) -> None:
    """Save after some steps, load into a fresh wrapped optimizer, continue: identical."""
    params = make_params(shapes, grad_dtype, seed=seed)
    opt = FSDPAwareOptimizer(torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01))
    for step in range(steps):
        give_grads(params, seed=seed + step)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p in resumed:
        p.grad_dtype = grad_dtype
    opt2 = FSDPAwareOptimizer(torch.optim.AdamW(resumed, lr=1e-2, weight_decay=0.01))
    assert init_optimizer_state(opt2)
    opt2.load_state_dict(saved)
    for step in range(steps, steps + 2):
        give_grads(params, seed=seed + step)
        give_grads(resumed, seed=seed + step)
        opt.step()
        opt2.step()
    for p, q in zip(params, resumed, strict=True):
        assert_bitwise(p.data, q.data)
    for key, state in opt.state_dict()["state"].items():
        for name, value in state.items():
            assert_bitwise(value, opt2.state_dict()["state"][key][name])


# ----------------------------------------------------------------------------------------
# init_optimizer_state
# ----------------------------------------------------------------------------------------
def test_torch_dcp_initialiser_rejects_the_grad_as_upstream_reports() -> None:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = torch.nn.Linear(3, 2)
    for p in model.parameters():
        p.grad_dtype = torch.bfloat16
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(RuntimeError, match="grad_dtype"):
        get_optimizer_state_dict(model, opt)
    fixed = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert init_optimizer_state(FSDPAwareOptimizer(fixed))
    state = get_optimizer_state_dict(model, FSDPAwareOptimizer(fixed))["state"]
    assert set(state) == {"weight", "bias"} and state["weight"]["step"].item() == 0


@pytest.mark.parametrize("tensor_lr", [False, True])
def test_init_creates_state_and_leaves_everything_else_untouched(tensor_lr: bool) -> None:
    params = make_params([(4, 3), (3,)], torch.bfloat16)
    special = torch.tensor([-0.0, float("nan"), float("inf")])
    with torch.no_grad():
        params[1].copy_(special)
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    lr: Any = torch.tensor(0.01) if tensor_lr else 0.01
    opt = torch.optim.AdamW(
        [{"params": params}, {"params": [frozen]}], lr=lr, weight_decay=0.5, foreach=False
    )
    lr_value = float(lr)
    existing = torch.full((3,), 2.0, dtype=torch.bfloat16)
    params[1].grad = existing
    before = [bits(p) for p in params]
    groups_before = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]

    assert init_optimizer_state(opt) is True

    assert [torch.equal(bits(p), b) for p, b in zip(params, before, strict=True)] == [True] * 2
    assert params[0].grad is None and params[1].grad is existing
    assert all(p.grad_dtype == torch.bfloat16 for p in params)
    for p in params:
        assert opt.state[p]["step"].item() == 0
        assert not opt.state[p]["exp_avg"].any()
    assert frozen not in opt.state
    for group, snapshot in zip(opt.param_groups, groups_before, strict=True):
        assert group.keys() - {"params"} == snapshot.keys()
        assert group["lr"] is snapshot["lr"]  # a tensor lr stays the same object
        assert float(group["lr"]) == lr_value and group["weight_decay"] == 0.5


def test_init_then_training_equals_an_untouched_optimizer() -> None:
    params = make_params([(3, 3), (5,)], torch.bfloat16)
    untouched = clone_params(params)
    for p in untouched:
        p.grad_dtype = torch.bfloat16
    opt = FSDPAwareOptimizer(torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1))
    ref = FSDPAwareOptimizer(torch.optim.AdamW(untouched, lr=1e-2, weight_decay=0.1))
    assert init_optimizer_state(opt)
    for step in range(3):
        give_grads(params, seed=step)
        give_grads(untouched, seed=step)
        opt.step()
        ref.step()
    for p, q in zip(params, untouched, strict=True):
        assert_bitwise(p.data, q.data)
        assert_bitwise(opt.state[p]["step"], ref.state[q]["step"])


def test_init_is_a_no_op_when_state_exists() -> None:
    params = make_params([(3,)], torch.bfloat16)
    opt = FSDPAwareOptimizer(torch.optim.AdamW(params, lr=1e-2))
    give_grads(params, seed=0)
    opt.step()
    snapshot = copy.deepcopy(opt.state_dict())
    grad = params[0].grad
    assert init_optimizer_state(opt) is False
    assert params[0].grad is grad
    assert opt.state[params[0]]["step"].item() == 1
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], snapshot["state"][0]["exp_avg"])


class GroupStepAdam(torch.optim.Optimizer):
    """Keeps its step counter in the parameter group, as TE's FusedAdam does."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            for p in group["params"]:
                state = self.state[p]
                state.setdefault("m", torch.zeros_like(p))
                state["m"].mul_(0.9).add_(p.grad)
                p.add_(state["m"], alpha=-group["lr"])


def test_init_skips_stub_and_initialised_leaves_and_covers_frozen_params_in_containers() -> None:
    ready, fresh, frozen, leftover = make_params([(2,), (2,), (2,), (2,)], None)
    frozen.requires_grad_(False)
    initialised = torch.optim.Adam([ready])
    initialised.state[ready]["exp_avg"] = torch.ones(2)  # e.g. loaded: left as it is
    held = torch.optim.Adam([fresh, frozen])  # in a Megatron container: every param
    stub = torch.optim.Adam([leftover])  # a stub rank's optimizer is never stepped
    chained = SimpleNamespace(
        chained_optimizers=[
            initialised,
            SimpleNamespace(optimizer=stub, is_stub_optimizer=True),
            SimpleNamespace(optimizer=held),
        ]
    )
    assert init_optimizer_state(chained) is True
    assert set(initialised.state[ready]) == {"exp_avg"}
    assert set(held.state) == {fresh, frozen}
    assert not stub.state


@pytest.mark.parametrize("precision_aware", [False, True])
def test_a_step_passes_the_closure_through(precision_aware: bool) -> None:
    params = make_params([(2,)], None)
    give_grads(params, seed=0)
    opt = FSDPAwareOptimizer(torch.optim.SGD(params, lr=0.1), precision_aware=precision_aware)
    assert opt.step(lambda: 7.0) == 7.0


def test_init_through_stacks_and_containers_restores_group_counters() -> None:
    a, b = make_params([(2,), (3,)], torch.bfloat16)
    first = GroupStepAdam([a])
    second = torch.optim.SGD([b], lr=0.1, momentum=0.9)
    chained = SimpleNamespace(
        chained_optimizers=[SimpleNamespace(optimizer=first), SimpleNamespace(optimizer=second)]
    )
    stack = OptimizerWrapper(FSDPAwareOptimizer(torch.optim.SGD(make_params([(2,)], None))))
    assert init_optimizer_state(chained) is True
    # a group counter stays, at 0: the next step is step 1, as on an untouched optimizer
    assert first.param_groups[0]["step"] == 0
    assert set(first.state[a]) == {"m"} and set(second.state[b]) == {"momentum_buffer"}
    assert init_optimizer_state(stack) is False  # plain SGD without momentum has no state


def test_init_failure_drops_new_state_and_restores_everything() -> None:
    params = make_params([(3,)], torch.bfloat16)
    lr = torch.tensor(0.5)
    inner = RecordingSGD(params, lr=lr, momentum=0.9)
    inner.fail_next = True
    before = bits(params[0])
    with pytest.raises(RuntimeError, match="injected failure"):
        init_optimizer_state(FSDPAwareOptimizer(inner))
    assert not inner.state and params[0].grad is None
    assert inner.param_groups[0]["lr"] is lr and lr.item() == 0.5
    assert torch.equal(bits(params[0]), before)
    assert inner.seen == [[(torch.float32, inner.seen[0][0][1])]]  # the step saw cast grads


def test_init_respects_a_precision_aware_stack() -> None:
    params = make_params([(3,)], torch.bfloat16)
    inner = RecordingSGD(params, lr=0.1, momentum=0.9)
    assert init_optimizer_state(FSDPAwareOptimizer(inner, precision_aware=True))
    assert inner.seen[0][0][0] == torch.bfloat16
    # The zero grads keep the param's own grad_dtype, which an inner step may read.
    assert inner.grad_dtypes == [[torch.bfloat16]]


def test_a_step_sees_grad_dtype_of_the_cast_grads_and_gets_the_original_back() -> None:
    params = make_params([(3,), (2, 2)], torch.bfloat16)
    inner = RecordingSGD(params, lr=0.1)
    opt = FSDPAwareOptimizer(inner)
    give_grads(params, seed=1)
    opt.step()
    assert inner.grad_dtypes == [[torch.float32, torch.float32]]
    assert [p.grad_dtype for p in params] == [torch.bfloat16, torch.bfloat16]


def test_putting_grads_back_restores_every_param_and_raises_the_first_failure() -> None:
    params = make_params([(2,), (3,), (4,)], None)
    grads = [torch.ones(2), torch.zeros(5), torch.ones(4)]  # the second cannot go back
    swapped: list[Any] = [(p, g, None) for p, g in zip(params, grads, strict=True)]
    swapped.insert(0, (params[0], torch.zeros(7), None))  # put back last: fails too
    with pytest.raises(RuntimeError) as error:
        _restore_grads(swapped)
    assert "[5]" in str(error.value)  # the first failure, in restore order (last to first)
    assert swapped == []
    assert params[2].grad is grads[2]


@pytest.mark.parametrize("value", [True, None, "3"])
def test_a_step_counter_that_is_no_number_is_left_alone(value: Any) -> None:
    state = {"step": value}
    _zero_counter(state, "step")
    assert state["step"] is value


@pytest.mark.parametrize("value", [7, 2.5, torch.tensor(4.0)])
def test_a_numeric_step_counter_is_zeroed_keeping_its_type(value: Any) -> None:
    state = {"step": value}
    _zero_counter(state, "step")
    assert type(state["step"]) is type(value) and state["step"] == 0


class FailingGroupStepAdam(GroupStepAdam):
    """Creates its group counter, then fails: the counter must not survive the failure."""

    def step(self, closure: Any = None) -> None:
        super().step(closure)
        raise RuntimeError("injected failure after the group counter was created")


def test_init_failure_restores_param_groups_exactly() -> None:
    params = make_params([(3,)], None)
    opt = FailingGroupStepAdam(params, lr=0.1)
    groups_before = copy.deepcopy(
        [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    )
    with pytest.raises(RuntimeError, match="injected failure"):
        init_optimizer_state(opt)
    assert [
        {k: v for k, v in g.items() if k != "params"} for g in opt.param_groups
    ] == groups_before
    assert "step" not in opt.param_groups[0] and not opt.state


SGD_MOMENTUM = [
    pytest.param({"dampening": 0.1}, id="dampening"),
    pytest.param({"dampening": 0.5, "foreach": True}, id="dampening-foreach"),
    pytest.param({"dampening": 0.1, "fused": True}, id="dampening-fused"),
    pytest.param({"nesterov": True, "weight_decay": 0.1}, id="nesterov"),
    pytest.param({"dampening": 0.1, "maximize": True}, id="dampening-maximize"),
]


def sgd(params: list[torch.nn.Parameter], options: dict[str, Any]) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, **options)


def train_some(opt: Any, params: list[torch.nn.Parameter], steps: range) -> None:
    fused = any(group.get("fused") for group in opt.param_groups)
    for step in steps:
        give_grads(params, seed=step)
        if step == 0 and not fused:  # torch's fused SGD fails on a late first grad itself
            params[-1].grad = None  # a param without a grad on the first step
        opt.step()


@pytest.mark.parametrize("options", SGD_MOMENTUM)
def test_init_then_sgd_momentum_trains_like_an_untouched_optimizer(options: dict[str, Any]) -> None:
    params = make_params([(3, 2), (4,), (2,)], None)
    untouched = clone_params(params)
    opt, ref = sgd(params, options), sgd(untouched, options)
    assert init_optimizer_state(opt)
    # the zero buffers are there for a checkpoint load to fill ...
    assert all(not opt.state[p]["momentum_buffer"].any() for p in params)
    train_some(opt, params, range(3))
    train_some(ref, untouched, range(3))
    # ... but the first real step adopts the grads, as on an untouched optimizer
    for p, q in zip(params, untouched, strict=True):
        assert_bitwise(p.data, q.data)
        assert_bitwise(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])


def test_init_then_sgd_without_a_grad_keeps_no_buffer_like_an_untouched_optimizer() -> None:
    params = make_params([(2,), (3,)], None)
    opt = sgd(params, {"dampening": 0.1})
    assert init_optimizer_state(opt)
    params[0].grad = torch.ones(2)
    opt.step()
    assert set(opt.state) == {params[0]}  # params[1] had no grad: no state, as in torch
    assert torch.equal(opt.state[params[0]]["momentum_buffer"], torch.ones(2))


@pytest.mark.parametrize("in_place", [False, True], ids=["load_state_dict", "written_in_place"])
def test_init_then_load_keeps_loaded_sgd_momentum(in_place: bool) -> None:
    params = make_params([(3,), (2, 2)], None)
    saved = clone_params(params)
    ref = sgd(saved, {"dampening": 0.1})
    train_some(ref, saved, range(2))
    checkpoint = copy.deepcopy(ref.state_dict())
    with torch.no_grad():
        for p, q in zip(params, saved, strict=True):
            p.copy_(q)
    opt = sgd(params, {"dampening": 0.1})
    assert init_optimizer_state(opt)
    if in_place:  # as a DCP load does: the same tensors, filled
        for index, p in enumerate(params):
            opt.state[p]["momentum_buffer"].copy_(checkpoint["state"][index]["momentum_buffer"])
    else:  # new tensors (the zero placeholders are still referenced from elsewhere)
        placeholders = [opt.state[p]["momentum_buffer"] for p in params]
        opt.load_state_dict(checkpoint)
        loaded = [opt.state[p]["momentum_buffer"] for p in params]
        assert all(a is not b for a, b in zip(loaded, placeholders, strict=True))
    train_some(opt, params, range(2, 4))
    train_some(ref, saved, range(2, 4))
    for p, q in zip(params, saved, strict=True):
        assert_bitwise(p.data, q.data)
        assert_bitwise(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])


def test_the_first_step_drops_only_the_placeholders_nothing_loaded() -> None:
    params = make_params([(3,), (2,), (4,), (2,)], None)
    opt = sgd(params, {"dampening": 0.1})
    assert init_optimizer_state(opt)
    placeholders = [opt.state[p]["momentum_buffer"] for p in params]  # kept alive
    loaded = torch.full((3,), 0.5)
    opt.state[params[0]]["momentum_buffer"] = loaded  # replaced
    del opt.state[params[1]]  # dropped by a load
    placeholders[2].fill_(0.25)  # written in place
    give_grads(params, seed=1)  # params[3]: untouched
    grads = [p.grad.clone() for p in params]
    opt.step()
    buffers = [opt.state[p]["momentum_buffer"] for p in params]
    assert buffers[0] is loaded
    assert torch.equal(loaded, torch.full((3,), 0.5).mul_(0.9).add_(grads[0], alpha=0.9))
    assert torch.equal(buffers[2], torch.full((4,), 0.25).mul_(0.9).add_(grads[2], alpha=0.9))
    for index in (1, 3):  # created from the grad, as on an untouched optimizer
        assert buffers[index] is not placeholders[index]
        assert torch.equal(buffers[index], grads[index])


def test_a_copy_made_before_the_first_step_treats_the_placeholders_as_real() -> None:
    # Documented limit: torch does not copy an optimizer's hooks, so the marking is lost.
    param = torch.nn.Parameter(torch.ones(1))
    opt = sgd([param], {"dampening": 0.5})
    assert init_optimizer_state(opt)
    copied = copy.deepcopy(opt)
    copied_param = copied.param_groups[0]["params"][0]
    param.grad, copied_param.grad = torch.ones(1), torch.ones(1)
    opt.step()
    copied.step()
    assert opt.state[param]["momentum_buffer"].item() == 1.0  # buf = grad
    assert copied.state[copied_param]["momentum_buffer"].item() == 0.5  # 0.9*0 + 0.5*grad


def test_init_then_dcp_load_continues_sgd_with_dampening_bitwise(tmp_path: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.3)

    def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            x = torch.randn(5, 3, generator=torch.Generator().manual_seed(step))
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    model, opt = build()
    train(model, opt, range(2))
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(
            {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)},
            checkpoint_id=str(tmp_path),
        )
    resumed_model, resumed = build()
    assert init_optimizer_state(resumed)
    state = {
        "model": resumed_model.state_dict(),
        "optim": get_optimizer_state_dict(resumed_model, resumed),
    }
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(state, checkpoint_id=str(tmp_path))
    set_optimizer_state_dict(resumed_model, resumed, state["optim"])
    train(model, opt, range(2, 4))
    train(resumed_model, resumed, range(2, 4))
    for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert_bitwise(p.data, q.data)
        assert_bitwise(opt.state[p]["momentum_buffer"], resumed.state[q]["momentum_buffer"])


# ----------------------------------------------------------------------------------------
# with PrecisionAwareAdamW (TE FusedAdam's precision-aware state, portable)
# ----------------------------------------------------------------------------------------
PA_CONFIGS = [
    # (param dtype, grad dtype, optimizer options)
    (torch.float32, torch.bfloat16, {"exp_avg_dtype": torch.bfloat16}),
    (torch.float32, torch.bfloat16, {"exp_avg_sq_dtype": torch.uint8}),
    (
        torch.bfloat16,
        torch.bfloat16,
        {"master_weights": True, "store_param_remainders": True, "exp_avg_sq_dtype": torch.float16},
    ),
]


def make_pa(params: list[torch.nn.Parameter], options: dict[str, Any]) -> Any:
    from wrapped_optim.optimizers import PrecisionAwareAdamW

    return PrecisionAwareAdamW(params, lr=1e-2, weight_decay=0.1, **options)


def make_typed(dtype: torch.dtype, grad_dtype: torch.dtype, seed: int) -> list[torch.nn.Parameter]:
    params = [
        torch.nn.Parameter(p.detach().to(dtype)) for p in make_params([(6, 5), (5,)], None, seed)
    ]
    for p in params:
        p.grad_dtype = grad_dtype
    return params


@pytest.mark.parametrize("precision_aware", [True, False])
@pytest.mark.parametrize(("dtype", "grad_dtype", "options"), PA_CONFIGS)
def test_precision_aware_adamw_init_load_and_continue_bitwise(
    dtype: torch.dtype, grad_dtype: torch.dtype, options: dict[str, Any], precision_aware: bool
) -> None:
    params = make_typed(dtype, grad_dtype, seed=3)
    opt = FSDPAwareOptimizer(make_pa(params, options), precision_aware=precision_aware)
    for step in range(3):
        give_grads(params, seed=step)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())

    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p in resumed:
        p.grad_dtype = grad_dtype
    opt2 = FSDPAwareOptimizer(make_pa(resumed, options), precision_aware=precision_aware)
    before = [bits(p) for p in resumed]
    assert init_optimizer_state(opt2) is True
    assert [torch.equal(bits(p), b) for p, b in zip(resumed, before, strict=True)] == [True] * 2
    assert opt2.param_groups[0]["step"] == 0 and all(p.grad is None for p in resumed)
    opt2.load_state_dict(saved)
    for step in range(3, 5):
        give_grads(params, seed=step)
        give_grads(resumed, seed=step)
        opt.step()
        opt2.step()
    for p, q in zip(params, resumed, strict=True):
        assert_bitwise(p.data, q.data)
        for name, value in opt.state[p].items():
            assert_bitwise(value, opt2.state[q][name])
            assert_bitwise(opt.get_unscaled_state(p, name), opt2.get_unscaled_state(q, name))


def test_upstream_hooks_fire_twice_for_a_subclass_while_the_wrapper_steps_once() -> None:
    """REFERENCE §4: hooks registered on a subclass instance fire again in super().step()."""
    experimental = pytest.importorskip("megatron_fsdp.experimental")

    class SubclassedAdamW(torch.optim.AdamW):
        def step(self, closure: Any = None) -> Any:
            return super().step(closure)

    # Any plain AdamW created before makes torch wrap AdamW.step with the hook-firing profiler
    # wrapper; SubclassedAdamW.step is wrapped too, so hooks fire in both.
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    owner = SimpleNamespace(sync_model_weight_from_main_weight=lambda: None)

    def owned_params() -> list[torch.nn.Parameter]:
        params = make_params([(4, 3), (3,)], torch.bfloat16)
        for p in params:
            p._mfsdp_parameter_group = owner  # structural double of Megatron-FSDP's group
        give_grads(params, seed=0)
        return params

    upstream_params = owned_params()
    upstream = SubclassedAdamW(upstream_params, lr=1e-2)
    experimental.fully_shard_optimizer(upstream)
    with pytest.raises(AssertionError):
        upstream.step()
    assert upstream_params[0].grad.dtype == torch.float32  # and it is left cast

    ours_params = owned_params()
    reference = clone_params(ours_params)
    for p, q in zip(ours_params, reference, strict=True):
        q.grad = p.grad.float()
    FSDPAwareOptimizer(SubclassedAdamW(ours_params, lr=1e-2)).step()
    torch.optim.AdamW(reference, lr=1e-2).step()
    for p, q in zip(ours_params, reference, strict=True):
        assert_bitwise(p.data, q.data)
        assert p.grad.dtype == torch.bfloat16


def test_init_steps_with_zero_lr_and_weight_decay_keeping_a_tensor_lr_object() -> None:
    params = make_params([(3,)], torch.bfloat16)
    lr = torch.tensor(0.25)
    inner = RecordingSGD(params, lr=lr, momentum=0.9, weight_decay=0.5)
    assert init_optimizer_state(inner)
    assert inner.hyper == [(lr, 0.0, 0.0)]  # the same tensor, zeroed in place
    assert inner.param_groups[0]["lr"] is lr and lr.item() == 0.25
    assert inner.param_groups[0]["weight_decay"] == 0.5


finite_or_special = st.floats(width=32, allow_nan=True, allow_infinity=True)


@given(
    values=st.lists(finite_or_special, min_size=1, max_size=12),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    optimizer=st.sampled_from(["adamw", "sgd", "precision_aware"]),
)
def test_init_leaves_any_weights_bit_identical(
    values: list[float], dtype: torch.dtype, optimizer: str
) -> None:
    from wrapped_optim.optimizers import PrecisionAwareAdamW

    param = torch.nn.Parameter(torch.tensor(values).to(dtype))
    param.grad_dtype = torch.bfloat16
    before = bits(param)
    inner: Any
    if optimizer == "adamw":
        inner = torch.optim.AdamW([param], lr=0.1, weight_decay=0.1)
    elif optimizer == "sgd":
        inner = torch.optim.SGD([param], lr=0.1, momentum=0.9, weight_decay=0.1)
    else:
        inner = PrecisionAwareAdamW(
            [param], lr=0.1, weight_decay=0.1, master_weights=dtype == torch.bfloat16
        )
    assert init_optimizer_state(FSDPAwareOptimizer(inner))
    assert torch.equal(bits(param), before)
    assert param.grad is None and param.grad_dtype == torch.bfloat16
