"""Hugging Face Accelerate driving a wrapped_optim stack: train, ``save_state``, ``load_state``.

Run by tests/frameworks/test_accelerate.py with every recipe of ``stacks.py``.
"""

from __future__ import annotations

# --8<-- [start:imports]
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

# --8<-- [end:imports]
from docs.guides.examples.stacks import check_resume
from docs.guides.examples.toy import build_model, make_loader

__all__ = ["train"]


# --8<-- [start:loop]
def train(
    make_optimizer: Callable[[torch.nn.Module], Any],
    *,
    epochs: int,
    checkpoint_dir: Path,
    save_after: int = 1,
    resume: bool = False,
    dtype: torch.dtype = torch.float32,
) -> torch.nn.Module:
    """Trains ``epochs`` epochs and saves the whole state after ``save_after`` of them into
    ``checkpoint_dir``; with ``resume=True``, loads it and trains the epochs that are left."""
    # Two micro-batches per step: the stack sees only the steps that happen.
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = build_model(dtype)
    optimizer = make_optimizer(model)  # wrap first: the stack is what Accelerate gets
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=10)
    model, optimizer, loader, scheduler = accelerator.prepare(
        model, optimizer, make_loader(), scheduler
    )
    first_epoch = 0
    if resume:
        accelerator.load_state(checkpoint_dir)  # model, optimizer, scheduler, RNG states
        first_epoch = save_after
    for epoch in range(first_epoch, epochs):
        for inputs, targets in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(inputs.to(dtype)), targets.to(dtype))
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), max_norm=0.5)
                optimizer.step()  # skipped by Accelerate between accumulation boundaries
                scheduler.step()
                optimizer.zero_grad()
        if epoch + 1 == save_after and not resume:
            accelerator.save_state(checkpoint_dir)  # optimizer.bin: the bare optimizer's format
    return accelerator.unwrap_model(model)
    # --8<-- [end:loop]


if __name__ == "__main__":
    # --8<-- [start:main]
    check_resume(train, "Accelerate")
    # --8<-- [end:main]
