"""GPU check: streaming DCP checkpoints keep device memory bounded and state exact on CUDA.

A CUDA PrecisionAwareAdamW (bf16 params with FP32 masters, fp16 / FP8 moments) is saved and
loaded with :mod:`wrapped_optim.checkpoint`; the check reports the peak *device* memory growth
of each call (``torch.cuda.max_memory_allocated``) next to ``dcp.save(opt.state_dict())`` /
``dcp.load`` + ``load_state_dict``, and verifies the loaded storage bit for bit. Only runnable
with CUDA: ``python -m tests.gpu.gpu_streaming``.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from ._report import Section, main_of, require_cuda

__all__ = ["run"]


def _build(n: int, numel: int, seed: int) -> Any:
    import torch

    from wrapped_optim.optimizers import PrecisionAwareAdamW

    g = torch.Generator(device="cuda").manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.randn(numel, device="cuda", generator=g).to(torch.bfloat16))
        for _ in range(n)
    ]
    opt = PrecisionAwareAdamW(
        params,
        lr=1e-3,
        master_weights=True,
        exp_avg_dtype=torch.float16,
        exp_avg_sq_dtype=torch.uint8,
    )
    for p in params:
        p.grad = torch.randn(numel, device="cuda", generator=g).to(torch.bfloat16)
    opt.step()
    opt.zero_grad()
    return opt


def _storage(opt: Any) -> list[Any]:
    out = []
    for p in opt.param_groups[0]["params"]:
        for name in ("exp_avg", "exp_avg_sq", "master_param"):
            out.append(opt.state[p][name].clone())
            out.append(opt.get_unscaled_state(p, name).clone())
    return out


def _measure(fn: Any) -> tuple[float, int]:
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, torch.cuda.max_memory_allocated() - base


def run() -> Section:
    """Runs the CUDA check (not run without CUDA); a loaded state that is not bit-identical
    to the saved one is a failure.

    Only the CUDA allocator sees every temporary, so this is where the streaming bound is
    measured rather than modelled; it raises without CUDA instead of reporting CPU figures.

    Example:
        On a CUDA machine, ``python -m tests.gpu.gpu_streaming`` prints the table:

        >>> from tests.gpu.gpu_streaming import run
        >>> print(run().markdown)  # doctest: +SKIP
        # GPU check: streaming optimizer checkpoints
        ...
    """
    import torch
    import torch.distributed.checkpoint as dcp

    from wrapped_optim.checkpoint import load_optimizer, save_optimizer

    require_cuda("gpu_streaming")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    n, numel, chunk = 8, 16 << 20, 16 << 20
    largest = numel * 4
    root = Path(tempfile.mkdtemp(prefix="wrapped_optim_gpu_streaming_"))
    rows = []
    try:
        opt = _build(n, numel, seed=0)
        expected = _storage(opt)

        def plain_save() -> None:
            sd = opt.state_dict()
            dcp.save(sd, checkpoint_id=root / "plain", no_dist=True)

        rows.append(("`dcp.save(opt.state_dict())`", *_measure(plain_save)))
        rows.append(
            (
                "`save_optimizer(opt)`",
                *_measure(lambda: save_optimizer(opt, root / "stream", chunk_bytes=chunk)),
            )
        )
        results = {}
        for label, path in (("plain", root / "plain"), ("stream", root / "stream")):
            other = _build(n, numel, seed=1)

            def plain_load(other: Any = other, path: Path = path) -> None:
                sd = other.state_dict()
                dcp.load(sd, checkpoint_id=path, no_dist=True)
                other.load_state_dict(sd)

            rows.append((f"`dcp.load` + `load_state_dict` ({label} ckpt)", *_measure(plain_load)))
            results[f"plain_load_{label}"] = _storage(other)
            other = _build(n, numel, seed=1)
            rows.append(
                (
                    f"`load_optimizer(opt)` ({label} ckpt)",
                    *_measure(lambda o=other, p=path: load_optimizer(o, p, chunk_bytes=chunk)),
                )
            )
            results[f"stream_load_{label}"] = _storage(other)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    exact = all(
        all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        for got in results.values()
    )
    lines = [
        "# GPU check: streaming optimizer checkpoints",
        "",
        f"{torch.cuda.get_device_name()}: PrecisionAwareAdamW, {n} bf16 params of {numel:,} "
        f"elements, FP32 masters, fp16/FP8 moments; largest expanded tensor "
        f"{largest / 2**20:.0f} MiB, chunk {chunk / 2**20:.0f} MiB.",
        "",
        "| call | seconds | peak device growth MiB | x largest tensor |",
        "|---|---:|---:|---:|",
    ]
    for label, seconds, growth in rows:
        lines.append(
            f"| {label} | {seconds:.2f} | {growth / 2**20:,.0f} | {growth / largest:.2f} |"
        )
    lines += ["", f"Loaded state bit-identical to the saved state: {'yes' if exact else 'NO'}", ""]
    failures = [] if exact else ["loaded state bit-identical to the saved state"]
    return Section("\n".join(lines), failures)


if __name__ == "__main__":
    raise SystemExit(main_of(run))
