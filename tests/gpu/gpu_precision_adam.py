"""GPU checks for PrecisionAwareAdamW and the codecs (needs CUDA; run by the lead's GPU job).

``python -m tests.gpu.gpu_precision_adam`` prints a Markdown section: the same
format checks the CPU tests make, on CUDA (chunked read/write against the whole-tensor API
with the source on the host, save -> load -> continue bit-identical, CUDA vs CPU agreement of
the stored formats), and step times against ``torch.optim.AdamW(fused=True)`` on the GPU.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch

from wrapped_optim._formats import codecs
from wrapped_optim.optimizers import PrecisionAwareAdamW
from wrapped_optim.optimizers.precision_adamw import _state as precision_state

from ._report import Section, main_of, require_cuda

__all__ = ["run"]

BF16 = torch.bfloat16
_CONFIGS: dict[str, dict[str, Any]] = {
    "bf16 moments": {"exp_avg_dtype": BF16, "exp_avg_sq_dtype": BF16},
    "FP8 moments": {"exp_avg_dtype": torch.uint8, "exp_avg_sq_dtype": torch.uint8},
    "fp16 master + fp16 m + FP8 v": {
        "master_weights": True,
        "master_weight_dtype": torch.float16,
        "exp_avg_dtype": torch.float16,
        "exp_avg_sq_dtype": torch.uint8,
    },
    "remainders + bf16 moments": {
        "master_weights": True,
        "store_param_remainders": True,
        "exp_avg_dtype": BF16,
        "exp_avg_sq_dtype": BF16,
    },
}


def _scale_of(opt: Any, param: torch.Tensor, name: str) -> torch.Tensor | None:
    """The per-tensor scale of ``param``'s state ``name`` in ``opt`` (None if unscaled)."""
    return precision_state.scale_of(opt.layout, opt.scales, param, name)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(
        a.detach().contiguous().view(torch.uint8).cpu(),
        b.detach().contiguous().view(torch.uint8).cpu(),
    )


def _train(cfg: dict[str, Any], dtype: torch.dtype, device: str, steps: int) -> Any:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4099, generator=gen).to(dtype).to(device))]
    opt = PrecisionAwareAdamW(params, lr=1e-2, weight_decay=0.1, chunk_numel=1000, **cfg)
    for i in range(steps):
        g = torch.randn(4099, generator=torch.Generator().manual_seed(100 + i))
        params[0].grad = g.to(dtype).to(device)
        opt.step()
    return params, opt


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at the magnitude of each element of ``x``."""
    mantissa = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[dtype]
    _, exponent = torch.frexp(x.abs().float())  # |x| in [2**(e-1), 2**e)
    return torch.ldexp(torch.ones_like(x.float()), exponent - 1 - mantissa)


def _checks(device: str = "cuda") -> list[tuple[str, bool]]:
    """Every check, on ``device`` (CPU works too, which is how this module is tested)."""
    results: list[tuple[str, bool]] = []
    for label, cfg in _CONFIGS.items():
        dtype = BF16 if cfg.get("master_weights") else torch.float32
        params, opt = _train(cfg, dtype, device, 3)
        p = params[0]
        ok = True
        for name in opt.state[p]:
            whole = opt.get_unscaled_state(p, name).reshape(-1)
            out = torch.empty_like(whole)
            for s, e in codecs.chunk_bounds(whole.numel(), 777):
                opt.read_unscaled_state_chunk(p, name, s, out[s:e])
            ok &= _same(out, whole)
        results.append((f"{label}: chunked read == get_unscaled_state", ok))

        other = copy.deepcopy(opt)
        q = other.param_groups[0]["params"][0]
        ok = True
        for name in opt.state[p]:
            host = opt.get_unscaled_state(p, name).cpu()
            opt.set_scaled_state(p, name, host.clone().to(device))
            other.write_scaled_state_chunked(q, name, host, 1000)
            ok &= _same(opt.state[p][name], other.state[q][name])
            if _scale_of(opt, p, name) is not None:
                ok &= _same(_scale_of(opt, p, name), _scale_of(other, q, name))
        results.append((f"{label}: chunked write from host == set_scaled_state", ok))

        sd = copy.deepcopy(opt.state_dict())
        resumed_params = [torch.nn.Parameter(p.detach().clone())]
        resumed = PrecisionAwareAdamW(
            resumed_params, lr=1e-2, weight_decay=0.1, chunk_numel=1000, **cfg
        )
        resumed.load_state_dict(sd)
        for i in range(2):
            g = torch.randn(4099, generator=torch.Generator().manual_seed(200 + i)).to(dtype)
            p.grad, resumed_params[0].grad = g.to(device), g.to(device)
            opt.step()
            resumed.step()
        ok = _same(p, resumed_params[0]) and all(
            _same(opt.state[p][n], resumed.state[resumed_params[0]][n]) for n in opt.state[p]
        )
        results.append((f"{label}: save -> load -> continue bit-identical", ok))

        cpu_params, _ = _train(cfg, dtype, "cpu", 3)
        dev_params, _ = _train(cfg, dtype, device, 3)
        want = cpu_params[0].float()
        diff = (want - dev_params[0].float().cpu()).abs()
        # Paths may round differently in the last bit of the stored parameter: allow one ulp
        # of the parameter's dtype at each element's magnitude (a bf16 ulp is 2**-6 in [2, 4)).
        ok = bool((diff <= torch.maximum(_ulp(want, dtype), torch.tensor(1e-2))).all())
        results.append(
            (f"{label}: {device} vs CPU params after 3 steps, max |diff| {diff.max():.2e}", ok)
        )
    return results


def _time(
    make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    dtype: torch.dtype,
    numel: int,
) -> float:
    params = [
        torch.nn.Parameter(torch.randn(numel // 4, device="cuda").to(dtype)) for _ in range(4)
    ]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = make(params)
    opt.step()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def run() -> Section:
    """Run the CUDA checks and timings; every failed check is a failure of the section.

    Example:
        >>> from tests.gpu.gpu_precision_adam import run
        >>> run().markdown.startswith("## PrecisionAwareAdamW on CUDA")  # doctest: +SKIP
        True
    """
    require_cuda("gpu_precision_adam")
    lines = [f"## PrecisionAwareAdamW on CUDA ({torch.cuda.get_device_name()})", ""]
    lines += ["| check | result |", "|---|---|"]
    results = _checks()  # the fused step's own checks: gpu_fused_step
    for label, ok in results:
        lines.append(f"| {label} | {'pass' if ok else 'FAIL'} |")
    numel = 50_000_000
    lines += ["", f"Step time, {numel // 1_000_000}M parameters (best of 10):", ""]
    lines += ["| configuration | ms | x torch fused |", "|---|---:|---:|"]
    fused = _time(lambda ps: torch.optim.AdamW(ps, fused=True), torch.float32, numel)
    lines.append(f"| torch AdamW fused (fp32) | {fused:.2f} | 1.00 |")
    for label, cfg in (("fp32 state", {}), *(_CONFIGS.items())):
        dtype = BF16 if cfg.get("master_weights") else torch.float32

        def make(ps: list[torch.nn.Parameter], cfg: dict[str, Any] = cfg) -> torch.optim.Optimizer:
            return PrecisionAwareAdamW(ps, **cfg)

        ms = _time(make, dtype, numel)
        kind = str(dtype).removeprefix("torch.")
        lines.append(f"| ours {label} ({kind} params) | {ms:.2f} | {ms / fused:.2f} |")
    lines.append("")
    return Section("\n".join(lines), [label for label, ok in results if not ok])


if __name__ == "__main__":
    raise SystemExit(main_of(run))
