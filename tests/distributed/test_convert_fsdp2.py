"""convert() between FSDP2's DCP checkpoints and plain torch.save files (gloo, 2 CPU ranks).

FSDP2 writes its optimizer with ``get_optimizer_state_dict`` (DTensor shards on 2 ranks);
the converter reads that without a process group into a torch.save file that a plain AdamW
loads, and writes it back as a DCP checkpoint that FSDP2 on 2 ranks loads through
``set_optimizer_state_dict``. Every tensor is compared bitwise, and training continued after
the round trip equals training continued from the original checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from wrapped_optim.checkpoint import convert, names_from_model

from .conftest import Launcher, mismatches

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.xdist_group("convert_fsdp2"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

STEPS = 3
CONTINUE = 2


def plain_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def sharded_model(world_size: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    model = plain_model()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, number: int, rank: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * number + rank))
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    flat = {
        f"model.{k}": v.clone() for k, v in get_model_state_dict(model, options=options).items()
    }
    for fqn, state in get_optimizer_state_dict(model, optimizer, options=options)["state"].items():
        for key, value in state.items():
            flat[f"{fqn}.{key}"] = value.detach().clone()
    return flat


def train_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model = sharded_model(world_size)
    optimizer = make_optimizer(model)
    for number in range(STEPS):
        step(model, optimizer, number, rank)
    dcp.save({"optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=f"{root}/optim")
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=f"{root}/model")
    saved = full_state(model, optimizer)
    for number in range(STEPS, STEPS + CONTINUE):
        step(model, optimizer, number, rank)
    return {"saved": saved, "continued": full_state(model, optimizer)}


def resume_worker(rank: int, world_size: int, root: str, optim_dir: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from wrapped_optim.fsdp import init_optimizer_state

    model = sharded_model(world_size)
    optimizer = make_optimizer(model)
    init_optimizer_state(optimizer)
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
    }
    dcp.load({"model": state["model"]}, checkpoint_id=f"{root}/model")
    dcp.load({"optim": state["optim"]}, checkpoint_id=optim_dir)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    loaded = full_state(model, optimizer)
    for number in range(STEPS, STEPS + CONTINUE):
        step(model, optimizer, number, rank)
    return {"loaded": loaded, "continued": full_state(model, optimizer)}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("convert_fsdp2")


@pytest.fixture(scope="module")
def trained(launcher: Launcher, root: Path) -> list[dict[str, Any]]:
    return launcher(train_worker, 2, str(root))


@pytest.fixture(scope="module")
def converted(root: Path, trained: list[dict[str, Any]]) -> Path:
    model = plain_model()
    report = convert(
        root / "optim", root / "optimizer.pt", to="torch-save", model=model, verify=True
    )
    assert report.source_format == "dcp" and report.tensors == 8 and report.lossy == {}
    convert(root / "optimizer.pt", root / "back", to="dcp", model=model, under="optim", verify=True)
    return root / "optimizer.pt"


def test_plain_adamw_loads_fsdp2_state_bitwise(
    trained: list[dict[str, Any]], converted: Path
) -> None:
    model = plain_model()
    optimizer = make_optimizer(model)
    optimizer.load_state_dict(torch.load(converted, weights_only=True))
    names = names_from_model(model).names
    got = {}
    for name, param in zip(names, model.parameters(), strict=True):
        for key, value in optimizer.state[param].items():
            got[f"{name}.{key}"] = value
    saved = {k: v for k, v in trained[0]["saved"].items() if not k.startswith("model.")}
    assert sorted(got) == sorted(saved)
    assert mismatches(saved, got) == []


def test_fsdp2_resumes_from_the_converted_state_bitwise(
    launcher: Launcher, root: Path, trained: list[dict[str, Any]], converted: Path
) -> None:
    resumed = launcher(resume_worker, 2, str(root), str(root / "back"))
    for rank in range(2):
        assert mismatches(trained[rank]["saved"], resumed[rank]["loaded"]) == []
        assert mismatches(trained[rank]["continued"], resumed[rank]["continued"]) == []
