"""fp16 AMP: torch's GradScaler (what Accelerate, Lightning and the Trainer use for fp16) must
reach a fused optimizer under our wrappers.

A fused torch optimizer unscales in its own kernel: GradScaler sets ``grad_scale`` and
``found_inf`` on the object it steps and the leaf reads them from itself. Before the wrapper
forwarded them, a wrapped fused SGD stepped on grads 65536 times too large and stepped
through infs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision

from docs.guides.examples import lightning_module
from tests.frameworks.harness import assert_bitwise_weights, weights
from wrapped_optim import FSDPAwareOptimizer, OptimizerWrapper, wrap

WRAPPINGS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "staged": lambda opt: wrap(opt, {"staged": {}}),
    "fsdp_over_staged": lambda opt: FSDPAwareOptimizer(wrap(opt, {"staged": {}})),
    "plain_twice": lambda opt: OptimizerWrapper(OptimizerWrapper(opt)),
}


def _fused_sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True)


def _scaled_steps(wrapping: Callable[[Any], Any] | None, poison_step: int | None) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    leaf = _fused_sgd(model)
    optimizer = leaf if wrapping is None else wrapping(leaf)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    scales = []
    for step in range(4):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.full((2, 4), 0.5 + step)).square().sum()
        scaler.scale(loss).backward()
        if step == poison_step:
            model.weight.grad[0, 0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        optimizer.zero_grad()
        for holder in {id(layer): layer for layer in (optimizer, leaf)}.values():
            assert not hasattr(holder, "grad_scale") and not hasattr(holder, "found_inf")
    return weights(model), scales


@pytest.mark.parametrize("wrapping", sorted(WRAPPINGS))
@pytest.mark.parametrize("poison_step", [None, 2])
def test_grad_scaler_reaches_a_wrapped_fused_optimizer(
    wrapping: str, poison_step: int | None
) -> None:
    bare_weights, bare_scales = _scaled_steps(None, poison_step)
    got_weights, got_scales = _scaled_steps(WRAPPINGS[wrapping], poison_step)
    assert got_scales == bare_scales
    if poison_step is not None:
        assert bare_scales[poison_step] == bare_scales[poison_step - 1] / 2  # the step skipped
    assert_bitwise_weights(got_weights, bare_weights, f"{wrapping} under GradScaler")


@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated")
def test_lightning_fp16_amp_steps_a_wrapped_fused_optimizer(tmp_path: Path) -> None:
    # Lightning refuses precision="16-mixed" on a CPU by name; its plugin, given explicitly,
    # runs fp16 autocast and a GradScaler there as on a GPU.
    def fit(wrapped: bool) -> dict[str, torch.Tensor]:
        def make(model: torch.nn.Module) -> Any:
            optimizer = _fused_sgd(model)
            return wrap(optimizer, {"staged": {}}) if wrapped else optimizer

        module = lightning_module.Regressor(make, torch.float32)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
        trainer = L.Trainer(
            max_epochs=1,
            accelerator="cpu",
            devices=1,
            plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
            default_root_dir=tmp_path,
            enable_checkpointing=False,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, train_dataloaders=lightning_module.make_loader())
        return weights(module.net)

    assert_bitwise_weights(fit(True), fit(False), "Lightning 16-mixed with a wrapped fused SGD")
