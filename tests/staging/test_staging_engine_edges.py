"""Edges of the staging engine the main suite (tests/test_staged.py) does not reach: accessor
calls by keyword, holders that cache their expansions, the chunked load's chunk size and
device bound, which fp16 writes are protected, the no-copy gates on a minimal precision-aware
holder, which state dicts count as plain FP32 Adam state, and the allocator-cache release."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.doubles.distributed import DistributedOptimizerDouble, ddp_config, megatron_config
from tests.doubles.te_fused_adam import te_style
from tests.param_builders import train_on_random_grads
from wrapped_optim._staging import engine
from wrapped_optim._staging.engine import (
    fp32_no_copy_load,
    no_copy_decisions,
    staged_load,
    staged_save,
    staging_decisions,
)
from wrapped_optim.optimizers import PrecisionAwareAdamW
from wrapped_optim.testing import assert_state_dict_equal
from wrapped_optim.testing.probe import DeviceMemoryProbe, device_ledger

FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16


def _holder(cls: type = PrecisionAwareAdamW, **kwargs: Any) -> tuple[Any, list[Any]]:
    g = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(10,), (3,)]]
    options = {"exp_avg_dtype": BF16, "exp_avg_sq_dtype": FP16, **kwargs}
    opt = cls(params, lr=1e-2, **options)
    train_on_random_grads(opt, params, 2, seed=8)
    return opt, params


def _distributed(opt: Any) -> DistributedOptimizerDouble:
    return DistributedOptimizerDouble(
        opt, megatron_config(precision_aware=False), ddp_config(megatron_fsdp=False)
    )


# ----------------------------------------------------------------------------------------
# save
# ----------------------------------------------------------------------------------------


def test_accessor_called_by_keyword_is_staged_in_chunks_and_extra_arguments_are_not() -> None:
    class WithDtype(PrecisionAwareAdamW):  # type: ignore[misc]
        def get_unscaled_state(self, param: Any, state_name: str, dtype: Any = None) -> Any:
            value = super().get_unscaled_state(param, state_name)
            return value if dtype is None else value.to(dtype)

    opt, params = _holder(WithDtype)
    expected = opt.get_unscaled_state(params[0], "exp_avg")
    with staged_save(opt, chunk_bytes=16) as stats:
        calls = [
            opt.get_unscaled_state(param=params[0], state_name="exp_avg"),
            opt.get_unscaled_state(params[0], state_name="exp_avg"),
            opt.get_unscaled_state(params[0], "exp_avg"),
        ]
        assert stats.chunked_reads == 3 and stats.whole_tensor_reads == 0
        whole = opt.get_unscaled_state(params[0], "exp_avg", FP32)
        assert stats.chunked_reads == 3 and stats.whole_tensor_reads == 1
    for value in [*calls, whole]:
        assert torch.equal(value, expected)


def test_calls_the_engine_does_not_stage_reach_the_holder_with_their_keywords() -> None:
    class Extra(PrecisionAwareAdamW):  # type: ignore[misc]
        def get_unscaled_state(self, param: Any, state_name: str, dtype: Any = None) -> Any:
            if state_name == "unlisted":  # a state its dtype map does not name: FP32
                return torch.full(param.shape, 2.0)
            value = super().get_unscaled_state(param, state_name)
            return value if dtype is None else value.to(dtype)

        def read_unscaled_state_chunk(self, param: Any, name: str, start: int, out: Any) -> None:
            # The chunk reader may call the accessor itself, by keyword.
            whole = self.get_unscaled_state(param=param, state_name=name)
            out.copy_(whole.view(-1)[start : start + out.numel()])

    opt, params = _holder(Extra)
    expected = opt.get_unscaled_state(params[0], "exp_avg")
    with staged_save(opt, chunk_bytes=16) as stats:
        half = opt.get_unscaled_state(param=params[0], state_name="exp_avg", dtype=FP16)
        unlisted = opt.get_unscaled_state(params[0], "unlisted")
        chunked = opt.get_unscaled_state(params[0], "exp_avg")
    assert half.dtype == FP16 and torch.equal(half, expected.to(FP16))
    assert torch.equal(unlisted, torch.full((10,), 2.0))
    assert torch.equal(chunked, expected)
    assert (stats.whole_tensor_reads, stats.direct_reads, stats.chunked_reads) == (1, 1, 1)


def test_a_dtype_map_that_is_no_mapping_is_no_precision_aware_holder() -> None:
    class Listed(torch.optim.SGD):
        name_to_dtype_map = ["exp_avg"]

    opt = Listed([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    (decision,) = staging_decisions(opt)
    assert decision.reason == "Listed is not a precision-aware holder"


@pytest.mark.parametrize("accessor", [3, None])
def test_accessor_errors_name_the_holder_and_what_it_got(accessor: Any) -> None:
    opt, params = _holder(te_style(PrecisionAwareAdamW))
    opt.get_unscaled_state = accessor
    kind = type(accessor).__name__
    message = (
        f"checkpoint staging requires TEStylePrecisionAwareAdamW.get_unscaled_state() to be "
        f"callable: TEStylePrecisionAwareAdamW declares precision-aware state "
        f"(name_to_dtype_map) but its get_unscaled_state is a {kind}; give it TE FusedAdam's "
        "state accessors"
    )
    with pytest.raises(RuntimeError) as error, staged_save(opt):
        pass
    assert str(error.value) == message

    opt.get_unscaled_state = lambda param, state_name: (1.0,)
    with pytest.raises(TypeError) as error, staged_save(opt):
        opt.get_unscaled_state(params[0], "exp_avg")
    assert str(error.value) == (
        "TEStylePrecisionAwareAdamW.get_unscaled_state() must return a torch.Tensor for "
        "checkpoint staging, but returned a tuple for state 'exp_avg'; the holder's state "
        "accessor does not follow TE FusedAdam's contract"
    )


def test_a_holder_that_caches_its_expansion_gets_a_copy_in_the_checkpoint() -> None:
    class Caching(te_style(PrecisionAwareAdamW)):  # type: ignore[misc]
        cache: dict[tuple[int, str], torch.Tensor]

        def get_unscaled_state(self, param: Any, state_name: str) -> Any:
            value = super().get_unscaled_state(param, state_name)
            if self.name_to_dtype_map[state_name] == FP32:
                return value
            key = (id(param), state_name)
            cached = self.__dict__.setdefault("cache", {}).setdefault(key, value)
            return cached.copy_(value)

    opt, _ = _holder(Caching)
    bare = opt.state_dict()
    with staged_save(opt) as stats:
        result = opt.state_dict()
    assert stats.whole_tensor_reads == 4
    assert_state_dict_equal(bare, result, names=("bare", "staged"))
    cached = {t.data_ptr() for t in opt.cache.values()}
    staged = {e[name].data_ptr() for e in result["state"].values() for name in ("exp_avg",)}
    assert not staged & cached


def test_only_a_stored_tensor_no_larger_than_the_param_is_read_in_chunks() -> None:
    param = torch.zeros(4)

    class Holder:
        state = {
            param: {
                "codes": torch.zeros(2, dtype=torch.uint8),  # block-scaled: smaller
                "same": torch.zeros(4, dtype=BF16),
                "padded": torch.zeros(5, dtype=BF16),
                "number": 1.0,
            }
        }

    holder = Holder()
    assert engine._stored_state(holder, param, "codes") is holder.state[param]["codes"]
    assert engine._stored_state(holder, param, "same") is holder.state[param]["same"]
    for name in ("padded", "number", "missing"):
        assert engine._stored_state(holder, param, name) is None
    assert engine._stored_state(holder, torch.zeros(4), "same") is None
    assert engine._stored_state(object(), param, "same") is None


# ----------------------------------------------------------------------------------------
# load
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("chunk_bytes", "chunk"), [(16, 4), (19, 4), (1 << 20, 1 << 18)])
def test_chunked_load_writes_chunks_of_chunk_bytes_and_records_one_in_flight(
    chunk_bytes: int, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    source, _ = _holder()
    checkpoint = source.state_dict()
    target, _ = _holder()
    seen: list[int] = []
    original = PrecisionAwareAdamW.write_scaled_state_chunked

    def spying(opt: Any, param: Any, name: str, value: Any, chunk_numel: int) -> None:
        seen.append(chunk_numel)
        original(opt, param, name, value, chunk_numel)

    monkeypatch.setattr(PrecisionAwareAdamW, "write_scaled_state_chunked", spying)
    with DeviceMemoryProbe() as probe, staged_load(target, chunk_bytes=chunk_bytes) as stats:
        target.load_state_dict(checkpoint)
    assert stats.chunked_writes == 4 and set(seen) == {chunk}
    peak = probe.peak_extra_bytes
    assert type(peak) is int and peak == 4 * min(chunk, 10)
    assert device_ledger.live_bytes == 0
    assert_state_dict_equal(checkpoint, target.state_dict(), names=("checkpoint", "loaded"))


@pytest.mark.parametrize("value", ["not a tensor", torch.zeros(2), torch.zeros(10, dtype=BF16)])
def test_chunked_load_leaves_what_it_cannot_write_to_the_holder(value: Any) -> None:
    opt, params = _holder()
    calls: list[Any] = []

    def refusing(param: Any, state_name: str, unscaled_state: Any) -> None:
        calls.append(unscaled_state)

    opt.set_scaled_state = refusing
    with staged_load(opt) as stats:
        opt.set_scaled_state(params[0], "exp_avg", value)
    assert calls == [value] and stats.chunked_writes == 0


def test_only_fp16_bound_writes_are_protected() -> None:
    cls = te_style(PrecisionAwareAdamW)
    source, _ = _holder(cls, exp_avg_dtype=BF16, exp_avg_sq_dtype=FP16)
    target, _ = _holder(cls, exp_avg_dtype=BF16, exp_avg_sq_dtype=FP16)
    with staged_load(target) as stats:
        target.load_state_dict(source.state_dict())
    assert stats.protected_writes == 2  # exp_avg_sq of two params; exp_avg is bf16


# ----------------------------------------------------------------------------------------
# FP32 no-copy load
# ----------------------------------------------------------------------------------------


class _FusedAdamLike(torch.optim.Optimizer):
    """The least a holder needs for the no-copy path: a torch optimizer with a dtype map
    naming no moment, a ``set_scaled_state``, no master_weights or store_param_remainders."""

    name_to_dtype_map: dict[str, torch.dtype] = {}

    def __init__(self) -> None:
        super().__init__([torch.nn.Parameter(torch.zeros(2))], {})

    def set_scaled_state(self, param: Any, state_name: str, value: Any) -> None:
        raise AssertionError("not called")


def test_no_copy_gates_on_a_minimal_fused_adam_like_holder() -> None:
    holder = _FusedAdamLike()
    (decision,) = no_copy_decisions(_distributed(holder))
    assert (decision.index, decision.eligible, decision.reason) == (0, True, "eligible")

    holder.set_scaled_state = None  # type: ignore[assignment, method-assign]
    (decision,) = no_copy_decisions(_distributed(holder))
    assert decision.reason == "_FusedAdamLike is not a precision-aware holder"

    holder = _FusedAdamLike()
    holder.load_state_dict = 3  # type: ignore[assignment, method-assign]
    (decision,) = no_copy_decisions(_distributed(holder))
    assert decision.reason == "_FusedAdamLike has no load_state_dict"


class _NoSetter(torch.optim.SGD):
    name_to_dtype_map: dict[str, torch.dtype] = {}


def test_no_copy_gate_needs_a_scaled_state_setter() -> None:
    holder = _NoSetter([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    (decision,) = no_copy_decisions(_distributed(holder))
    assert decision.reason == "_NoSetter is not a precision-aware holder"


def _plain_state(params: int = 2) -> dict[str, Any]:
    state = {i: {"exp_avg": torch.zeros(2), "exp_avg_sq": torch.ones(2)} for i in range(params)}
    return {"state": state, "param_groups": [{"params": list(range(params)), "lr": 0.1}]}


def _without(key: str) -> dict[str, Any]:
    state_dict = _plain_state()
    del state_dict[key]
    return state_dict


@pytest.mark.parametrize(
    "state_dict",
    [
        [("state", {})],
        {**_plain_state(), "state": [1, 2]},
        {**_plain_state(), "param_groups": {"params": [0, 1]}},
        _without("state"),
        _without("param_groups"),
        {**_plain_state(), "param_groups": [{"lr": 0.1}]},
        {**_plain_state(), "param_groups": [None]},
        {"state": {}, "param_groups": [{"params": []}]},
        {**_plain_state(), "param_groups": [{"params": [0]}]},
        {**_plain_state(), "state": {0: _plain_state()["state"][0], 1: [1]}},
        {**_plain_state(), "state": {0: _plain_state()["state"][0], 1: {"exp_avg": 1}}},
        {**_plain_state(1), "state": {0: {"exp_avg": torch.zeros(2), "exp_avg_sq": 1.0}}},
        {**_plain_state(1), "state": {0: {"exp_avg": torch.zeros(2), "exp_avg_sq": [1.0]}}},
        {
            **_plain_state(1),
            "state": {0: {"exp_avg": torch.zeros(2), "exp_avg_sq": torch.ones(2, dtype=BF16)}},
        },
    ],
    ids=lambda _: "",
)
def test_only_plain_fp32_adam_state_is_adopted(state_dict: Any) -> None:
    assert engine._plain_fp32_adam_state(_plain_state())
    assert not engine._plain_fp32_adam_state(state_dict)


def test_adoptions_are_counted_and_release_the_cache_only_with_cuda_initialized(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    released: list[int] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: released.append(1))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    holder, _ = _holder(exp_avg_dtype=FP32, exp_avg_sq_dtype=FP32)
    container = _distributed(holder)
    with fp32_no_copy_load(container) as stats:
        holder.load_state_dict(holder.state_dict())
        holder.load_state_dict(holder.state_dict())
    assert stats.adoptions == 2 and released == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with fp32_no_copy_load(container) as stats:
        holder.load_state_dict(holder.state_dict())
    assert stats.adoptions == 1 and released == []
