"""The staged save's memory bound on Megatron's real precision-aware DistributedOptimizer.

Run in a spawned worker after :func:`tests.megatron_real.precision_aware.install_te_stand_in`:
for each precision-aware config and format, a trained stack is saved bare (Megatron alone:
each state's whole FP32 expansion from ``get_unscaled_state``) and another through ``wrap``
with a small ``staged.chunk_bytes``, each save inside a
:class:`~wrapped_optim.testing.DeviceMemoryProbe`. Under the CUDA shim the optimizer's state
is device state (``is_cuda``), so the staging engine stages it as it would on a GPU, through
one chunk of device scratch, and its ledger records every byte it keeps there; the bare
save's expansions go on the same ledger while alive
(:func:`~wrapped_optim.testing.probe.count_unstaged_expansions`). A model wider than the
suite's makes the whole expansion many chunks.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

HIDDEN = 256  # 66,820 parameters: 33,410 per rank of 2
CHUNK_BYTES = 16 * 1024
STEPS = 2
BOUND_CONFIGS = ("bf16_remainders", "fp8_remainders", "bf16_fp16_master")
BOUND_FORMATS = ("dp_reshardable", "fully_reshardable")  # legacy gathers as fully_reshardable


def whole_expansion(optimizer: Any) -> tuple[int, int]:
    """(every compressed state's FP32 expansion on this rank, the largest one), in bytes:
    what ``get_unscaled_state`` returns for each state stored below FP32 (an int16 remainder
    comes back as it is)."""
    from tests.megatron_real.harness import bare, leaf

    inner = leaf(bare(optimizer)).optimizer
    mapping = inner.name_to_dtype_map
    sizes = [
        param.numel() * 4
        for group in inner.param_groups
        for param in group["params"]
        for name, stored in inner.state[param].items()
        if mapping.get(name, torch.float32) != torch.float32 and stored.dtype != torch.int16
    ]
    return sum(sizes), max(sizes)


def device_state(optimizer: Any) -> None:
    """The inner optimizer's state tensors, device tensors for the shim (as they are on a GPU:
    :func:`tests.megatron_real.shim.make_device_tensor`)."""
    from tests.megatron_real.harness import bare, leaf
    from tests.megatron_real.shim import make_device_tensor

    inner = leaf(bare(optimizer)).optimizer
    for state in inner.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                make_device_tensor(value)
                assert value.is_cuda  # what the staging engine asks


def measure(rank: int, root: str) -> dict[tuple[str, str, str], dict[str, int]]:
    """``{(config, format, "bare" | "staged"): {"peak": ..., "whole": ..., "largest": ...}}``
    for this rank; inside a fresh process with the TE stand-in installed."""
    from tests.megatron_real.dist_ckpt import save
    from tests.megatron_real.harness import leaf, megatron_session, train
    from tests.megatron_real.precision_aware import build_precision_aware
    from wrapped_optim import wrap
    from wrapped_optim.config import StackConfig
    from wrapped_optim.testing.probe import DeviceMemoryProbe, count_unstaged_expansions

    out: dict[tuple[str, str, str], dict[str, int]] = {}
    with megatron_session():
        for name in BOUND_CONFIGS:
            for writer in ("bare", "staged"):
                model, optimizer = build_precision_aware(name, 0, hidden=HIDDEN)
                if writer == "staged":
                    config = StackConfig.from_megatron(
                        leaf(optimizer).config, overrides={"staged": {"chunk_bytes": CHUNK_BYTES}}
                    )
                    optimizer = wrap(optimizer, config)
                train(model, optimizer, range(STEPS), rank)
                device_state(optimizer)
                whole, largest = whole_expansion(optimizer)
                for fmt in BOUND_FORMATS:
                    directory = Path(root, "bound", name, writer, fmt)
                    with contextlib.ExitStack() as scopes:
                        probe = scopes.enter_context(DeviceMemoryProbe())
                        if writer == "bare":
                            scopes.enter_context(count_unstaged_expansions(optimizer))
                        save(model, optimizer, directory, fmt)
                    out[name, fmt, writer] = {
                        "peak": probe.peak_extra_bytes,
                        "whole": whole,
                        "largest": largest,
                    }
    return out
