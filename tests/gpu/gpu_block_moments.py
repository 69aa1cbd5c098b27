"""GPU checks of PrecisionAwareAdamW's block-scaled moments (needs CUDA and triton).

``python -m tests.gpu.gpu_block_moments`` prints a Markdown section with, per block format
and parameter layout:

* every parameter takes the Triton block kernel (``_block_step.triton_update`` accepts it);
* three steps at about 1M parameters on CUDA are bitwise the CPU kernel's (the CPU suite
  checks the kernel against the torch implementation and the interpreted Triton kernel);
* a state_dict saved on CUDA after three steps resumes bit-identically (three more steps);
* the step's time on CUDA beside torch's fused AdamW (informative, not a target).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from wrapped_optim.optimizers import PrecisionAwareAdamW
from wrapped_optim.optimizers.kernels import cpu_kernel
from wrapped_optim.optimizers.precision_adamw import _block_step

from ._report import Section, main_of, require_cuda, row_table

__all__ = ["CONFIGS", "rows", "run"]

#: name -> (param dtype, optimizer keywords)
CONFIGS: dict[str, tuple[torch.dtype, dict[str, Any]]] = {
    "fp32 params, int8 blocks": (torch.float32, {"block_moments": "int8"}),
    "fp32 params, FP8 blocks": (torch.float32, {"block_moments": "fp8"}),
    "fp32 params, int4 blocks": (torch.float32, {"block_moments": "int4"}),
    "bf16 params, remainders, int8 blocks": (
        torch.bfloat16,
        {"block_moments": "int8", "master_weights": True, "store_param_remainders": True},
    ),
    "bf16 params, FP32 master, int4 blocks (L2)": (
        torch.bfloat16,
        {"block_moments": "int4", "master_weights": True, "adam_w_mode": False},
    ),
}
_SIZES = (1_000_003, 4099, 7)


def _make(name: str, device: str, **extra: Any) -> Any:
    dtype, kw = CONFIGS[name]
    gen = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype).to(device))
              for n in _SIZES]  # fmt: skip
    grads = [[(torch.randn(n, generator=gen) * 0.1).to(dtype).to(device) for n in _SIZES]
             for _ in range(6)]  # fmt: skip
    opt = PrecisionAwareAdamW(params, lr=1e-2, weight_decay=0.1, **kw, **extra)
    return opt, params, grads


def _steps(opt: Any, params: list[Any], grads: list[Any], steps: range) -> None:
    for i in steps:
        for p, g in zip(params, grads[i], strict=True):
            p.grad = g
        opt.step()


def _state(opt: Any, params: list[Any]) -> list[torch.Tensor]:
    out = [p.detach().cpu() for p in params]
    for p in params:
        out += [t.cpu() for t in opt.state[p].values()]
        out += [s.cpu() for s in opt.scales.get(p, {}).values()]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype
        and torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        for x, y in zip(a, b, strict=True)
    )


def rows(name: str, device: str = "cuda") -> list[tuple[str, bool, str]]:
    """The rows of configuration ``name``."""
    out: list[tuple[str, bool, str]] = []
    opt, params, grads = _make(name, device)
    for p in params:
        opt.initialize_state(p, opt.layout.uses_remainder(p))
    taken = []
    real = _block_step.triton_update

    def watching(*args: Any, **kwargs: Any) -> bool:
        result = real(*args, **kwargs)
        taken.append(result)
        return result

    _block_step.triton_update = watching  # type: ignore[assignment]
    try:
        _steps(opt, params, grads, range(3))
    finally:
        _block_step.triton_update = real  # type: ignore[assignment]
    out.append((f"{name}: Triton block kernel taken", bool(taken) and all(taken),
                f"{sum(taken)} of {len(taken)} parameter steps"))  # fmt: skip
    if cpu_kernel.available():
        host, host_params, host_grads = _make(name, "cpu", cpu_kernel=True)
        _steps(host, host_params, host_grads, range(3))
        same = _same(_state(opt, params), _state(host, host_params))
        out.append((f"{name}: 3 steps at 1M bitwise = the CPU kernel", same, ""))
    saved = copy.deepcopy(opt.state_dict())
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    again = PrecisionAwareAdamW(resumed, lr=1e-2, weight_decay=0.1, **CONFIGS[name][1])
    again.load_state_dict(saved)
    _steps(opt, params, grads, range(3, 6))
    _steps(again, resumed, grads, range(3, 6))
    out.append((f"{name}: resume bitwise", _same(_state(opt, params), _state(again, resumed)), ""))
    fused = torch.optim.AdamW([torch.nn.Parameter(p.detach().float()) for p in params], fused=True)
    times = []
    for o, ps in ((opt, params), (fused, fused.param_groups[0]["params"])):
        for p, g in zip(ps, grads[0], strict=True):
            p.grad = g.to(p.dtype)
        o.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            o.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / 10 * 1e3)
    out.append((f"{name}: step time (informative)", True,
                f"{times[0]:.3f} ms; torch fused FP32 AdamW {times[1]:.3f} ms"))  # fmt: skip
    return out


def run() -> Section:
    """Run every configuration's rows; each failed row fails the section.

    Example:
        >>> from tests.gpu.gpu_block_moments import run
        >>> run().markdown.startswith("## Block-scaled moments on GPU")  # doctest: +SKIP
        True
    """
    require_cuda("gpu_block_moments")
    found: list[tuple[str, bool, str]] = []
    for name in CONFIGS:
        try:
            found += rows(name)
        except Exception as exc:  # one configuration's error is its failed row
            found.append((f"{name}: ran", False, f"{type(exc).__name__}: {exc}"[:300]))
    title = f"## Block-scaled moments on GPU ({torch.cuda.get_device_name()})"
    return row_table(found, title)


if __name__ == "__main__":
    raise SystemExit(main_of(run))
