"""Regression tests for issue 20 items 4, 5, 6 and 8 and the streaming bug of issue 18.

Each fails on the main of before the shared validator (wrapped_optim._formats.state_format):
a load that
rounded live FP32 masters, hyper-parameters and step counts that loaded and then crashed or
drifted, a streaming load that took a negative second moment and a group without ``lr``, and
``torch.compile`` failing inside the stale-master guard.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

from wrapped_optim import HybridSyncOptimizer
from wrapped_optim.checkpoint import OptimizerCheckpointError, load_optimizer
from wrapped_optim.optimizers import HybridOffloadOptimizer, PrecisionAwareAdamW
from wrapped_optim.testing import (
    assert_state_dict_equal,
    checkpoint_roundtrip,
    optimizer_params,
    synthetic_gradients,
)

BF16 = torch.bfloat16


def _params(dtype: torch.dtype = BF16, seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype))
        for shape in ((6, 4), (7,), (3, 2))
    ]


def _stepped(opt: Any, steps: int = 3) -> Any:
    for step in range(steps):
        synthetic_gradients(opt, step)
        opt.step()
    return opt


def _hybrid(sub: Any = PrecisionAwareAdamW, **options: Any) -> HybridOffloadOptimizer:
    if sub is PrecisionAwareAdamW:
        options = {"exp_avg_dtype": BF16, "exp_avg_sq_dtype": BF16, **options}
    return HybridOffloadOptimizer(
        _params(), offload_fraction=0.5, cpu_optimizer_cls=sub, gpu_optimizer_cls=sub,
        lr=0.01, **options,
    )  # fmt: skip


def _unchanged(opt: Any, before: Any, params: list[torch.Tensor]) -> None:
    assert_state_dict_equal(before, checkpoint_roundtrip(opt.state_dict()))
    for old, new in zip(params, optimizer_params(opt), strict=True):
        assert torch.equal(old, new)


def _rejects(opt: Any, bad: Any, match: str) -> None:
    before = checkpoint_roundtrip(opt.state_dict())
    params = [p.detach().clone() for p in optimizer_params(opt)]
    with pytest.raises(OptimizerCheckpointError, match=match):
        opt.load_state_dict(bad)
    _unchanged(opt, before, params)


# ------------------------------------------------------------------------------------------
# Item 4: load_state_dict(state_dict()) keeps the FP32 masters and the caller's dict
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("atomic", [False, True])
def test_self_round_trip_keeps_fp32_masters_and_the_callers_dict(atomic: bool) -> None:
    opt = _stepped(_hybrid(atomic_step=atomic))
    masters = {p: m.clone() for p, m in opt.param_to_fp32_param.items()}
    # The masters carry bits the bf16 weights cannot: a copy from the weights would lose them.
    assert any(not torch.equal(m, p.float()) for p, m in masters.items())
    sd = opt.state_dict()
    given = checkpoint_roundtrip(sd)
    opt.load_state_dict(sd)
    for param, master in masters.items():
        assert torch.equal(opt.param_to_fp32_param[param], master)
    assert_state_dict_equal(given, sd, names=("given", "after load"))
    # ...and training goes on exactly as without the load.
    twin = _stepped(_hybrid(atomic_step=atomic))
    _stepped(opt, 1), _stepped(twin, 1)
    for a, b in zip(optimizer_params(opt), optimizer_params(twin), strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------
# Item 5: hyper-parameters the constructors reject are rejected by every loader
# ------------------------------------------------------------------------------------------
BAD_HYPER_PARAMETERS = [
    ("lr", math.nan),
    ("lr", math.inf),
    ("lr", -0.1),
    ("lr", torch.tensor(math.nan)),
    ("eps", math.nan),
    ("eps", -1e-8),
    ("weight_decay", math.inf),
    ("weight_decay", -0.5),
    ("betas", (math.nan, 0.999)),
    ("betas", (0.9, 1.0)),
    ("betas", (-0.1, 0.999)),
    ("betas", (0.9, math.inf)),
]


@pytest.mark.parametrize(("name", "value"), BAD_HYPER_PARAMETERS, ids=repr)
def test_constructor_and_loaders_reject_the_same_hyper_parameters(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=name):
        PrecisionAwareAdamW(_params(), **{name: value})
    opt = _stepped(PrecisionAwareAdamW(_params(), lr=0.01, master_weights=True))
    bad = checkpoint_roundtrip(opt.state_dict())
    bad["param_groups"][0][name] = value
    _rejects(opt, bad, f"param group 0: {name}")


@pytest.mark.parametrize("sub", [torch.optim.AdamW, PrecisionAwareAdamW])
@pytest.mark.parametrize("betas", [(math.nan, 0.999), (0.9, 1.5)], ids=repr)
def test_hybrid_offload_rejects_bad_betas(sub: Any, betas: tuple[float, float]) -> None:
    opt = _stepped(_hybrid(sub))
    bad = checkpoint_roundtrip(opt.state_dict())
    bad["param_groups"][0]["betas"] = betas
    _rejects(opt, bad, "param group 0: betas must be two numbers in")


def _save(sd: Any, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=path, no_dist=True)


@pytest.mark.parametrize("kind", ["adam", "precision"])
def test_load_optimizer_rejects_a_negative_second_moment(kind: str, tmp_path: Path) -> None:
    """Issue 18's example: the streaming load took ``exp_avg_sq = -1``."""
    make = torch.optim.Adam if kind == "adam" else PrecisionAwareAdamW
    opt = _stepped(make(_params(torch.float32), lr=0.01))
    bad = checkpoint_roundtrip(opt.state_dict())
    bad["state"][2]["exp_avg_sq"] = -torch.ones_like(bad["state"][2]["exp_avg_sq"])
    _save(bad, tmp_path)
    with pytest.raises(OptimizerCheckpointError, match="exp_avg_sq' has negative values"):
        load_optimizer(opt, tmp_path)


@pytest.mark.parametrize("kind", ["adam", "precision"])
def test_load_optimizer_rejects_a_group_without_lr(kind: str, tmp_path: Path) -> None:
    """Issue 18's example: the streaming load silently kept its own ``lr``."""
    make = torch.optim.Adam if kind == "adam" else PrecisionAwareAdamW
    opt = _stepped(make(_params(torch.float32), lr=0.01))
    bad = checkpoint_roundtrip(opt.state_dict())
    del bad["param_groups"][0]["lr"]
    _save(bad, tmp_path)
    before = checkpoint_roundtrip(opt.state_dict())
    params = [p.detach().clone() for p in optimizer_params(opt)]
    with pytest.raises(OptimizerCheckpointError, match="missing hyper-parameter 'lr'"):
        load_optimizer(opt, tmp_path)
    _unchanged(opt, before, params)


def test_load_optimizer_rejects_a_nan_lr(tmp_path: Path) -> None:
    opt = _stepped(torch.optim.AdamW(_params(torch.float32), lr=0.01))
    bad = checkpoint_roundtrip(opt.state_dict())
    bad["param_groups"][0]["lr"] = math.nan
    _save(bad, tmp_path)
    before = checkpoint_roundtrip(opt.state_dict())
    params = [p.detach().clone() for p in optimizer_params(opt)]
    with pytest.raises(OptimizerCheckpointError, match="param group 0: lr must be a finite"):
        load_optimizer(opt, tmp_path)
    _unchanged(opt, before, params)


@settings(max_examples=12, deadline=None)
@given(
    lr=st.floats(0.0, 1.0, allow_subnormal=False),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    make=st.sampled_from([torch.optim.Adam, torch.optim.AdamW]),
)
def test_load_optimizer_reads_back_a_tensor_lr(lr: float, dtype: torch.dtype, make: Any) -> None:
    """Found after issue 20: a tensor ``lr`` saved through DCP was never read back, and the
    loaded group lost its ``lr`` key altogether (the next step raised KeyError)."""
    import tempfile

    opt = _stepped(make(_params(torch.float32), lr=torch.tensor(lr, dtype=dtype)))
    expected = checkpoint_roundtrip(opt.state_dict())
    with tempfile.TemporaryDirectory() as path:
        _save(opt.state_dict(), Path(path))
        opt.param_groups[0]["lr"] = torch.tensor(0.5, dtype=dtype)
        load_optimizer(opt, path)
    loaded = opt.param_groups[0]["lr"]
    assert isinstance(loaded, torch.Tensor) and loaded.dtype == dtype
    assert_state_dict_equal(expected, checkpoint_roundtrip(opt.state_dict()))
    same = [torch.nn.Parameter(p.detach().clone()) for p in optimizer_params(opt)]
    twin = make(same, lr=torch.tensor(0.5, dtype=dtype))
    twin.load_state_dict(expected)
    for o in (opt, twin):
        _stepped(o, 1)
    for a, b in zip(optimizer_params(opt), optimizer_params(twin), strict=True):
        assert torch.equal(a, b)


def test_load_optimizer_rejects_a_nan_tensor_lr_read_from_the_checkpoint(tmp_path: Path) -> None:
    opt = _stepped(torch.optim.AdamW(_params(torch.float32), lr=torch.tensor(0.01)))
    bad = checkpoint_roundtrip(opt.state_dict())
    bad["param_groups"][0]["lr"] = torch.tensor(math.nan)
    _save(bad, tmp_path)
    lr = opt.param_groups[0]["lr"]
    before = checkpoint_roundtrip(opt.state_dict())
    params = [p.detach().clone() for p in optimizer_params(opt)]
    with pytest.raises(OptimizerCheckpointError, match="param group 0: lr must be a finite"):
        load_optimizer(opt, tmp_path)
    _unchanged(opt, before, params)
    assert opt.param_groups[0]["lr"] is lr


# ------------------------------------------------------------------------------------------
# Item 6: tensor step counts
# ------------------------------------------------------------------------------------------
BAD_STEPS = {
    "bf16 0-d": torch.tensor(3.0, dtype=BF16),
    "fp16 0-d": torch.tensor(3.0, dtype=torch.float16),
    "2 elements": torch.tensor([3.0, 3.0]),
    "shape (1,)": torch.tensor([3.0]),
    "fraction": torch.tensor(2.5),
    "negative": torch.tensor(-1.0),
    "nan": torch.tensor(math.nan),
}


@pytest.mark.parametrize("step", list(BAD_STEPS.values()), ids=list(BAD_STEPS))
def test_bad_tensor_group_steps_are_rejected(step: torch.Tensor) -> None:
    opt = _stepped(PrecisionAwareAdamW(_params(), lr=0.01, master_weights=True))
    bad = checkpoint_roundtrip(opt.state_dict())
    bad["param_groups"][0]["step"] = step
    _rejects(opt, bad, "param group 0: invalid step")


@pytest.mark.parametrize("step", list(BAD_STEPS.values()), ids=list(BAD_STEPS))
def test_bad_tensor_param_steps_are_rejected_by_hybrid_and_streaming(
    step: torch.Tensor, tmp_path: Path
) -> None:
    opt = _stepped(_hybrid(torch.optim.AdamW))
    bad = checkpoint_roundtrip(opt.state_dict())
    for entry in bad["state"].values():
        entry["step"] = step
    _rejects(opt, bad, r"param \d+: invalid step")
    adam = _stepped(torch.optim.Adam(_params(torch.float32), lr=0.01))
    bad = checkpoint_roundtrip(adam.state_dict())
    for entry in bad["state"].values():
        entry["step"] = step
    _save(bad, tmp_path)
    with pytest.raises(OptimizerCheckpointError, match=r"param \d+: invalid step"):
        load_optimizer(adam, tmp_path)


@pytest.mark.parametrize(
    "step", [torch.tensor(3), torch.tensor(3, dtype=torch.int32), torch.tensor(3.0), 3.0]
)
def test_exact_step_counts_of_any_form_load_as_an_int(step: Any) -> None:
    """What torch writes (a float32 0-d tensor) and other exact counts are taken; the group
    then holds FusedAdam's int, and the next step equals that of a plain int load."""
    source = _stepped(PrecisionAwareAdamW(_params(), lr=0.01, master_weights=True))
    sd = checkpoint_roundtrip(source.state_dict())
    reference = PrecisionAwareAdamW(_params(seed=1), lr=0.01, master_weights=True)
    reference.load_state_dict(sd)
    sd["param_groups"][0]["step"] = step
    opt = PrecisionAwareAdamW(_params(seed=1), lr=0.01, master_weights=True)
    opt.load_state_dict(sd)
    assert type(opt.param_groups[0]["step"]) is int and opt.param_groups[0]["step"] == 3
    _stepped(opt, 1), _stepped(reference, 1)
    assert_state_dict_equal(reference.state_dict(), opt.state_dict())


# ------------------------------------------------------------------------------------------
# Item 8: torch.compile through HybridSyncOptimizer
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stale", [False, True])
def test_compiled_step_through_hybrid_sync_matches_eager(stale: bool) -> None:
    def make() -> tuple[torch.nn.Module, HybridSyncOptimizer]:
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 4).to(BF16)
        inner = HybridOffloadOptimizer(model.parameters(), offload_fraction=0.5, lr=0.1)
        if stale:  # the weights change behind the optimizer: the guard must refresh
            with torch.no_grad():
                model.weight.add_(1.0)
        return model, HybridSyncOptimizer(inner)

    def train(model: torch.nn.Module, opt: HybridSyncOptimizer, step: Any) -> None:
        for i in range(2):
            opt.zero_grad()
            model(torch.full((2, 6), float(i + 1), dtype=BF16)).sum().backward()
            step()

    torch._dynamo.reset()
    model, opt = make()
    train(model, opt, torch.compile(opt.step, backend="eager"))
    eager_model, eager_opt = make()
    train(eager_model, eager_opt, eager_opt.step)
    assert not opt.guard_armed
    for a, b in zip(model.parameters(), eager_model.parameters(), strict=True):
        assert torch.equal(a, b)
    # The FP32 state agrees to rounding: dynamo traces torch's AdamW with tensor step counts,
    # whose FP32 arithmetic differs from the eager path's in the last bits (a stale master
    # that the guard had not refreshed would be off by the 1.0 added above).
    compiled, eager = opt.state_dict()["state"], eager_opt.state_dict()["state"]
    assert compiled.keys() == eager.keys()
    for index, entry in eager.items():
        for name, value in entry.items():
            torch.testing.assert_close(compiled[index][name], value, rtol=1e-4, atol=1e-5)
