"""CUDA check of staged checkpoints: real ``torch.cuda`` peak memory for save and load.

One command on one GPU (an H200 takes a few minutes; no network)::

    python -m tests.gpu.gpu_staged

For models of 100M and 500M parameters (within a time budget) (40% in one embedding) with a
``PrecisionAwareAdamW`` (bf16 ``exp_avg``, fp16 ``exp_avg_sq``) on the GPU it measures the
peak extra allocation (``torch.cuda.max_memory_allocated`` minus the allocation before) and
the time of:

* save: unstaged ``state_dict()``; the same followed by moving the dict to the host (what a
  checkpoint writer does); whole-tensor staging; chunked staging (the wrapper);
* load of an FP32 checkpoint on the host and on the device: the bare loader vs the wrapper;
* FP32 no-copy load: a FP32 Adam in a distributed-optimizer-shaped container loading
  device tensors, copying (bare) vs adopting (wrapper's scope).

Every staged state dict is checked against the unstaged one for the smallest model, and the
documented bounds are rows that fail: a chunked save needs at most ``chunk_bytes`` on the
device; a chunked load too (it writes into the existing storage, and the validator's value
check is a reduction without masks), plus ``LOAD_SLACK_BYTES`` for the per-tensor scalars
(amax, scale, multiplier) and reduction buffers, each its own caching-allocator block.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from wrapped_optim._bench.staged import MiB, build_model_optimizer, whole_tensor_state_dict
from wrapped_optim._staging.engine import fp32_no_copy_load
from wrapped_optim.staged import StagedCheckpointOptimizer
from wrapped_optim.testing.probe import DeviceMemoryProbe

from ._report import Section, main_of, require_cuda

__all__ = ["run"]

SIZES = (100_000_000, 500_000_000)
TIME_BUDGET_S = 60.0  # no new model size is started after this; one size takes ~1 min


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float, int]:
    """Result, seconds and peak extra device bytes of one call."""
    gc.collect()
    _sync(device)
    with DeviceMemoryProbe(device) as probe:
        start = time.perf_counter()
        result = fn()
        _sync(device)
        seconds = time.perf_counter() - start
    return result, seconds, probe.peak_extra_bytes


def _to_host(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.to("cpu")
    if isinstance(tree, dict):
        return {k: _to_host(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to_host(v) for v in tree]
    return tree


def _state_dict_to_host(opt: Any) -> Any:
    return _to_host(opt.state_dict())


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


class _DistributedContainer:
    """The attributes of a Megatron DistributedOptimizer that the no-copy gates read."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.config = None
        self.ddp_config = None
        self.is_stub_optimizer = False
        self.shard_fp32_from_float16_groups: list[list[torch.Tensor]] = [[]]


def _incoming_fp32_adam(opt: Any, device: torch.device) -> dict[str, Any]:
    sd: dict[str, Any] = opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    sd["state"] = {
        i: {
            "exp_avg": torch.rand(p.shape, device=device),
            "exp_avg_sq": torch.rand(p.shape, device=device),
        }
        for i, p in enumerate(params)
    }
    return sd


def _adopt(container: Any, sd: dict[str, Any]) -> int:
    with fp32_no_copy_load(container) as stats:
        container.optimizer.load_state_dict(sd)
    return stats.adoptions


def _no_copy_row(total: int, device: torch.device) -> dict[str, Any]:
    from wrapped_optim.optimizers import PrecisionAwareAdamW

    params = [torch.nn.Parameter(torch.zeros(total // 4, device=device)) for _ in range(4)]
    opt = PrecisionAwareAdamW(params, lr=1e-4)
    container = _DistributedContainer(opt)
    row: dict[str, Any] = {"params": total}
    sd = _incoming_fp32_adam(opt, device)
    _, row["bare_s"], row["bare_peak"] = _timed(partial(opt.load_state_dict, sd), device)
    del sd
    opt.state.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    sd = _incoming_fp32_adam(opt, device)
    row["adoptions"], row["adopt_s"], row["adopt_peak"] = _timed(
        partial(_adopt, container, sd), device
    )
    return row


def _storage_bytes(opt: Any) -> int:
    """Bytes of the optimizer's stored state (for the report)."""
    return sum(
        value.numel() * value.element_size()
        for entry in opt.state.values()
        for value in entry.values()
        if isinstance(value, torch.Tensor)
    )


#: What a chunked load may hold beyond ``chunk_bytes``: small per-tensor scalars and buffers.
LOAD_SLACK_BYTES = 1 << 20


def bound_failures(rows: Sequence[dict[str, Any]], chunk_bytes: int) -> list[str]:
    """The documented bounds each measured row breaks (empty: all hold).

    Example:
        >>> row = {"params": 10**8, "largest": 10, "storage": 600, "save_chunked_peak": 64,
        ...        "load_host_chunked_peak": 2**20 + 65, "load_dev_chunked_peak": 674}
        >>> bound_failures([row], 64)
        ['100M: chunked load (host ckpt) peak 1048641 B > 1048640 B']
    """
    failures = []
    for r in rows:
        size = f"{r['params'] / 1e6:.0f}M"
        if r["save_chunked_peak"] > chunk_bytes:
            failures.append(
                f"{size}: chunked save peak {r['save_chunked_peak']} B > {chunk_bytes} B"
            )
        for where in ("host", "dev"):
            peak, bound = r[f"load_{where}_chunked_peak"], chunk_bytes + LOAD_SLACK_BYTES
            if peak > bound:
                label = "host ckpt" if where == "host" else "device ckpt"
                failures.append(f"{size}: chunked load ({label}) peak {peak} B > {bound} B")
    return failures


def _size_row(total: int, device: torch.device, chunk_bytes: int, check: bool) -> dict[str, Any]:
    opt, params = build_model_optimizer(total, device=str(device))
    wrapped = StagedCheckpointOptimizer(opt, chunk_bytes=chunk_bytes)
    row: dict[str, Any] = {
        "params": sum(p.numel() for p in params),
        "largest": max(p.numel() for p in params),
        "storage": _storage_bytes(opt),
    }

    whole = partial(whole_tensor_state_dict, opt, chunk_bytes)
    reference, row["save_unstaged_s"], row["save_unstaged_peak"] = _timed(opt.state_dict, device)
    if check:
        reference = _to_host(reference)
    else:
        del reference
    _, row["save_to_host_s"], row["save_to_host_peak"] = _timed(
        partial(_state_dict_to_host, opt), device
    )
    staged_whole, row["save_whole_s"], row["save_whole_peak"] = _timed(whole, device)
    if check and not _same(staged_whole, reference):
        raise AssertionError("whole-tensor staged state dict differs from unstaged")
    del staged_whole
    checkpoint, row["save_chunked_s"], row["save_chunked_peak"] = _timed(wrapped.state_dict, device)
    if check and not _same(checkpoint, reference):
        raise AssertionError("chunked staged state dict differs from unstaged")
    if check:
        del reference

    _, row["load_host_unstaged_s"], row["load_host_unstaged_peak"] = _timed(
        partial(opt.load_state_dict, checkpoint), device
    )
    _, row["load_host_chunked_s"], row["load_host_chunked_peak"] = _timed(
        partial(wrapped.load_state_dict, checkpoint), device
    )
    on_device = {
        **checkpoint,
        "state": {
            i: {k: v.to(device) for k, v in entry.items()}
            for i, entry in checkpoint["state"].items()
        },
    }
    del checkpoint
    _, row["load_dev_unstaged_s"], row["load_dev_unstaged_peak"] = _timed(
        partial(opt.load_state_dict, on_device), device
    )
    _, row["load_dev_chunked_s"], row["load_dev_chunked_peak"] = _timed(
        partial(wrapped.load_state_dict, on_device), device
    )
    del on_device
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _render(
    rows: list[dict[str, Any]], no_copy: list[dict[str, Any]], chunk_bytes: int, device: str
) -> str:
    def mib(n: int) -> str:
        return f"{n / MiB:,.0f}"

    lines = [
        "## Staged checkpoints on CUDA (measured with torch.cuda peak allocation)",
        "",
        f"Device: {device}; `chunk_bytes` = {chunk_bytes // MiB} MiB; PrecisionAwareAdamW with",
        "bf16 `exp_avg` and fp16 `exp_avg_sq`; 40% of each model is one embedding.",
        "",
        "### Save: peak extra device MiB (seconds)",
        "",
        "| params | largest | unstaged | unstaged + to host | whole-tensor | chunked "
        "| chunked / (unstaged + to host) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['params'] / 1e6:.0f}M | {r['largest'] / 1e6:.0f}M "
            f"| {mib(r['save_unstaged_peak'])} ({r['save_unstaged_s']:.2f}) "
            f"| {mib(r['save_to_host_peak'])} ({r['save_to_host_s']:.2f}) "
            f"| {mib(r['save_whole_peak'])} ({r['save_whole_s']:.2f}) "
            f"| {mib(r['save_chunked_peak'])} ({r['save_chunked_s']:.2f}) "
            f"| {r['save_chunked_s'] / r['save_to_host_s']:.2f}x |"
        )
    lines += [
        "",
        "### Load of an FP32 checkpoint: peak extra device MiB (seconds)",
        "",
        "| params | host ckpt, bare | host ckpt, chunked | device ckpt, bare "
        "| device ckpt, chunked |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['params'] / 1e6:.0f}M "
            f"| {mib(r['load_host_unstaged_peak'])} ({r['load_host_unstaged_s']:.2f}) "
            f"| {mib(r['load_host_chunked_peak'])} ({r['load_host_chunked_s']:.2f}) "
            f"| {mib(r['load_dev_unstaged_peak'])} ({r['load_dev_unstaged_s']:.2f}) "
            f"| {mib(r['load_dev_chunked_peak'])} ({r['load_dev_chunked_s']:.2f}) |"
        )
    lines += [
        "",
        "### FP32 no-copy load (device tensors into an FP32 Adam)",
        "",
        "| params | bare: peak MiB (s) | adopted: peak MiB (s) | adoptions |",
        "|---:|---:|---:|---:|",
    ]
    for r in no_copy:
        lines.append(
            f"| {r['params'] / 1e6:.0f}M | {mib(r['bare_peak'])} ({r['bare_s']:.2f}) "
            f"| {mib(r['adopt_peak'])} ({r['adopt_s']:.2f}) | {r['adoptions']} |"
        )
    lines += ["", "Reproduce: `python -m tests.gpu.gpu_staged`.", ""]
    return "\n".join(lines)


def _run(
    device: str, sizes: Sequence[int], chunk_bytes: int, time_budget_s: float = TIME_BUDGET_S
) -> Section:
    dev = torch.device(device)
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    no_copy: list[dict[str, Any]] = []
    for index, size in enumerate(sizes):
        if rows and time.perf_counter() - start > time_budget_s:
            break
        rows.append(_size_row(size, dev, chunk_bytes, check=index == 0))
        no_copy.append(_no_copy_row(size, dev))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (ledger)"
    failures = bound_failures(rows, chunk_bytes)
    text = _render(rows, no_copy, chunk_bytes, name)
    if failures:
        text += "\nBounds broken:\n\n" + "".join(f"- {f}\n" for f in failures)
    return Section(text, failures)


def run() -> Section:
    """Runs the CUDA measurements (not run without a GPU); a broken bound is a failure.

    Example:
        >>> run.__name__
        'run'
    """
    require_cuda("gpu_staged")
    return _run("cuda", SIZES, 64 * MiB)


if __name__ == "__main__":
    raise SystemExit(main_of(run))
