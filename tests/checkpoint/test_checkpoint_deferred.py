"""Deferred state (``wrapped_optim.checkpoint._deferred``): a precision-aware optimizer's
compressed states are promised as meta placeholders and expanded slice by slice when DCP
writes them; what an asynchronous save stages is detached from the live optimizer."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tests.staging.device_shim import DeviceOnCpu
from wrapped_optim.checkpoint._deferred import (
    DeferredState,
    _owned_cpu_copy,
    _placeholder_state_dict,
    _staged_contents,
    _uses_remainder,
)
from wrapped_optim.optimizers import HybridOffloadOptimizer, PrecisionAwareAdamW


class _WholeStatesOnly(PrecisionAwareAdamW):
    """A holder that expands whole states only (as TE's FusedAdam does)."""

    read_unscaled_state_chunk = None  # type: ignore[assignment]


def _stepped(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.linspace(-1.0, 1.0, p.numel()).reshape(p.shape)
    opt.step()
    return opt


def _holder(cls: type[PrecisionAwareAdamW] = PrecisionAwareAdamW) -> PrecisionAwareAdamW:
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    opt = cls(params, lr=0.1, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.uint8)
    return _stepped(opt)  # type: ignore[return-value]


@pytest.mark.parametrize("cls", [PrecisionAwareAdamW, _WholeStatesOnly])
def test_compressed_states_are_promised_and_read_slice_by_slice(
    cls: type[PrecisionAwareAdamW],
) -> None:
    opt = _holder(cls)
    state_dict, deferred = _placeholder_state_dict(opt)
    assert "get_unscaled_state" not in vars(opt)  # the placeholder patch is gone
    assert sorted(deferred) == [
        (0, "exp_avg"),
        (0, "exp_avg_sq"),
        (1, "exp_avg"),
        (1, "exp_avg_sq"),
    ]
    params = [p for g in opt.param_groups for p in g["params"]]
    for (index, name), promised in deferred.items():
        placeholder = state_dict["state"][index][name]
        assert placeholder.is_meta and placeholder.shape == params[index].shape
        assert promised.param is params[index] and promised.name == name
        assert promised.shape == params[index].shape
        whole = opt.get_unscaled_state(params[index], name).reshape(-1)
        numel = whole.numel()
        assert torch.equal(promised.read(0, numel).reshape(-1), whole)  # DCP views it
        pieces = [promised.read(start, min(2, numel - start)) for start in range(0, numel, 2)]
        assert torch.equal(torch.cat(pieces), whole)
        assert torch.equal(promised.read(1, 3), whole[1:4])
    for entry in state_dict["state"].values():
        assert [n for n, v in entry.items() if torch.is_tensor(v) and v.is_meta] == [
            n for n in entry if n in ("exp_avg", "exp_avg_sq")
        ]


def test_an_fp32_state_beside_a_compressed_one_is_real_in_the_state_dict() -> None:
    param = torch.nn.Parameter(torch.randn(6))
    opt = _stepped(PrecisionAwareAdamW([param], lr=0.1, exp_avg_sq_dtype=torch.uint8))
    state_dict, deferred = _placeholder_state_dict(opt)
    assert sorted(deferred) == [(0, "exp_avg_sq")]
    exp_avg = state_dict["state"][0]["exp_avg"]
    assert not exp_avg.is_meta
    assert torch.equal(exp_avg, opt.get_unscaled_state(param, "exp_avg"))


def test_a_whole_read_of_an_fp32_state_is_a_copy_not_the_state() -> None:
    param = torch.nn.Parameter(torch.randn(6))
    opt = _stepped(_WholeStatesOnly([param], lr=0.1, exp_avg_dtype=torch.float32))
    stored = opt.state[param]["exp_avg"]
    before = stored.clone()
    out = DeferredState(opt, param, "exp_avg").read(0, 6)
    assert torch.equal(out, before)
    out.fill_(9.0)  # DCP may free or reuse what it is handed
    assert torch.equal(opt.state[param]["exp_avg"], before)


def test_a_plain_optimizer_has_nothing_deferred() -> None:
    param = torch.nn.Parameter(torch.ones(2))
    opt = _stepped(torch.optim.Adam([param]))
    state_dict, deferred = _placeholder_state_dict(opt)
    assert deferred == {} and not state_dict["state"][0]["exp_avg"].is_meta


def test_an_async_save_stages_a_holders_state_as_it_was() -> None:
    opt = _holder()
    params = [p for g in opt.param_groups for p in g["params"]]
    expected = {
        (i, n): opt.get_unscaled_state(p, n).clone()
        for i, p in enumerate(params)
        for n in ("exp_avg", "exp_avg_sq")
    }
    staged, deferred = _staged_contents(opt)
    _stepped(opt)  # training goes on while the save writes
    assert set(deferred) == set(expected)
    for key, promised in deferred.items():
        assert promised.holder is not opt
        whole = promised.read(0, expected[key].numel()).reshape(-1)
        assert torch.equal(whole, expected[key].reshape(-1))
    assert staged["param_groups"][0]["lr"] == 0.1


def test_an_async_save_copies_what_aliases_the_live_optimizer() -> None:
    param = torch.nn.Parameter(torch.ones(3))
    opt = _stepped(torch.optim.Adam([param], lr=torch.tensor(0.1)))
    opt.state[param]["param_itself"] = param
    staged, deferred = _staged_contents(opt)
    assert deferred == {}
    entry = staged["state"][0]
    before = {name: value.clone() for name, value in entry.items()}
    _stepped(opt)
    opt.param_groups[0]["lr"].fill_(0.5)  # a scheduler writes a tensor lr in place
    for name, value in entry.items():
        assert torch.equal(value, before[name]), name
    assert staged["param_groups"][0]["lr"].item() == pytest.approx(0.1)
    assert entry["param_itself"] is not param


def test_a_state_dict_owned_by_nobody_is_handed_out_as_it_is() -> None:
    compact = torch.arange(4.0)
    assert _owned_cpu_copy(compact) is compact
    base = torch.arange(8.0)
    detached_bigger = torch.empty(0).set_(base.untyped_storage(), 0, (2,))  # type: ignore[call-overload]
    for shared in (base[2:6], base.reshape(2, 4).t(), detached_bigger):
        out = _owned_cpu_copy(shared)
        assert torch.equal(out, shared) and out.is_contiguous() and out._base is None
        assert out.untyped_storage().nbytes() == out.nbytes
        assert out.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    offset = torch.empty(0).set_(base.untyped_storage(), 4, (4,))  # type: ignore[call-overload]
    assert _owned_cpu_copy(offset) is not offset
    bf16 = torch.arange(8.0, dtype=torch.bfloat16)[1:5]
    assert _owned_cpu_copy(bf16).dtype == torch.bfloat16
    assert torch.equal(_owned_cpu_copy(bf16), bf16)
    strided = torch.empty_strided((2, 3), (1, 2))  # no base, its own storage, not contiguous
    strided.copy_(torch.arange(6.0).reshape(2, 3))
    out = _owned_cpu_copy(strided)
    assert out is not strided and out.is_contiguous() and torch.equal(out, strided)
    with_grad = torch.ones(3, requires_grad=True)
    out = _owned_cpu_copy(with_grad)
    assert out is not with_grad and not out.requires_grad and torch.equal(out, torch.ones(3))


def test_only_a_bf16_params_fp32_master_is_kept_as_a_remainder() -> None:
    bf16 = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    fp32 = torch.nn.Parameter(torch.ones(4))
    opt = PrecisionAwareAdamW([bf16, fp32], master_weights=True, store_param_remainders=True)
    assert _uses_remainder(opt, bf16, "master_param")
    assert not _uses_remainder(opt, fp32, "master_param")
    assert not _uses_remainder(opt, bf16, "exp_avg")
    plain = PrecisionAwareAdamW([bf16], master_weights=True)
    assert not _uses_remainder(plain, bf16, "master_param")
    no_master = PrecisionAwareAdamW([bf16], store_param_remainders=True)
    assert not _uses_remainder(no_master, bf16, "master_param")
    fp16_master = PrecisionAwareAdamW(
        [bf16], master_weights=True, master_weight_dtype=torch.float16
    )
    assert not _uses_remainder(fp16_master, bf16, "master_param")


class _Spy(PrecisionAwareAdamW):
    """Records every whole expansion it hands out and every buffer a chunk is expanded into."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.expansions: list[torch.Tensor] = []
        self.chunk_buffers: list[tuple[torch.device, torch.dtype]] = []

    def get_unscaled_state(self, param: torch.Tensor, state_name: str) -> torch.Tensor:
        full = super().get_unscaled_state(param, state_name)
        self.expansions.append(full)
        return full

    def read_unscaled_state_chunk(
        self, param: torch.Tensor, state_name: str, start: int, out: torch.Tensor
    ) -> None:
        self.chunk_buffers.append((out.device, out.dtype))
        super().read_unscaled_state_chunk(param, state_name, start, out)


class _WholeSpy(_Spy):
    read_unscaled_state_chunk = None  # type: ignore[assignment]


def _expected(opt: PrecisionAwareAdamW) -> dict[tuple[int, str], torch.Tensor]:
    params = [p for g in opt.param_groups for p in g["params"]]
    return {
        (i, n): opt.get_unscaled_state(p, n).reshape(-1).clone()
        for i, p in enumerate(params)
        for n in ("exp_avg", "exp_avg_sq")
    }


def test_a_chunked_holder_expands_a_slice_on_the_states_device_never_the_whole() -> None:
    opt = _holder(_Spy)
    expected = _expected(opt)
    _, deferred = _placeholder_state_dict(opt)
    device = torch.device("cuda", 1)
    mode = DeviceOnCpu(device)  # the stored states are device tensors, the params are not
    for entry in opt.state.values():
        for value in entry.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                mode.put_on_device(value)
    opt.expansions.clear()
    with mode:
        reads = {key: promised.read(1, 3) for key, promised in deferred.items()}
        on_device = [mode.on_device(t) for t in reads.values()]
    assert opt.chunk_buffers == [(device, torch.float32)] * len(deferred)
    assert opt.expansions == []  # no whole expansion behind a slice
    assert on_device == [False] * len(deferred)  # handed out as host copies
    for key, value in reads.items():
        assert value.device.type == "cpu" and torch.equal(value, expected[key][1:4])


def test_a_whole_read_of_a_fresh_expansion_is_handed_out_without_a_copy() -> None:
    opt = _holder(_WholeSpy)
    _, deferred = _placeholder_state_dict(opt)
    for promised in deferred.values():
        numel = promised.param.numel()
        opt.expansions.clear()
        whole = promised.read(0, numel)
        assert [whole] == opt.expansions and whole is opt.expansions[0]
        assert opt.chunk_buffers == []


def test_placeholders_and_slices_are_float32_whatever_the_default_dtype() -> None:
    opt = _holder()
    expected = _expected(opt)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        state_dict, deferred = _placeholder_state_dict(opt)
        reads = {key: promised.read(0, 2) for key, promised in deferred.items()}
    finally:
        torch.set_default_dtype(previous)
    assert {state_dict["state"][i][n].dtype for i, n in deferred} == {torch.float32}
    for key, value in reads.items():
        assert value.dtype == torch.float32 and torch.equal(value, expected[key][:2])


def test_a_copy_is_made_on_the_host_whatever_the_default_device() -> None:
    base = torch.arange(8.0)
    with torch.device("meta"):
        out = _owned_cpu_copy(base[2:6])
    assert out.device.type == "cpu" and torch.equal(out, base[2:6])


@pytest.fixture
def mesh(one_process_group: None) -> DeviceMesh:
    """The one-process gloo group's CPU mesh."""
    return init_device_mesh("cpu", (torch.distributed.get_world_size(),))


@pytest.mark.parametrize("cls", [PrecisionAwareAdamW, _WholeStatesOnly])
def test_a_sharded_params_states_are_promised_as_dtensors_and_read_from_its_shard(
    cls: type[PrecisionAwareAdamW], mesh: DeviceMesh
) -> None:
    full = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    param = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
    opt = cls([param], lr=0.1, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.uint8)
    param.grad = distribute_tensor(full * 0.5, mesh, [Shard(0)])
    opt.step()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the placeholder's dtype is float32 regardless
    try:
        state_dict, deferred = _placeholder_state_dict(opt)
    finally:
        torch.set_default_dtype(previous)
    assert sorted(deferred) == [(0, "exp_avg"), (0, "exp_avg_sq")]
    shard = param.to_local()  # type: ignore[attr-defined]
    for (index, name), promised in deferred.items():
        placeholder = state_dict["state"][index][name]
        assert isinstance(placeholder, DTensor) and placeholder.shape == param.shape
        assert placeholder.placements == param.placements  # type: ignore[attr-defined]
        assert placeholder.device_mesh == param.device_mesh  # type: ignore[attr-defined]
        local = placeholder.to_local()
        assert local.is_meta and local.dtype == torch.float32 and local.shape == shard.shape
        whole = opt.get_unscaled_state(param, name).to_local().reshape(-1)  # type: ignore[attr-defined]
        assert torch.equal(promised.read(0, whole.numel()).reshape(-1), whole)
        assert torch.equal(promised.read(2, 5), whole[2:7])


class _TableHolder(torch.optim.Optimizer):
    """A minimal chunked precision-aware holder: no ``master_weights`` or
    ``store_param_remainders`` attribute, and its bf16 codes kept in a table of its own
    (``state`` holds only the step)."""

    name_to_dtype_map = {"exp_avg": torch.bfloat16, "master_param": torch.float32}

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, {"lr": 0.1})
        self.codes: dict[str, dict[torch.Tensor, torch.Tensor]] = {"exp_avg": {}}
        self.chunk_buffers: list[torch.device] = []

    def get_unscaled_state(self, param: torch.Tensor, state_name: str) -> torch.Tensor:
        return self.codes[state_name][param].float()

    def set_scaled_state(self, param: torch.Tensor, state_name: str, value: torch.Tensor) -> None:
        self.codes[state_name][param] = value.to(torch.bfloat16)
        self.state[param]["step"] = torch.tensor(1.0)

    def read_unscaled_state_chunk(
        self, param: torch.Tensor, state_name: str, start: int, out: torch.Tensor
    ) -> None:
        self.chunk_buffers.append(out.device)
        out.copy_(self.codes[state_name][param].reshape(-1)[start : start + out.numel()])

    def write_scaled_state_chunked(
        self, param: torch.Tensor, state_name: str, source: torch.Tensor, chunk_numel: int
    ) -> None:
        self.set_scaled_state(param, state_name, source)


def test_a_state_kept_outside_state_is_expanded_on_its_params_device() -> None:
    param = torch.nn.Parameter(torch.zeros(5))
    holder = _TableHolder([param])
    holder.set_scaled_state(param, "exp_avg", torch.arange(5.0))
    device = torch.device("cuda", 0)
    mode = DeviceOnCpu(device)
    mode.put_on_device(param)
    with mode:
        out = DeferredState(holder, param, "exp_avg").read(1, 3)
        assert not mode.on_device(out)
    assert holder.chunk_buffers == [device]
    assert torch.equal(out, torch.arange(1.0, 4.0))


def test_a_holder_without_the_remainder_options_keeps_no_remainder() -> None:
    bf16 = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    holder = _TableHolder([bf16])
    assert not _uses_remainder(holder, bf16, "master_param")
    holder.master_weights = True  # type: ignore[attr-defined]
    assert not _uses_remainder(holder, bf16, "master_param")
    del holder.master_weights  # type: ignore[attr-defined]
    holder.store_param_remainders = True  # type: ignore[attr-defined]
    assert not _uses_remainder(holder, bf16, "master_param")
    holder.master_weights = True  # type: ignore[attr-defined]
    assert _uses_remainder(holder, bf16, "master_param")


class _FreshEntries(torch.optim.Adam):
    """An optimizer whose state dict adds a fresh tensor per param that nobody else holds."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params)
        self.issued: list[torch.Tensor] = []

    def state_dict(self) -> dict[str, Any]:
        state_dict = super().state_dict()
        for index, entry in state_dict["state"].items():  # torch hands out the live entries
            state_dict["state"][index] = {**entry, "doubled": entry["exp_avg"] * 2}
            self.issued.append(state_dict["state"][index]["doubled"])
        return state_dict


def test_an_async_save_copies_lists_and_tuples_and_nothing_fresh() -> None:
    param = torch.nn.Parameter(torch.ones(3))
    opt = _stepped(_FreshEntries([param]))
    entry = opt.state[param]
    entry["history"] = [entry["exp_avg"], 2]
    entry["pair"] = (entry["exp_avg_sq"], "x")
    before = (entry["exp_avg"].clone(), entry["exp_avg_sq"].clone())
    staged, _ = _staged_contents(opt)
    kept = staged["state"][0]
    assert kept["doubled"] is opt.issued[-1]  # fresh: handed on without a copy
    _stepped(opt)
    assert type(kept["history"]) is list and type(kept["pair"]) is tuple
    assert torch.equal(kept["history"][0], before[0]) and kept["history"][1] == 2
    assert torch.equal(kept["pair"][0], before[1]) and kept["pair"][1] == "x"


def test_a_frozen_twin_maps_a_param_keyed_table_onto_its_own_params() -> None:
    opt = _holder()
    first = opt.param_groups[0]["params"][0]
    opt.owners = {first: first}  # type: ignore[attr-defined]  # a table param -> param
    _, deferred = _staged_contents(opt)
    promised = deferred[(0, "exp_avg")]
    assert promised.param is not first and torch.equal(promised.param, first)
    assert promised.holder.owners == {promised.param: promised.param}
    assert next(iter(promised.holder.owners.values())) is promised.param


class _HybridWithHolderApi(HybridOffloadOptimizer):
    """A hybrid that also presents a precision-aware holder's API."""

    name_to_dtype_map = {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.float32}

    def get_unscaled_state(self, param: torch.Tensor, state_name: str) -> torch.Tensor:
        raise AssertionError("an async save of a hybrid stages its own state_dict")

    def set_scaled_state(self, param: torch.Tensor, state_name: str, value: torch.Tensor) -> None:
        raise AssertionError("an async save never writes state")


def test_an_async_save_of_a_hybrid_with_a_holders_api_stages_its_state_dict() -> None:
    params = [torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16)) for _ in range(2)]
    hybrid = _HybridWithHolderApi(
        params, offload_fraction=1.0, cpu_optimizer_cls=PrecisionAwareAdamW, lr=1e-2,
        exp_avg_dtype=torch.bfloat16,
    )  # fmt: skip

    def step() -> None:
        for p in params:
            p.grad = torch.full_like(p, 0.5)
        hybrid.step()

    step()
    expected = {
        (i, n): v.clone() for i, e in hybrid.state_dict()["state"].items() for n, v in e.items()
    }
    staged, deferred = _staged_contents(hybrid)
    step()
    assert deferred == {}
    got = {(i, n): v for i, e in staged["state"].items() for n, v in e.items()}
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[key], expected[key]) for key in expected)
