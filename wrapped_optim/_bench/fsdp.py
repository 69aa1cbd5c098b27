"""Does FSDPAwareOptimizer allocate full-size grads on every step? A measurement.

Sharded FP32 weights with bf16 grads (Megatron-FSDP's main weights / main grads) need their
grads cast to FP32 for a plain optimizer. Casting afresh each step (what upstream's
``fully_shard_optimizer`` hooks do) allocates FP32 copies of every grad on every step;
FSDPAwareOptimizer copies into buffers it keeps. Measured here on a CPU with the torch
profiler's allocation records (bytes allocated inside ``optimizer.step()``), the storage
addresses the inner optimizer sees, and wall time.

Run: ``python -m wrapped_optim._bench.fsdp`` (add ``--quick`` for a smaller model).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from wrapped_optim._bench._figures import Panel, bar_panels
from wrapped_optim.fsdp import FSDPAwareOptimizer
from wrapped_optim.wrapper import OptimizerWrapper


def _install_grad(param: torch.Tensor, grad: torch.Tensor, grad_dtype: torch.dtype) -> None:
    """``param.grad = grad`` as a user writes it around torch's ``grad_dtype`` check: the old
    grad off first, then the dtype the new one has, then the grad."""
    param.grad = None
    param.grad_dtype = grad_dtype
    param.grad = grad


class _CastEachStep(OptimizerWrapper):
    """The baseline: a fresh ``grad.to(param.dtype)`` per parameter on every step."""

    def _step(self, closure: Callable[[], Any] | None) -> Any:
        swapped = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.dtype != p.dtype:
                    swapped.append((p, p.grad, p.grad_dtype))
                    _install_grad(p, p.grad.to(p.dtype), p.dtype)
        try:
            return self._inner_step(closure)
        finally:
            for p, grad, grad_dtype in swapped:
                _install_grad(p, grad, grad_dtype)


def _params(count: int, numel: int, grad_dtype: torch.dtype) -> list[torch.nn.Parameter]:
    params = []
    for _ in range(count):
        p = torch.nn.Parameter(torch.randn(numel))
        p.grad_dtype = grad_dtype
        params.append(p)
    return params


def _measure(
    label: str,
    make_inner: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    wrap: Callable[[torch.optim.Optimizer], Any],
    grad_dtype: torch.dtype,
    count: int,
    numel: int,
    steps: int,
) -> dict[str, Any]:
    torch.manual_seed(0)
    params = _params(count, numel, grad_dtype)
    inner = make_inner(params)
    seen: list[tuple[int, ...]] = []
    inner.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append(
            tuple(p.grad.data_ptr() for g in opt.param_groups for p in g["params"])
        )
    )
    optimizer = wrap(inner)
    # Fresh grad objects per step, made before measuring (as a backward pass would).
    grads = [[torch.randn(numel).to(grad_dtype) for _ in params] for _ in range(steps + 1)]

    def step(index: int) -> None:
        for p, g in zip(params, grads[index], strict=True):
            p.grad = g
        optimizer.step()

    step(0)  # warm-up: state and (for ours) the cast buffers are created here
    allocated = 0
    times = []
    for index in range(1, steps + 1):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step(index)
        allocated += sum(max(e.self_cpu_memory_usage, 0) for e in prof.events())
    for index in range(1, steps + 1):
        start = time.perf_counter()
        step(index)
        times.append(time.perf_counter() - start)
    measured = seen[1 : steps + 1]
    return {
        "label": label,
        "alloc_per_step": allocated / steps,
        "distinct_addresses": len(set(measured)),
        "ms": min(times) * 1e3,
    }


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


_INNERS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "SGD(momentum=0.9)": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
}
_APPROACHES: list[tuple[str, Callable[[torch.optim.Optimizer], Any], torch.dtype]] = [
    ("FSDPAwareOptimizer (kept buffers)", FSDPAwareOptimizer, torch.bfloat16),
    ("cast afresh each step (upstream hooks)", _CastEachStep, torch.bfloat16),
    ("reference: FP32 grads, no wrapper", lambda inner: inner, torch.float32),
]
_SHORT = ("FSDPAwareOptimizer", "cast afresh", "FP32 reference")


def collect(quick: bool = False) -> dict[str, Any]:
    """Measures every inner optimizer with every way of handing it the grads (one CPU
    thread) and returns the rows.

    Example:
        >>> from wrapped_optim._bench.fsdp import collect
        >>> collect(quick=True)["rows"][0]["label"]  # doctest: +SKIP
        'FSDPAwareOptimizer (kept buffers)'
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    count, numel, steps = (4, 1 << 16, 3) if quick else (8, 1 << 21, 10)
    try:
        rows = [
            {"inner": inner_name, **_measure(label, make, wrap, dtype, count, numel, steps)}
            for inner_name, make in _INNERS.items()
            for label, wrap, dtype in _APPROACHES
        ]
    finally:  # later topics of the same report run with the caller's threads
        torch.set_num_threads(previous)
    return {"count": count, "numel": numel, "steps": steps, "torch": torch.__version__,
            "rows": rows}  # fmt: skip


def _by_inner(data: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """inner optimizer -> its rows in the order of :data:`_APPROACHES`."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for row in data["rows"]:
        grouped.setdefault(row["inner"], []).append(row)
    return grouped


def headline(data: dict[str, Any]) -> str:
    """The topic's result in one sentence (AdamW's rows, or the last inner's).

    Example:
        >>> rows = [{"inner": "AdamW", "alloc_per_step": a * 2**20} for a in (128, 192, 128)]
        >>> from textwrap import fill
        >>> print(fill(headline({"count": 8, "numel": 1 << 21, "rows": rows}), 80))
        FSDPAwareOptimizer around AdamW: 0.00 MiB allocated per step beyond the
        optimizer's own, where casting the bf16 grads afresh allocates 64.00 MiB (1.00x
        the FP32 grads).
    """
    grouped = _by_inner(data)
    inner = "AdamW" if "AdamW" in grouped else list(grouped)[-1]
    ours, fresh, reference = (r["alloc_per_step"] for r in grouped[inner])
    full = data["count"] * data["numel"] * 4
    return (
        f"FSDPAwareOptimizer around {inner}: {_mib(ours - reference)} MiB allocated per step "
        f"beyond the optimizer's own, where casting the bf16 grads afresh allocates "
        f"{_mib(fresh - reference)} MiB ({(fresh - reference) / full:.2f}x the FP32 grads)."
    )


def render(data: dict[str, Any]) -> str:
    """The Markdown section of :func:`collect`'s ``data``.

    Example:
        >>> render.__name__
        'render'
    """
    count, numel, steps = data["count"], data["numel"], data["steps"]
    full_grad_bytes = count * numel * 4
    rows = []
    summary = []
    for inner_name, results in _by_inner(data).items():
        for result in results:
            rows.append(
                f"| {inner_name} | {result['label']} | {_mib(result['alloc_per_step'])} | "
                f"{result['distinct_addresses']} | {result['ms']:.1f} |"
            )
        ours, fresh, reference = (r["alloc_per_step"] for r in results)
        summary.append(
            f"- {inner_name}: beyond the optimizer's own allocations (the FP32-grad reference), "
            f"FSDPAwareOptimizer allocated {_mib(ours - reference)} MiB per step, casting "
            f"afresh {_mib(fresh - reference)} MiB ({(fresh - reference) / full_grad_bytes:.2f}"
            " x the FP32 grads)."
        )
    return "\n".join(
        [
            "## FSDPAwareOptimizer: cast buffers are reused",
            "",
            f"**{headline(data)}**",
            "",
            f"{count} FP32 parameters of {numel:,} elements with bf16 grads (`grad_dtype`); "
            f"their FP32 grads would take {_mib(full_grad_bytes)} MiB. {steps} measured steps "
            "after one warm-up step, new bf16 grad objects every step. *Allocated per step*: "
            "bytes allocated inside `optimizer.step()` (torch profiler, CPU). *Grad addresses*: "
            "distinct sets of grad storage addresses the inner optimizer saw over those steps "
            "(1 = the same buffers every step).",
            "",
            "| inner optimizer | grads handed over by | allocated per step (MiB) | "
            "grad addresses | fastest step (ms) |",
            "|---|---|---:|---:|---:|",
            *rows,
            "",
            *summary,
            "",
            "Step times include the bf16 -> FP32 copy, which both wrappers pay (it is what a "
            "plain optimizer needs); an optimizer that reads bf16 grads itself "
            "(`precision_aware=True`) skips it. Times come from a shared machine and are "
            "noisy (the fastest of the timed steps is shown); the allocation counts are exact.",
            "",
            "Reproduce: `wrapped-optim bench fsdp --out DIR` (`--quick` for a small run). "
            f"Measured with torch {data['torch']}, 1 CPU thread.",
            "",
        ]
    )


def run(quick: bool = False) -> str:
    """Runs the measurement and returns it as a Markdown section.

    Example:
        >>> from wrapped_optim._bench.fsdp import run
        >>> print(run(quick=True))  # doctest: +SKIP
        ## FSDPAwareOptimizer: cast buffers are reused
        ...
    """
    return render(collect(quick))


def plots(data: dict[str, Any], out_dir: Path | str) -> list[Path]:
    """``fsdp_allocations.png``: bytes allocated per step and step time per way of handing
    over the grads, against the size of the FP32 grads (needs matplotlib).

    Example:
        >>> import tempfile
        >>> rows = [{"inner": "AdamW", "alloc_per_step": a * 2**20, "ms": 1.0}
        ...         for a in (128, 192, 128)]
        >>> data = {"count": 8, "numel": 1 << 21, "rows": rows}
        >>> [p.name for p in plots(data, tempfile.mkdtemp())]
        ['fsdp_allocations.png']
    """
    grouped = _by_inner(data)
    labels = list(grouped)
    full = data["count"] * data["numel"] * 4 / 2**20
    memory = Panel(
        "Bytes allocated inside optimizer.step(), per step",
        labels,
        {short: [rows[k]["alloc_per_step"] / 2**20 for rows in grouped.values()]
         for k, short in enumerate(_SHORT)},
        "MiB",
        anchor=(f"the FP32 grads ({full:.0f} MiB)", full),
    )  # fmt: skip
    time = Panel(
        "Fastest step",
        labels,
        {short: [rows[k]["ms"] for rows in grouped.values()] for k, short in enumerate(_SHORT)},
        "milliseconds",
    )
    return [bar_panels(Path(out_dir) / "fsdp_allocations.png", [memory, time])]


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv[1:]))
