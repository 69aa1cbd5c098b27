"""The transformers ``Trainer`` driving a wrapped_optim stack on a tiny causal LM.

Run by tests/frameworks/test_transformers.py with every recipe of ``stacks.py``. The model is
built from a config (random weights, nothing downloaded).
"""

from __future__ import annotations

# --8<-- [start:imports]
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

# --8<-- [end:imports]
from docs.guides.examples.stacks import check_resume

__all__ = ["TokenData", "build_causal_lm", "train"]

# --8<-- [start:data]
BATCH_SIZE = 4


def build_causal_lm(dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """A one-layer Llama with a 64-token vocabulary, the same weights every time."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(config).to(dtype)


class TokenData(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Random token sequences, their own labels (the model shifts them)."""

    def __init__(self, samples: int = 16, length: int = 12) -> None:
        generator = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 64, (samples, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}
        # --8<-- [end:data]


# --8<-- [start:trainer]
def train(
    make_optimizer: Callable[[torch.nn.Module], Any],
    *,
    epochs: int,
    checkpoint_dir: Path,
    save_after: int = 1,
    resume: bool = False,
    dtype: torch.dtype = torch.float32,
) -> torch.nn.Module:
    """Trains ``epochs`` epochs, saving every ``save_after`` epochs' worth of steps into
    ``checkpoint_dir``; with ``resume=True``, resumes from the first of those checkpoints."""
    data = TokenData()
    steps_per_epoch = len(data) // BATCH_SIZE
    model = build_causal_lm(dtype)
    optimizer = make_optimizer(model)  # the stack, handed over as is
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=10)
    args = TrainingArguments(
        output_dir=str(checkpoint_dir / "resumed" if resume else checkpoint_dir),
        max_steps=epochs * steps_per_epoch,
        per_device_train_batch_size=BATCH_SIZE,
        save_strategy="steps",
        save_steps=save_after * steps_per_epoch,
        max_grad_norm=0.5,
        use_cpu=True,
        seed=0,
        report_to=[],
        logging_strategy="no",
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(optimizer, scheduler))
    first = checkpoint_dir / f"checkpoint-{save_after * steps_per_epoch}"
    trainer.train(resume_from_checkpoint=str(first) if resume else None)
    return model
    # --8<-- [end:trainer]


if __name__ == "__main__":
    # --8<-- [start:main]
    check_resume(train, "transformers")
    # --8<-- [end:main]
