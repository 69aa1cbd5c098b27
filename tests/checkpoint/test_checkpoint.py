"""Streaming DCP optimizer checkpoints: round trips, interop with plain DCP, errors, bounds."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from wrapped_optim import OptimizerWrapper
from wrapped_optim.checkpoint import (
    OptimizerCheckpointError,
    StreamingSavePlanner,
    load_optimizer,
    save_optimizer,
)
from wrapped_optim.checkpoint._common import DEFAULT_CHUNK_BYTES

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _params(shapes: list[tuple[int, ...]], seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _train(opt: Any, params: list[torch.nn.Parameter], steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def _plain_save(opt: Any, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(opt.state_dict(), checkpoint_id=path, no_dist=True)


def _plain_load(scaffold: dict[str, Any], path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(scaffold, checkpoint_id=path, no_dist=True)


def assert_state_dicts_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for index, entries in a["state"].items():
        other = b["state"][index]
        assert entries.keys() == other.keys(), index
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == other[name].dtype, (index, name)
                assert torch.equal(value, other[name]), (index, name)
            else:
                assert value == other[name], (index, name)


OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.8, 0.9)),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgd_plain": lambda ps: torch.optim.SGD(ps, lr=0.1),  # momentum_buffer is None
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, centered=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),  # factored (row/col) state
}
SHAPES = [(7, 5), (13,), (3, 4, 2), ()]


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_round_trip_into_fresh_optimizer_then_training_continues_bit_identically(
    kind: str, tmp_path: Path
) -> None:
    params = _params(SHAPES)
    opt = OPTIMIZERS[kind](params)
    _train(opt, params, 3)
    save_optimizer(opt, tmp_path, chunk_bytes=32)

    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = OPTIMIZERS[kind](twin_params)
    for g in twin.param_groups:
        g["lr"] = 123.0  # must be overwritten from the checkpoint
    load_optimizer(twin, tmp_path)
    assert_state_dicts_equal(twin.state_dict(), opt.state_dict())

    _train(opt, params, 2, seed=7)
    _train(twin, twin_params, 2, seed=7)
    for p, q in zip(params, twin_params, strict=True):
        assert torch.equal(p, q)


def test_load_writes_into_the_live_state_tensors(tmp_path: Path) -> None:
    params = _params(SHAPES)
    opt = torch.optim.Adam(params, lr=1e-2)
    _train(opt, params, 2)
    expected = copy.deepcopy(opt.state_dict())
    save_optimizer(opt, tmp_path, chunk_bytes=40)
    live = {id(p): dict(opt.state[p]) for p in params}
    for entries in opt.state.values():
        for value in entries.values():
            value.zero_()
    load_optimizer(opt, tmp_path)
    for p in params:
        for name, tensor in opt.state[p].items():
            assert tensor is live[id(p)][name], name  # same tensor object: no new storage
    assert_state_dicts_equal(opt.state_dict(), expected)


def test_plain_dcp_load_reads_a_streaming_checkpoint(tmp_path: Path) -> None:
    params = _params(SHAPES)
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)
    _train(opt, params, 2)
    save_optimizer(opt, tmp_path, chunk_bytes=24)  # several row chunks per tensor

    md = FileSystemReader(tmp_path).read_metadata()
    entry = md.state_dict_metadata["state.0.exp_avg"]
    assert isinstance(entry, TensorStorageMetadata)
    assert len(entry.chunks) == 7  # 7 rows of 5 float32 = 20 bytes each

    other_params = _params(SHAPES, seed=5)
    other = torch.optim.AdamW(other_params, lr=1.0)
    _train(other, other_params, 1, seed=3)
    scaffold = other.state_dict()
    _plain_load(scaffold, tmp_path)
    assert_state_dicts_equal(scaffold, opt.state_dict())


def test_load_optimizer_reads_a_plain_dcp_checkpoint(tmp_path: Path) -> None:
    params = _params(SHAPES)
    opt = torch.optim.RMSprop(params, lr=1e-2, momentum=0.3)
    _train(opt, params, 2)
    _plain_save(opt, tmp_path)
    twin = torch.optim.RMSprop(_params(SHAPES, seed=9), lr=5.0)
    load_optimizer(twin, tmp_path)
    assert_state_dicts_equal(twin.state_dict(), opt.state_dict())


def test_works_through_a_wrapper_stack(tmp_path: Path) -> None:
    params = _params(SHAPES)
    opt = OptimizerWrapper(OptimizerWrapper(torch.optim.Adam(params, lr=1e-3)))
    _train(opt, params, 2)
    save_optimizer(opt, tmp_path / "a")
    twin = OptimizerWrapper(torch.optim.Adam(_params(SHAPES, seed=4), lr=1e-1))
    load_optimizer(twin, tmp_path / "a")
    assert_state_dicts_equal(twin.state_dict(), opt.state_dict())


def test_empty_optimizer_state_round_trips(tmp_path: Path) -> None:
    params = _params(SHAPES)
    opt = torch.optim.Adam(params, lr=0.25)
    save_optimizer(opt, tmp_path)
    twin = torch.optim.Adam(_params(SHAPES), lr=1.0)
    load_optimizer(twin, tmp_path)
    assert twin.param_groups[0]["lr"] == 0.25
    assert len(twin.state) == 0


def test_save_writer_options_and_release(tmp_path: Path) -> None:
    params = _params([(64, 16), (33, 8)])
    opt = torch.optim.Adam(params, lr=1e-3)
    _train(opt, params, 1)
    writer = FileSystemWriter(tmp_path, thread_count=2, sync_files=False)
    before = writer.per_thread_copy_ahead
    save_optimizer(opt, tmp_path, storage_writer=writer, chunk_bytes=512)
    assert writer.per_thread_copy_ahead == before  # restored after the save
    twin = torch.optim.Adam(_params([(64, 16), (33, 8)], seed=2), lr=1.0)
    load_optimizer(twin, tmp_path)
    assert_state_dicts_equal(twin.state_dict(), opt.state_dict())


def test_planner_materialises_at_most_one_chunk_per_item(tmp_path: Path) -> None:
    sd = {"a": torch.randn(100, 10), "b": {"c": torch.randn(50)}, "n": 3}
    planner = StreamingSavePlanner(chunk_bytes=400, release_after_write=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=tmp_path, no_dist=True, planner=planner)
    assert 0 < planner.peak_chunk_bytes <= 400
    out = {"a": torch.zeros(100, 10), "b": {"c": torch.zeros(50)}, "n": 0}
    _plain_load(out, tmp_path)
    assert torch.equal(out["a"], sd["a"]) and torch.equal(out["b"]["c"], sd["b"]["c"])
    assert out["n"] == 3


def test_rejects_bad_chunk_bytes() -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        StreamingSavePlanner(chunk_bytes=0)


# ------------------------------------------------------------------------------------------
# Bad checkpoints: clear errors, optimizer untouched
# ------------------------------------------------------------------------------------------
def _snapshot(opt: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy(opt.state_dict())


@pytest.mark.parametrize(
    ("other_shapes", "other_groups", "message"),
    [
        ([(7, 5), (13,), (3, 4, 2), ()], 2, "2 param groups"),
        ([(7, 5), (13,)], 1, "param group 0: the checkpoint has 2 params"),
        ([(7, 5), (14,), (3, 4, 2), ()], 1, r"param 1: state 'exp_avg' has shape \(14,\)"),
    ],
)
def test_mismatched_checkpoint_is_rejected_before_any_write(
    tmp_path: Path, other_shapes: list[tuple[int, ...]], other_groups: int, message: str
) -> None:
    src_params = _params(other_shapes, seed=3)
    if other_groups == 2:
        src = torch.optim.Adam([{"params": src_params[:2]}, {"params": src_params[2:]}])
    else:
        src = torch.optim.Adam(src_params)
    _train(src, src_params, 1)
    save_optimizer(src, tmp_path)

    params = _params(SHAPES)
    opt = torch.optim.Adam(params, lr=1e-2)
    _train(opt, params, 2)
    before = _snapshot(opt)
    with pytest.raises(OptimizerCheckpointError, match=message):
        load_optimizer(opt, tmp_path)
    assert_state_dicts_equal(opt.state_dict(), before)


def test_state_that_cannot_fit_a_fresh_parameter_is_rejected(tmp_path: Path) -> None:
    src_params = _params([(4, 3)])
    src = torch.optim.Adam(src_params)
    _train(src, src_params, 1)
    save_optimizer(src, tmp_path)
    fresh = torch.optim.Adam(_params([(4, 2)]))
    with pytest.raises(OptimizerCheckpointError, match=r"shape \(4, 3\), the param has \(4, 2\)"):
        load_optimizer(fresh, tmp_path)
    assert len(fresh.state) == 0


def test_not_an_optimizer_checkpoint(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"weight": torch.ones(2)}, checkpoint_id=tmp_path, no_dist=True)
    opt = torch.optim.SGD(_params([(2,)]), lr=0.1)
    with pytest.raises(OptimizerCheckpointError, match="param_groups"):
        load_optimizer(opt, tmp_path)


def test_megatron_like_containers_are_refused(tmp_path: Path) -> None:
    class Container:
        def __init__(self, inner: Any) -> None:
            self.optimizer = inner

        def step(self) -> None: ...

        def state_dict(self) -> dict[str, Any]:
            return {}

    class Chained:
        def __init__(self, *children: Any) -> None:
            self.chained_optimizers = list(children)

    adam = torch.optim.Adam(_params([(2,)]))
    with pytest.raises(TypeError, match="Megatron"):
        save_optimizer(Container(adam), tmp_path)
    with pytest.raises(TypeError, match="2 leaf"):
        load_optimizer(Chained(Container(adam), Container(adam)), tmp_path)


def test_needs_a_destination() -> None:
    opt = torch.optim.SGD(_params([(2,)]), lr=0.1)
    with pytest.raises(ValueError, match="checkpoint_id"):
        save_optimizer(opt)
    with pytest.raises(ValueError, match="checkpoint_id"):
        load_optimizer(opt)


# ------------------------------------------------------------------------------------------
# Property: any shapes, chunk sizes and histories round-trip exactly, both directions
# ------------------------------------------------------------------------------------------
shapes_strategy = st.lists(
    st.lists(st.integers(1, 6), min_size=0, max_size=3).map(tuple), min_size=1, max_size=4
)


@given(
    shapes=shapes_strategy,
    steps=st.integers(0, 3),
    chunk_bytes=st.one_of(st.none(), st.integers(1, 200)),
    plain_writer=st.booleans(),
    kind=st.sampled_from(sorted(OPTIMIZERS)),
)
def test_property_round_trip(
    tmp_path_factory: pytest.TempPathFactory,
    shapes: list[tuple[int, ...]],
    steps: int,
    chunk_bytes: int | None,
    plain_writer: bool,
    kind: str,
) -> None:
    path = tmp_path_factory.mktemp("ckpt")
    params = _params(shapes)
    opt = OPTIMIZERS[kind](params)
    _train(opt, params, steps)
    if plain_writer:
        _plain_save(opt, path)
    else:
        save_optimizer(opt, path, chunk_bytes=chunk_bytes)
    twin = OPTIMIZERS[kind]([torch.nn.Parameter(p.detach().clone()) for p in params])
    load_optimizer(twin, path)
    assert_state_dicts_equal(twin.state_dict(), opt.state_dict())
    if steps and not plain_writer:
        scaffold = copy.deepcopy(opt.state_dict())
        for entries in scaffold["state"].values():
            for name, value in entries.items():
                if isinstance(value, torch.Tensor):
                    entries[name] = torch.full_like(value, math.nan)
        _plain_load(scaffold, path)
        assert_state_dicts_equal(scaffold, opt.state_dict())


# ------------------------------------------------------------------------------------------
# Precision-aware holders: a small protocol double (bf16 and scaled-fp16 moments)
# ------------------------------------------------------------------------------------------
class ToyPrecisionMomentum(torch.optim.Optimizer):
    """Momentum SGD whose two moments are stored compressed, with the holder protocol.

    exp_avg is stored in bf16 (no scale); exp_avg_sq in fp16 with a per-tensor scale
    amax / 32752, as TE stores fp16 moments. Records how it was asked for state.
    """

    name_to_dtype_map = {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.float16}

    def __init__(self, params: list[torch.nn.Parameter], lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr, "step": 0})
        self.scales: dict[tuple[int, str], torch.Tensor] = {}
        self.calls: dict[str, int] = {"get": 0, "set": 0, "read_chunk": 0, "write_chunked": 0}
        self.max_chunk_numel = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            group["step"] += 1
            for p in group["params"]:
                m = self._decode(p, "exp_avg") if p in self.state else torch.zeros_like(p)
                v = self._decode(p, "exp_avg_sq") if p in self.state else torch.zeros_like(p)
                m.mul_(0.9).add_(p.grad)
                v.mul_(0.99).addcmul_(p.grad, p.grad)
                self._encode(p, "exp_avg", m)
                self._encode(p, "exp_avg_sq", v)
                p.sub_(group["lr"] * m / (v.sqrt() + 1e-3))

    # storage format
    def _decode(self, p: torch.Tensor, name: str) -> torch.Tensor:
        stored = self.state[p][name]
        if name == "exp_avg":
            return stored.float()
        return stored.float() * self.scales[(id(p), name)]

    def _encode(self, p: torch.Tensor, name: str, x: torch.Tensor) -> None:
        if name == "exp_avg":
            self.state[p][name] = x.to(torch.bfloat16)
            return
        amax = x.abs().max() if x.numel() else torch.zeros(())
        scale = torch.where(amax > 0, amax / 32752, torch.ones(()))
        self.scales[(id(p), name)] = scale
        self.state[p][name] = (x / scale).to(torch.float16)

    # the holder protocol
    def get_unscaled_state(self, p: torch.Tensor, name: str) -> torch.Tensor:
        self.calls["get"] += 1
        return self._decode(p, name)

    def set_scaled_state(self, p: torch.Tensor, name: str, x: torch.Tensor) -> None:
        self.calls["set"] += 1
        self._encode(p, name, x.clone())

    def read_unscaled_state_chunk(
        self, p: torch.Tensor, name: str, start: int, out: torch.Tensor
    ) -> None:
        self.calls["read_chunk"] += 1
        self.max_chunk_numel = max(self.max_chunk_numel, out.numel())
        flat = self.state[p][name].reshape(-1)[start : start + out.numel()].float()
        if name != "exp_avg":
            flat = flat * self.scales[(id(p), name)]
        out.copy_(flat)

    def write_scaled_state_chunked(
        self, p: torch.Tensor, name: str, source: torch.Tensor, chunk_numel: int
    ) -> None:
        self.calls["write_chunked"] += 1
        self._encode(p, name, source.reshape(p.shape).clone())

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        sd["state"] = {
            i: {name: self.get_unscaled_state(params[i], name) for name in entries}
            for i, entries in sd["state"].items()
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        for i, entries in state_dict["state"].items():
            for name, value in entries.items():
                self.state[params[i]]
                self.set_scaled_state(params[i], name, value)


class ToyWholeTensorHolder(ToyPrecisionMomentum):
    """The same holder without the chunk API (like TE FusedAdam)."""

    read_unscaled_state_chunk = None  # type: ignore[assignment]
    write_scaled_state_chunked = None  # type: ignore[assignment]


def _storage(opt: ToyPrecisionMomentum) -> list[tuple[torch.Tensor, ...]]:
    out = []
    for g in opt.param_groups:
        for p in g["params"]:
            if p in opt.state:
                out.append(
                    (
                        opt.state[p]["exp_avg"],
                        opt.state[p]["exp_avg_sq"],
                        opt.scales[(id(p), "exp_avg_sq")],
                    )
                )
    return out


def _assert_same_storage(a: ToyPrecisionMomentum, b: ToyPrecisionMomentum) -> None:
    sa, sb = _storage(a), _storage(b)
    assert len(sa) == len(sb)
    for x, y in zip(sa, sb, strict=True):
        for u, v in zip(x, y, strict=True):
            assert u.dtype == v.dtype and torch.equal(u, v)


HOLDER_SHAPES = [(40, 6), (17,), (2, 3, 5)]


@pytest.mark.parametrize("holder_cls", [ToyPrecisionMomentum, ToyWholeTensorHolder])
def test_holder_save_streams_and_loads_into_storage(
    holder_cls: type[ToyPrecisionMomentum], tmp_path: Path
) -> None:
    params = _params(HOLDER_SHAPES)
    opt = holder_cls(params, lr=0.05)
    _train(opt, params, 3)
    expected = opt.state_dict()
    opt.calls = dict.fromkeys(opt.calls, 0)

    save_optimizer(OptimizerWrapper(opt), tmp_path, chunk_bytes=64)  # 16 floats per chunk
    if holder_cls is ToyPrecisionMomentum:
        assert opt.calls["get"] == 0  # never the whole expansion
        assert 0 < opt.max_chunk_numel <= 16
    else:
        assert opt.calls["get"] == 2 * len(HOLDER_SHAPES)  # one whole tensor at a time

    # plain DCP reads it as the optimizer's ordinary (expanded FP32) state dict
    scaffold = copy.deepcopy(expected)
    _plain_load(scaffold, tmp_path)
    assert_state_dicts_equal(scaffold, expected)

    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = holder_cls(twin_params, lr=9.0)
    _train(twin, twin_params, 1, seed=11)  # different storage and scales to overwrite
    twin.calls = dict.fromkeys(twin.calls, 0)
    bf16_storage = [twin.state[q]["exp_avg"] for q in twin_params]
    load_optimizer(twin, tmp_path)
    _assert_same_storage(twin, opt)
    assert twin.param_groups[0]["lr"] == 0.05 and twin.param_groups[0]["step"] == 3
    # bf16 exp_avg (no scale) is read straight into the live storage; the fp16 exp_avg_sq
    # goes through the holder's writer once its whole tensor has arrived.
    assert all(
        twin.state[q]["exp_avg"] is t for q, t in zip(twin_params, bf16_storage, strict=True)
    )
    key = "write_chunked" if holder_cls is ToyPrecisionMomentum else "set"
    assert twin.calls[key] == len(HOLDER_SHAPES) and twin.calls["get"] == 0

    with torch.no_grad():
        for p, q in zip(params, twin_params, strict=True):
            q.copy_(p)  # the twin's own training step moved its params
    _train(opt, params, 2, seed=4)
    _train(twin, twin_params, 2, seed=4)
    for p, q in zip(params, twin_params, strict=True):
        assert torch.equal(p, q)


def test_holder_loads_a_plain_dcp_checkpoint_into_a_fresh_optimizer(tmp_path: Path) -> None:
    params = _params(HOLDER_SHAPES)
    opt = ToyPrecisionMomentum(params, lr=0.05)
    _train(opt, params, 2)
    _plain_save(opt, tmp_path)
    twin = ToyPrecisionMomentum([torch.nn.Parameter(p.detach().clone()) for p in params])
    load_optimizer(twin, tmp_path)  # no state yet: storage is created by the holder
    _assert_same_storage(twin, opt)
    assert twin.param_groups[0]["step"] == 2


def test_holder_shape_mismatch_is_rejected_before_any_write(tmp_path: Path) -> None:
    src_params = _params([(40, 6), (18,), (2, 3, 5)])
    src = ToyPrecisionMomentum(src_params)
    _train(src, src_params, 1)
    save_optimizer(src, tmp_path)
    params = _params(HOLDER_SHAPES)
    opt = ToyPrecisionMomentum(params)
    _train(opt, params, 2)
    before = [tuple(t.clone() for t in s) for s in _storage(opt)]
    with pytest.raises(
        OptimizerCheckpointError, match=r"param 1: state 'exp_avg' has shape \(18,\)"
    ):
        load_optimizer(opt, tmp_path)
    for x, y in zip(_storage(opt), before, strict=True):
        for u, v in zip(x, y, strict=True):
            assert torch.equal(u, v)


# ------------------------------------------------------------------------------------------
# PrecisionAwareAdamW (bf16 / fp16 / FP8 moments, masters, remainders)
# ------------------------------------------------------------------------------------------
PA_CONFIGS: dict[str, tuple[torch.dtype, dict[str, Any]]] = {
    "fp32": (torch.float32, {}),
    "bf16_moments": (
        torch.float32,
        {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16},
    ),
    "fp16_fp8": (torch.float32, {"exp_avg_dtype": torch.float16, "exp_avg_sq_dtype": torch.uint8}),
    "bf16_params_fp32_master": (
        torch.bfloat16,
        {"master_weights": True, "exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.uint8},
    ),
    "remainders": (
        torch.bfloat16,
        {
            "master_weights": True,
            "store_param_remainders": True,
            "exp_avg_dtype": torch.float16,
            "exp_avg_sq_dtype": torch.bfloat16,
        },
    ),
}
PA_SHAPES = [(24, 8), (31,), (3, 5, 2)]


def _pa(config: str, seed: int = 0, lr: float = 1e-2) -> tuple[Any, list[torch.nn.Parameter]]:
    from wrapped_optim.optimizers import PrecisionAwareAdamW

    dtype, kwargs = PA_CONFIGS[config]
    params = [torch.nn.Parameter(p.detach().to(dtype)) for p in _params(PA_SHAPES, seed)]
    return PrecisionAwareAdamW(params, lr=lr, weight_decay=0.01, **kwargs), params


def _pa_train(opt: Any, params: list[torch.nn.Parameter], steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()


def _assert_same_pa_storage(a: Any, b: Any) -> None:
    pa = [p for g in a.param_groups for p in g["params"]]
    pb = [p for g in b.param_groups for p in g["params"]]
    for p, q in zip(pa, pb, strict=True):
        assert a.state[p].keys() == b.state[q].keys()
        for name, stored in a.state[p].items():
            other = b.state[q][name]
            assert stored.dtype == other.dtype, name
            assert torch.equal(stored.view(torch.uint8), other.view(torch.uint8)), name
            # equal storage and equal expansions: equal scales
            ea, eb = a.get_unscaled_state(p, name), b.get_unscaled_state(q, name)
            assert torch.equal(ea.view(torch.uint8), eb.view(torch.uint8)), name
    assert a.param_groups[0]["step"] == b.param_groups[0]["step"]


@pytest.mark.parametrize("config", sorted(PA_CONFIGS))
def test_precision_aware_adamw_streams_both_ways(config: str, tmp_path: Path) -> None:
    from wrapped_optim.patching import patch_attribute

    opt, params = _pa(config)
    _pa_train(opt, params, 3)
    expected = opt.state_dict()
    compressed = {n for n, d in opt.name_to_dtype_map.items() if d != torch.float32}

    whole_expansions: list[str] = []
    original = opt.get_unscaled_state

    def counting(param: torch.Tensor, name: str) -> torch.Tensor:
        if name in compressed:
            whole_expansions.append(name)
        return original(param, name)

    with patch_attribute(opt, "get_unscaled_state", counting):
        save_optimizer(opt, tmp_path / "stream", chunk_bytes=96)
    assert whole_expansions == []  # compressed state was only ever expanded chunk by chunk

    # plain DCP reads the streaming checkpoint as the optimizer's portable FP32 state dict
    scaffold = copy.deepcopy(expected)
    for entries in scaffold["state"].values():
        for value in entries.values():
            value.zero_()
    _plain_load(scaffold, tmp_path / "stream")
    assert_state_dicts_equal(scaffold, expected)

    # streaming load == the optimizer's own load_state_dict, bit for bit
    twin, twin_params = _pa(config, seed=3, lr=5.0)
    _pa_train(twin, twin_params, 1, seed=9)
    load_optimizer(twin, tmp_path / "stream")
    reference, _ = _pa(config, seed=3)
    reference.load_state_dict(expected)
    _assert_same_pa_storage(twin, reference)
    _assert_same_pa_storage(twin, opt)

    # plain dcp.save -> streaming load into a never-stepped optimizer
    _plain_save(opt, tmp_path / "plain")
    fresh, fresh_params = _pa(config, seed=4)
    load_optimizer(fresh, tmp_path / "plain")
    _assert_same_pa_storage(fresh, opt)

    # and training continues exactly as if it had never stopped
    with torch.no_grad():
        for p, q in zip(params, fresh_params, strict=True):
            q.copy_(p)
    _pa_train(opt, params, 2, seed=5)
    _pa_train(fresh, fresh_params, 2, seed=5)
    for p, q in zip(params, fresh_params, strict=True):
        assert torch.equal(p, q)


def test_precision_aware_remainder_mismatch_is_rejected(tmp_path: Path) -> None:
    opt, params = _pa("bf16_params_fp32_master")
    _pa_train(opt, params, 1)
    save_optimizer(opt, tmp_path)
    other, other_params = _pa("remainders")
    _pa_train(other, other_params, 2)
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(OptimizerCheckpointError, match="store_param_remainders mismatch"):
        load_optimizer(other, tmp_path)
    assert_state_dicts_equal(other.state_dict(), before)


def test_precision_aware_missing_state_is_rejected(tmp_path: Path) -> None:
    src = torch.optim.SGD(_params(PA_SHAPES), lr=0.1, momentum=0.9)
    _train(src, src.param_groups[0]["params"], 1)
    save_optimizer(src, tmp_path)  # momentum_buffer only: not PrecisionAwareAdamW state
    opt, _ = _pa("bf16_moments")
    with pytest.raises(OptimizerCheckpointError, match="momentum_buffer"):
        load_optimizer(opt, tmp_path)


@given(
    config=st.sampled_from(sorted(PA_CONFIGS)),
    steps=st.integers(1, 3),
    chunk_bytes=st.one_of(st.none(), st.integers(2, 300)),
)
def test_property_precision_aware_round_trip(
    tmp_path_factory: pytest.TempPathFactory, config: str, steps: int, chunk_bytes: int | None
) -> None:
    path = tmp_path_factory.mktemp("pa")
    opt, params = _pa(config)
    _pa_train(opt, params, steps)
    save_optimizer(opt, path, chunk_bytes=chunk_bytes)
    twin, _ = _pa(config, seed=1)
    load_optimizer(twin, path, chunk_bytes=chunk_bytes or DEFAULT_CHUNK_BYTES)
    _assert_same_pa_storage(twin, opt)


# ------------------------------------------------------------------------------------------
# HybridOffloadOptimizer, alone and under HybridSyncOptimizer
# ------------------------------------------------------------------------------------------
def _hybrid(seed: int = 0, lr: float = 1e-2) -> tuple[Any, list[torch.nn.Parameter]]:
    from wrapped_optim.optimizers import HybridOffloadOptimizer

    params = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in _params(PA_SHAPES, seed)]
    params.append(_params([(6, 2)], seed)[0])  # an fp32 param too
    return HybridOffloadOptimizer(params, offload_fraction=0.5, lr=lr), params


@pytest.mark.parametrize("synced", [False, True])
def test_hybrid_offload_streams_in_place(synced: bool, tmp_path: Path) -> None:
    from wrapped_optim.hybrid import HybridSyncOptimizer

    opt, params = _hybrid()
    _pa_train(opt, params, 3)
    expected = copy.deepcopy(opt.state_dict())
    save_optimizer(HybridSyncOptimizer(opt) if synced else opt, tmp_path, chunk_bytes=64)

    scaffold = copy.deepcopy(expected)
    _plain_load(scaffold, tmp_path)
    assert_state_dicts_equal(scaffold, expected)

    twin, twin_params = _hybrid(seed=6, lr=1.0)
    _pa_train(twin, twin_params, 1, seed=2)
    live = {id(p): dict(twin.state[p]) for p in twin_params}
    stack = HybridSyncOptimizer(twin) if synced else twin
    load_optimizer(stack, tmp_path)
    assert_state_dicts_equal(twin.state_dict(), expected)
    for p in twin_params:  # written into the sub-optimizers' own tensors
        for name, value in twin.state[p].items():
            assert value is live[id(p)][name], name
    if synced:
        # HybridSyncOptimizer pushed the restored masters into the model weights
        for p, q in zip(params, twin_params, strict=True):
            assert torch.equal(p, q)
        _pa_train(opt, params, 2, seed=8)
        _pa_train(stack, twin_params, 2, seed=8)
        for p, q in zip(params, twin_params, strict=True):
            assert torch.equal(p, q)


def test_hybrid_offload_without_state_loads_through_its_loader(tmp_path: Path) -> None:
    opt, params = _hybrid()
    _pa_train(opt, params, 2)
    save_optimizer(opt, tmp_path)
    fresh, _ = _hybrid(seed=1)
    load_optimizer(fresh, tmp_path)
    assert_state_dicts_equal(fresh.state_dict(), opt.state_dict())


class AdoptingHolder(ToyWholeTensorHolder):
    """A holder whose set_scaled_state keeps the caller's FP32 tensor as its storage."""

    name_to_dtype_map = {"exp_avg": torch.float32, "exp_avg_sq": torch.float16}

    def _encode(self, p: torch.Tensor, name: str, x: torch.Tensor) -> None:
        if name == "exp_avg":
            self.state[p][name] = x  # adopted, not copied
            return
        super()._encode(p, name, x)

    def set_scaled_state(self, p: torch.Tensor, name: str, x: torch.Tensor) -> None:
        self.calls["set"] += 1
        self._encode(p, name, x if name == "exp_avg" else x.clone())

    def _decode(self, p: torch.Tensor, name: str) -> torch.Tensor:
        if name == "exp_avg":
            return self.state[p][name]
        return super()._decode(p, name)


def test_an_adopted_accumulator_is_not_released(tmp_path: Path) -> None:
    params = _params(HOLDER_SHAPES)
    opt = AdoptingHolder(params)
    _train(opt, params, 2)
    save_optimizer(opt, tmp_path)
    fresh = AdoptingHolder([torch.nn.Parameter(p.detach().clone()) for p in params])
    load_optimizer(fresh, tmp_path)  # no live state: exp_avg goes through set_scaled_state
    assert_state_dicts_equal(fresh.state_dict(), opt.state_dict())


def test_staged_stacks_interoperate_with_their_own_state_dicts(tmp_path: Path) -> None:
    from wrapped_optim.staged import StagedCheckpointOptimizer

    opt, params = _pa("bf16_params_fp32_master")
    stack = StagedCheckpointOptimizer(opt, chunk_bytes=256)
    _pa_train(stack, params, 2)
    save_optimizer(stack, tmp_path / "stream", chunk_bytes=128)
    _plain_save(stack, tmp_path / "plain")  # the stack's own (staged) state dict

    scaffold = copy.deepcopy(stack.state_dict())
    for entries in scaffold["state"].values():
        for value in entries.values():
            value.zero_()
    _plain_load(scaffold, tmp_path / "stream")
    assert_state_dicts_equal(scaffold, opt.state_dict())

    for name in ("stream", "plain"):
        twin, _ = _pa("bf16_params_fp32_master", seed=8)
        load_optimizer(StagedCheckpointOptimizer(twin), tmp_path / name)
        _assert_same_pa_storage(twin, opt)


def test_precision_aware_save_with_several_writer_threads(tmp_path: Path) -> None:
    opt, params = _pa("fp16_fp8")
    _pa_train(opt, params, 2)
    writer = FileSystemWriter(tmp_path, thread_count=3, sync_files=False)
    save_optimizer(opt, tmp_path, storage_writer=writer, chunk_bytes=100)
    assert len(list(tmp_path.glob("*.distcp"))) == 3
    twin, _ = _pa("fp16_fp8", seed=2)
    load_optimizer(twin, tmp_path, chunk_bytes=64)
    _assert_same_pa_storage(twin, opt)
