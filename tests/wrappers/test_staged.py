"""StagedCheckpointOptimizer and its staging engine, against PrecisionAwareAdamW, the
DistributedOptimizer double around it and the real megatron-core ChainedOptimizer."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.doubles.distributed import DistributedOptimizerDouble, ddp_config, megatron_config
from tests.doubles.te_fused_adam import te_fp16_bug, te_style
from tests.gpu import gpu_staged
from wrapped_optim._adapters.precision import supports_chunked_state
from wrapped_optim._bench import staged as bench_staged
from wrapped_optim._staging.engine import (
    StagingStats,
    fp32_no_copy_load,
    no_copy_decisions,
    staged_load,
    staged_save,
    staging_decisions,
)
from wrapped_optim.optimizers import PrecisionAwareAdamW as Holder
from wrapped_optim.staged import StagedCheckpointOptimizer
from wrapped_optim.testing.probe import DeviceMemoryProbe, count_unstaged_expansions, device_ledger

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
PATCHED = ("get_unscaled_state", "set_scaled_state", "load_state_dict")
FP8 = torch.uint8  # E4M3, as TE spells it
COMPRESSED = [BF16, FP16, FP8]

# ----------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------


def make_params(shapes: list[tuple[int, ...]], seed: int, dtype: torch.dtype = FP32) -> list[Any]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def train(opt: Any, params: list[Any], steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + 1000)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


def make_holder(
    shapes: list[tuple[int, ...]],
    *,
    seed: int = 0,
    exp_avg: torch.dtype = BF16,
    exp_avg_sq: torch.dtype = FP16,
    master: bool = False,
    steps: int = 2,
    cls: type = Holder,
    param_dtype: torch.dtype = FP32,
) -> tuple[Any, list[Any]]:
    params = make_params(shapes, seed, param_dtype)
    opt = cls(
        params,
        lr=1e-2,
        exp_avg_dtype=exp_avg,
        exp_avg_sq_dtype=exp_avg_sq,
        master_weights=master,
    )
    train(opt, params, steps, seed)
    return opt, params


def assert_same(a: Any, b: Any, *, host: bool = False, path: str = "sd") -> None:
    """Same structure, types, dtypes, shapes and bits; ``host``: every tensor of ``a`` on CPU."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape}"
        assert torch.equal(a, b), f"{path}: values differ"
        if host:
            assert a.device.type == "cpu", path
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for key in a:
            assert_same(a[key], b[key], host=host, path=f"{path}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, host=host, path=f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def assert_unpatched(*objs: Any) -> None:
    for obj in objs:
        leaked = [name for name in PATCHED if name in vars(obj)]
        assert not leaked, f"{type(obj).__name__} keeps instance patches {leaked}"
    assert device_ledger.live_bytes == 0


def storage_snapshot(opt: Any) -> dict[int, dict[str, torch.Tensor]]:
    """The holder's raw stored state (compressed storage, not expansions), cloned."""
    params = [p for g in opt.param_groups for p in g["params"]]
    return {
        i: {k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
        for i, p in enumerate(params)
        if p in opt.state
    }


def assert_storage_equal(a: Any, b: Any) -> None:
    assert_same(storage_snapshot(a), storage_snapshot(b))


shapes_st = st.lists(
    st.one_of(
        st.tuples(st.integers(1, 40)),
        st.tuples(st.integers(1, 9), st.integers(1, 9)),
    ),
    min_size=1,
    max_size=4,
)
chunk_st = st.sampled_from([4, 8, 20, 64, 1 << 20])

# ----------------------------------------------------------------------------------------
# save: staged == unstaged, on the host, within the chunk bound
# ----------------------------------------------------------------------------------------


@given(
    shapes=shapes_st,
    exp_avg=st.sampled_from([*COMPRESSED, FP32]),
    exp_avg_sq=st.sampled_from(COMPRESSED),
    master=st.booleans(),
    chunk_bytes=chunk_st,
    seed=st.integers(0, 2**16),
)
def test_staged_state_dict_equals_unstaged_within_chunk_bound(
    shapes: list[tuple[int, ...]],
    exp_avg: torch.dtype,
    exp_avg_sq: torch.dtype,
    master: bool,
    chunk_bytes: int,
    seed: int,
) -> None:
    opt, _ = make_holder(shapes, seed=seed, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, master=master)
    bare = opt.state_dict()
    staged = StagedCheckpointOptimizer(opt, chunk_bytes=chunk_bytes)
    with DeviceMemoryProbe("cpu") as probe:
        result = staged.state_dict()
    assert_same(result, bare, host=True)
    assert staged.last_stats.staged_holders == 1
    assert staged.last_stats.chunked_reads > 0
    assert staged.last_stats.whole_tensor_reads == 0
    # Host-resident state is decoded straight into the host buffer: only the decode's own
    # chunk-sized temporaries (FP8's index), never more than one chunk.
    assert 0 <= probe.peak_extra_bytes <= chunk_bytes
    assert_unpatched(opt)


def test_chunked_staging_decodes_in_chunks_and_never_aliases_storage() -> None:
    opt, params = make_holder([(1000,)], exp_avg=BF16, exp_avg_sq=FP16)
    staged = StagedCheckpointOptimizer(opt, chunk_bytes=256)
    with DeviceMemoryProbe() as probe:
        result = staged.state_dict()
    assert probe.peak_extra_bytes == 0  # on the host: no scratch, no copy through one
    assert staged.last_stats.chunked_reads == 2
    stored = opt.state[params[0]]["exp_avg"]
    assert result["state"][0]["exp_avg"].data_ptr() != stored.data_ptr()


@given(shapes=shapes_st, seed=st.integers(0, 2**16), chunk_bytes=chunk_st)
def test_whole_tensor_staging_for_holders_without_chunk_api(
    shapes: list[tuple[int, ...]], seed: int, chunk_bytes: int
) -> None:
    opt, params = make_holder(shapes, seed=seed, cls=te_style(Holder), master=True)
    assert not supports_chunked_state(opt)
    bare = opt.state_dict()
    staged = StagedCheckpointOptimizer(opt, chunk_bytes=chunk_bytes)
    with DeviceMemoryProbe() as probe:
        result = staged.state_dict()
    assert_same(result, bare, host=True)
    stats = staged.last_stats
    assert stats.chunked_reads == 0
    assert stats.whole_tensor_reads == 2 * len(params)  # exp_avg, exp_avg_sq
    assert stats.direct_reads == len(params)  # fp32 master_param
    # one whole expansion alive at a time: the largest tensor, not the sum
    assert probe.peak_extra_bytes == 4 * max(p.numel() for p in params)
    assert_unpatched(opt)


def test_remainder_master_goes_to_host_as_int16() -> None:
    params = make_params([(33,), (4, 4)], 1, BF16)
    opt = Holder(
        params,
        lr=1e-2,
        master_weights=True,
        store_param_remainders=True,
        exp_avg_dtype=FP8,
        exp_avg_sq_dtype=BF16,
    )
    train(opt, params, 2, 1)
    bare = opt.state_dict()
    staged = StagedCheckpointOptimizer(opt, chunk_bytes=16)
    result = staged.state_dict()
    assert_same(result, bare, host=True)
    assert result["state"][0]["master_param"].dtype == torch.int16
    assert staged.last_stats.direct_reads == 2 and staged.last_stats.chunked_reads == 4
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = Holder(
        fresh_params,
        lr=1e-2,
        master_weights=True,
        store_param_remainders=True,
        exp_avg_dtype=FP8,
        exp_avg_sq_dtype=BF16,
    )
    StagedCheckpointOptimizer(fresh, chunk_bytes=16).load_state_dict(result)
    assert_storage_equal(fresh, opt)
    assert_unpatched(opt, fresh)


def test_holder_whose_chunk_api_reenters_the_patched_accessors() -> None:
    class Reentrant(Holder):  # type: ignore[misc, valid-type]
        def read_unscaled_state_chunk(self, param: Any, name: str, start: int, out: Any) -> None:
            out.copy_(self.get_unscaled_state(param, name).view(-1)[start : start + out.numel()])

        def write_scaled_state_chunked(self, param: Any, name: str, source: Any, n: int) -> None:
            self.set_scaled_state(param, name, source)

    opt, _ = make_holder([(30,)], cls=Reentrant)
    bare = opt.state_dict()
    staged = StagedCheckpointOptimizer(opt, chunk_bytes=8)
    assert_same(staged.state_dict(), bare)
    staged.load_state_dict(bare)
    assert staged.last_stats.chunked_writes == 2
    assert_same(opt.state_dict(), bare)
    assert_unpatched(opt)


def test_stage_save_false_leaves_state_dict_alone() -> None:
    opt, _ = make_holder([(10,)])
    staged = StagedCheckpointOptimizer(opt, stage_save=False)
    with DeviceMemoryProbe() as probe:
        assert_same(staged.state_dict(), opt.state_dict())
    assert probe.peak_extra_bytes == 0
    assert staged.last_stats.staged_holders == 0


def test_fp32_states_on_a_host_source_are_handed_out_like_the_bare_optimizer_does() -> None:
    opt, params = make_holder([(6,)], exp_avg=FP32, exp_avg_sq=BF16)
    staged = StagedCheckpointOptimizer(opt)
    result = staged.state_dict()
    live = opt.state[params[0]]
    # FP32: already on the host, the live tensor as FusedAdam returns it (no copy, no bytes)
    assert result["state"][0]["exp_avg"].data_ptr() == live["exp_avg"].data_ptr()
    # compressed: a fresh FP32 host buffer
    assert result["state"][0]["exp_avg_sq"].dtype == FP32
    assert staged.last_stats.direct_reads == 1 and staged.last_stats.chunked_reads == 1


# ----------------------------------------------------------------------------------------
# load: chunked, exact, atomic, caller's tensors untouched
# ----------------------------------------------------------------------------------------


def clone_sd(sd: Any) -> Any:
    return copy.deepcopy(sd)


@given(
    shapes=shapes_st,
    exp_avg=st.sampled_from(COMPRESSED),
    exp_avg_sq=st.sampled_from([*COMPRESSED, FP32]),
    master=st.booleans(),
    chunk_bytes=chunk_st,
    seed=st.integers(0, 2**16),
)
def test_chunked_load_matches_bare_load_and_keeps_callers_tensors(
    shapes: list[tuple[int, ...]],
    exp_avg: torch.dtype,
    exp_avg_sq: torch.dtype,
    master: bool,
    chunk_bytes: int,
    seed: int,
) -> None:
    kw = dict(exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, master=master)
    source, _ = make_holder(shapes, seed=seed, steps=3, **kw)  # type: ignore[arg-type]
    checkpoint = source.state_dict()
    pristine = clone_sd(checkpoint)

    bare, _ = make_holder(shapes, seed=seed + 1, steps=1, **kw)  # type: ignore[arg-type]
    bare.load_state_dict(clone_sd(checkpoint))
    target, _ = make_holder(shapes, seed=seed + 1, steps=1, **kw)  # type: ignore[arg-type]
    staged = StagedCheckpointOptimizer(target, chunk_bytes=chunk_bytes)
    with DeviceMemoryProbe() as probe:
        staged.load_state_dict(checkpoint)

    assert_same(checkpoint, pristine)  # the caller's tensors were not modified
    assert_storage_equal(target, bare)
    assert_same(target.state_dict(), bare.state_dict())
    assert staged.last_stats.chunked_writes > 0
    assert probe.peak_extra_bytes <= chunk_bytes
    assert_unpatched(target)


@given(
    shapes=shapes_st,
    steps=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    dtypes=st.tuples(st.sampled_from(COMPRESSED), st.sampled_from(COMPRESSED)),
    master=st.booleans(),
    chunk_bytes=chunk_st,
    seed=st.integers(0, 2**16),
)
def test_resume_through_wrapper_is_exact(
    shapes: list[tuple[int, ...]],
    steps: tuple[int, int],
    dtypes: tuple[torch.dtype, torch.dtype],
    master: bool,
    chunk_bytes: int,
    seed: int,
) -> None:
    before, after = steps
    kw = dict(exp_avg=dtypes[0], exp_avg_sq=dtypes[1], master=master)
    # uninterrupted run
    ref, ref_params = make_holder(shapes, seed=seed, steps=before, **kw)  # type: ignore[arg-type]
    # interrupted: save through the wrapper, restore into a fresh stack, continue
    first, first_params = make_holder(shapes, seed=seed, steps=before, **kw)  # type: ignore[arg-type]
    checkpoint = StagedCheckpointOptimizer(first, chunk_bytes=chunk_bytes).state_dict()
    model = [p.detach().clone() for p in first_params]

    params = [torch.nn.Parameter(m.clone()) for m in model]
    fresh = Holder(
        params,
        lr=1e-2,
        exp_avg_dtype=kw["exp_avg"],
        exp_avg_sq_dtype=kw["exp_avg_sq"],
        master_weights=master,
    )
    resumed = StagedCheckpointOptimizer(fresh, chunk_bytes=chunk_bytes)
    resumed.load_state_dict(checkpoint)
    train(ref, ref_params, after, seed + 7)
    train(resumed, params, after, seed + 7)
    for p, q in zip(params, ref_params, strict=True):
        assert torch.equal(p, q)
    assert_same(resumed.state_dict(), ref.state_dict())
    assert_unpatched(fresh)


def test_rejected_checkpoint_leaves_optimizer_unchanged() -> None:
    opt, _ = make_holder([(8,), (3, 3)], master=True)
    before = storage_snapshot(opt)
    groups_before = copy.deepcopy(
        [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    )
    bad = opt.state_dict()
    bad["state"][1]["exp_avg_sq"] = torch.zeros(4)  # wrong size for the 3x3 param
    staged = StagedCheckpointOptimizer(opt, chunk_bytes=8)
    with pytest.raises((ValueError, RuntimeError)):
        staged.load_state_dict(bad)
    assert_same(storage_snapshot(opt), before)
    assert [
        {k: v for k, v in g.items() if k != "params"} for g in opt.param_groups
    ] == groups_before
    assert_unpatched(opt)


def test_te_style_fp16_load_does_not_scale_callers_tensor() -> None:
    cls = te_fp16_bug(Holder)
    source, _ = make_holder([(16,)], cls=cls, exp_avg=FP16, exp_avg_sq=FP16)
    checkpoint = source.state_dict()
    pristine = clone_sd(checkpoint)

    bare, _ = make_holder([(16,)], cls=cls, exp_avg=FP16, exp_avg_sq=FP16)
    exposed = clone_sd(checkpoint)
    bare.load_state_dict(exposed)
    with pytest.raises(AssertionError):  # the double really has TE's bug
        assert_same(exposed, pristine)

    target, _ = make_holder([(16,)], cls=cls, exp_avg=FP16, exp_avg_sq=FP16)
    staged = StagedCheckpointOptimizer(target)
    staged.load_state_dict(checkpoint)
    assert_same(checkpoint, pristine)
    assert staged.last_stats.protected_writes == 2
    assert_storage_equal(target, bare)
    assert_unpatched(target)


# ----------------------------------------------------------------------------------------
# eligibility gates
# ----------------------------------------------------------------------------------------


def chained_optimizer(parts: list[Any]) -> Any:
    """megatron-core's real ChainedOptimizer around ``parts``."""
    return pytest.importorskip("megatron.core.optimizer").ChainedOptimizer(parts)


def distributed(opt: Any, **config: Any) -> DistributedOptimizerDouble:
    fsdp = config.pop("megatron_fsdp", False)
    return DistributedOptimizerDouble(
        opt, megatron_config(**config), ddp_config(megatron_fsdp=fsdp)
    )


@pytest.mark.parametrize(
    ("build", "reason"),
    [
        (lambda h: h, "eligible"),
        (lambda h: distributed(h), "eligible"),
        (lambda h: distributed(None), "stub optimizer (no parameters on this rank)"),
        (
            lambda h: distributed(h, precision_aware=False),
            "config.use_precision_aware_optimizer is off",
        ),
        (lambda h: distributed(h, cpu_offload=True), "config.optimizer_cpu_offload is on"),
        (lambda h: distributed(h, megatron_fsdp=True), "ddp_config.use_megatron_fsdp is on"),
    ],
)
def test_save_gates(build: Callable[[Any], Any], reason: str) -> None:
    holder, _ = make_holder([(4,)])
    stack = StagedCheckpointOptimizer(build(holder))
    (decision,) = staging_decisions(stack)
    assert decision.reason == reason
    assert decision.eligible is (reason == "eligible")
    stack.state_dict()
    assert stack.last_stats.staged_holders == int(reason == "eligible")


def test_save_gates_on_the_holder_itself() -> None:
    fp32_holder, _ = make_holder([(4,)], exp_avg=FP32, exp_avg_sq=FP32)
    adamw = torch.optim.AdamW(make_params([(4,)], 0), lr=0.1)
    te, _ = make_holder([(4,)], cls=te_style(Holder))
    chained = chained_optimizer([distributed(fp32_holder), distributed(adamw), distributed(te)])
    reasons = [(d.eligible, d.reason, d.chunked) for d in staging_decisions(chained)]
    assert reasons == [
        (False, "every state is FP32", False),
        (False, "AdamW is not a precision-aware holder", False),
        (True, "eligible", False),
    ]


def test_same_holder_reached_twice_is_staged_once() -> None:
    holder, _ = make_holder([(4,)])
    chained = chained_optimizer([distributed(holder), distributed(holder)])
    decisions = staging_decisions(chained)
    assert [d.reason for d in decisions] == ["eligible", "already staged"]
    assert [(d.index, d.eligible) for d in decisions] == [(0, True), (1, False)]
    with staged_save(chained) as stats:
        holder.state_dict()
    assert stats.staged_holders == 1
    assert_unpatched(holder)


# ----------------------------------------------------------------------------------------
# errors and fault injection: patches never leak
# ----------------------------------------------------------------------------------------


def test_non_tensor_from_accessor_is_a_type_error_naming_the_class() -> None:
    base = te_style(Holder)

    class ListReturningAdam(base):  # type: ignore[misc, valid-type]
        def get_unscaled_state(self, param: Any, name: str) -> Any:
            return [1.0]

    holder, _ = make_holder([(4,)], cls=base)
    holder.__class__ = ListReturningAdam
    stack = StagedCheckpointOptimizer(holder)
    message = r"ListReturningAdam\.get_unscaled_state\(\) must return a torch\.Tensor.*'exp_avg'"
    with pytest.raises(TypeError, match=message):
        stack.state_dict()
    assert_unpatched(holder)


def test_missing_accessor_is_a_runtime_error() -> None:
    base = te_style(Holder)

    class NoAccessor(base):  # type: ignore[misc, valid-type]
        def __getattribute__(self, name: str) -> Any:
            if name in ("get_unscaled_state", "set_scaled_state"):
                raise AttributeError(name)
            return super().__getattribute__(name)

    holder, _ = make_holder([(4,)], cls=base)
    holder.__class__ = NoAccessor
    chained = chained_optimizer([distributed(holder)])
    with pytest.raises(RuntimeError, match=r"NoAccessor\.get_unscaled_state\(\) to be callable"):
        StagedCheckpointOptimizer(chained).state_dict()
    setter = r"set_scaled_state\(\) to be callable"
    with pytest.raises(RuntimeError, match=setter), staged_load(chained):
        pass
    assert_unpatched(holder)


class Injected(Exception):
    pass


def faulty(cls: type, counter: dict[str, int]) -> type:
    """Subclass whose accessors count calls and raise at call number ``counter['fail_at']``."""
    names = ["get_unscaled_state", "set_scaled_state"]
    if getattr(cls, "read_unscaled_state_chunk", None) is not None:
        names += ["read_unscaled_state_chunk", "write_scaled_state_chunked"]

    def wrap(name: str) -> Callable[..., Any]:
        def method(self: Any, *args: Any) -> Any:
            counter["calls"] += 1
            if counter["calls"] == counter["fail_at"]:
                raise Injected(f"{name} call {counter['calls']}")
            return getattr(cls, name)(self, *args)

        return method

    return type(f"Faulty{cls.__name__}", (cls,), {n: wrap(n) for n in names})


@pytest.mark.parametrize("te", [False, True])
def test_fault_at_every_accessor_call_leaves_no_patch(te: bool) -> None:
    base = te_style(Holder) if te else Holder
    counter = {"calls": 0, "fail_at": -1}
    cls = faulty(base, counter)

    def fresh() -> tuple[Any, Any]:
        holder, _ = make_holder([(40,), (3, 5)], cls=cls, master=True)
        chained = chained_optimizer([distributed(holder)])
        return holder, StagedCheckpointOptimizer(chained, chunk_bytes=32)

    def run(stack: Any, checkpoint: Any) -> None:
        stack.state_dict()
        stack.sharded_state_dict({}, is_loading=False)
        stack.sharded_state_dict({}, is_loading=True)
        stack.load_state_dict(checkpoint)

    holder, stack = fresh()
    checkpoint = stack.sharded_state_dict({})
    counter["calls"] = 0
    run(stack, checkpoint)
    total = counter["calls"]
    assert total > 10
    for fail_at in range(1, total + 1):
        holder, stack = fresh()
        counter.update(calls=0, fail_at=fail_at)
        with pytest.raises(Injected):
            run(stack, checkpoint)
        assert_unpatched(holder)
        counter["fail_at"] = -1


def test_invalid_options() -> None:
    holder, _ = make_holder([(4,)])
    with pytest.raises(ValueError, match="chunk_bytes must be at least 4"):
        StagedCheckpointOptimizer(holder, chunk_bytes=2)
    with pytest.raises(TypeError, match="chunk_bytes must be an int"):
        StagedCheckpointOptimizer(holder, chunk_bytes=1.5)  # type: ignore[arg-type]
    with pytest.raises(AttributeError, match="has no sharded_state_dict"):
        StagedCheckpointOptimizer(holder).sharded_state_dict({})


# ----------------------------------------------------------------------------------------
# Megatron containers (the DistributedOptimizer double, the real ChainedOptimizer)
# ----------------------------------------------------------------------------------------


def megatron_stack(seed: int = 0) -> tuple[Any, Any, Any]:
    chunky, _ = make_holder([(50,), (4, 6)], seed=seed, master=True)
    te, _ = make_holder([(30,)], seed=seed + 1, cls=te_style(Holder), master=True)
    chained = chained_optimizer([distributed(chunky), distributed(te)])
    return chained, chunky, te


def test_megatron_sharded_state_dict_staged_equals_unstaged() -> None:
    chained, chunky, te = megatron_stack()
    bare = chained.sharded_state_dict({}, False)
    stack = StagedCheckpointOptimizer(chained, chunk_bytes=64)
    with DeviceMemoryProbe() as probe:
        staged = stack.sharded_state_dict({}, False)
    assert_same(staged, bare)
    for index in (0, 1):
        for tensors in staged[index]["param_state"].values():
            assert all(t.device.type == "cpu" for t in tensors.values())
    stats = stack.last_stats
    assert stats.staged_holders == 2 and stats.chunked_reads > 0 and stats.whole_tensor_reads > 0
    # whole-tensor staging of the TE-style holder dominates: its largest tensor
    assert probe.peak_extra_bytes == 30 * 4
    assert_same(stack.state_dict(), chained.state_dict())
    assert_unpatched(chunky, te)


def test_megatron_load_paths_are_staged_and_exact() -> None:
    source, src_chunky, _ = megatron_stack(seed=3)
    checkpoint = StagedCheckpointOptimizer(source, chunk_bytes=64).sharded_state_dict({})
    pristine = clone_sd(checkpoint)

    bare, bare_chunky, bare_te = megatron_stack(seed=5)
    bare.load_state_dict(clone_sd(checkpoint))
    chained, chunky, te = megatron_stack(seed=5)
    stack = StagedCheckpointOptimizer(chained, chunk_bytes=64)
    with DeviceMemoryProbe() as probe:
        stack.load_state_dict(checkpoint)
    assert_same(checkpoint, pristine)
    stats = stack.last_stats
    # Megatron's scaffold comes from state_dict(): staged while loading too
    assert stats.staged_holders == 2 and stats.chunked_reads > 0
    assert stats.chunked_writes > 0
    assert probe.peak_extra_bytes <= 30 * 4
    assert_storage_equal(chunky, bare_chunky)
    assert_storage_equal(te, bare_te)
    assert_storage_equal(chunky, src_chunky)
    # sharded_state_dict(is_loading=True) loads the scaffold under the load scopes as well
    stack.sharded_state_dict({}, is_loading=True)
    assert stack.last_stats.chunked_writes > 0
    assert_storage_equal(chunky, src_chunky)
    assert_unpatched(chunky, te)


# ----------------------------------------------------------------------------------------
# FP32 no-copy load
# ----------------------------------------------------------------------------------------


def fp32_distributed(steps: int = 1, seed: int = 0, **config: Any) -> tuple[Any, Any]:
    holder, _ = make_holder([(12,), (2, 3)], seed=seed, exp_avg=FP32, exp_avg_sq=FP32, steps=steps)
    config.setdefault("precision_aware", False)
    return distributed(holder, exp_avg_dtype=FP32, exp_avg_sq_dtype=FP32, **config), holder


def plain_adam_state(holder: Any, seed: int = 9) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    sd = holder.state_dict()
    for entry in sd["state"].values():
        for key in ("exp_avg", "exp_avg_sq"):
            entry[key] = torch.rand(entry[key].shape, generator=gen)
    return sd


def test_no_copy_adopts_plain_fp32_adam_state() -> None:
    container, holder = fp32_distributed()
    incoming = plain_adam_state(holder)
    assert [d.reason for d in no_copy_decisions(container)] == ["eligible"]
    params = [p for g in holder.param_groups for p in g["params"]]
    with fp32_no_copy_load(container) as stats:
        holder.load_state_dict(incoming)
    assert stats.adoptions == 1
    for index, p in enumerate(params):
        for key in ("exp_avg", "exp_avg_sq"):
            assert holder.state[p][key] is incoming["state"][index][key]  # adopted, not copied
    assert_unpatched(holder)
    # the bare loader copies
    _, holder2 = fp32_distributed()
    incoming2 = plain_adam_state(holder2)
    holder2.load_state_dict(incoming2)
    p0 = holder2.param_groups[0]["params"][0]
    assert holder2.state[p0]["exp_avg"] is not incoming2["state"][0]["exp_avg"]
    assert_storage_equal(holder, holder2)


def test_no_copy_through_wrapper_on_a_fresh_distributed_optimizer() -> None:
    source, src_holder = fp32_distributed(steps=2, seed=1)
    checkpoint = source.sharded_state_dict({})
    container, holder = fp32_distributed(steps=0, seed=2)
    assert len(holder.state) == 0
    stack = StagedCheckpointOptimizer(container)
    stack.load_state_dict(checkpoint)
    assert stack.last_stats.adoptions == 1
    assert_storage_equal(holder, src_holder)
    assert_unpatched(holder)


def test_adopted_state_trains_exactly_like_copied_state() -> None:
    source, _ = fp32_distributed(steps=2, seed=1)
    checkpoint = source.sharded_state_dict({})
    adopting, a = fp32_distributed(steps=1, seed=2)
    copying, b = fp32_distributed(steps=1, seed=2)
    first = StagedCheckpointOptimizer(adopting)
    first.load_state_dict(checkpoint)
    second = StagedCheckpointOptimizer(copying, no_copy_load=False)
    second.load_state_dict(clone_sd(checkpoint))
    assert (first.last_stats.adoptions, second.last_stats.adoptions) == (1, 0)
    pa = [p for g in a.param_groups for p in g["params"]]
    pb = [p for g in b.param_groups for p in g["params"]]
    train(first, pa, 2, 4)
    train(second, pb, 2, 4)
    assert all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))
    assert_storage_equal(a, b)
    assert_unpatched(a, b)


def test_no_copy_falls_back_for_other_incoming_state() -> None:
    container, holder = fp32_distributed()
    incoming = plain_adam_state(holder)
    incoming["state"][0]["exp_avg"] = incoming["state"][0]["exp_avg"].double()
    expected = copy.deepcopy(incoming)
    with fp32_no_copy_load(container) as stats:
        holder.load_state_dict(incoming)
    assert stats.adoptions == 0
    _, ref = fp32_distributed()
    ref.load_state_dict(expected)
    assert_storage_equal(holder, ref)
    # an extra state: whatever the original loader does with it, the patched one does too
    extra = plain_adam_state(holder)
    extra["state"][1]["master_param"] = torch.zeros(2, 3)
    _, ref = fp32_distributed()
    with fp32_no_copy_load(container) as stats:
        assert outcome(holder.load_state_dict, copy.deepcopy(extra), holder) == outcome(
            ref.load_state_dict, copy.deepcopy(extra), ref
        )
    assert stats.adoptions == 0
    assert_unpatched(holder)


def outcome(load: Callable[[Any], None], sd: Any, holder: Any) -> Any:
    try:
        load(sd)
    except Exception as error:
        return type(error).__name__
    snapshot = storage_snapshot(holder)
    return [(i, k, v.dtype, v.tolist()) for i, entry in snapshot.items() for k, v in entry.items()]


def test_rejected_no_copy_load_leaves_optimizer_unchanged() -> None:
    container, holder = fp32_distributed()
    before = storage_snapshot(holder)
    bad = plain_adam_state(holder)
    bad["param_groups"][0]["params"] = bad["param_groups"][0]["params"][:1]
    del bad["state"][1]
    with fp32_no_copy_load(container) as stats, pytest.raises(ValueError):
        holder.load_state_dict(bad)
    assert stats.adoptions == 1
    assert_same(storage_snapshot(holder), before)
    assert_unpatched(holder)


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"precision_aware": True}, "config.use_precision_aware_optimizer is on"),
        ({"cpu_offload": True}, "config.optimizer_cpu_offload is on"),
        ({"megatron_fsdp": True}, "ddp_config.use_megatron_fsdp is on"),
    ],
)
def test_no_copy_config_gates(kwargs: dict[str, Any], reason: str) -> None:
    container, holder = fp32_distributed(**kwargs)
    assert [d.reason for d in no_copy_decisions(container)] == [reason]
    with fp32_no_copy_load(container) as stats:
        holder.load_state_dict(plain_adam_state(holder))
    assert stats.adoptions == 0


def test_no_copy_holder_gates() -> None:
    def reason_for(container: Any) -> str:
        (decision,) = no_copy_decisions(container)
        return decision.reason

    holder, _ = make_holder([(4,)], exp_avg=FP32, exp_avg_sq=FP32)
    assert reason_for(holder) == "not inside a distributed optimizer"
    stub = distributed(None, precision_aware=False)
    assert reason_for(stub) == "stub optimizer (no parameters on this rank)"
    master, _ = make_holder([(4,)], exp_avg=FP32, exp_avg_sq=FP32, master=True)
    assert reason_for(distributed(master, precision_aware=False)) == "master_weights is on"
    bf16_moments, _ = make_holder([(4,)], exp_avg=BF16, exp_avg_sq=FP32)
    assert reason_for(distributed(bf16_moments, precision_aware=False)) == (
        "exp_avg is stored as torch.bfloat16, not FP32"
    )
    adamw = torch.optim.AdamW(make_params([(4,)], 0), lr=0.1)
    assert reason_for(distributed(adamw, precision_aware=False)) == (
        "AdamW is not a precision-aware holder"
    )
    remainders, _ = make_holder([(4,)], exp_avg=FP32, exp_avg_sq=FP32)
    remainders.store_param_remainders = True
    assert reason_for(distributed(remainders, precision_aware=False)) == (
        "store_param_remainders is on"
    )
    bf16_params, _ = make_holder([(4,)], exp_avg=FP32, exp_avg_sq=FP32, param_dtype=BF16, steps=0)
    assert reason_for(distributed(bf16_params, precision_aware=False)) == (
        "a parameter is torch.bfloat16, not FP32"
    )


# ----------------------------------------------------------------------------------------
# probe and wrapper plumbing
# ----------------------------------------------------------------------------------------


def test_probe_counts_only_its_own_block() -> None:
    device_ledger.allocate(100)
    try:
        with DeviceMemoryProbe() as probe:
            device_ledger.allocate(50)
            device_ledger.release(50)
            device_ledger.allocate(20)
            device_ledger.release(20)
        assert probe.peak_extra_bytes == 50
        assert probe.summary()["source"] == "ledger"
    finally:
        device_ledger.release(100)


def test_engine_contexts_share_stats_and_validate() -> None:
    holder, _ = make_holder([(10,)])
    stats = StagingStats()
    with staged_save(holder, chunk_bytes=8, stats=stats), staged_load(holder, stats=stats):
        holder.load_state_dict(holder.state_dict())
    assert stats.chunked_reads == 2 and stats.chunked_writes == 2
    with pytest.raises(ValueError), staged_save(holder, chunk_bytes=0):
        pass
    assert_unpatched(holder)


def test_wrapper_is_transparent_for_training_and_pickles() -> None:
    holder, params = make_holder([(5,)])
    stack = StagedCheckpointOptimizer(holder, chunk_bytes=1024)
    assert stack.param_groups is holder.param_groups
    assert "StagedCheckpointOptimizer(chunk_bytes=1024" in repr(stack)
    train(stack, params, 1, 0)
    clone = pickle.loads(pickle.dumps(stack))
    assert clone.chunk_bytes == 1024
    assert_same(clone.state_dict(), stack.state_dict())


def test_unstaged_baseline_counter_sees_every_expansion() -> None:
    opt, params = make_holder([(20,), (3, 4)], exp_avg=BF16, exp_avg_sq=FP8, master=True)
    with DeviceMemoryProbe() as probe, count_unstaged_expansions(opt):
        sd = opt.state_dict()
    assert probe.peak_extra_bytes == 2 * 4 * sum(p.numel() for p in params)
    del sd
    assert_unpatched(opt)


def test_benchmark_and_gpu_script_code_paths_on_cpu() -> None:
    row = bench_staged.measure(30_000, chunk_bytes=4096, reps=1)
    assert row["save_peak"]["unstaged"] == 8 * row["params"]
    assert row["save_peak"]["whole"] == 4 * row["largest"]
    assert row["save_peak"]["chunked"] <= 4096 and row["load_peak"]["chunked"] <= 4096
    section = gpu_staged._run("cpu", [40_000], 4096)
    assert "| 0M | 0 (" in section.markdown and "| 1 |" in section.markdown  # one adoption
    assert section.ok, section.failures  # the one-chunk bounds hold on the CPU ledger


def test_dtensor_params_are_handed_through_unstaged(tmp_path: Any) -> None:
    dist = torch.distributed
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    created = not dist.is_initialized()
    if created:
        store = f"file://{tmp_path / 'store'}"
        dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        full = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
        p = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
        opt = Holder([p], exp_avg_dtype=BF16, exp_avg_sq_dtype=FP16)
        p.grad = distribute_tensor(full * 0.5, mesh, [Shard(0)])
        opt.step()
        bare = opt.state_dict()
        stack = StagedCheckpointOptimizer(opt, chunk_bytes=16)
        with DeviceMemoryProbe() as probe:
            staged = stack.state_dict()
        assert stack.last_stats.passthrough_reads == 2
        assert stack.last_stats.chunked_reads == 0 and probe.peak_extra_bytes == 0
        with staged_save(opt) as stats:  # a call by keyword is handed through as it is
            by_keyword = opt.get_unscaled_state(param=p, state_name="exp_avg")
        assert stats.passthrough_reads == 1
        assert torch.equal(by_keyword.full_tensor(), bare["state"][0]["exp_avg"].full_tensor())
        for name in ("exp_avg", "exp_avg_sq"):
            value = staged["state"][0][name]
            assert type(value) is type(bare["state"][0][name])
            assert torch.equal(value.full_tensor(), bare["state"][0][name].full_tensor())
        stack.load_state_dict(staged)
        assert stack.last_stats.chunked_writes == 0
        assert_unpatched(opt)
    finally:
        if created:
            dist.destroy_process_group()


def test_allocator_cache_is_released_after_an_adoption_only(monkeypatch: Any) -> None:
    released: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: released.append(1))
    container, holder = fp32_distributed()
    with fp32_no_copy_load(container):
        holder.load_state_dict(plain_adam_state(holder))
    assert released == [1]
    with fp32_no_copy_load(container):
        holder.load_state_dict(holder.state_dict())  # its own FP32 state is plain Adam state too
    assert released == [1, 1]
    mixed = plain_adam_state(holder)
    mixed["state"][0]["exp_avg"] = mixed["state"][0]["exp_avg"].half()
    with fp32_no_copy_load(container) as stats:
        holder.load_state_dict(mixed)
    assert stats.adoptions == 0 and released == [1, 1]
