"""FSDPAwareOptimizer and init_optimizer_state on PyTorch FSDP2 (gloo, 2 CPU processes).

FSDP2 with a MixedPrecisionPolicy computes in bf16 but casts reduced grads to the sharded
FP32 parameters' dtype, so it never produces the mixed grad-dtype case: here the wrapper must
be a transparent no-op. Two spawns (train, resume) and one in-process world of one serve
every test of this module.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from .conftest import Launcher, mismatches, requantized_fp8_mismatches, run_in_this_process

# One xdist worker per module (with --dist loadgroup): its tests share module-scoped spawns.
pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("fsdp2")]

CHECKPOINT_STEP = 3
CONTINUE_STEPS = 3
# SGD with dampening: init_optimizer_state's zero momentum buffers must take the loaded
# values (DCP writes into the DTensor shards in place), not be dropped as placeholders.
OPTIMIZERS = ["adamw", "precision_aware_adamw", "sgd_dampening"]
# PrecisionAwareAdamW consumes low-precision grads itself: no cast needed.
PRECISION_AWARE = {"adamw": False, "precision_aware_adamw": True, "sgd_dampening": False}
# States kept in FP8 with a per-shard scale: re-quantized when the sharding changes.
FP8_STATES = {"adamw": (), "precision_aware_adamw": ("exp_avg_sq",), "sgd_dampening": ()}


# ----------------------------------------------------------------------------------------
# helpers (run inside the workers)
# ----------------------------------------------------------------------------------------
def build_model(world_size: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model[0], mesh=mesh, mp_policy=policy)
    fully_shard(model[2], mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def make_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    from wrapped_optim.optimizers import PrecisionAwareAdamW

    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if name == "precision_aware_adamw":
        # bf16 first moments, FP8 second moments (TE FusedAdam's compressed formats)
        return PrecisionAwareAdamW(
            model.parameters(),
            lr=1e-2,
            weight_decay=0.1,
            exp_avg_dtype=torch.bfloat16,
            exp_avg_sq_dtype=torch.uint8,
        )
    if name == "sgd_dampening":
        return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, dampening=0.1)
    raise ValueError(name)


def wrap(name: str, optimizer: torch.optim.Optimizer) -> Any:
    from wrapped_optim.fsdp import FSDPAwareOptimizer

    return FSDPAwareOptimizer(optimizer, precision_aware=PRECISION_AWARE[name])


def forward_backward(model: torch.nn.Module, step: int, rank: int) -> None:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 8, generator=generator)
    model(x).float().pow(2).mean().backward()


def snapshot(model: torch.nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        out[name] = local(param).detach().clone()
        for key, value in optimizer.state[param].items():
            out[f"{name}.{key}"] = local(value).detach().clone()
            if key in getattr(optimizer, "name_to_dtype_map", {}):  # compressed: add scales
                unscaled = optimizer.get_unscaled_state(param, key)
                out[f"{name}.{key}.unscaled"] = local(unscaled).detach().clone()
    for index, group in enumerate(optimizer.param_groups):
        if "step" in group:
            out[f"param_group{index}.step"] = torch.tensor(group["step"])
    return out


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def full_state(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    flat: dict[str, Any] = dict(get_model_state_dict(model, options=options))
    optim = get_optimizer_state_dict(model, optimizer, options=options)
    for fqn, state in optim["state"].items():
        for key, value in state.items():
            flat[f"{fqn}.{key}"] = value.detach().clone()
    return flat


def dcp_state(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
    }


def load_checkpoint(model: torch.nn.Module, optimizer: Any, path: str) -> bool:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from wrapped_optim.fsdp import init_optimizer_state

    created = init_optimizer_state(optimizer)
    state = dcp_state(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    return created


# ----------------------------------------------------------------------------------------
# workers
# ----------------------------------------------------------------------------------------
def train_worker(rank: int, world_size: int, checkpoint_root: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    out: dict[str, Any] = {}

    # -- FSDP2 does not produce mixed grad dtypes; forcing grad_dtype breaks its backward --
    model = build_model(world_size)
    forward_backward(model, 0, rank)
    param = next(model.parameters())
    out["param_kind"] = (type(param).__name__, param.dtype, param.grad.dtype)
    model.zero_grad()
    for p in model.parameters():
        p.grad_dtype = torch.bfloat16
    try:
        forward_backward(model, 0, rank)
        out["forced_grad_dtype_backward"] = "ok"
    except RuntimeError as error:
        out["forced_grad_dtype_backward"] = str(error)

    for name in OPTIMIZERS:
        # -- transparent: wrapped equals unwrapped, grads untouched, no buffers ------------
        plain_model, ours_model = build_model(world_size), build_model(world_size)
        plain = make_optimizer(name, plain_model)
        ours = wrap(name, make_optimizer(name, ours_model))
        per_step = []
        grads_untouched = True
        for step in range(CHECKPOINT_STEP):
            forward_backward(plain_model, step, rank)
            plain.step()
            plain.zero_grad()
            forward_backward(ours_model, step, rank)
            grads = [p.grad for p in ours_model.parameters()]
            ours.step()
            grads_untouched &= all(
                p.grad is g for p, g in zip(ours_model.parameters(), grads, strict=True)
            )
            ours.zero_grad()
            per_step.append(mismatches(snapshot(plain_model, plain), snapshot(ours_model, ours)))
        out[f"{name}/mismatch_vs_unwrapped"] = per_step
        out[f"{name}/grads_untouched"] = grads_untouched
        out[f"{name}/cast_buffer_bytes"] = ours.cast_buffer_bytes

        # -- checkpoint, then the uninterrupted continuation ---------------------------------
        dcp.save(dcp_state(ours_model, ours), checkpoint_id=f"{checkpoint_root}/{name}")
        out[f"{name}/full_state"] = full_state(ours_model, ours)
        for step in range(CHECKPOINT_STEP, CHECKPOINT_STEP + CONTINUE_STEPS):
            forward_backward(ours_model, step, rank)
            ours.step()
            ours.zero_grad()
        out[f"{name}/final"] = snapshot(ours_model, ours)
    return out


def resume_worker(rank: int, world_size: int, checkpoint_root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in OPTIMIZERS:
        model = build_model(world_size)
        optimizer = wrap(name, make_optimizer(name, model))
        out[f"{name}/init_created"] = load_checkpoint(model, optimizer, f"{checkpoint_root}/{name}")
        for step in range(CHECKPOINT_STEP, CHECKPOINT_STEP + CONTINUE_STEPS):
            forward_backward(model, step, rank)
            optimizer.step()
            optimizer.zero_grad()
        out[f"{name}/final"] = snapshot(model, optimizer)
    return out


def reshard_worker(rank: int, world_size: int, checkpoint_root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in OPTIMIZERS:
        model = build_model(world_size)
        optimizer = wrap(name, make_optimizer(name, model))
        load_checkpoint(model, optimizer, f"{checkpoint_root}/{name}")
        out[f"{name}/full_state"] = full_state(model, optimizer)
    return out


# ----------------------------------------------------------------------------------------
# the spawns, shared by the tests
# ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("fsdp2_ckpt"))


@pytest.fixture(scope="module")
def trained(launcher: Launcher, checkpoint_root: str) -> list[dict[str, Any]]:
    return launcher(train_worker, 2, checkpoint_root)


@pytest.fixture(scope="module")
def resumed(
    launcher: Launcher, checkpoint_root: str, trained: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    return launcher(resume_worker, 2, checkpoint_root)


@pytest.fixture(scope="module")
def resharded(
    tmp_path_factory: pytest.TempPathFactory, checkpoint_root: str, trained: list[dict[str, Any]]
) -> dict[str, Any]:
    single = tmp_path_factory.mktemp("fsdp2_single")
    result: dict[str, Any] = run_in_this_process(reshard_worker, single, checkpoint_root)
    return result


# ----------------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------------
def assert_same_full_state(saved: dict[str, Any], reloaded: dict[str, Any], name: str) -> None:
    """Bitwise equal, except FP8 states: those within one re-quantization of the saved ones."""
    fp8 = [key for key in saved if key.rsplit(".", 1)[-1] in FP8_STATES[name]]
    assert bool(fp8) == bool(FP8_STATES[name])
    exact = {key: value for key, value in saved.items() if key not in fp8}
    assert mismatches(exact, {key: reloaded[key] for key in reloaded if key not in fp8}) == []
    assert requantized_fp8_mismatches(saved, reloaded, fp8) == []


def test_fsdp2_grads_have_the_param_dtype(trained: list[dict[str, Any]]) -> None:
    for rank in trained:
        assert rank["param_kind"] == ("DTensor", torch.float32, torch.float32)
        # FSDP2 assigns grads in the param dtype: a bf16 grad_dtype makes it fail itself.
        assert "grad_dtype" in rank["forced_grad_dtype_backward"]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_wrapper_is_a_transparent_no_op(trained: list[dict[str, Any]], name: str) -> None:
    for rank in trained:
        assert rank[f"{name}/mismatch_vs_unwrapped"] == [[]] * CHECKPOINT_STEP
        assert rank[f"{name}/grads_untouched"]
        assert rank[f"{name}/cast_buffer_bytes"] == 0


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_dcp_resume_continues_bitwise(
    trained: list[dict[str, Any]], resumed: list[dict[str, Any]], name: str
) -> None:
    for before, after in zip(trained, resumed, strict=True):
        assert after[f"{name}/init_created"]
        assert mismatches(before[f"{name}/final"], after[f"{name}/final"]) == []


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_reload_into_one_process_gives_the_same_full_state(
    trained: list[dict[str, Any]], resharded: dict[str, Any], name: str
) -> None:
    for rank in trained:
        assert_same_full_state(rank[f"{name}/full_state"], resharded[f"{name}/full_state"], name)
