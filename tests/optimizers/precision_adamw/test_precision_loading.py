"""PrecisionAwareAdamW.load_state_dict writes into the existing storage, within one slice.

The whole incoming state is validated before the first write (a rejected checkpoint changes
nothing: tests/test_bad_inputs.py, test_precision_adam.py); these tests prove what follows
the validation: the storage objects are kept, the extra memory is one slice of every
temporary (torch's profiler), new storage appears only where a format or shape changed, a
crafted state dict aliasing live state loads as a copy would, and a load interrupted half-way
is completed before the exception propagates.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.cpu_peak import SLACK, peak_cpu_bytes
from wrapped_optim._formats import codecs
from wrapped_optim.optimizers import PrecisionAwareAdamW

from .test_precision_adam import (
    BF16,
    CONFIGS,
    FP8,
    FP32,
    assert_same_optimizer,
    clone_params,
    clone_sd,
    make_params,
    set_grads,
)


def _trained(
    config: str, dtype: torch.dtype, shapes: list[tuple[int, ...]], steps: int, seed: int = 0
) -> tuple[list[Any], PrecisionAwareAdamW]:
    params = make_params(shapes, dtype, seed=seed)
    opt = PrecisionAwareAdamW(params, lr=1e-2, weight_decay=0.1, **CONFIGS[config])
    for i in range(steps):
        set_grads(params, i, seed=seed + 1)
        opt.step()
    return params, opt


def _storage(opt: PrecisionAwareAdamW) -> dict[tuple[int, str], torch.Tensor]:
    return {
        (i, name): t
        for i, p in enumerate(opt.param_groups[0]["params"])
        for name, t in opt.state.get(p, {}).items()
    }


@given(
    config=st.sampled_from(sorted(CONFIGS)),
    dtype=st.sampled_from([FP32, BF16]),
    steps=st.integers(1, 3),
)
def test_load_writes_into_the_existing_storage(config: str, dtype: torch.dtype, steps: int) -> None:
    """The same storage tensors (and scale tensors) hold the checkpoint afterwards, bitwise
    what a fresh optimizer loads; the caller's dict is untouched."""
    _, source = _trained(config, dtype, [(5, 3), (7,)], steps)
    sd = clone_sd(source.state_dict())
    before = clone_sd(sd)
    params, opt = _trained(config, dtype, [(5, 3), (7,)], 2, seed=9)  # other values, same layout
    storage = _storage(opt)
    scales = {id(t) for entry in opt._scales.values() for t in entry.values()}
    opt.load_state_dict(sd)
    assert all(opt.state[opt.param_groups[0]["params"][i]][n] is t for (i, n), t in storage.items())
    assert {id(t) for entry in opt._scales.values() for t in entry.values()} == scales
    fresh = PrecisionAwareAdamW(clone_params(params), lr=1e-2, weight_decay=0.1, **CONFIGS[config])
    fresh.load_state_dict(clone_sd(sd))
    assert_same_optimizer(opt, fresh)
    assert all(
        torch.equal(v, before["state"][k][n]) for k, e in sd["state"].items() for n, v in e.items()
    )


@pytest.mark.parametrize("config", ["bf16-moments", "fp16-moments", "fp8-moments", "remainders"])
def test_load_peak_is_one_slice_with_every_temporary(config: str) -> None:
    """All temporaries of a load together (validation, conversions, the scaled encoder's
    blocks, FP8 decoding's fixed index): one slice of ``max(chunk_numel, 2**20)`` FP32
    elements. It used to be new storage for the whole state beside the old, plus the
    finiteness check's masks of each whole tensor."""
    n = 2_500_000  # FP32 10 MB per state: more than the 4 MiB slice
    params, opt = _trained(config, BF16 if config == "remainders" else FP32, [(n,)], 1)
    sd = clone_sd(opt.state_dict())
    for entry in sd["state"].values():  # values the storage formats do not hold as they are
        for value in entry.values():
            if value.dtype == FP32:
                value.mul_(1.0001).abs_()
    slice_numel = max(opt.chunk_numel, 1 << 20)
    index = 4 * codecs.GATHER_BLOCK if config == "fp8-moments" else 0
    peak = peak_cpu_bytes(lambda: opt.load_state_dict(sd))
    assert peak <= 4 * slice_numel + index + SLACK, peak
    p = params[0]
    for name in sd["state"][0]:  # and the values arrived (the lossless scale where exact)
        expected = copy.deepcopy(opt)
        expected.set_scaled_state(p, name, sd["state"][0][name])
        assert torch.equal(opt.state[p][name], expected.state[p][name]), name


def test_storage_of_another_format_or_shape_is_replaced_one_tensor_at_a_time() -> None:
    _, source = _trained("fp8-moments", FP32, [(4, 3)], 2)
    sd = clone_sd(source.state_dict())
    params, opt = _trained("fp8-moments", FP32, [(4, 3)], 1, seed=3)
    p = params[0]
    kept = opt.state[p]["exp_avg_sq"]
    opt.state[p]["exp_avg"] = torch.zeros(12)  # a foreign format and shape
    del opt._scales[p]["exp_avg"]
    opt.load_state_dict(sd)
    assert opt.state[p]["exp_avg"].dtype == FP8 and opt.state[p]["exp_avg"].shape == (4, 3)
    assert opt.state[p]["exp_avg_sq"] is kept
    fresh = PrecisionAwareAdamW(
        clone_params(params), lr=1e-2, weight_decay=0.1, **CONFIGS["fp8-moments"]
    )
    fresh.load_state_dict(clone_sd(sd))
    assert_same_optimizer(opt, fresh)


def test_state_the_checkpoint_lacks_is_dropped_as_before() -> None:
    """Params without state in the checkpoint lose theirs (and their scales), as torch's
    loader leaves them."""
    params, opt = _trained("fp16-moments", FP32, [(3,), (4,)], 2)
    sd = clone_sd(opt.state_dict())
    del sd["state"][1]
    opt.load_state_dict(sd)
    assert params[1] not in opt.state and params[1] not in opt._scales
    assert set(opt.state[params[0]]) == {"exp_avg", "exp_avg_sq"}


def test_a_state_dict_aliasing_other_live_state_loads_as_its_copy() -> None:
    """Written in place, a source that is another param's live storage must be read before
    that storage is overwritten (crafted dicts: here two params' states swapped)."""
    params, opt = _trained("fp32-master", FP32, [(6,), (6,)], 2)
    sd = opt.state_dict()  # FP32 states: the live tensors themselves
    swapped = {"state": {0: sd["state"][1], 1: sd["state"][0]}, "param_groups": sd["param_groups"]}
    expected = copy.deepcopy(opt)
    expected.load_state_dict(clone_sd(swapped))
    opt.load_state_dict(swapped)
    assert_same_optimizer(opt, expected)
    a, b = params
    assert not torch.equal(opt.state[a]["exp_avg"], opt.state[b]["exp_avg"])


def test_reloading_its_own_state_dict_copies_nothing() -> None:
    params, opt = _trained("remainders", BF16, [(2_000_000,)], 1)
    sd = opt.state_dict()  # the remainder is the live tensor
    peak = peak_cpu_bytes(lambda: opt.load_state_dict(sd))
    assert peak <= 4 * (1 << 20) + SLACK  # no copy of the 4 MB remainder beside the slice
    assert opt.state[params[0]]["master_param"] is sd["state"][0]["master_param"]


class _Flaky:
    """A set_scaled_state that raises ``kind`` at the given calls."""

    def __init__(self, opt: PrecisionAwareAdamW, fail: set[int], kind: type[BaseException]):
        self.opt, self.fail, self.kind, self.calls = opt, fail, kind, 0
        self.original = opt.set_scaled_state

    def __call__(self, param: Any, name: str, value: Any) -> None:
        self.calls += 1
        if self.calls in self.fail:
            if self.calls > 1:
                self.original(param, name, value * 0 + 7)  # half-written on the way out
            raise self.kind(f"call {self.calls}")
        self.original(param, name, value)


@pytest.mark.parametrize("kind", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("at", [1, 2, 4])
def test_a_load_interrupted_half_way_is_completed(kind: type[BaseException], at: int) -> None:
    _, source = _trained("remainders", BF16, [(4,), (3,)], 3)
    sd = clone_sd(source.state_dict())
    _params, opt = _trained("remainders", BF16, [(4,), (3,)], 1, seed=5)
    expected = copy.deepcopy(opt)
    expected.load_state_dict(clone_sd(sd))
    opt.set_scaled_state = _Flaky(opt, {at}, kind)  # type: ignore[method-assign]
    with pytest.raises(kind, match=f"call {at}") as raised:
        opt.load_state_dict(sd)
    del opt.set_scaled_state
    assert any("loaded completely" in note for note in raised.value.__notes__)
    assert_same_optimizer(opt, expected)


def test_a_load_that_cannot_be_completed_says_so_and_a_new_load_repairs_it() -> None:
    _, source = _trained("fp8-moments", FP32, [(4,), (3,)], 3)
    sd = clone_sd(source.state_dict())
    _params, opt = _trained("fp8-moments", FP32, [(4,), (3,)], 1, seed=5)
    expected = copy.deepcopy(opt)
    expected.load_state_dict(clone_sd(sd))
    opt.set_scaled_state = _Flaky(opt, set(range(3, 100)), RuntimeError)  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="call 3") as raised:
        opt.load_state_dict(sd)
    assert any("part of its old state" in note for note in raised.value.__notes__)
    del opt.set_scaled_state
    opt.load_state_dict(sd)
    assert_same_optimizer(opt, expected)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("bad", "name", "match"),
    [
        (float("nan"), "exp_avg", "non-finite"),
        (float("inf"), "exp_avg", "non-finite"),
        (float("-inf"), "exp_avg_sq", "non-finite"),
        (-1.0, "exp_avg_sq", "negative"),
    ],
)
def test_the_value_check_without_masks_finds_every_bad_value(
    dtype: torch.dtype, bad: float, name: str, match: str
) -> None:
    """The validator's value check is one min/max reduction now (no mask of the tensor's
    size); it still names each kind of bad value, in every float dtype it accepts."""
    _params, opt = _trained("bf16-moments", FP32, [(5,)], 1)
    sd = clone_sd(opt.state_dict())
    before = copy.deepcopy(opt)
    sd["state"][0] = {k: v.to(dtype) for k, v in sd["state"][0].items()}
    sd["state"][0][name][3] = bad
    with pytest.raises(ValueError, match=f"param 0: state '{name}' has {match}"):
        opt.load_state_dict(sd)
    assert_same_optimizer(opt, before)
    sd["state"][0]["exp_avg"][3] = -2.0  # a negative first moment is fine
    sd["state"][0]["exp_avg_sq"][3] = 0.5
    opt.load_state_dict(sd)


@pytest.mark.parametrize("atomic", [False, True])
def test_streaming_load_reads_unscaled_states_straight_into_storage(
    tmp_path: Any, atomic: bool
) -> None:
    """``load_optimizer`` reads bf16 (and FP32, remainder) states straight into the live
    storage, with no FP32 accumulator of the tensor (there used to be one: 4 bytes per
    element); fp16/FP8 states still gather one (their scale needs the whole tensor's amax).
    The atomic load adds no host memory: its undo journal is on disk (it used to keep one
    copy of the state as stored)."""
    from wrapped_optim.checkpoint import load_optimizer, save_optimizer

    n, chunk = 4_000_000, 1 << 20
    _, source = _trained("bf16-moments", FP32, [(n,)], 1)
    save_optimizer(source, tmp_path, chunk_bytes=chunk)
    params, opt = _trained("bf16-moments", FP32, [(n,)], 2, seed=4)
    storage = _storage(opt)
    stored = sum(t.numel() * t.element_size() for t in storage.values())
    peak = peak_cpu_bytes(lambda: load_optimizer(opt, tmp_path, chunk_bytes=chunk, atomic=atomic))
    assert peak <= 3 * chunk < stored / 2, peak  # DCP's read item, ours: none, atomic or not
    assert all(opt.state[params[0]][name] is t for (_, name), t in storage.items())
    expected = PrecisionAwareAdamW(
        clone_params(params), lr=1e-2, weight_decay=0.1, **CONFIGS["bf16-moments"]
    )
    expected.load_state_dict(clone_sd(source.state_dict()))
    assert_same_optimizer(opt, expected, scales=False)


def test_loaded_hyper_parameters_never_alias_the_callers_even_in_containers() -> None:
    """Review finding: tensors inside a container (``betas`` as a tuple of tensors) stayed
    the caller's after a load."""
    p = torch.nn.Parameter(torch.zeros(4))
    opt = PrecisionAwareAdamW([p], exp_avg_dtype=torch.bfloat16)
    opt.initialize_state(p, opt.layout.uses_remainder(p))
    state_dict = opt.state_dict()
    betas = (torch.tensor(0.8), torch.tensor(0.9))
    lr = torch.tensor(0.01)
    state_dict["param_groups"][0].update(betas=betas, lr=lr)
    opt.load_state_dict(state_dict)
    group = opt.param_groups[0]
    assert group["lr"] is not lr and torch.equal(group["lr"], lr)
    assert all(mine is not theirs for mine, theirs in zip(group["betas"], betas, strict=True))
    assert [float(b) for b in group["betas"]] == [float(b) for b in betas]
