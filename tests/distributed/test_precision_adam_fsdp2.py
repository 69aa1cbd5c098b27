"""PrecisionAwareAdamW on FSDP2 (torch.distributed.fsdp.fully_shard) with 2 gloo processes.

The parameters are DTensors sharded on dim 0: the optimizer's state must follow the local
shard (plain tensors of the shard's shape) and ``state_dict()`` must re-wrap every state as a
DTensor with the parameter's mesh and placements, so DCP can save and reshard it.
One spawn runs every scenario; the tests below assert on the facts each rank reports.
"""

from __future__ import annotations

import copy
import os
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from wrapped_optim.optimizers import PrecisionAwareAdamW

pytestmark = pytest.mark.distributed

WORLD = 2
BF16_CONFIG: dict[str, Any] = {
    "lr": 1e-2,
    "weight_decay": 0.1,
    "exp_avg_dtype": torch.bfloat16,
    "exp_avg_sq_dtype": torch.bfloat16,
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))  # same on every rank
    for _ in range(steps):
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def _scenario(rank: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    facts: dict[str, Any] = {}
    mesh = init_device_mesh("cpu", (WORLD,))
    model, reference = _model(), _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    opt = PrecisionAwareAdamW(params, **BF16_CONFIG)
    ref_opt = PrecisionAwareAdamW(reference.parameters(), **BF16_CONFIG)
    _train(model, opt, 3)
    _train(reference, ref_opt, 3)

    facts["params_are_dtensors"] = all(isinstance(p, DTensor) for p in params)
    facts["state_is_local"] = all(
        not isinstance(t, DTensor) and t.shape == p.to_local().shape
        for p in params
        for t in opt.state[p].values()
    )
    facts["param_max_diff"] = max(
        (p.full_tensor() - r).abs().max().item()
        for p, r in zip(params, reference.parameters(), strict=True)
    )

    sd = opt.state_dict()
    wrapped = [
        (p, name, value)
        for p, (_, entry) in zip(params, sorted(sd["state"].items()), strict=True)
        for name, value in entry.items()
    ]
    facts["state_dict_dtensors"] = all(
        isinstance(v, DTensor) and v.placements == p.placements and v.device_mesh == p.device_mesh
        for p, _, v in wrapped
    )
    facts["state_dict_full_equals_reference"] = all(
        torch.equal(v.full_tensor(), ref_opt.get_unscaled_state(r, name))
        for (p, name, v), r in zip(
            wrapped, [r for r in reference.parameters() for _ in range(2)], strict=True
        )
    )
    snapshot = copy.deepcopy(sd)
    fresh = PrecisionAwareAdamW(params, **BF16_CONFIG)
    fresh.load_state_dict(snapshot)
    facts["load_restores_local_state"] = (
        all(
            torch.equal(fresh.state[p][n], opt.state[p][n])
            and not isinstance(fresh.state[p][n], DTensor)
            for p in params
            for n in opt.state[p]
        )
        and fresh.param_groups[0]["step"] == 3
    )

    # torch.distributed.checkpoint's optimizer state dict (what DCP saves) round-trips too.
    try:
        osd = get_optimizer_state_dict(model, opt)
        values = [v for entry in osd["state"].values() for v in entry.values()]
        facts["dcp_values_dtensors"] = bool(values) and all(isinstance(v, DTensor) for v in values)
        other = PrecisionAwareAdamW(params, **BF16_CONFIG)
        set_optimizer_state_dict(model, other, copy.deepcopy(osd))
        facts["dcp_roundtrip"] = all(
            torch.equal(other.state[p][n], opt.state[p][n]) for p in params for n in opt.state[p]
        )
    except Exception:  # reported as a fact so the test shows the traceback
        facts["dcp_error"] = traceback.format_exc()

    # FP8 moments: each rank scales its own shard (one scale per local tensor).
    fp8_model, fp8_ref = _model(), _model()
    fully_shard(fp8_model, mesh=mesh)
    fp8 = {"lr": 1e-2, "exp_avg_dtype": torch.uint8, "exp_avg_sq_dtype": torch.uint8}
    fp8_opt = PrecisionAwareAdamW(fp8_model.parameters(), **fp8)
    fp8_ref_opt = PrecisionAwareAdamW(fp8_ref.parameters(), **fp8)
    _train(fp8_model, fp8_opt, 2)
    _train(fp8_ref, fp8_ref_opt, 2)
    facts["fp8_param_max_diff"] = max(
        (p.full_tensor() - r).abs().max().item()
        for p, r in zip(fp8_model.parameters(), fp8_ref.parameters(), strict=True)
    )
    facts["fp8_scales_per_shard"] = all(
        s.shape == (1,) for p in fp8_model.parameters() for s in fp8_opt._scales[p].values()
    )
    return facts


def _worker(rank: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    try:
        torch.save(_scenario(rank), os.path.join(out_dir, f"facts_{rank}.pt"))
    except BaseException:
        Path(out_dir, f"error_{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def facts(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("fsdp2_precision_adam")
    try:
        mp.start_processes(
            _worker, args=(str(out / "store"), str(out)), nprocs=WORLD, start_method="spawn"
        )
    except mp.ProcessRaisedException:
        errors = "\n".join(p.read_text() for p in sorted(out.glob("error_*.txt")))
        pytest.fail(f"FSDP2 worker failed:\n{errors}")
    return [torch.load(out / f"facts_{r}.pt", weights_only=False) for r in range(WORLD)]


def test_state_follows_the_local_shard(facts: list[dict[str, Any]]) -> None:
    for rank_facts in facts:
        assert rank_facts["params_are_dtensors"]
        assert rank_facts["state_is_local"]
        # Same data on both ranks: FSDP2's averaged grads equal the unsharded ones, and the
        # elementwise bf16-moment update gives the same parameters.
        assert rank_facts["param_max_diff"] == 0.0


def test_state_dict_rewraps_as_dtensor_and_loads_back(facts: list[dict[str, Any]]) -> None:
    for rank_facts in facts:
        assert rank_facts["state_dict_dtensors"]
        assert rank_facts["state_dict_full_equals_reference"]
        assert rank_facts["load_restores_local_state"]


def test_dcp_optimizer_state_dict_roundtrip(facts: list[dict[str, Any]]) -> None:
    for rank_facts in facts:
        assert "dcp_error" not in rank_facts, rank_facts.get("dcp_error")
        assert rank_facts["dcp_values_dtensors"]
        assert rank_facts["dcp_roundtrip"]


def test_fp8_moments_scale_each_shard(facts: list[dict[str, Any]]) -> None:
    for rank_facts in facts:
        assert rank_facts["fp8_scales_per_shard"]
        # Per-shard scales quantize differently from whole-tensor ones: close, not equal.
        assert rank_facts["fp8_param_max_diff"] < 5e-3
