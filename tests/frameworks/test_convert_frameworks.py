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
