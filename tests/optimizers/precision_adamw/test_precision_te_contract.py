"""PrecisionAwareAdamW where Megatron-Core depends on TE's FusedAdam (docs/precision_adam.md,
"Standing in for FusedAdam under Megatron"): Core's loading scaffold, its dummy step,
``initialize_state``'s signature; while a checkpoint from anywhere else is still validated.

The scaffold here is built the way ``DistributedOptimizer.load_state_dict`` builds it for a
fresh optimizer (Core 0.16.1 and 0.19.2): the inner optimizer's own ``state_dict()`` groups,
their ``params`` lists taken over as they are, and ``torch.empty`` storage-dtype tensors.
tests/megatron_real/test_precision_aware.py runs Core's real code.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch

from wrapped_optim import compat
from wrapped_optim._formats.errors import OptimizerCheckpointError
from wrapped_optim.optimizers import PrecisionAwareAdamW

BF16 = torch.bfloat16
# Megatron's precision-aware FusedAdam arguments for each storage layout it builds.
LAYOUTS = {
    "bf16_remainders": {"exp_avg_dtype": BF16, "exp_avg_sq_dtype": BF16},
    "fp8_remainders": {"exp_avg_dtype": torch.uint8, "exp_avg_sq_dtype": torch.uint8},
    "fp16_master": {
        "exp_avg_dtype": BF16,
        "exp_avg_sq_dtype": BF16,
        "master_weight_dtype": torch.float16,
        "store_param_remainders": False,
    },
}


def _megatron_adam(layout: str) -> tuple[list[torch.nn.Parameter], PrecisionAwareAdamW]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n).to(BF16)) for n in (6, 3)]
    options: dict[str, Any] = {"store_param_remainders": True, **LAYOUTS[layout]}
    opt = PrecisionAwareAdamW(
        [{"params": params, "wd_mult": 1.0}],
        lr=0.01,
        master_weights=True,
        use_decoupled_grad=True,
        **options,
    )
    return params, opt


def _fingerprint(opt: PrecisionAwareAdamW) -> list[Any]:
    """Every stored tensor (bytes), scale and group option of ``opt``."""

    def raw(t: torch.Tensor) -> bytes:
        return bytes(t.detach().reshape(-1).view(torch.uint8).tolist())

    out: list[Any] = [repr({k: v for k, v in g.items() if k != "params"}) for g in opt.param_groups]
    for group in opt.param_groups:
        for p in group["params"]:
            out.append(raw(p))
            out += [(n, t.dtype, raw(t)) for n, t in sorted(opt.state.get(p, {}).items())]
            out += [(n, raw(t)) for n, t in sorted(opt.scales.get(p, {}).items())]
    return out


def _garbage(shape: int, dtype: torch.dtype) -> torch.Tensor:
    """What ``torch.empty`` may hold: here deliberately the worst (NaN, negatives, huge)."""
    if dtype == torch.int16:
        return torch.full((shape,), -7, dtype=dtype)
    if dtype == torch.uint8:
        return torch.full((shape,), 0xFF, dtype=dtype)  # E4M3 NaN
    return torch.tensor([float("nan"), -1e30, -3.0] * shape)[:shape].to(dtype)


def _core_scaffold(opt: PrecisionAwareAdamW, checkpoint_groups: list[dict[str, Any]]) -> Any:
    """``DistributedOptimizer.load_state_dict``'s argument to the inner optimizer's loader for
    an optimizer without state: the checkpoint's group options around the optimizer's own
    index lists, and storage-dtype placeholders."""
    own = opt.state_dict()
    groups = [
        {**saved, "params": mine["params"]}
        for saved, mine in zip(checkpoint_groups, own["param_groups"], strict=True)
    ]
    state = {}
    for index, param in enumerate(p for g in opt.param_groups for p in g["params"]):
        dtypes = opt.name_to_dtype_map
        master = torch.int16 if opt.layout.uses_remainder(param) else dtypes["master_param"]
        state[index] = {
            "exp_avg": _garbage(param.numel(), dtypes["exp_avg"]),
            "exp_avg_sq": _garbage(param.numel(), dtypes["exp_avg_sq"]),
            "master_param": _garbage(param.numel(), master),
        }
    return {"state": state, "param_groups": groups}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_core_scaffold_loads_as_under_te(layout: str) -> None:
    params, opt = _megatron_adam(layout)
    checkpoint_groups = [{**opt.param_groups[0], "params": [0, 1], "step": 5, "lr": 0.5}]
    opt.load_state_dict(_core_scaffold(opt, checkpoint_groups))
    for param in params:
        state = opt.state[param]
        for name in ("exp_avg", "exp_avg_sq", "master_param"):
            assert state[name].dtype == opt.layout.storage_dtype(param, name)
            assert state[name].shape == param.shape
        # Placeholders are storage for Core's parameter-state load to write, never read:
        # no NaN from uninitialised memory reaches the state.
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.get_unscaled_state(param, name), torch.zeros(param.numel()))
    assert opt.param_groups[0]["step"] == 5 and opt.param_groups[0]["lr"] == 0.5
    # What Core writes next (set_scaled_state) lands in that storage.
    value = torch.linspace(0.0, 1.0, 6)
    opt.set_scaled_state(params[0], "exp_avg_sq", value)
    assert torch.allclose(opt.get_unscaled_state(params[0], "exp_avg_sq"), value, rtol=0.07)


def test_core_scaffold_of_existing_state_is_the_state_itself() -> None:
    # Core's scaffold for an optimizer with state: its own state_dict()'s state, as it is.
    params, opt = _megatron_adam("bf16_remainders")
    for param in params:
        param.decoupled_grad = torch.ones_like(param)
    opt.step()
    before = _fingerprint(opt)
    own = opt.state_dict()
    opt.load_state_dict({"state": own["state"], "param_groups": own["param_groups"]})
    assert _fingerprint(opt) == before


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_the_same_tensors_from_elsewhere_are_validated(how: str) -> None:
    # Provenance, not content: a state dict that did not come from this optimizer's own
    # state_dict() in this process (a file, a copy) is a checkpoint, checked whole.
    params, opt = _megatron_adam("bf16_remainders")
    for param in params:
        param.decoupled_grad = torch.ones_like(param)
    opt.step()
    before = _fingerprint(opt)
    scaffold = _core_scaffold(opt, [{**opt.param_groups[0], "params": [0, 1]}])
    if how == "deepcopy":
        hostile = copy.deepcopy(scaffold)
    else:
        buffer = io.BytesIO()
        torch.save(scaffold, buffer)
        buffer.seek(0)
        hostile = torch.load(buffer)
    with pytest.raises(OptimizerCheckpointError):
        opt.load_state_dict(hostile)
    assert _fingerprint(opt) == before


def test_recognition_lasts_one_load() -> None:
    params, opt = _megatron_adam("bf16_remainders")
    scaffold = _core_scaffold(opt, [{**opt.param_groups[0], "params": [0, 1]}])
    opt.load_state_dict(scaffold)
    with pytest.raises(OptimizerCheckpointError):
        opt.load_state_dict(scaffold)  # the same dict again: now a checkpoint like any other
    assert opt.state[params[0]]["exp_avg"].dtype == BF16


def test_a_scaffold_of_the_wrong_size_is_refused() -> None:
    _, opt = _megatron_adam("bf16_remainders")
    scaffold = _core_scaffold(opt, [{**opt.param_groups[0], "params": [0, 1]}])
    scaffold["state"][0]["exp_avg"] = torch.empty(5, dtype=BF16)
    with pytest.raises(ValueError, match="5 elements"):
        opt.load_state_dict(scaffold)


def test_megatrons_dummy_step_creates_state_without_moving_anything() -> None:
    # Core's _init_optimizer_states_with_dummy_values: zero .grad on every param, step,
    # zero_grad, with use_decoupled_grad=True. FusedAdam creates state before it reads
    # decoupled_grad (absent here), so the state exists and nothing is updated.
    params, opt = _megatron_adam("bf16_remainders")
    weights = [p.detach().clone() for p in params]
    for param in params:
        param.grad = torch.zeros_like(param)
    opt.step()
    opt.zero_grad()
    for param, weight in zip(params, weights, strict=True):
        assert sorted(opt.state[param]) == ["exp_avg", "exp_avg_sq", "master_param"]
        assert torch.equal(param, weight)
        assert torch.equal(opt.get_unscaled_state(param, "exp_avg"), torch.zeros(param.numel()))


def test_params_with_no_grad_at_all_still_get_no_state() -> None:
    params, opt = _megatron_adam("bf16_remainders")
    params[0].decoupled_grad = torch.ones_like(params[0])
    opt.step()
    assert opt.state[params[0]] and not opt.state.get(params[1])


def test_compat_init_optimizer_state_creates_state_for_decoupled_grads() -> None:
    params, opt = _megatron_adam("fp8_remainders")
    weights = [p.detach().clone() for p in params]
    assert compat.init_optimizer_state(opt)
    assert all(sorted(opt.state[p]) == ["exp_avg", "exp_avg_sq", "master_param"] for p in params)
    assert all(torch.equal(p, w) for p, w in zip(params, weights, strict=True))


def test_initialize_state_needs_store_param_remainders_as_te_2_1() -> None:
    # Megatron-Core's init_state_fn calls initialize_state(p): a TypeError under TE >= 2.1.
    params, opt = _megatron_adam("bf16_remainders")
    with pytest.raises(TypeError):
        opt.initialize_state(params[0])  # type: ignore[call-arg]
    opt.initialize_state(params[0], True)
    assert opt.state[params[0]]["master_param"].dtype == torch.int16
