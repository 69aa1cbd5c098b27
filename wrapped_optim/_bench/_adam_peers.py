"""The other CPU AdamW implementations ``bench precision_adam`` measures beside ours, and the
quality check every row gets (loss after a few hundred steps against FP32 AdamW).

Every peer is optional (``pip install 'wrapped-optim[bench]'``, never needed by the tests or
CI): each is imported by name and stepped once on a probe tensor, and a peer that cannot be
imported, built or run on this machine becomes a printed skip reason instead of a row.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import math
import os
from collections.abc import Callable
from typing import Any

import attrs
import torch

Factory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
BF16, FP32 = torch.bfloat16, torch.float32
#: Steps of the quality problem.
QUALITY_STEPS = 300
_LR = 1e-3


@attrs.frozen
class Peer:
    """One peer row: label, parameter dtype, factory, the bytes per parameter its step must
    move at least (``traffic`` says which) and the class of ours it competes with.

    Example:
        >>> import torch
        >>> from wrapped_optim._bench._adam_peers import Peer
        >>> peer = Peer("SGD", torch.float32, lambda ps: torch.optim.SGD(ps), 12, "p 4+4, g 4",
        ...             "FP32 state")
        >>> peer.bytes_moved
        12
    """

    label: str
    dtype: torch.dtype
    factory: Factory
    bytes_moved: float
    traffic: str
    group: str


# (label, package, module, optimizer class, keyword arguments, param dtype, bytes, traffic,
# class). torchao and bitsandbytes keep 8-bit moments block-wise (one FP32 scale per 256 or
# 2048 elements: under 0.04 bytes per parameter, left out of `bytes`).
_EIGHT_BIT = "p 4+4, g 4, m 1+1, v 1+1"
_SPECS: list[tuple[str, str, str, str, dict[str, Any], torch.dtype, float, str, str]] = [
    ("torchao AdamWFp8 (FP8 moments)", "torchao", "torchao.optim", "AdamWFp8", {}, FP32, 16,
     _EIGHT_BIT, "8-bit moments"),
    ("torchao AdamW8bit", "torchao", "torchao.optim", "AdamW8bit", {}, FP32, 16, _EIGHT_BIT,
     "8-bit moments"),
    ("torchao AdamW4bit", "torchao", "torchao.optim", "AdamW4bit", {}, FP32, 14,
     "p 4+4, g 4, m 0.5+0.5, v 0.5+0.5", "block-scaled 4-bit moments"),
    ("bitsandbytes AdamW8bit", "bitsandbytes", "bitsandbytes.optim", "AdamW8bit", {}, FP32, 16,
     _EIGHT_BIT, "8-bit moments"),
    ("torchao AdamW, bf16 params + bf16 stochastic rounding", "torchao", "torchao.optim",
     "_AdamW", {"bf16_stochastic_round": True}, BF16, 14, "p 2+2, g 2, m 2+2, v 2+2",
     "bf16 params + bf16 moments"),
    ("torch-optimi AdamW, bf16 params", "torch-optimi", "optimi", "AdamW",
     {"kahan_sum": False}, BF16, 14, "p 2+2, g 2, m 2+2, v 2+2", "bf16 params + bf16 moments"),
    ("DeepSpeedCPUAdam, bf16 params (FP32 state)", "deepspeed", "deepspeed.ops.adam",
     "DeepSpeedCPUAdam", {"adamw_mode": True}, BF16, 22, "p 2+2, g 2, m 4+4, v 4+4",
     "bf16 params + bf16 moments"),
    ("torch-optimi AdamW + Kahan summation, bf16 params", "torch-optimi", "optimi", "AdamW",
     {"kahan_sum": True}, BF16, 18, "p 2+2, kahan 2+2, g 2, m 2+2, v 2+2",
     "bf16 params + remainders / FP32 master"),
    ("DeepSpeedCPUAdam (FP32)", "deepspeed", "deepspeed.ops.adam", "DeepSpeedCPUAdam",
     {"adamw_mode": True}, FP32, 28, "p 4+4, g 4, m 4+4, v 4+4", "FP32 state"),
    ("torchao AdamW8bit + bf16 stochastic rounding, bf16 params", "torchao", "torchao.optim",
     "AdamW8bit", {"bf16_stochastic_round": True}, BF16, 10, "p 2+2, g 2, m 1+1, v 1+1",
     "bf16 params + remainders + FP8 moments"),
]  # fmt: skip


def _probe(cls: Any, kwargs: dict[str, Any], dtype: torch.dtype) -> None:
    """One step on a tensor large enough that the 8-bit optimizers quantize it."""
    param = torch.nn.Parameter(torch.randn(8192).to(dtype))
    param.grad = torch.randn(8192).to(dtype)
    cls([param], lr=_LR, **kwargs).step()


def peers() -> tuple[list[Peer], list[str]]:
    """The peers that run here, and a skip reason for each one that does not (not
    installed, fails to build or to step on CPU). DeepSpeed is imported with
    ``DS_ACCELERATOR=cpu`` (unless set otherwise), so it builds its CPU Adam op with the
    system compiler on first use.

    Example:
        >>> from wrapped_optim._bench._adam_peers import peers
        >>> found, skipped = peers()
        >>> len(found) + len(skipped)
        10
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    found, skipped = [], []
    for label, package, module, name, kwargs, dtype, nbytes, traffic, group in _SPECS:
        try:
            cls = getattr(importlib.import_module(module), name)
            _probe(cls, kwargs, dtype)
        except Exception as exc:  # ImportError, a failed build, an unsupported device
            skipped.append(f"{label} skipped ({package}): {type(exc).__name__}: {str(exc)[:200]}")
            continue
        found.append(
            Peer(label, dtype, _factory(cls, kwargs), nbytes, traffic + _version(package), group)
        )
    return found, skipped


def _factory(cls: Any, kwargs: dict[str, Any]) -> Factory:
    return lambda ps: cls(ps, lr=_LR, **kwargs)


def _version(package: str) -> str:
    try:
        return f" ({package} {importlib.metadata.version(package)})"
    except importlib.metadata.PackageNotFoundError:
        return ""


def quality_loss(factory: Factory, dtype: torch.dtype, steps: int = QUALITY_STEPS) -> float:
    """Training loss after ``steps`` steps of ``factory``'s optimizer (which must use lr 1e-3,
    the default of torch's AdamW and ours) on a small
    fixed regression (a 64-256-64 tanh network with parameters in ``dtype`` fitting a random
    teacher on 512 samples; loss in FP32): what a wrong or imprecise optimizer cannot hide
    behind its speed. Deterministic for a deterministic optimizer.

    Example:
        >>> import torch
        >>> from wrapped_optim._bench._adam_peers import quality_loss
        >>> adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-3)
        >>> quality_loss(adamw, torch.float32, steps=50) < quality_loss(adamw, torch.float32, 5)
        True
    """
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=gen)
    teacher = torch.tanh(x @ torch.randn(64, 64, generator=gen) / 8) @ torch.randn(
        64, 64, generator=gen
    )
    shapes = [(64, 256), (256,), (256, 64), (64,)]
    params = [
        torch.nn.Parameter((torch.randn(shape, generator=gen) / math.sqrt(shape[0])).to(dtype))
        for shape in shapes
    ]
    optimizer = factory(params)
    rates = {float(group["lr"]) for group in optimizer.param_groups}
    if not all(math.isclose(rate, _LR, rel_tol=1e-6) for rate in rates):
        raise ValueError(f"the quality problem runs at lr {_LR}; the factory set {sorted(rates)}")
    w1, b1, w2, b2 = params
    inputs = x.to(dtype)

    def loss() -> torch.Tensor:
        return (torch.tanh(inputs @ w1 + b1) @ w2 + b2).float().sub(teacher).square().mean()

    for _ in range(steps):
        optimizer.zero_grad()
        loss().backward()
        optimizer.step()
    with torch.no_grad():
        return float(loss())
