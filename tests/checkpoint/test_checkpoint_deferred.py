"""Deferred state (``wrapped_optim.checkpoint._deferred``): a precision-aware optimizer's
compressed states are promised as meta placeholders and expanded slice by slice when DCP
writes them; what an asynchronous save stages is detached from the live optimizer."""

from __future__ import annotations

import pytest
import torch

from wrapped_optim.checkpoint._deferred import (
    DeferredState,
    _owned_cpu_copy,
    _placeholder_state_dict,
    _staged_contents,
    _uses_remainder,
)
from wrapped_optim.optimizers import PrecisionAwareAdamW


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
