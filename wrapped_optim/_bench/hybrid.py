"""HybridOffloadOptimizer's step, phase by phase, against a bare fused AdamW step; then the
cost of HybridSyncOptimizer's syncs and stale-master guard, relative to one optimizer step.

The breakdown (copy-in of the grads, host step, copy-out of the results, device step) is
measured at offload_fraction 1.0 and 0.5 beside torch's ``AdamW(fused=True)`` stepping FP32
params of the same numel in place — the target is a 1.0 step within 1.3x of that. The guard
runs once (first step after construction or a load) and the syncs run once per load;
afterwards a wrapped step costs one flag check. Measured on this machine's CPU.

Reproduce: ``wrapped-optim bench hybrid --out DIR`` or ``python -m wrapped_optim._bench.hybrid``
(``--quick`` for 10M params only).
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from wrapped_optim._bench._figures import Panel, bar_panels
from wrapped_optim.hybrid import HybridSyncOptimizer
from wrapped_optim.optimizers import HybridOffloadOptimizer, PrecisionAwareAdamW

_TENSORS = 10


def _params(total: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    numel = max(1, total // _TENSORS)
    return [
        torch.nn.Parameter(torch.randn(numel, generator=gen).to(torch.bfloat16))
        for _ in range(_TENSORS)
    ]


def _timed(fn: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


#: Bytes each phase moves per offloaded parameter (read + write): for bf16 params with FP32
#: host copies, unfused (the grad cast in, the step over param, grad and both moments, the
#: param cast out) and fused (the fused host step reads the bf16 grad and writes the bf16
#: param itself: 2 + 8 + 16 + 2); for FP32 params, unfused (no grad copy: the host copy steps
#: with the param's own grad; the result is copied out) and fused (the FP32 grad read, the
#: param written with the copy's value: 4 + 8 + 16 + 4).
_PHASE_BYTES = {
    "bf16": {"copy_in": 2 + 4, "host": 16 + 12, "copy_out": 4 + 2},
    "bf16 fused": {"copy_in": 0, "host": 2 + 8 + 16 + 2, "copy_out": 0},
    "fp32": {"copy_in": 0, "host": 16 + 12, "copy_out": 4 + 4},
    "fp32 fused": {"copy_in": 0, "host": 4 + 8 + 16 + 4, "copy_out": 0},
}
_PHASES = ("copy_in", "host", "copy_out", "device")
#: The project's target: an offload_fraction=1.0 step within this factor of a bare fused step.
TARGET_RATIO = 1.3


def _timed_once(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@contextlib.contextmanager
def _native_stderr_closed() -> Iterator[None]:
    """File descriptor 2 on /dev/null: torch 2.13's profiler writes a line there at each
    start and stop, which would interleave with the benchmark's progress lines."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


#: The step's profiler ranges (docs/hybrid.md) -> the phases of the breakdown.
_RANGES = {
    "HybridOffloadOptimizer.copy_in": "copy_in",
    "HybridOffloadOptimizer.host_step": "host",
    "HybridOffloadOptimizer.device_step": "device",
    "HybridOffloadOptimizer.copy_out": "copy_out",
}


def _phases_once(opt: HybridOffloadOptimizer) -> tuple[dict[str, float], int]:
    """One ``step`` of ``opt`` split into its phases, read from the profiler ranges the step
    opens (the profiler's own cost is in them, not in the ``step`` time measured apart), and
    how many params its fused host step updated: their host copies get no grad (their grad
    copy-in and param copy-out are part of the host step then)."""
    times = dict.fromkeys(_PHASES, 0.0)
    activities = [torch.profiler.ProfilerActivity.CPU]
    with _native_stderr_closed(), torch.profiler.profile(activities=activities) as prof:
        opt.step()
    for event in prof.events():
        phase = _RANGES.get(event.name)
        if phase is not None:
            times[phase] += event.cpu_time_total * 1e-6
    fused = sum(copy.grad is None for copy in opt.gpu_params_map_cpu_copy.values())
    return times, fused


#: The variants of :func:`breakdown`: key -> (offload_fraction, fused_host_step).
VARIANTS = {
    "1.0": (1.0, None),
    "1.0 unfused": (1.0, False),
    "0.5": (0.5, None),
    "1.0 int8 blocks": (1.0, None),
    "1.0 FP8 blocks": (1.0, None),
    "1.0 int4 blocks": (1.0, None),
}
#: The variants whose host optimizer is PrecisionAwareAdamW with block-scaled moments (its
#: ``block_moments``; one FP32 scale per 256 values, 128 for int4), the others torch's AdamW.
BLOCK_VARIANTS = {"1.0 int8 blocks": "int8", "1.0 FP8 blocks": "fp8", "1.0 int4 blocks": "int4"}


def _host_options(key: str) -> dict[str, Any]:
    """The host optimizer of variant ``key``: torch's AdamW (the default), or
    PrecisionAwareAdamW with the variant's block-scaled moments."""
    if key not in BLOCK_VARIANTS:
        return {}
    return {"cpu_optimizer_cls": PrecisionAwareAdamW, "block_moments": BLOCK_VARIANTS[key]}


def breakdown(
    total: int, dtype: torch.dtype = torch.bfloat16, rounds: int = 5
) -> dict[str, dict[str, float]]:
    """Best-of-``rounds`` seconds per phase and for a whole ``step`` of HybridOffloadOptimizer
    in each of :data:`VARIANTS` (default options: the fused host step where it applies; and
    ``fused_host_step=False``, the unfused path; :data:`BLOCK_VARIANTS` step
    PrecisionAwareAdamW with block-scaled moments on the host), with ``"fused"``: how many
    params the fused host step updated; plus ``"bare"``: torch ``AdamW(fused=True)`` over
    FP32 params of the same numel. Rounds interleave every variant, so load from other
    processes hits all alike; the minimum is the least disturbed sample.

    Example:
        >>> result = breakdown(10_000, rounds=1)
        >>> list(result)  # doctest: +NORMALIZE_WHITESPACE
        ['bare', '1.0', '1.0 unfused', '0.5', '1.0 int8 blocks', '1.0 FP8 blocks',
         '1.0 int4 blocks']
        >>> result["1.0 int4 blocks"]["fused"]
        10.0
        >>> sorted(result["1.0"])
        ['copy_in', 'copy_out', 'device', 'fused', 'host', 'step']
        >>> result["1.0 unfused"]["fused"]
        0.0
    """
    gen = torch.Generator().manual_seed(0)
    numel = max(1, total // _TENSORS)

    def make(param_dtype: torch.dtype) -> list[torch.nn.Parameter]:
        params = []
        for _ in range(_TENSORS):
            p = torch.nn.Parameter(torch.randn(numel, generator=gen).to(param_dtype))
            p.grad = torch.randn(numel, generator=gen).to(param_dtype)
            params.append(p)
        return params

    bare_params = make(torch.float32)
    bare = torch.optim.AdamW(bare_params, lr=1e-6, fused=True)
    hybrids = {
        key: HybridOffloadOptimizer(
            make(dtype),
            offload_fraction=fraction,
            fused_host_step=fused,
            lr=1e-6,
            **_host_options(key),
        )
        for key, (fraction, fused) in VARIANTS.items()
    }
    bare.step()  # state created outside the timings
    for opt in hybrids.values():
        opt.step()
    best: dict[str, dict[str, float]] = {"bare": {"step": float("inf")}}
    for key in hybrids:
        best[key] = dict.fromkeys((*_PHASES, "step"), float("inf"))
    for _ in range(rounds):
        best["bare"]["step"] = min(best["bare"]["step"], _timed_once(bare.step))
        for key, opt in hybrids.items():
            times, fused = _phases_once(opt)
            for phase, seconds in times.items():
                best[key][phase] = min(best[key][phase], seconds)
            best[key]["fused"] = float(fused)
            best[key]["step"] = min(best[key]["step"], _timed_once(opt.step))
    return best


def _breakdown_lines(data: dict[str, Any]) -> list[str]:
    """The Markdown table of the breakdown rows with the ratio to the bare step, and the
    bytes each phase moves."""
    rounds = data["rounds"]
    lines = [
        "## Hybrid offload step breakdown",
        "",
        f"One `HybridOffloadOptimizer` step (default options: torch `AdamW` on the host, "
        f"stepped by the fused host step where it applies, else `AdamW(fused=True)`; `AdamW` "
        f"on the device; {_TENSORS} equal tensors; FP32 host copies) split into its phases, "
        "beside a bare `AdamW(fused=True)` step over FP32 params of the same numel (updated in "
        "place: no copies). 'fused' marks a host step that reads the grads and writes the "
        "params itself (copy-in and copy-out are then part of it); the '1.0 unfused' rows "
        "(`fused_host_step=False`) are the separate passes it replaces. Times are the "
        f"best of {rounds} interleaved rounds, in milliseconds; the phases are timed one by "
        "one (the same calls `step` makes), the step column is a whole `step()`. On a CPU the "
        "'device' is the host too, so the device step runs on the same cores. The '1.0 int8 "
        "blocks', '1.0 FP8 blocks' and '1.0 int4 blocks' rows step `PrecisionAwareAdamW` "
        "with block-scaled moments on the host (`cpu_optimizer_cls=PrecisionAwareAdamW, "
        "block_moments=...`; one FP32 scale per 256 values, 128 for int4): the fused host "
        "step reads the bf16 or FP32 grad, updates the FP32 host copy and the 8- or 4-bit "
        "moments block by block and writes the param, so the host keeps 6.03 (8-bit) or "
        "5.06 (4-bit) bytes per offloaded parameter instead of 12 with FP32 moments.",
        "",
        "| params | param dtype | offload | copy-in | host step | copy-out | device step "
        "| step | bare | step / bare |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    traffic: list[str] = []
    for case in data["breakdown"]:
        total, name, result = case["params"], case["dtype"], case["result"]
        bare = result["bare"]["step"]
        for key in _measured_variants(result):
            m = result[key]
            ratio = m["step"] / bare
            cells = [f"{m[p] * 1e3:.1f}" for p in _PHASES]
            if m["fused"]:
                cells[1] += " (fused)"
            lines.append(
                f"| {total / 1e6:g}M | {name} | {key} | {' | '.join(cells)} "
                f"| {m['step'] * 1e3:.1f} | {bare * 1e3:.1f} | {ratio:.2f}x |"
            )
        for key in ("1.0", "1.0 unfused"):
            m = result[key]
            kind = f"{name} fused" if m["fused"] else name
            rates = ", ".join(
                f"{p.replace('_', '-')} {nbytes} B/param = {nbytes * total / m[p] / 1e9:.1f} GB/s"
                for p, nbytes in _PHASE_BYTES[kind].items()
                if nbytes
            )
            traffic.append(f"- {total / 1e6:g}M {name}, offload {key}: {rates}.")
        traffic.append(
            f"- {total / 1e6:g}M bare step: 28 B/param = {28 * total / bare / 1e9:.1f} GB/s."
        )
    floors = {kind: sum(b.values()) / 28 for kind, b in _PHASE_BYTES.items()}
    lines += [
        "",
        "Bytes each phase moves (read + write) and the bandwidth it reached:",
        "",
        *traffic,
        "",
        "Every phase is memory-bound. With bf16 params the unfused step moves "
        f"{sum(_PHASE_BYTES['bf16'].values())} B/param (grad cast in, step, param cast out: a "
        f"floor of {floors['bf16']:.2f}x the bare step at equal bandwidth); the fused host "
        "step reads the bf16 grad, updates the FP32 host copy and the moments and writes the "
        f"bf16 param in one pass: {sum(_PHASE_BYTES['bf16 fused'].values())} B/param, the "
        f"bare step's bytes ({floors['bf16 fused']:.2f}x). FP32 params keep a distinct FP32 "
        "host copy (it is what lets stale copies behave as on a GPU); the fused host step "
        "reads the FP32 grad, updates the copy and the moments and writes the param with the "
        f"copy's exact value: {sum(_PHASE_BYTES['fp32 fused'].values())} B/param "
        f"({floors['fp32 fused']:.2f}x). Unfused, the copy steps with the param's own grad and "
        f"is copied out: {sum(_PHASE_BYTES['fp32'].values())} B/param ({floors['fp32']:.2f}x).",
        "",
    ]
    return lines


def _measure(total: int, repeats: int) -> dict[str, float]:
    params = _params(total)
    for p in params:
        p.grad = torch.randn(p.shape, dtype=torch.float32).to(torch.bfloat16)
    inner = HybridOffloadOptimizer(params, offload_fraction=0.5, lr=1e-6)
    opt = HybridSyncOptimizer(inner)
    inner.step()  # create state outside the timings
    opt.check_masters()  # disarm the guard
    # Interleaved, so that load from other processes hits all alike.
    bare_samples, wrapped_samples, atomic_samples = [], [], []
    for _ in range(repeats):
        bare_samples.append(_timed(inner.step, 1))
        wrapped_samples.append(_timed(opt.step, 1))
        inner.atomic_step = True  # the opt-in snapshot of the host half
        atomic_samples.append(_timed(inner.step, 1))
        inner.atomic_step = False
    bare_step = statistics.median(bare_samples)
    wrapped_step = statistics.median(wrapped_samples)

    guard = _timed(opt.check_masters, repeats)  # the guard's whole work, armed or not

    def guard_stale() -> None:
        with torch.no_grad():
            params[0].add_(1.0)  # one stale tensor: guard finds it and refreshes it
        opt.check_masters()

    guard_refresh = _timed(guard_stale, repeats)
    reload = _timed(opt.reload_model_params, repeats)
    full_sync = _timed(opt.sync_from_masters, repeats)
    return {
        "bare": bare_step,
        "wrapped": wrapped_step,
        "atomic": statistics.median(atomic_samples),
        "guard": guard,
        "guard_refresh": guard_refresh,
        "reload": reload,
        "full_sync": full_sync,
    }


def _wrapper_overhead_us(calls: int = 20_000) -> float:
    """Per-step cost of the wrapper itself once the guard ran: the same (near no-op) step of
    a one-parameter offload optimizer, bare and wrapped."""
    param = torch.nn.Parameter(torch.zeros(1))  # no grad: nothing to update
    inner = HybridOffloadOptimizer([param], lr=0.1)
    opt = HybridSyncOptimizer(inner)
    opt.check_masters()
    bare = min(_timed(lambda: [inner.step() for _ in range(calls)], 1) for _ in range(3))
    wrapped = min(_timed(lambda: [opt.step() for _ in range(calls)], 1) for _ in range(3))
    return (wrapped - bare) / calls * 1e6


def collect(quick: bool = False, *, sizes: list[int] | None = None) -> dict[str, Any]:
    """Measures the breakdown (bf16 params at ``sizes``, FP32 at the first) and the syncs
    and guard (10M params; also 100M unless quick) and returns the rows.

    Example:
        >>> data = collect(sizes=[100_000])
        >>> [(case["params"], case["dtype"]) for case in data["breakdown"]]
        [(100000, 'bf16'), (100000, 'fp32')]
        >>> section = render(data)
        >>> "| 0.1M |" in section and "| 0.1M | bf16 | 1.0 |" in section
        True
    """
    if sizes is None:
        sizes = [10_000_000] if quick else [10_000_000, 100_000_000]
    rounds = 3 if quick else 5
    cases = [(total, torch.bfloat16) for total in sizes] + [(sizes[0], torch.float32)]
    return {
        "rounds": rounds,
        "tensors": _TENSORS,
        "breakdown": [
            {
                "params": total,
                "dtype": "bf16" if dtype == torch.bfloat16 else "fp32",
                "result": breakdown(total, dtype, rounds=rounds),
            }
            for total, dtype in cases
        ],
        "sync": [
            {"params": total, **_measure(total, 7 if total <= 10_000_000 else 3)} for total in sizes
        ],
        "wrapper_overhead_us": _wrapper_overhead_us(),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread(s), "
        f"torch {torch.__version__}, Python {sys.version.split()[0]}",
    }


def headline(data: dict[str, Any]) -> str:
    """The topic's result in one sentence, from the largest bf16 model measured.

    Example:
        >>> step = {"copy_in": 0.0, "host": 0.064, "copy_out": 0.0, "device": 0.0,
        ...         "step": 0.063, "fused": 10.0}
        >>> unfused = dict(step, step=0.116, fused=0.0)
        >>> case = {"params": 100_000_000, "dtype": "bf16",
        ...         "result": {"1.0": step, "1.0 unfused": unfused, "bare": {"step": 0.061}}}
        >>> from textwrap import fill
        >>> print(fill(headline({"breakdown": [case]}), 80))
        Hybrid offload at 100M bf16 parameters: a fully offloaded step takes 1.03x a
        bare fused AdamW step (1.90x without the fused host step).
    """
    case = [c for c in data["breakdown"] if c["dtype"] == "bf16"][-1]
    result = case["result"]
    bare = result["bare"]["step"]
    return (
        f"Hybrid offload at {case['params'] / 1e6:g}M bf16 parameters: a fully offloaded step "
        f"takes {result['1.0']['step'] / bare:.2f}x a bare fused AdamW step "
        f"({result['1.0 unfused']['step'] / bare:.2f}x without the fused host step)."
    )


def render(data: dict[str, Any]) -> str:
    """The Markdown sections of :func:`collect`'s ``data``.

    Example:
        >>> render.__name__  # run with measured rows in collect's example
        'render'
    """
    breakdown_lines = _breakdown_lines(data)
    lines = [
        *breakdown_lines[:2],
        f"**{headline(data)}**",
        "",
        *breakdown_lines[2:],
        "## Hybrid offload sync and stale-master guard",
        "",
        "Portable `HybridOffloadOptimizer` (AdamW host and device sub-optimizers, bf16 params in",
        f"{data['tensors']} equal tensors, offload_fraction=0.5, FP32 copies) wrapped in",
        "`HybridSyncOptimizer`. Times are medians in milliseconds; ratios are relative to one",
        "bare optimizer step (`atomic_step=False`, the default). The `atomic_step=True` column",
        "snapshots the host half every step so that a failed device step can be undone. The",
        "guard and the syncs run once per construction or load.",
        "",
        "Every step:",
        "",
        "| params | step (bare) | step, atomic_step=True | step (wrapped, after guard) "
        "| per-step overhead |",
        "|---:|---:|---:|---:|---:|",
    ]
    once = [
        "",
        "Once per construction or load:",
        "",
        "| params | guard, clean | guard, 1 stale tensor | model-only sync | full-state sync |",
        "|---:|---:|---:|---:|---:|",
    ]
    for m in data["sync"]:
        base = m["bare"]

        def cell(key: str, m: dict[str, float] = m, base: float = base) -> str:
            return f"{m[key] * 1e3:.1f} ({m[key] / base:.2f}x)"

        overhead = (m["wrapped"] - base) / base * 100
        size = f"{m['params'] / 1e6:g}M"
        lines.append(
            f"| {size} | {base * 1e3:.1f} | {cell('atomic')} | {cell('wrapped')} "
            f"| {overhead:+.1f}% |"
        )
        once.append(
            f"| {size} | {cell('guard')} | {cell('guard_refresh')} | {cell('reload')} "
            f"| {cell('full_sync')} |"
        )
    lines += [
        *once,
        "",
        "The wrapped/bare step ratio is within this shared machine's noise; the wrapper's own",
        "per-step cost after the guard, measured on a no-op inner step, is "
        f"{data['wrapper_overhead_us']:.1f} µs (the hook dispatch of `OptimizerWrapper.step` "
        "and one flag check).",
        "",
        f"Machine: {data['machine']}.",
        "",
        "Reproduce: `wrapped-optim bench hybrid --out DIR` (`--quick`: 10M only).",
        "",
    ]
    return "\n".join(lines)


def targets(data: dict[str, Any]) -> str:
    """The fully offloaded step's time target per case, met or missed (the contributors'
    page).

    Example:
        >>> case = {"params": 10**7, "dtype": "bf16",
        ...         "result": {"1.0": {"step": 0.012}, "bare": {"step": 0.010}}}
        >>> print(targets({"breakdown": [case]}).splitlines()[-1])
        | 10M | bf16 | 1.20x | met |
    """
    lines = [
        "## Hybrid offload",
        "",
        f"An offload_fraction=1.0 step within {TARGET_RATIO}x of a bare `AdamW(fused=True)` "
        "step over FP32 params of the same numel.",
        "",
        "| params | param dtype | step / bare | verdict |",
        "|---:|---|---:|---|",
    ]
    for case in data["breakdown"]:
        ratio = case["result"]["1.0"]["step"] / case["result"]["bare"]["step"]
        verdict = "met" if ratio <= TARGET_RATIO else "missed"
        lines.append(f"| {case['params'] / 1e6:g}M | {case['dtype']} | {ratio:.2f}x | {verdict} |")
    return "\n".join(lines)


def run(quick: bool = False, *, sizes: list[int] | None = None) -> str:
    """Measures and returns the Markdown sections (10M params; also 100M unless quick).

    Example:
        >>> run.__name__
        'run'
    """
    return render(collect(quick, sizes=sizes))


def _measured_variants(result: dict[str, Any]) -> list[str]:
    """The variants ``result`` has, in :data:`VARIANTS` order (rows of an earlier run may
    lack the newer ones)."""
    return [key for key in VARIANTS if key in result]


_PHASE_LABELS = {"copy_in": "copy-in", "host": "host step", "copy_out": "copy-out",
                 "device": "device step"}  # fmt: skip


def plots(data: dict[str, Any], out_dir: Path | str) -> list[Path]:
    """``hybrid_phases.png``: one step split into its phases per size, dtype and variant,
    against the bare fused AdamW step of the same numel (needs matplotlib).

    Example:
        >>> import tempfile
        >>> phases = {"copy_in": 0.001, "host": 0.008, "copy_out": 0.001, "device": 0.0,
        ...           "step": 0.01, "fused": 0.0}
        >>> result = {**dict.fromkeys(VARIANTS, phases), "bare": {"step": 0.008}}
        >>> data = {"breakdown": [{"params": 10**7, "dtype": "bf16", "result": result}]}
        >>> [p.name for p in plots(data, tempfile.mkdtemp())]
        ['hybrid_phases.png']
    """
    panels = []
    for case in data["breakdown"]:
        result = case["result"]
        keys = _measured_variants(result)
        labels = [*(f"offload {key}" for key in keys), "bare AdamW(fused=True)"]
        series = {
            _PHASE_LABELS[phase]: [*(result[key][phase] * 1e3 for key in keys), None]
            for phase in _PHASES
        }
        series["whole step()"] = [None] * len(keys) + [result["bare"]["step"] * 1e3]
        panels.append(
            Panel(
                f"{case['params'] / 1e6:g}M {case['dtype']} params: one step by phase",
                labels,
                series,
                "milliseconds",
                stacked=True,
                anchor=("bare fused AdamW", result["bare"]["step"] * 1e3),
            )
        )
    return [bar_panels(Path(out_dir) / "hybrid_phases.png", panels)]


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv))
