"""GPU check: HybridOffloadOptimizer with precision-aware sub-optimizers, staged, on CUDA.

The stack Megatron runs with ``use_precision_aware_optimizer`` and ``optimizer_cpu_offload``,
in portable form: CUDA bf16 params, ``PrecisionAwareAdamW`` host and device sub-optimizers with
bf16 (and fp16/FP8) moments, offload fractions 0, 0.5 and 1, wrapped by ``wrap()``
(``HybridSyncOptimizer`` over ``StagedCheckpointOptimizer``). Gradients come from a seeded
generator (no model kernels), so every figure is deterministic. For each case:

1. the saved state is FusedAdam's portable format on the host (FP32 moments, step in groups),
   read chunk by chunk (``StagingStats``), with peak extra CUDA memory at most one chunk;
2. save -> load into a fresh stack -> continue equals uninterrupted stepping bitwise, and the
   load wrote every compressed state chunk by chunk.

Reproduce: ``python -m tests.gpu.gpu_hybrid_precision`` (``run(device="cpu")`` runs
the same checks on the host, without the memory bound's meaning).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from wrapped_optim._demo_model import TinyGPT
from wrapped_optim.optimizers import HybridOffloadOptimizer, PrecisionAwareAdamW
from wrapped_optim.stack import wrap
from wrapped_optim.staged import StagedCheckpointOptimizer
from wrapped_optim.testing.probe import DeviceMemoryProbe

from ._report import Section, main_of, require_cuda

__all__ = ["run"]

_CHUNK_BYTES = 1 << 16
_CASES = (
    (0.0, torch.bfloat16, torch.bfloat16),
    (0.5, torch.bfloat16, torch.bfloat16),
    (1.0, torch.bfloat16, torch.bfloat16),
    (0.5, torch.uint8, torch.float16),
)


def _params(device: str) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=512, width=256, depth=2, heads=4, context=64)
    return [torch.nn.Parameter(p.detach().to(device, torch.bfloat16)) for p in model.parameters()]


def _stack(params: list[torch.nn.Parameter], fraction: float, m: Any, v: Any) -> Any:
    inner = HybridOffloadOptimizer(
        params,
        offload_fraction=fraction,
        cpu_optimizer_cls=PrecisionAwareAdamW,
        gpu_optimizer_cls=PrecisionAwareAdamW,
        lr=1e-3,
        weight_decay=0.01,
        exp_avg_dtype=m,
        exp_avg_sq_dtype=v,
    )
    return wrap(inner, {"staged": {"chunk_bytes": _CHUNK_BYTES}})


def _step(params: list[torch.nn.Parameter], opt: Any, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.device, p.dtype)
    opt.step()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _case(device: str, fraction: float, m: Any, v: Any) -> tuple[str, bool, str]:
    params = _params(device)
    opt = _stack(params, fraction, m, v)
    for step in range(3):
        _step(params, opt, step)
    with DeviceMemoryProbe(device) as probe:
        saved = opt.state_dict()
    stats = opt.find_layer(StagedCheckpointOptimizer).last_stats
    n_states = 2 * len(saved["state"])
    moments = [e[n] for e in saved["state"].values() for n in ("exp_avg", "exp_avg_sq")]
    portable = (
        all(t.dtype == torch.float32 and t.device.type == "cpu" for t in moments)
        and saved["param_groups"][0]["step"] == 3
    )
    payload = copy.deepcopy(saved)
    for step in range(3, 5):
        _step(params, opt, step)

    twin_params = _params(device)
    with torch.no_grad():
        for t, p in zip(twin_params, _params(device), strict=True):
            t.copy_(p)
    twin = _stack(twin_params, fraction, m, v)
    twin.load_state_dict(payload)
    load_stats = twin.find_layer(StagedCheckpointOptimizer).last_stats
    for step in range(3, 5):
        _step(twin_params, twin, step)
    identical = _same([p.detach() for p in twin_params], [p.detach() for p in params]) and _same(
        twin.state_dict(), opt.state_dict()
    )
    ok = (
        portable
        and stats.chunked_reads == n_states
        and load_stats.chunked_writes == n_states
        and identical
        and (device != "cuda" or probe.peak_extra_bytes <= _CHUNK_BYTES)
    )
    name = f"fraction {fraction}, exp_avg {m}, exp_avg_sq {v}"
    detail = (
        f"holders {stats.staged_holders}, chunked reads {stats.chunked_reads}/{n_states}, "
        f"chunked writes {load_stats.chunked_writes}, peak extra {probe.peak_extra_bytes} B "
        f"({probe.source}), resume bit-identical {identical}"
    )
    return name, ok, detail


def run(device: str = "cuda") -> Section:
    """Runs the checks; a failed case is a failure of the section (not run without CUDA).

    Example:
        >>> import torch
        >>> if torch.cuda.is_available():  # doctest: +SKIP
        ...     print(run().markdown)
    """
    if device == "cuda":
        require_cuda("gpu_hybrid_precision")
    rows = [_case(device, *case) for case in _CASES]
    lines = [
        "## Hybrid offload with precision-aware sub-optimizers, staged "
        f"({device}, chunk {_CHUNK_BYTES} B)",
        "",
        "| case | ok | detail |",
        "|---|---|---|",
        *[f"| {name} | {'yes' if ok else 'NO'} | {detail} |" for name, ok, detail in rows],
        "",
        "Reproduce: `python -m tests.gpu.gpu_hybrid_precision`.",
    ]
    return Section("\n".join(lines), [name for name, ok, _ in rows if not ok])


if __name__ == "__main__":
    raise SystemExit(main_of(run))
