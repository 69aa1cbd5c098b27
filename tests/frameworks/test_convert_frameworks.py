"""convert() on the optimizer checkpoints real frameworks write: transformers' Trainer
(``optimizer.pt``, parameters in two groups) and Lightning (``optimizer_states`` in a
``.ckpt``), carried to DCP by name and back, bit for bit."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from docs.guides.examples import lightning_module, transformers_trainer
from wrapped_optim.checkpoint import convert, names_from_model

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"),
]


def _grouped_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    """transformers' default split: no weight decay for biases and norms."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    )


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for index, entries in a["state"].items():
        for key, value in entries.items():
            other = b["state"][index][key]
            assert other.dtype == value.dtype and torch.equal(other, value), (index, key)


def _round_trip(source: Path, tmp_path: Path, names: Any, trusted: bool) -> dict[str, Any]:
    report = convert(source, tmp_path / "dcp", to="dcp", names=names, trusted=trusted, verify=True)
    assert report.lossy == {}
    convert(tmp_path / "dcp", tmp_path / "back.pt", to="torch-save", names=names, verify=True)
    back: dict[str, Any] = torch.load(tmp_path / "back.pt", weights_only=True)
    return back


def test_transformers_trainer_optimizer_pt(tmp_path: Path) -> None:
    built: list[tuple[torch.nn.Module, torch.optim.Optimizer]] = []

    def make(model: torch.nn.Module) -> torch.optim.Optimizer:
        built.append((model, _grouped_adamw(model)))
        return built[-1][1]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers_trainer.train(make, epochs=1, checkpoint_dir=tmp_path / "run")
    (saved,) = sorted((tmp_path / "run").glob("checkpoint-*/optimizer.pt"))
    model, optimizer = built[0]
    names = names_from_model(model, optimizer)
    back = _round_trip(saved, tmp_path, names, trusted=False)
    _same(torch.load(saved, weights_only=True), back)


def test_lightning_checkpoint(tmp_path: Path) -> None:
    built: list[tuple[torch.nn.Module, torch.optim.Optimizer]] = []

    def make(model: torch.nn.Module) -> torch.optim.Optimizer:
        built.append((model, torch.optim.AdamW(model.parameters(), lr=1e-2)))
        return built[-1][1]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lightning_module.train(make, epochs=1, checkpoint_dir=tmp_path / "run")
    (saved,) = sorted((tmp_path / "run").glob("*.ckpt"))
    model, optimizer = built[0]
    back = _round_trip(saved, tmp_path, names_from_model(model, optimizer), trusted=False)
    (expected,) = torch.load(saved, weights_only=False)["optimizer_states"]
    _same(expected, back)


def test_accelerate_save_state_through_dcp_and_back_resumes_bitwise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real Accelerate run's ``optimizer.bin``, converted by the command line to DCP,
    loads into a torch optimizer bitwise; converted back and put in place of the original,
    ``load_state`` resumes the run exactly as the uninterrupted one."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from docs.guides.examples import accelerate_loop
    from docs.guides.examples.toy import build_model
    from wrapped_optim._cli import main

    built: list[tuple[torch.nn.Module, torch.optim.Optimizer]] = []

    def make(model: torch.nn.Module) -> torch.optim.Optimizer:
        built.append((model, torch.optim.AdamW(model.parameters(), lr=1e-2)))
        return built[-1][1]

    run = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        final = accelerate_loop.train(make, epochs=2, checkpoint_dir=run, save_after=1)
    uninterrupted = {n: p.detach().clone() for n, p in final.named_parameters()}
    saved: dict[str, Any] = torch.load(run / "optimizer.bin", weights_only=True)
    spec = "docs.guides.examples.toy:build_model"
    dcp_dir, back = tmp_path / "dcp", tmp_path / "optimizer.bin"
    common = ["--model", spec, "--verify", "--no-progress"]
    assert main(["convert", str(run / "optimizer.bin"), str(dcp_dir), "--to", "dcp", *common]) == 0
    assert "torch-save -> dcp" in capsys.readouterr().out

    # DCP -> a fresh torch optimizer, by name, as FSDP2 / torchtitan load it.
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5)  # the loop's initial_lr
    state = get_optimizer_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(dcp_dir), no_dist=True)
    set_optimizer_state_dict(model, optimizer, state)
    _same(saved, optimizer.state_dict())

    # DCP -> optimizer.bin again, in place of Accelerate's own, and resumed by load_state.
    assert main(["convert", str(dcp_dir), str(back), "--to", "torch-save", *common]) == 0
    _same(saved, torch.load(back, weights_only=True))
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(run, resumed_dir)
    shutil.copyfile(back, resumed_dir / "optimizer.bin")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed = accelerate_loop.train(
            make, epochs=2, checkpoint_dir=resumed_dir, save_after=1, resume=True
        )
    for name, value in resumed.named_parameters():
        assert torch.equal(value, uninterrupted[name]), name
