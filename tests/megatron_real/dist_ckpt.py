"""Megatron's own checkpoint path, as Megatron-Bridge drives it, for the real CPU stacks.

Save: ``optimizer.sharded_state_dict(model_sd, False, metadata=...)`` (or, for the legacy
format, ``state_dict()`` plus ``save_parameter_state``) written by
``megatron.core.dist_checkpointing.save``. Load: a fresh build, ``sharded_state_dict(model_sd,
True, ...)``, ``dist_checkpointing.load``, ``model.load_state_dict``,
``optimizer.load_state_dict`` — by each *route* a user takes (bare Megatron, compat's helpers
in Bridge's order, ``wrap``, the explicit stack, ``setup_optimizer``'s stack).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from wrapped_optim import compat, wrap
from wrapped_optim._adapters.walk import walk_leaves
from wrapped_optim.hybrid import HybridSyncOptimizer
from wrapped_optim.staged import StagedCheckpointOptimizer

# Core's sharding formats (metadata["distrib_optim_sharding_type"]), plus Megatron-LM's
# legacy pair save_parameter_state / load_parameter_state.
FORMATS = ("dp_reshardable", "fully_reshardable", "fully_sharded_model_space", "legacy")
ROUTES = ("bare", "compat", "wrap", "stack", "setup")


def metadata(fmt: str) -> dict[str, Any]:
    """The metadata Bridge passes to ``sharded_state_dict`` for format ``fmt``."""
    return {"distrib_optim_sharding_type": fmt}


def route_optimizer(optimizer: Any, route: str) -> Any:
    """The optimizer a user of ``route`` holds, built around Megatron's ``optimizer``."""
    if route == "wrap":
        return wrap(optimizer)
    if route == "stack":
        return HybridSyncOptimizer(StagedCheckpointOptimizer(optimizer))
    if route == "setup":
        from wrapped_optim.config import StackConfig

        return wrap(optimizer, StackConfig.from_megatron(optimizer))
    return optimizer


def save(model: Any, optimizer: Any, directory: Path, fmt: str) -> None:
    """Writes model and optimizer the way Bridge's ``save_checkpoint`` does for ``fmt``.

    ``model`` is Megatron's DistributedDataParallel; its module's sharded state dict is what
    Megatron checkpoints (the unwrapped model, as Megatron-LM's ``unwrap_model`` gives it).
    """
    from megatron.core import dist_checkpointing

    directory.mkdir(parents=True, exist_ok=True)
    model_sd = model.module.sharded_state_dict()
    if fmt == "legacy":
        (directory / "model").mkdir(exist_ok=True)
        dist_checkpointing.save({"model": model_sd}, str(directory / "model"))
        # Megatron-LM's legacy files: the common state (the same on every data-parallel
        # rank) written by rank 0, the parameter state gathered to rank 0.
        common = optimizer.state_dict()
        if torch.distributed.get_rank() == 0:
            torch.save(common, directory / "optimizer_common.pt")
        if _distributed(optimizer):
            optimizer.save_parameter_state(str(directory / "param_state.pt"))
        torch.distributed.barrier()
        return
    state = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, False, metadata=metadata(fmt)),
    }
    (directory / "dist").mkdir(exist_ok=True)
    dist_checkpointing.save(state, str(directory / "dist"))


def _distributed(optimizer: Any) -> bool:
    """Whether the stack holds a DistributedOptimizer (a legacy checkpoint then has a separate
    parameter-state file; FP32Optimizer and Float16Optimizer keep everything in state_dict)."""
    return any(hasattr(leaf.container, "save_parameter_state") for leaf in walk_leaves(optimizer))


def _load_optimizer(model: Any, optimizer: Any, directory: Path, fmt: str) -> None:
    from megatron.core import dist_checkpointing

    model_sd = model.module.sharded_state_dict()
    if fmt == "legacy":
        loaded = dist_checkpointing.load({"model": model_sd}, str(directory / "model"))
        model.module.load_state_dict(loaded["model"])
        # Megatron's HybridDeviceOptimizer keeps its sub-optimizer classes in its groups.
        common = torch.load(directory / "optimizer_common.pt", weights_only=False)
        with torch.no_grad():
            optimizer.load_state_dict(common)
            if _distributed(optimizer):
                optimizer.load_parameter_state(str(directory / "param_state.pt"))
        return
    request = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, True, metadata=metadata(fmt)),
    }
    loaded = dist_checkpointing.load(request, str(directory / "dist"))
    model.module.load_state_dict(loaded["model"])
    with torch.no_grad():
        optimizer.load_state_dict(loaded["optimizer"])


def load_converted(model: Any, optimizer: Any, optimizer_dir: str, fmt: str) -> None:
    """Megatron's own resume of the optimizer alone from a (converted) directory in format
    ``fmt``: ``dist_checkpointing.load`` of its sharded state dict, or (legacy)
    ``load_state_dict`` of ``optimizer_common.pt`` then ``load_parameter_state``."""
    from megatron.core import dist_checkpointing

    if fmt == "legacy":
        common = torch.load(Path(optimizer_dir, "optimizer_common.pt"), weights_only=False)
        with torch.no_grad():
            optimizer.load_state_dict(common)
            optimizer.load_parameter_state(str(Path(optimizer_dir, "param_state.pt")))
        return
    model_sd = model.module.sharded_state_dict()
    request = optimizer.sharded_state_dict(model_sd, True, metadata=metadata(fmt))
    state = dist_checkpointing.load({"optimizer": request}, optimizer_dir)
    with torch.no_grad():
        optimizer.load_state_dict(state["optimizer"])


def load_dcp_into(model: torch.nn.Module, optimizer: Any, path: Path) -> None:
    """A DCP optimizer checkpoint loaded into a plain torch ``optimizer`` the way an FSDP2 /
    DCP user does: torch's initialiser, ``dcp.load`` (keys the source lacks keep torch's
    values), ``set_optimizer_state_dict``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    template = get_optimizer_state_dict(model, optimizer)
    planner = DefaultLoadPlanner(allow_partial_load=True)
    dcp.load(template, checkpoint_id=str(path), planner=planner, no_dist=True)
    set_optimizer_state_dict(model, optimizer, template)


def assert_resumed_bitwise(
    source: dict[str, torch.Tensor],
    cells: list[dict[str, Any]],
    uninterrupted: list[dict[str, torch.Tensor]] | None,
) -> None:
    """Each rank's resume ``cell`` loaded without error, the state right after the load is
    ``source`` bit for bit, and (``uninterrupted``: each rank's snapshot of the run that went
    on, at the saving world size) the resumed run continued exactly as it."""
    from tests.distributed.conftest import mismatches

    for cell in cells:
        assert "error" not in cell, cell.get("error")
    after = whole_model_space([cell["space"] for cell in cells])
    assert after.keys() == source.keys()
    assert mismatches(source, after) == []
    if uninterrupted is not None:
        for snapshot_, cell in zip(uninterrupted, cells, strict=True):
            assert mismatches(snapshot_, cell["snapshot"]) == []


def prime_like_newer_core(optimizer: Any) -> None:
    """What megatron-core 0.17+ does itself in ``sharded_state_dict(is_loading=True)``: a
    DistributedOptimizer without state first gets dummy state (``state_dict`` asserts one
    step across its states; 0.16.1 leaves that to the caller)."""
    for member in getattr(optimizer, "chained_optimizers", [optimizer]):
        init = getattr(member, "_init_optimizer_states_with_dummy_values", None)
        if init is not None and len(member.optimizer.state) == 0:
            init()


def load(model: Any, optimizer: Any, directory: Path, fmt: str, route: str) -> None:
    """A full resume of ``optimizer`` (as returned by :func:`route_optimizer`) and ``model``.

    The compat route runs Bridge's sequence: the load inside
    ``memory_efficient_fp32_optimizer_state_loading`` (and this project's
    ``hybrid_optimizer_state_loading``), then ``sync_hybrid_device_optimizer_fp32_master_copies``.
    """
    if route == "bare":
        prime_like_newer_core(optimizer)
    if route != "compat":
        _load_optimizer(model, optimizer, directory, fmt)
        return
    with contextlib.ExitStack() as scopes:
        scopes.enter_context(compat.memory_efficient_fp32_optimizer_state_loading(optimizer))
        scopes.enter_context(compat.hybrid_optimizer_state_loading(optimizer))
        _load_optimizer(model, optimizer, directory, fmt)
    compat.sync_hybrid_device_optimizer_fp32_master_copies(optimizer)


def load_model_only(model: Any, optimizer: Any, directory: Path, fmt: str, route: str) -> None:
    """Fine-tuning: the weights from the checkpoint, the optimizer state fresh.

    Megatron reloads the main params from the model after a model-only load
    (``reload_model_params``); Bridge then syncs the hybrid master copies.
    """
    from megatron.core import dist_checkpointing

    model_dir = directory / ("model" if fmt == "legacy" else "dist")
    loaded = dist_checkpointing.load({"model": model.module.sharded_state_dict()}, str(model_dir))
    model.module.load_state_dict(loaded["model"])
    optimizer.reload_model_params()
    if route == "compat":
        compat.sync_hybrid_device_optimizer_fp32_master_copies(optimizer)


def save_and_continue(
    model: Any, optimizer: Any, directory: Path, formats: tuple[str, ...], at: int, more: int,
    rank: int,
) -> dict[str, Any]:  # fmt: skip
    """``at`` steps, a save in each of ``formats`` (to ``directory / fmt``), ``more`` steps:
    ``{"space": model_space_state at the save, "snapshot": the uninterrupted run's end}``."""
    from tests.megatron_real.harness import train

    train(model, optimizer, range(at), rank)
    for fmt in formats:
        save(model, optimizer, directory / fmt, fmt)
    space = model_space_state(model, optimizer)
    train(model, optimizer, range(at, at + more), rank)
    return {"snapshot": snapshot(model, optimizer), "space": space}


def resume_and_continue(
    model: Any, optimizer: Any, directory: Path, fmt: str, route: str, more: range, rank: int
) -> dict[str, Any]:
    """A full resume by ``route``, then ``more`` steps: ``{"space": model_space_state right
    after the load, "snapshot": after the steps}``, or ``{"error": ...}`` if the load raised
    (reported to the tests, which decide)."""
    from tests.megatron_real.harness import train

    try:
        load(model, optimizer, directory, fmt, route)
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}
    space = model_space_state(model, optimizer)
    train(model, optimizer, more, rank)
    return {"snapshot": snapshot(model, optimizer), "space": space}


# --------------------------------------------------------------------------------------
# What a resume must reproduce
# --------------------------------------------------------------------------------------
def _tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return torch.tensor(float(value), dtype=torch.float64)


def snapshot(model: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    """Everything an exact resume must reproduce, by path: weights, every FP32 master level of
    every hybrid offload optimizer, every state tensor (moments, per-parameter ``step``) of
    every leaf and of every HybridDeviceOptimizer sub-optimizer, and each group's ``lr``."""
    from wrapped_optim._adapters.hybrid import hybrid_master_copies

    out = {f"weight/{name}": p.detach().clone() for name, p in model.named_parameters()}
    for i, entry in enumerate(hybrid_master_copies(optimizer)):
        for label, level in entry.levels():
            out[f"master/{i}/{label}"] = level.detach().clone()
    for leaf in walk_leaves(optimizer):
        if leaf.optimizer is None:
            continue
        holders = [("leaf", leaf.optimizer)]
        holders += [
            (f"sub{j}", sub) for j, sub in enumerate(getattr(leaf.optimizer, "sub_optimizers", []))
        ]
        for label, holder in holders:
            for g, group in enumerate(holder.param_groups):
                out[f"lr/{leaf.index}/{label}/{g}"] = _tensor(group["lr"])
                for k, param in enumerate(group["params"]):
                    for key, value in sorted(holder.state.get(param, {}).items()):
                        if key != "master_param":  # an alias of a level above
                            out[f"state/{leaf.index}/{label}/{g}/{k}/{key}"] = _tensor(value)
    return out


def model_space_state(model: Any, optimizer: Any) -> dict[str, tuple[int, int, torch.Tensor]]:
    """This rank's slice of each parameter's main param and optimizer state, in model space:
    ``{"<param name>/<key>": (start, end, values)}`` over the flattened parameter (what a
    resharded resume must put back, whatever the world size)."""
    names = {id(p): name for name, p in model.named_parameters()}
    out: dict[str, tuple[int, int, torch.Tensor]] = {}
    for leaf in walk_leaves(optimizer):
        container = leaf.container
        if leaf.is_stub or not hasattr(container, "_get_main_param_and_optimizer_states"):
            continue
        for model_param in container.model_param_group_index_map:
            param_range = container._get_model_param_range_map(model_param)["param"]
            tensors = container._get_main_param_and_optimizer_states(model_param)
            for key, value in tensors.items():
                if key == "master_param":
                    continue
                value = _tensor(value).reshape(-1) if key != "step" else _tensor(value)
                out[f"{names[id(model_param)]}/{key}"] = (param_range.start, param_range.end, value)
    return out


def whole_model_space(
    spaces: list[dict[str, tuple[int, int, torch.Tensor]]],
) -> dict[str, torch.Tensor]:
    """Each parameter's state in model space, put together from every rank's slice of
    :func:`model_space_state` (a ``step`` is the same on every rank)."""
    parts: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
    for space in spaces:
        for key, part in space.items():
            parts.setdefault(key, []).append(part)
    whole = {}
    for key, slices in parts.items():
        if key.endswith("/step"):
            values = {float(value) for _, _, value in slices}
            assert len(values) == 1, (key, values)  # every rank counts the same steps
            whole[key] = slices[0][2]
            continue
        slices.sort(key=lambda part: part[0])
        assert [s for s, _, _ in slices] == [0, *[e for _, e, _ in slices[:-1]]], key
        whole[key] = torch.cat([values for _, _, values in slices])
    return whole
