"""GPU checks of PrecisionAwareAdamW's fused Triton step (needs CUDA and triton).

``python -m tests.gpu.gpu_fused_step`` prints a Markdown section with, per format
configuration (fp16/FP8 moments and fp16 masters included):

* the step took the fused path (every parameter of the group is the kernel's);
* kernel launches in one step, counted by ``torch.profiler``: exactly
  ``fused_gpu.launches_per_step`` (one per format combination, three where scaled), no other
  kernel and no copy once the tables are cached;
* no host synchronisation: two steps (one rebuilding the address table for new grads) under
  ``torch.cuda.set_sync_debug_mode("error")``;
* bitwise equality with the same kernels run on CPU by Triton's interpreter (in a child
  process with ``TRITON_INTERPRET=1``; the CPU suite checks the interpreter against the
  single-rounding reference and the codecs), with subnormal-sized values in one
  configuration (a GPU flushing subnormals would differ there);
* bitwise equality with the CPU kernel for the formats it covers, at 1M parameters.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import torch

from wrapped_optim.optimizers import PrecisionAwareAdamW
from wrapped_optim.optimizers.kernels import cpu_kernel
from wrapped_optim.optimizers.precision_adamw import _fused_gpu as fused_gpu
from wrapped_optim.optimizers.precision_adamw._operand import Operand

from ._report import Section, main_of, require_cuda, row_table

__all__ = ["CONFIGS", "Config", "interpreted_run", "rows", "run"]

BF16, FP16, FP32, FP8 = torch.bfloat16, torch.float16, torch.float32, torch.uint8


class Config(NamedTuple):
    """One format configuration: param dtypes (cycled over the params), the grad dtype (None:
    the param's), the magnitude of grads, the optimizer's keywords, whether the CPU kernel
    reads these formats."""

    param_dtypes: tuple[torch.dtype, ...]
    grad_dtype: torch.dtype | None
    magnitude: float
    keywords: dict[str, Any]
    cpu_kernel: bool


_MASTER = {"master_weights": True}
CONFIGS = {
    "bf16 params, FP32 master, bf16 moments": Config(
        (BF16,), None, 1.0, {**_MASTER, "exp_avg_dtype": BF16, "exp_avg_sq_dtype": BF16}, True
    ),
    "bf16 params, remainders, fp16 m, FP8 v": Config(
        (BF16,),
        None,
        1.0,
        {**_MASTER, "store_param_remainders": True, "exp_avg_dtype": FP16, "exp_avg_sq_dtype": FP8},
        True,
    ),
    "fp32 params, FP8 moments": Config(
        (FP32,), None, 1.0, {"exp_avg_dtype": FP8, "exp_avg_sq_dtype": FP8}, True
    ),
    "bf16 params, fp16 master, FP8 moments": Config(
        (BF16,),
        None,
        1.0,
        {**_MASTER, "master_weight_dtype": FP16, "exp_avg_dtype": FP8, "exp_avg_sq_dtype": FP8},
        False,
    ),
    "fp32/bf16/fp16 params, FP32 masters, fp16 moments, subnormal values": Config(
        (FP32, BF16, FP16),
        FP32,
        1e-20,  # v = (1 - beta2) * g * g is subnormal
        {**_MASTER, "exp_avg_dtype": FP16, "exp_avg_sq_dtype": FP16},
        False,
    ),
}
_SMALL = (8193, 4099, 7)  # against the interpreter (slow): blocks, a tail, a tiny tensor
_LARGE = (1_000_003, 4099, 7)


def _make(name: str, sizes: tuple[int, ...], device: str, **extra: Any) -> Any:
    """(optimizer, params, grads) of configuration ``name`` on ``device``, from one seed."""
    dtypes, grad_dtype, magnitude, kw, _ = CONFIGS[name]
    gen = torch.Generator().manual_seed(7)
    params, grads = [], []
    for i, n in enumerate(sizes):
        dtype = dtypes[i % len(dtypes)]
        params.append(torch.nn.Parameter((torch.randn(n, generator=gen) * 3).to(dtype).to(device)))
        grads.append([(torch.randn(n, generator=gen) * magnitude).to(grad_dtype or dtype)
                      for _ in range(3)])  # fmt: skip
    opt = PrecisionAwareAdamW(params, lr=1e-2, weight_decay=0.1, **kw, **extra)
    return opt, params, [[g.to(device) for g in per_step] for per_step in grads]


def _operands(opt: PrecisionAwareAdamW, pairs: list[tuple[Any, Any]]) -> list[Operand]:
    return [Operand(p, g, opt.state[p], opt.scales.get(p, {})) for p, g in pairs]


def _pairs(params: list[Any], grads: list[Any], step: int) -> list[tuple[Any, Any]]:
    return [(p, g[step]) for p, g in zip(params, grads, strict=True)]


def _step(opt: PrecisionAwareAdamW, params: list[Any], grads: list[Any], step: int) -> None:
    """One step with the grads of ``step`` (passed straight to the fused step where a
    grad's dtype differs from its param's: torch refuses such a ``.grad``)."""
    if all(p.dtype == g[step].dtype for p, g in zip(params, grads, strict=True)):
        for p, g in zip(params, grads, strict=True):
            p.grad = g[step]
        opt.step()
        return
    for p in params:
        if not opt.state[p]:
            opt.initialize_state(p, opt.layout.uses_remainder(p))
    group = opt.param_groups[0]
    group["step"] = group.get("step", 0) + 1
    pairs = _pairs(params, grads, step)
    fused_gpu.update_group(
        opt.layout, _operands(opt, pairs), group, tables=opt._scratch.launch_tables, group_index=0
    )


def _state(opt: PrecisionAwareAdamW, params: list[Any]) -> list[torch.Tensor]:
    out = [p.detach().cpu() for p in params]
    for p in params:
        out += [t.cpu() for t in opt.state[p].values()]
        out += [s.cpu() for s in opt._scales.get(p, {}).values()]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype
        and torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        for x, y in zip(a, b, strict=True)
    )


def interpreted_run(name: str, out: str) -> None:
    """The child process's work: three steps of ``name`` on CPU through the interpreter."""
    fused_gpu._DEVICE_TYPES.add("cpu")
    opt, params, grads = _make(name, _SMALL, "cpu", cpu_kernel=False)
    for step in range(3):
        _step(opt, params, grads, step)
    torch.save(_state(opt, params), out)


def _interpreted(name: str) -> list[torch.Tensor]:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "state.pt")
        env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
        code = (
            "from tests.gpu.gpu_fused_step import interpreted_run; "
            f"interpreted_run({name!r}, {out!r})"
        )
        root = Path(__file__).resolve().parents[2]  # the repository root: tests importable
        subprocess.run([sys.executable, "-c", code], env=env, cwd=root, check=True, timeout=300)
        loaded: list[torch.Tensor] = torch.load(out)
        return loaded


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _launch_counts(
    opt: PrecisionAwareAdamW, params: list[Any], grads: list[Any], device: str
) -> str:
    """ "ours other copies": kernels of the fused step, other kernels, copies or fills, in one
    step with the tables cached; seen by the profiler on CUDA (elsewhere, the CPU suite's
    dry run, our launches as fused_gpu makes them)."""
    if device != "cuda":
        seen: list[Any] = []
        real = fused_gpu._launch

        def counting(kernel: Any, grid: tuple[int], *args: Any, **kw: Any) -> None:
            seen.append(kernel)
            real(kernel, grid, *args, **kw)

        fused_gpu._launch = counting
        try:
            _step(opt, params, grads, 2)
        finally:
            fused_gpu._launch = real
        return f"{len(seen)} 0 0"
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _step(opt, params, grads, 2)
        torch.cuda.synchronize()
    ours = other = copies = 0
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if "memcpy" in event.name.lower() or "memset" in event.name.lower():
            copies += 1
        elif "adamw_group_kernel" in event.name or "finalize_kernel" in event.name:
            ours += 1
        else:
            other += 1
    return f"{ours} {other} {copies}"


def _no_sync_step(
    opt: PrecisionAwareAdamW, params: list[Any], grads: list[Any], device: str
) -> str:
    """Step 1 (new grads: the address table is rebuilt) with every synchronising CUDA call an
    error; returns the error's first line, or "" when there was none."""
    if device != "cuda":
        _step(opt, params, grads, 1)
        return ""
    try:
        torch.cuda.set_sync_debug_mode("error")
        _step(opt, params, grads, 1)
        return ""
    except RuntimeError as exc:
        return str(exc).splitlines()[0] or type(exc).__name__
    finally:
        torch.cuda.set_sync_debug_mode("default")


def rows(name: str, device: str = "cuda", *, large: bool = True) -> list[tuple[str, bool, str]]:
    """The rows of configuration ``name`` (``device="cpu"`` with the interpreter is the CPU
    suite's dry run of this logic; ``large`` adds the 1M comparison with the CPU kernel)."""
    out: list[tuple[str, bool, str]] = []
    opt, params, grads = _make(name, _SMALL, device)
    for p in params:
        opt.initialize_state(p, opt.layout.uses_remainder(p))
    taken = all(
        fused_gpu.applicable(opt.layout, Operand(p, g, opt.state[p], opt.scales.get(p, {})))
        for p, g in _pairs(params, grads, 0)
    )
    out.append((f"{name}: fused path taken", taken, f"{len(params)} params in one group"))
    # Step 0 builds the tables and compiles; step 1 gets new grads (a table rebuild) under
    # the sync debug mode; step 2 is counted with the tables cached (its grads are step 1's).
    _step(opt, params, grads, 0)
    error = _no_sync_step(opt, params, grads, device)
    out.append((f"{name}: no host synchronisation in step", not error, error))
    grads = [[g[0], g[1], g[1]] for g in grads]
    launches = fused_gpu.launches_per_step(opt.layout, _operands(opt, _pairs(params, grads, 2)))
    expected = f"{launches} 0 0"
    counts = _launch_counts(opt, params, grads, device)
    out.append((f"{name}: kernels per step (ours, other, copies)", counts == expected,
                f"{counts}; expected {expected}"))  # fmt: skip
    run_opt, run_params, run_grads = _make(name, _SMALL, device)
    for step in range(3):
        _step(run_opt, run_params, run_grads, step)
    _sync(device)
    same = _same(_state(run_opt, run_params), _interpreted(name))
    out.append((f"{name}: 3 steps bitwise = the interpreter's (same kernels on CPU)", same, ""))
    if large and CONFIGS[name].cpu_kernel and cpu_kernel.available():
        runs = []
        for on, extra in ((device, {}), ("cpu", {"cpu_kernel": True})):
            big_opt, big_params, big_grads = _make(name, _LARGE, on, **extra)
            for step in range(3):
                _step(big_opt, big_params, big_grads, step)
            runs.append(_state(big_opt, big_params))
        out.append((f"{name}: 3 steps at 1M bitwise = the CPU kernel", _same(*runs), ""))
    return out


def run() -> Section:
    """Run every configuration's rows; each failed row fails the section.

    Example:
        >>> from tests.gpu.gpu_fused_step import run
        >>> run().markdown.startswith("## Fused GPU step")  # doctest: +SKIP
        True
    """
    require_cuda("gpu_fused_step")
    if not fused_gpu.available():
        return row_table([("triton importable", False, "")], "## Fused GPU step")
    found: list[tuple[str, bool, str]] = []
    for name in CONFIGS:
        try:
            found += rows(name)
        except Exception as exc:  # one configuration's error is its failed row
            found.append((f"{name}: ran", False, f"{type(exc).__name__}: {exc}"[:300]))
    title = f"## Fused GPU step ({torch.cuda.get_device_name()})"
    return row_table(found, title)


if __name__ == "__main__":
    raise SystemExit(main_of(run))
