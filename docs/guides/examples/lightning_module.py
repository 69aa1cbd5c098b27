"""Lightning driving a wrapped_optim stack: ``configure_optimizers``, clipping, checkpoints.

Run by tests/frameworks/test_lightning.py with every recipe of ``stacks.py``.
"""

from __future__ import annotations

# --8<-- [start:imports]
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch

# --8<-- [end:imports]
from docs.guides.examples.stacks import check_resume
from docs.guides.examples.toy import build_model, make_loader

__all__ = ["ManualRegressor", "Regressor", "train"]


# --8<-- [start:module]
class Regressor(L.LightningModule):
    """A small MLP whose optimizer comes from ``make_optimizer(module)``."""

    def __init__(
        self, make_optimizer: Callable[[torch.nn.Module], Any], dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.net = build_model(dtype)
        self.make_optimizer = make_optimizer
        self.input_dtype = dtype

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        inputs, targets = (tensor.to(self.input_dtype) for tensor in batch)
        return torch.nn.functional.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = self.make_optimizer(self)  # the stack: Lightning wraps it, we don't mind
        scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=10)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }
        # --8<-- [end:module]


# --8<-- [start:manual]
class ManualRegressor(Regressor):
    """The same module with manual optimization: Lightning's wrapper around the stack."""

    def __init__(
        self, make_optimizer: Callable[[torch.nn.Module], Any], dtype: torch.dtype
    ) -> None:
        super().__init__(make_optimizer, dtype)
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        optimizer = self.optimizers()  # a LightningOptimizer around the stack
        scheduler = self.lr_schedulers()
        inputs, targets = (tensor.to(self.input_dtype) for tensor in batch)
        loss = torch.nn.functional.mse_loss(self.net(inputs), targets)
        optimizer.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        optimizer.step()
        scheduler.step()
        return loss
        # --8<-- [end:manual]


# --8<-- [start:fit]
def train(
    make_optimizer: Callable[[torch.nn.Module], Any],
    *,
    epochs: int,
    checkpoint_dir: Path,
    save_after: int = 1,
    resume: bool = False,
    dtype: torch.dtype = torch.float32,
    module_cls: type[Regressor] = Regressor,
) -> torch.nn.Module:
    """Fits ``epochs`` epochs, checkpointing after ``save_after`` of them into
    ``checkpoint_dir``; with ``resume=True``, fits from that checkpoint instead."""
    checkpoint = checkpoint_dir / f"epoch={save_after - 1}.ckpt"
    saver = L.pytorch.callbacks.ModelCheckpoint(  # calls trainer.save_checkpoint
        dirpath=checkpoint_dir, filename="{epoch}", every_n_epochs=save_after, save_top_k=-1
    )
    module = module_cls(make_optimizer, dtype)
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        gradient_clip_val=0.5 if module.automatic_optimization else None,
        callbacks=[] if resume else [saver],
        enable_checkpointing=not resume,
        default_root_dir=checkpoint_dir,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=make_loader(), ckpt_path=checkpoint if resume else None)
    return module.net
    # --8<-- [end:fit]


if __name__ == "__main__":
    # --8<-- [start:main]
    check_resume(train, "Lightning")
    # --8<-- [end:main]
