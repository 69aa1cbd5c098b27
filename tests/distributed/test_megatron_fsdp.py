"""FSDPAwareOptimizer and init_optimizer_state on real Megatron-FSDP (gloo, 2 CPU processes).

Megatron-FSDP 0.6.1's experimental ``fully_shard`` with FP32 main weights and bf16 main grads
turns a bf16 model's parameters into FP32 DTensors with ``grad_dtype=bf16``: the case the
wrapper exists for. Three spawns serve every test of this module:

1. train (world 2): the unwrapped failures, ours against upstream's ``fully_shard_optimizer``,
   a raising step, a DCP checkpoint, and the uninterrupted continuation;
2. resume (world 2, fresh processes): load that checkpoint after ``init_optimizer_state``
   and continue;
3. reshard (world 1, in the pytest process): load the same checkpoint into one process.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any

import pytest
import torch

from .conftest import Launcher, mismatches, requantized_fp8_mismatches, run_in_this_process

# One xdist worker per module (with --dist loadgroup): its tests share module-scoped spawns.
pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("megatron_fsdp")]
if importlib.util.find_spec("megatron_fsdp") is None:
    pytest.skip("megatron-fsdp is not installed", allow_module_level=True)

CHECKPOINT_STEP = 3  # steps before the checkpoint
CONTINUE_STEPS = 3  # steps after it
OPTIMIZERS = ["adamw", "precision_aware_adamw"]
# PrecisionAwareAdamW consumes low-precision grads itself: no cast needed.
PRECISION_AWARE = {"adamw": False, "precision_aware_adamw": True}
# States kept in FP8 with a per-shard scale: re-quantized when the sharding changes.
FP8_STATES = {"adamw": (), "precision_aware_adamw": ("exp_avg_sq",)}


# ----------------------------------------------------------------------------------------
# helpers (run inside the workers)
# ----------------------------------------------------------------------------------------
def build_model(world_size: int) -> torch.nn.Module:
    from megatron_fsdp.experimental import Flat, Placements, fully_shard
    from megatron_fsdp.mixed_precision import MixedPrecisionPolicy
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(
        torch.bfloat16
    )
    placements = Placements(dp_axes=[0], parameter=[Flat()], gradient=[Flat()], optimizer=[Flat()])
    policy = MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.bfloat16)
    # Two FSDP units (bottom-up, then the root): two FSDP parameter groups.
    fully_shard(model[0], mesh, placements, policy)
    fully_shard(model[2], mesh, placements, policy)
    fully_shard(model, mesh, placements, policy)
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
    raise ValueError(name)


def wrap(name: str, optimizer: torch.optim.Optimizer) -> Any:
    from wrapped_optim.fsdp import FSDPAwareOptimizer

    return FSDPAwareOptimizer(optimizer, precision_aware=PRECISION_AWARE[name])


def fsdp_groups(model: torch.nn.Module) -> list[Any]:
    return [g for m in model.modules() for g in getattr(m, "parameter_groups", ())]


def forward_backward(model: torch.nn.Module, step: int, rank: int) -> None:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 8, generator=generator).to(torch.bfloat16)
    model(x).float().pow(2).mean().backward()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def snapshot(model: torch.nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    """Rank-local main weights, compute weights and optimizer state, cloned."""
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
    for index, group in enumerate(fsdp_groups(model)):
        # Per-tensor views: the flat buffers' padding is never written.
        for position, name in enumerate(group.parameter_names):
            view = group.model_weight.get_local_tensor(position)
            out[f"compute{index}/{name}"] = view.clone()
    return out


def compute_weights_follow_main(model: torch.nn.Module) -> bool:
    return all(
        torch.equal(
            g.model_weight.get_local_tensor(i),
            g.main_weight.get_local_tensor(i).to(g.model_weight.dtype),
        )
        for g in fsdp_groups(model)
        for i in range(len(g.parameter_names))
    )


def dcp_state(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    from megatron_fsdp.uneven_dtensor import preprocess_state_dict_for_uneven_dtensor
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    # Megatron-FSDP shards unevenly; its helper gives DCP the true chunk offsets.
    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optimizer)}
    return preprocess_state_dict_for_uneven_dtensor(state)


def gather_full(tensor: torch.Tensor) -> torch.Tensor:
    """A whole tensor from its dim-0 shards (Megatron-FSDP's Flat placement: rank order)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor.detach().clone()
    shards: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shards, tensor.to_local().detach().clone())
    full = torch.cat(shards, dim=0)
    assert full.shape == tensor.shape, (full.shape, tensor.shape)
    return full


def full_optimizer_state(model: torch.nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    """Main weights and the optimizer's state dict, gathered whole (same on all ranks)."""
    names = [name for name, _ in model.named_parameters()]  # the optimizer's param order
    out = {name: gather_full(param) for name, param in model.named_parameters()}
    state_dict = optimizer.state_dict()
    for index, state in state_dict["state"].items():
        for key, value in state.items():
            out[f"{names[index]}.{key}"] = gather_full(torch.as_tensor(value))
    for index, group in enumerate(state_dict["param_groups"]):
        if "step" in group:
            out[f"param_group{index}.step"] = torch.tensor(group["step"])
    return out


def load_checkpoint(model: torch.nn.Module, optimizer: Any, path: str) -> bool:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    from wrapped_optim.fsdp import init_optimizer_state

    created = init_optimizer_state(optimizer)
    state = dcp_state(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(model, optimizer, state["optim"])
    optimizer.refresh_compute_weights()  # the model load wrote the FP32 main weights
    return created


def step_counting_syncs(model: torch.nn.Module, optimizer: Any, calls: list[str]) -> None:
    """Steps, recording each Megatron-FSDP compute-weight refresh (via the patch utility)."""
    from wrapped_optim.patching import patch_attribute

    with contextlib.ExitStack() as patches:
        for index, group in enumerate(fsdp_groups(model)):
            sync = group.sync_model_weight_from_main_weight

            def counting(sync: Any = sync, label: str = f"group{index}") -> None:
                calls.append(label)
                sync()

            patches.enter_context(
                patch_attribute(group, "sync_model_weight_from_main_weight", counting)
            )
        optimizer.step()


# ----------------------------------------------------------------------------------------
# workers
# ----------------------------------------------------------------------------------------
def train_worker(rank: int, world_size: int, checkpoint_root: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from megatron_fsdp.experimental import fully_shard_optimizer
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    out: dict[str, Any] = {}

    # -- the unwrapped path fails as upstream reports ----------------------------------
    model = build_model(world_size)
    param = next(model.parameters())
    out["param_kind"] = (type(param).__name__, param.dtype, param.grad_dtype)
    try:
        get_optimizer_state_dict(model, torch.optim.AdamW(model.parameters()))
    except RuntimeError as error:
        out["dcp_initialiser_error"] = str(error)
    forward_backward(model, 0, rank)
    out["grad_dtype_seen"] = param.grad.dtype
    try:
        torch.optim.AdamW(model.parameters()).step()
    except RuntimeError as error:
        out["plain_adamw_error"] = str(error)

    for name in OPTIMIZERS:
        # -- ours against upstream's fully_shard_optimizer, bitwise ----------------------
        upstream_model, ours_model = build_model(world_size), build_model(world_size)
        upstream = make_optimizer(name, upstream_model)
        fully_shard_optimizer(upstream, precision_aware=PRECISION_AWARE[name])
        ours = wrap(name, make_optimizer(name, ours_model))
        syncs: list[str] = []

        equal_per_step = []
        for step in range(CHECKPOINT_STEP):
            forward_backward(upstream_model, step, rank)
            upstream.step()
            upstream.zero_grad()
            forward_backward(ours_model, step, rank)
            step_counting_syncs(ours_model, ours, syncs)
            ours.zero_grad()
            equal_per_step.append(
                mismatches(snapshot(upstream_model, upstream), snapshot(ours_model, ours))
            )
        out[f"{name}/mismatch_vs_upstream"] = equal_per_step
        out[f"{name}/syncs"] = syncs
        out[f"{name}/fsdp_groups"] = len(fsdp_groups(ours_model))
        out[f"{name}/compute_follows_main"] = compute_weights_follow_main(ours_model)
        out[f"{name}/cast_buffer_bytes"] = ours.cast_buffer_bytes
        out[f"{name}/cast_buffer_allocations"] = ours._cast_buffers.allocations

        # -- the checkpoint ---------------------------------------------------------------
        path = f"{checkpoint_root}/{name}"
        dcp.save(dcp_state(ours_model, ours), checkpoint_id=path)
        out[f"{name}/full_state"] = full_optimizer_state(ours_model, ours)

        # -- a raising step: upstream stays dirty, ours is clean --------------------------
        if PRECISION_AWARE[name]:
            # Nothing is cast, so there is nothing to leave dirty: just take the step.
            forward_backward(ours_model, CHECKPOINT_STEP, rank)
            ours.step()
            ours.zero_grad()
        else:
            forward_backward(upstream_model, CHECKPOINT_STEP, rank)
            forward_backward(ours_model, CHECKPOINT_STEP, rank)
            report: dict[str, Any] = {}
            for label, model_, optimizer in (
                ("upstream", upstream_model, upstream),
                ("ours", ours_model, ours),
            ):
                params = list(model_.parameters())
                grads = [p.grad for p in params]
                group = optimizer.param_groups[0]
                betas = group["betas"]
                group["betas"] = (0.9,)  # AdamW raises before touching any state
                try:
                    optimizer.step()
                except ValueError:
                    report[f"{label}/raised"] = True
                finally:
                    group["betas"] = betas
                report[f"{label}/grads_are_originals"] = all(
                    p.grad is g for p, g in zip(params, grads, strict=True)
                )
                report[f"{label}/grad_dtypes"] = sorted({str(p.grad.dtype) for p in params})
                report[f"{label}/param_grad_dtypes"] = sorted({str(p.grad_dtype) for p in params})
                try:
                    optimizer.step()
                    report[f"{label}/retry"] = "ok"
                except Exception as error:
                    report[f"{label}/retry"] = f"{type(error).__name__}: {error}"
                optimizer.zero_grad()
            out[f"{name}/raising_step"] = report

        # -- uninterrupted continuation (the failed attempt must have left no trace) --------
        for step in range(CHECKPOINT_STEP + 1, CHECKPOINT_STEP + CONTINUE_STEPS):
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
        out[f"{name}/compute_follows_main"] = compute_weights_follow_main(model)
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
        out[f"{name}/full_state"] = full_optimizer_state(model, optimizer)
    return out


# ----------------------------------------------------------------------------------------
# the spawns, shared by the tests
# ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("mfsdp_ckpt"))


@pytest.fixture(scope="module")
def trained(megatron_fsdp_launcher: Launcher, checkpoint_root: str) -> list[dict[str, Any]]:
    return megatron_fsdp_launcher(train_worker, 2, checkpoint_root)


@pytest.fixture(scope="module")
def resumed(
    megatron_fsdp_launcher: Launcher, checkpoint_root: str, trained: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    return megatron_fsdp_launcher(resume_worker, 2, checkpoint_root)


@pytest.fixture(scope="module")
def resharded(
    cuda_shim: None,
    tmp_path_factory: pytest.TempPathFactory,
    checkpoint_root: str,
    trained: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    # World size 1 runs in this (fresh-model) process: no spawn needed.
    return [run_in_this_process(reshard_worker, tmp_path_factory.mktemp("single"), checkpoint_root)]


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


def test_params_are_fp32_dtensors_with_bf16_grads(trained: list[dict[str, Any]]) -> None:
    for rank in trained:
        assert rank["param_kind"] == ("DTensor", torch.float32, torch.bfloat16)
        assert rank["grad_dtype_seen"] == torch.bfloat16


def test_unwrapped_path_fails_as_upstream_reports(trained: list[dict[str, Any]]) -> None:
    for rank in trained:
        assert "expected dtype torch.float32" in rank["plain_adamw_error"]
        assert "grad_dtype" in rank["dcp_initialiser_error"]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_wrapper_matches_upstream_adapter_bitwise(trained: list[dict[str, Any]], name: str) -> None:
    for rank in trained:
        assert rank[f"{name}/mismatch_vs_upstream"] == [[]] * CHECKPOINT_STEP
        # compute weights refreshed once per FSDP parameter group per step
        assert rank[f"{name}/fsdp_groups"] == 2
        assert rank[f"{name}/syncs"] == ["group0", "group1"] * CHECKPOINT_STEP
        assert rank[f"{name}/compute_follows_main"]
    # AdamW steps on FP32 copies of the bf16 grads, kept between steps; PrecisionAwareAdamW
    # reads the bf16 grads directly.
    expected = 0 if PRECISION_AWARE[name] else 4 * (8 * 16 + 16 + 16 * 4 + 4)
    assert sum(rank[f"{name}/cast_buffer_bytes"] for rank in trained) == expected
    # allocated on the first step only, one DTensor buffer per parameter, then reused
    expected_allocations = 0 if PRECISION_AWARE[name] else 4
    assert [rank[f"{name}/cast_buffer_allocations"] for rank in trained] == [
        expected_allocations
    ] * len(trained)


@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if not PRECISION_AWARE[n]])
def test_raising_step_leaves_upstream_dirty_and_ours_clean(
    trained: list[dict[str, Any]], name: str
) -> None:
    for rank in trained:
        report = rank[f"{name}/raising_step"]
        assert report["upstream/raised"] and report["ours/raised"]
        # upstream: the post-hook never ran, grads stay cast and grad_dtype stays changed
        assert not report["upstream/grads_are_originals"]
        assert report["upstream/grad_dtypes"] == ["torch.float32"]
        assert report["upstream/param_grad_dtypes"] == ["torch.float32"]
        assert report["upstream/retry"].startswith("AssertionError")
        # ours: the original bf16 grads and grad_dtype are back, the retry steps normally
        assert report["ours/grads_are_originals"]
        assert report["ours/grad_dtypes"] == ["torch.bfloat16"]
        assert report["ours/param_grad_dtypes"] == ["torch.bfloat16"]
        assert report["ours/retry"] == "ok"


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_dcp_resume_continues_bitwise(
    trained: list[dict[str, Any]], resumed: list[dict[str, Any]], name: str
) -> None:
    for before, after in zip(trained, resumed, strict=True):
        assert after[f"{name}/init_created"]
        assert after[f"{name}/compute_follows_main"]
        assert mismatches(before[f"{name}/final"], after[f"{name}/final"]) == []


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_reload_into_one_process_gives_the_same_full_state(
    trained: list[dict[str, Any]], resharded: list[dict[str, Any]], name: str
) -> None:
    (single,) = resharded
    for rank in trained:
        assert_same_full_state(rank[f"{name}/full_state"], single[f"{name}/full_state"], name)
