"""A loaded value must fit the format it is stored in, on every load path alike.

bf16's largest finite value (about 3.3895e38) is below FP32's (3.4028e38): an FP32 value
above it became inf when it was loaded into bf16 storage. The dict path
(``PrecisionAwareAdamW.load_state_dict``) stored that inf silently, the streaming DCP load
rejected it as "non-finite" after reading it in place (and stored it silently into a holder
without state yet). Now both reject it before writing anything, with the same message naming
the state, the magnitude and the format, and leave the optimizer bitwise as it was. The same
rule covers float64 values beyond FP32 and the scaled formats (fp16 expands FP32's largest
value to inf; FP8 does not).
"""

from __future__ import annotations

import copy
import math
import struct
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

from wrapped_optim._formats import codecs, load_limits
from wrapped_optim._formats.errors import OptimizerCheckpointError
from wrapped_optim.checkpoint import load_optimizer
from wrapped_optim.optimizers import PrecisionAwareAdamW


def f32(bits: int) -> float:
    """The FP32 value of a bit pattern, as a Python float."""
    value: float = struct.unpack("<f", struct.pack("<I", bits))[0]
    return value


BF16_LAST = f32(0x7F7F7FFF)  # the largest FP32 value that rounds to a finite bf16
BF16_OVER = f32(0x7F7F8000)  # the next one: a tie, rounded to even, which is inf
FP32_MAX = f32(0x7F7FFFFF)
FP16_LAST = f32(0x7F7FFFFE)  # scaled fp16 expands FP32_MAX to inf, this one to itself


def _optimizer(moments: torch.dtype, *, init: bool = True, n: int = 4) -> PrecisionAwareAdamW:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)), torch.nn.Parameter(torch.randn(n))]
    opt = PrecisionAwareAdamW(params, lr=0.1, exp_avg_dtype=moments, exp_avg_sq_dtype=moments)
    if init:
        for p in params:
            p.grad = torch.randn(n)
        opt.step()
    return opt


def _state_dict(opt: PrecisionAwareAdamW, value: float, name: str = "exp_avg") -> dict[str, Any]:
    """The optimizer's own portable state dict, with ``value`` at one place of param 1."""
    sd = copy.deepcopy(opt.state_dict())
    sd["state"] = {i: {k: v.clone() for k, v in e.items()} for i, e in sd["state"].items()}
    for i, p in enumerate(opt.param_groups[0]["params"]):  # a fresh optimizer: a state anyway
        sd["state"].setdefault(i, {k: torch.ones_like(p) for k in ("exp_avg", "exp_avg_sq")})
    sd["state"][1][name][2] = value
    return sd


def _fingerprint(opt: PrecisionAwareAdamW) -> Any:
    """Everything a load may change, by object identity and bits."""
    params = opt.param_groups[0]["params"]
    return (
        copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]),
        [(id(p), p.detach().clone()) for p in params],
        {
            (i, k): (id(t), t.clone())
            for i, p in enumerate(params)
            for k, t in opt.state.get(p, {}).items()
        },
        {
            (i, k): s.clone()
            for i, p in enumerate(params)
            for k, s in opt._scales.get(p, {}).items()
        },
    )


def _assert_unchanged(opt: PrecisionAwareAdamW, before: Any, *, same_objects: bool = True) -> None:
    """Bitwise as before; with ``same_objects`` also the same storage objects (the dict path
    writes nothing; an atomic streaming load puts back the values it read in place)."""
    groups, params, state, scales = _fingerprint(opt)
    assert groups == before[0]
    for (pid, p), (bid, b) in zip(params, before[1], strict=True):
        assert pid == bid and torch.equal(p.view(torch.int32), b.view(torch.int32))
    assert state.keys() == before[2].keys()
    for key, (tid, t) in state.items():
        bid, b = before[2][key]
        assert tid == bid or not same_objects, key
        assert t.dtype == b.dtype and torch.equal(t.view(torch.uint8), b.view(torch.uint8)), key
    assert scales.keys() == before[3].keys()
    for key, s in scales.items():
        assert torch.equal(s.view(torch.int32), before[3][key].view(torch.int32)), key


def _dict_load(opt: PrecisionAwareAdamW, sd: dict[str, Any]) -> None:
    opt.load_state_dict(sd)


def _streaming_load(atomic: bool) -> Callable[[PrecisionAwareAdamW, dict[str, Any]], None]:
    def load(opt: PrecisionAwareAdamW, sd: dict[str, Any]) -> None:
        with tempfile.TemporaryDirectory() as path:
            dcp.save(sd, checkpoint_id=path, no_dist=True)
            load_optimizer(opt, path, atomic=atomic)

    return load


LOADS = {"dict": _dict_load, "streaming": _streaming_load(True)}


def _error(load: Callable[..., None], opt: PrecisionAwareAdamW, sd: dict[str, Any]) -> str:
    before = _fingerprint(opt)
    with pytest.raises(OptimizerCheckpointError) as caught:
        load(opt, sd)
    _assert_unchanged(opt, before, same_objects=load is _dict_load)
    return str(caught.value)


@pytest.mark.parametrize("path", sorted(LOADS))
@pytest.mark.parametrize("init", [True, False], ids=["with-state", "fresh"])
@pytest.mark.parametrize(
    ("name", "sign"), [("exp_avg", 1.0), ("exp_avg", -1.0), ("exp_avg_sq", 1.0)]
)
def test_bf16_boundary_loads_below_and_is_rejected_above(
    path: str, init: bool, name: str, sign: float
) -> None:
    """The largest FP32 value that rounds to a finite bf16 loads (as bf16's largest value);
    the next FP32 value is rejected, naming the param, state, magnitude and format, and the
    optimizer is bitwise unchanged (the same storage objects, the same bits)."""
    load = LOADS[path]
    opt = _optimizer(torch.bfloat16, init=init)
    message = _error(load, opt, _state_dict(opt, sign * BF16_OVER, name))
    assert message == (
        f"param 1: state '{name}' has a value of magnitude 3.39617753e+38, beyond the range "
        "of its bf16 storage (it would load as inf; magnitudes up to 3.38953139e+38 load)"
    )
    load(opt, _state_dict(opt, sign * BF16_LAST, name))
    p = opt.param_groups[0]["params"][1]
    assert opt.state[p][name][2].item() == sign * torch.finfo(torch.bfloat16).max


@pytest.mark.parametrize("path", sorted(LOADS))
def test_float64_values_beyond_fp32_are_rejected_for_fp32_storage(path: str) -> None:
    """FP32 storage from a float64 checkpoint: the same rule at FP32's own boundary."""
    over = 2.0**128 - 2.0**103  # rounds to inf in FP32 (tie to even)
    last = float(torch.nextafter(torch.tensor(over, dtype=torch.float64), torch.tensor(0.0)))
    opt = _optimizer(torch.float32)
    sd = _state_dict(opt, 0.0)
    sd["state"] = {i: {k: v.double() for k, v in e.items()} for i, e in sd["state"].items()}
    sd["state"][1]["exp_avg"][2] = over
    message = _error(LOADS[path], opt, sd)
    assert "param 1: state 'exp_avg' has a value of magnitude 3.40282357e+38" in message
    assert "its FP32 storage" in message
    sd["state"][1]["exp_avg"][2] = last
    LOADS[path](opt, sd)
    assert opt.state[opt.param_groups[0]["params"][1]]["exp_avg"][2].item() == FP32_MAX


@pytest.mark.parametrize("path", sorted(LOADS))
def test_scaled_fp16_rejects_fp32_max_and_fp8_keeps_it(path: str) -> None:
    """Scaled formats never overflow in storage, but fp16 expands FP32's largest value to inf
    (``32752 * (amax / 32752)`` rounds up): it is rejected like bf16's overflow, the value
    just below loads finite. FP8 expands it exactly: it loads."""
    opt = _optimizer(torch.float16)
    message = _error(LOADS[path], opt, _state_dict(opt, -FP32_MAX))
    assert "magnitude 3.40282347e+38, beyond the range of its scaled fp16 storage" in message
    LOADS[path](opt, _state_dict(opt, -FP16_LAST))
    expanded = opt.get_unscaled_state(opt.param_groups[0]["params"][1], "exp_avg")
    assert expanded[2].item() == -FP16_LAST and bool(torch.isfinite(expanded).all())

    fp8 = _optimizer(torch.uint8)
    LOADS[path](fp8, _state_dict(fp8, -FP32_MAX))
    expanded = fp8.get_unscaled_state(fp8.param_groups[0]["params"][1], "exp_avg")
    assert expanded[2].item() == -FP32_MAX and bool(torch.isfinite(expanded).all())


@pytest.mark.parametrize(
    ("dtype", "scaled"),
    [
        (torch.bfloat16, True),
        (torch.float32, True),
        (torch.float16, True),
        (torch.uint8, True),
        (torch.bfloat16, False),
        (torch.float16, False),
    ],
)
def test_each_limit_is_what_the_format_does(dtype: torch.dtype, scaled: bool) -> None:
    """Each limit is the smallest magnitude the codec (a holder's storage) or the plain cast
    turns into inf, and the value just below it stays finite."""
    limit = load_limits.loads_as_inf(dtype, scaled=scaled)
    assert limit is not None
    wide = torch.float64 if dtype == torch.float32 else torch.float32  # what reaches it
    below = float(torch.nextafter(torch.tensor(limit, dtype=wide), torch.tensor(0.0, dtype=wide)))

    def stored(value: float) -> float:
        x = torch.tensor([value], dtype=torch.float64).to(wide)
        if not scaled or dtype in (torch.float32, torch.bfloat16):
            return float(x.to(dtype).double())
        data, scale = codecs.encode(x, dtype, exact=True)
        return float(codecs.decode(data, dtype, scale))

    assert not math.isfinite(stored(limit))  # inf (NaN for FP8: an inf amax poisons it)
    assert math.isfinite(stored(below))
    assert load_limits.overflow_problem(limit, dtype, scaled=scaled) is not None
    assert load_limits.overflow_problem(below, dtype, scaled=scaled) is None


def test_nothing_overflows_an_int16_remainder_or_float64() -> None:
    assert load_limits.loads_as_inf(torch.int16, scaled=True) is None
    assert load_limits.loads_as_inf(torch.float64) is None
    assert load_limits.overflow_problem(float("1e308"), torch.float64) is None


MAGNITUDES = st.integers(0x7F7F0000, 0x7F7FFFFF).map(f32) | st.floats(-1e3, 1e3)


@settings(max_examples=12, deadline=None)
@given(values=st.lists(st.tuples(MAGNITUDES, st.booleans()), min_size=4, max_size=4))
def test_both_paths_agree_on_every_round_trip(values: list[tuple[float, bool]]) -> None:
    """A state dict of large FP32 values: either both paths load it, to the same bits (and
    the loaded optimizer's own state dict loads again, unchanged), or both reject it with one
    message and change nothing."""
    first = torch.tensor([v if positive else -v for v, positive in values])
    outcomes: list[Any] = []
    for load in (_dict_load, _streaming_load(True)):
        opt = _optimizer(torch.bfloat16)
        sd = _state_dict(opt, 0.0)
        sd["state"][1]["exp_avg"] = first.clone()
        before = _fingerprint(opt)
        try:
            load(opt, sd)
        except OptimizerCheckpointError as error:
            _assert_unchanged(opt, before, same_objects=load is _dict_load)
            outcomes.append(str(error))
            continue
        p = opt.param_groups[0]["params"][1]
        stored = opt.state[p]["exp_avg"].clone()
        again = _fingerprint(opt)
        load(opt, opt.state_dict())  # its own state dict: a lossless round trip
        _assert_unchanged_values(opt, again)
        outcomes.append(stored.view(torch.int16).tolist())
    assert outcomes[0] == outcomes[1]
    fits = all(abs(v) < (load_limits.loads_as_inf(torch.bfloat16) or 0.0) for v, _ in values)
    assert isinstance(outcomes[0], list) == fits


def _assert_unchanged_values(opt: PrecisionAwareAdamW, before: Any) -> None:
    """The same bits (storage may be new objects after a streaming load of a fresh state)."""
    _, _, state, _ = _fingerprint(opt)
    for key, (_, t) in state.items():
        assert torch.equal(t.view(torch.uint8), before[2][key][1].view(torch.uint8)), key


def test_a_streaming_load_without_undo_never_writes_the_overflowing_read() -> None:
    """``atomic=False`` keeps no undo copy (what was read before the fault stays loaded),
    but the read that holds the overflow goes through a buffer of the checkpoint's dtype and
    is checked before it reaches the storage: that state keeps its old bits, never inf."""
    opt = _optimizer(torch.bfloat16)
    p = opt.param_groups[0]["params"][1]
    old = opt.state[p]["exp_avg"].clone()
    sd = _state_dict(opt, BF16_OVER)
    sd["state"][1]["exp_avg"][0] = 7.0
    with pytest.raises(OptimizerCheckpointError, match=r"magnitude 3\.39617753e\+38"):
        _streaming_load(False)(opt, sd)
    assert torch.equal(opt.state[p]["exp_avg"].view(torch.int16), old.view(torch.int16))


def _hybrid_state(hybrid: Any) -> list[torch.Tensor]:
    return [t.clone() for e in hybrid.state.values() for t in e.values() if torch.is_tensor(t)]


@pytest.mark.parametrize("path", ["dict", "streaming"])
def test_plain_copies_take_the_rule_of_their_cast(path: str, tmp_path: Any) -> None:
    """Outside a holder a state is cast plainly: float64 values beyond FP32 into
    HybridOffloadOptimizer's FP32 copies and torch AdamW state (its dict load stored inf)."""
    from wrapped_optim.optimizers import HybridOffloadOptimizer

    p = torch.nn.Parameter(torch.randn(4).to(torch.bfloat16))
    hybrid = HybridOffloadOptimizer([p], offload_fraction=1.0, lr=1e-2)
    p.grad = torch.randn(4).to(torch.bfloat16)
    hybrid.step()
    sd = copy.deepcopy(hybrid.state_dict())
    sd["state"][0] = {k: v.double() if k != "step" else v for k, v in sd["state"][0].items()}
    sd["state"][0]["exp_avg"][1] = 1e300
    before, weights = _hybrid_state(hybrid), p.detach().clone()
    with pytest.raises(OptimizerCheckpointError) as caught:
        if path == "dict":
            hybrid.load_state_dict(sd)
        else:
            dcp.save(sd, checkpoint_id=tmp_path, no_dist=True)
            load_optimizer(hybrid, tmp_path)
    assert "param 0: state 'exp_avg' has a value of magnitude 1e+300, beyond the range of its " \
        "FP32 storage" in str(caught.value)  # fmt: skip
    after = _hybrid_state(hybrid)
    assert len(after) == len(before) and all(map(torch.equal, after, before))
    assert torch.equal(p, weights)


def test_a_torch_optimizers_fp16_state_has_fp16s_own_limit(tmp_path: Any) -> None:
    """A torch optimizer's fp16 state is a plain cast (not scaled): the streaming load
    rejects FP32 values from 65520 up (they became inf), and 65504 loads."""
    half = torch.nn.Parameter(torch.randn(4).to(torch.float16))
    adam = torch.optim.Adam([half], lr=1e-2)
    half.grad = torch.randn(4).to(torch.float16)
    adam.step()
    kept = adam.state[half]["exp_avg"].clone()
    saved = adam.state_dict()
    entry = saved["state"][0]
    saved["state"][0] = {k: v.float() if k != "step" else v for k, v in entry.items()}
    saved["state"][0]["exp_avg"][1] = 65520.0
    dcp.save(saved, checkpoint_id=tmp_path / "over", no_dist=True)
    with pytest.raises(OptimizerCheckpointError, match="magnitude 65520, beyond the range of "
                       "its fp16 storage"):  # fmt: skip
        load_optimizer(adam, tmp_path / "over")
    assert torch.equal(adam.state[half]["exp_avg"], kept)
    saved["state"][0]["exp_avg"][1] = 65504.0
    dcp.save(saved, checkpoint_id=tmp_path / "max", no_dist=True)
    load_optimizer(adam, tmp_path / "max")
    assert adam.state[half]["exp_avg"][1].item() == 65504.0
