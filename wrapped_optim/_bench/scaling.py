"""Benchmark: how step, streaming save and atomic streaming load scale with the model size.

One PrecisionAwareAdamW (FP32 params and grads, bf16 ``exp_avg``/``exp_avg_sq``, the
compiled CPU kernel where it builds) per size, from 10M parameters up to the largest size
whose estimated peak fits the memory cap, each size in a fresh child process (one torch
thread, ``MALLOC_MMAP_THRESHOLD_=131072`` so freed tensors leave the process). Per size:

* step: the median of 3 timed steps after one that creates the state;
* save: :func:`wrapped_optim.checkpoint.save_optimizer` (streaming, 64 MiB chunks);
* load: :func:`wrapped_optim.checkpoint.load_optimizer` (atomic: its undo journal on disk),
  into the same optimizer after its state was changed, checked bitwise against the saved;
* memory: the RSS after the steps (model, grads and state), the whole process's peak RSS,
  and the peak growth of the save and of the load over the RSS before each.

The model is made of tensors of at most 16M elements (a transformer's matrices are of that
order), so the largest tensor, which bounds the streaming calls' memory, is the same at
every size above 16M. The cap defaults to 80% of the memory available when the run starts;
``WRAPPED_OPTIM_BENCH_MAX_GIB`` sets it (in GiB).

Run: ``python -m wrapped_optim._bench.scaling`` (``--quick``: two small sizes), or as a topic:
``wrapped-optim bench scaling --out docs``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from wrapped_optim._bench._figures import Panel, bar_panels
from wrapped_optim._bench._memory import proc_status, reset_peak

SIZES = (10, 30, 100, 200, 400, 800, 1200, 1500)  # millions of parameters
LARGEST_TENSOR = 16 << 20  # elements
BYTES_PER_PARAM = 12  # FP32 param and grad, two bf16 moments
BASE_BYTES = 1 << 30  # torch, the interpreter, the streaming calls' buffers: a bound
MiB = float(1 << 20)


def _build(n_params: int, seed: int) -> tuple[Any, list[Any]]:
    import torch

    from wrapped_optim.optimizers import PrecisionAwareAdamW

    sizes = [LARGEST_TENSOR] * (n_params // LARGEST_TENSOR)
    if n_params % LARGEST_TENSOR:
        sizes.append(n_params % LARGEST_TENSOR)
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=g) * 0.02) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    opt = PrecisionAwareAdamW(
        params, lr=1e-4, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16
    )
    return opt, params


def _digest(opt: Any) -> int:
    import torch

    total = 0
    for i, p in enumerate(opt.param_groups[0]["params"]):
        for name in ("exp_avg", "exp_avg_sq"):
            bits = opt.state[p][name].view(torch.int16)[::4097].to(torch.int64)
            total += (i + 1) * int(bits.sum()) + len(name)
    return total


def _measured(call: Callable[[], object], peaks: list[int]) -> tuple[float, int]:
    """Seconds of ``call()`` and its peak RSS growth (its peak RSS is added to ``peaks``)."""
    reset_peak()
    base = proc_status("VmRSS")
    start = time.perf_counter()
    call()
    seconds = time.perf_counter() - start
    peaks.append(proc_status("VmHWM"))
    return seconds, peaks[-1] - base


def _child(n_params: int, root: Path) -> None:
    import torch

    from wrapped_optim.checkpoint import load_optimizer, save_optimizer

    torch.set_num_threads(1)
    opt, _ = _build(n_params, seed=0)
    opt.step()  # creates the state (and builds or loads the kernel)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    steady = proc_status("VmRSS")
    peaks = [proc_status("VmHWM")]  # building and stepping
    saved = _digest(opt)
    save_seconds, save_growth = _measured(lambda: save_optimizer(opt, root / "ckpt"), peaks)
    with torch.no_grad():  # other values to load over
        for state in opt.state.values():
            state["exp_avg"].fill_(1)
            state["exp_avg_sq"].fill_(1)
    load_seconds, load_growth = _measured(lambda: load_optimizer(opt, root / "ckpt"), peaks)
    result = {
        "params": n_params,
        "step": sorted(times)[1],
        "save": save_seconds,
        "load": load_seconds,
        "steady_rss": steady,
        "peak_rss": max(peaks),
        "save_growth": save_growth,
        "load_growth": load_growth,
        "correct": _digest(opt) == saved,
    }
    print(json.dumps(result))


def _run_child(n_params: int, root: Path) -> dict[str, Any]:
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MALLOC_MMAP_THRESHOLD_="131072"
    )
    cmd = [sys.executable, "-m", "wrapped_optim._bench.scaling", "--child", str(n_params)]
    cmd.append(str(root))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600, check=False)
    shutil.rmtree(root / "ckpt", ignore_errors=True)
    if out.returncode != 0:
        raise RuntimeError(f"{n_params:,} parameters failed:\n{out.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def memory_cap() -> int:
    """The largest peak RSS a size may need (bytes): ``WRAPPED_OPTIM_BENCH_MAX_GIB``, or 80%
    of the memory available now.

    Example:
        >>> memory_cap() > 0
        True
    """
    value = os.environ.get("WRAPPED_OPTIM_BENCH_MAX_GIB")
    if value:
        return int(float(value) * (1 << 30))
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAv"))
    return int(0.8 * available)


def _estimate(millions: int) -> int:
    return millions * 10**6 * BYTES_PER_PARAM + BASE_BYTES


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``: (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - b * mx, b


def _exponent(rows: list[dict[str, Any]], key: str) -> float:
    """The log-log least-squares slope of ``key`` against the size, over every size but the
    smallest (whose fixed costs dominate) when there are three or more (1: linear; above 1:
    superlinear)."""
    tail = rows[1:] if len(rows) > 2 else rows
    if len(tail) < 2:
        return math.nan
    return _fit([math.log(r["params"]) for r in tail], [math.log(r[key]) for r in tail])[1]


_CAUSES = {
    "step": "The step reads and writes each parameter's 12 bytes of state, param and grad "
    "once, whatever the size: a cost per parameter that grows comes from the machine (memory "
    "bandwidth shared with other processes; transparent huge pages that the larger "
    "allocations no longer get, so more TLB misses), not from a term of the algorithm.",
    "save": "The save writes 8 bytes per parameter (the FP32 expansions) and syncs the files: "
    "once a checkpoint no longer fits the kernel's dirty-page allowance (`vm.dirty_ratio` of "
    "the available memory), its writes are throttled to the disk's speed, which a small "
    "checkpoint never meets.",
    "load": "The load reads the checkpoint just written, from the page cache while it fits "
    "there, and writes its undo journal (4 bytes per parameter here) into the page cache too: "
    "once checkpoint and journal outgrow the free page cache, reads go to the disk and every "
    "journal page first needs a page reclaimed (see the checkpoint docs' Memory section).",
}


def _reading(rows: list[dict[str, Any]]) -> list[str]:
    """One line per call: linear or not, with the cause of a superlinear term."""
    if len(rows) < 2:
        return []
    lines = []
    for key, cause in _CAUSES.items():
        k = _exponent(rows, key)
        first, last = (rows[i][key] / rows[i]["params"] * 1e9 for i in (0, -1))
        trend = (
            f"exponent {k:.2f}; {first:.1f} ns/param at the smallest size, {last:.1f} at "
            "the largest"
        )
        if k > 1.1:
            lines.append(f"- {key}: **superlinear** ({trend}). {cause}")
        else:
            lines.append(f"- {key}: no superlinear term ({trend}).")
    return [
        *lines,
        "",
        "The smallest sizes cost more per parameter where fixed costs dominate (DCP's "
        "planning and metadata, opening files, a thread). Times on a machine shared with other "
        "work vary from run to run; the memory figures do not.",
        "",
    ]


def collect(quick: bool = False) -> dict[str, Any]:
    """Runs every size that fits the cap (``quick``: 10M and 30M) and returns the rows.

    Example:
        >>> from wrapped_optim._bench.scaling import collect
        >>> [r["params"] for r in collect(quick=True)["rows"]]  # doctest: +SKIP
        [10000000, 30000000]
    """
    cap = memory_cap()
    sizes = SIZES[:2] if quick else tuple(m for m in SIZES if _estimate(m) <= cap)
    skipped = [] if quick else [m for m in SIZES if m not in sizes]
    root = Path(tempfile.mkdtemp(prefix="wrapped_optim_bench_scaling_"))
    try:
        rows = [_run_child(m * 10**6, root) for m in sizes]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "rows": rows,
        "cap": cap,
        "cap_from_env": bool(os.environ.get("WRAPPED_OPTIM_BENCH_MAX_GIB")),
        "skipped": skipped,
    }


def headline(data: dict[str, Any]) -> str:
    """The topic's result in one sentence.

    Example:
        >>> rows = [{"params": n, "step": n * 2e-9, "save": n * 7e-8, "load": n * 5e-8,
        ...          "steady_rss": 400 * MiB + 12 * n, "save_growth": 65 * MiB,
        ...          "load_growth": 193 * MiB} for n in (10**7, 10**8, 4 * 10**8)]
        >>> from textwrap import fill
        >>> print(fill(headline({"rows": rows}), 80))
        From 10M to 400M parameters step, save and load grow linearly (exponents 1.00,
        1.00, 1.00); memory 12.00 bytes per parameter, and a save or a load adds at most
        193 MiB at any size.
    """
    rows = data["rows"]
    n = [float(r["params"]) for r in rows]
    per_param = _fit(n, [float(r["steady_rss"]) for r in rows])[1] if len(rows) > 1 else 0.0
    exponents = [_exponent(rows, key) for key in _CAUSES] if len(rows) > 1 else []
    shape = "grow linearly" if exponents and max(exponents) <= 1.1 else "grow superlinearly"
    growth = max(max(r["save_growth"], r["load_growth"]) for r in rows)
    return (
        f"From {rows[0]['params'] / 1e6:,.0f}M to {rows[-1]['params'] / 1e6:,.0f}M parameters "
        + (
            f"step, save and load {shape} (exponents "
            + ", ".join(f"{k:.2f}" for k in exponents)
            + "); "
            if exponents
            else ""
        )
        + f"memory {per_param:.2f} bytes per parameter, and a save or a load adds at most "
        f"{growth / MiB:,.0f} MiB at any size."
    )


def render(data: dict[str, Any]) -> str:
    """The Markdown section of :func:`collect`'s ``data``.

    Example:
        >>> render.__name__
        'render'
    """
    rows, cap, skipped = data["rows"], data["cap"], data["skipped"]
    n = [float(r["params"]) for r in rows]
    fixed, per_param = _fit(n, [float(r["steady_rss"]) for r in rows])
    lines = [
        "# Scaling with the model size",
        "",
        f"**{headline(data)}**",
        "",
        "PrecisionAwareAdamW (FP32 params and grads, bf16 moments; the step path it "
        "chooses: the compiled CPU kernel where it builds), tensors of at most "
        f"{LARGEST_TENSOR / 2**20:.0f} Mi elements, one torch thread, each size in a fresh "
        "process; save = `save_optimizer` (streaming), load = `load_optimizer` (atomic, "
        "undo journal on disk). Peak growth is over the RSS just before the call.",
        "",
        "### Time",
        "",
        "| params | step s | save s | load s | step ns/param | save ns/param | load ns/param |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    memory = [
        "",
        "### Memory",
        "",
        "| params | RSS after steps MiB | bytes/param | peak RSS MiB | save growth MiB "
        "| load growth MiB | loaded exactly |",
        "|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in rows:
        p = r["params"]
        lines.append(
            f"| {p / 1e6:,.0f}M | {r['step']:.3f} | {r['save']:.2f} | {r['load']:.2f} "
            f"| {r['step'] / p * 1e9:.2f} | {r['save'] / p * 1e9:.2f} "
            f"| {r['load'] / p * 1e9:.2f} |"
        )
        memory.append(
            f"| {p / 1e6:,.0f}M | {r['steady_rss'] / MiB:,.0f} "
            f"| {r['steady_rss'] / p:.2f} | {r['peak_rss'] / MiB:,.0f} "
            f"| {r['save_growth'] / MiB:,.0f} | {r['load_growth'] / MiB:,.0f} "
            f"| {'yes' if r['correct'] else 'NO'} |"
        )
    exponents = ", ".join(f"{key} {_exponent(rows, key):.2f}" for key in _CAUSES)
    lines += [
        *memory,
        "",
        f"Memory: RSS after the steps = {fixed / MiB:,.0f} MiB + **{per_param:.2f} bytes per "
        f"parameter** (least squares over the sizes; {BYTES_PER_PARAM} expected: FP32 param "
        "and grad, two bf16 moments). The save's and the load's peak growth do not grow with "
        "the model: they are bounded by the largest tensor and the chunk size.",
        "",
        "Growth exponents (log-log least-squares slope over every size but the smallest; "
        f"1 = linear): "
        f"{exponents}.",
        "",
        *_reading(rows),
    ]
    if skipped:
        why = (
            "set for this run with `WRAPPED_OPTIM_BENCH_MAX_GIB`, as the machine's memory was "
            "shared with other work"
            if data["cap_from_env"]
            else "80% of the memory available at the start"
        )
        lines += [
            f"Sizes left out by the memory cap of {cap / (1 << 30):.1f} GiB ({why}; estimated peak "
            f"{BYTES_PER_PARAM} bytes/param + 1 GiB): "
            + ", ".join(f"{m:,}M" for m in skipped)
            + ". The full range on a 24 GiB machine: `wrapped-optim bench scaling --out docs` "
            "on an otherwise idle machine (the cap defaults to 80% of the available memory; "
            "`WRAPPED_OPTIM_BENCH_MAX_GIB` sets it).",
            "",
        ]
    return "\n".join(lines)


def run(quick: bool = False) -> str:
    """Runs every size that fits the cap (``quick``: 10M and 30M) and returns Markdown.

    Example:
        From a shell, ``python -m wrapped_optim._bench.scaling --quick`` prints what
        ``run(quick=True)`` returns.

        >>> from wrapped_optim._bench.scaling import run
        >>> run(quick=True).startswith("# Scaling")  # doctest: +SKIP
        True
    """
    return render(collect(quick))


def plots(data: dict[str, Any], out_dir: Path | str) -> list[Path]:
    """``scaling_per_param.png``: time and memory per parameter at every size, against the
    12 bytes per parameter the state needs and the largest tensor that bounds a streaming
    call (needs matplotlib).

    Example:
        >>> import tempfile
        >>> rows = [{"params": n, "step": n * 2e-9, "save": n * 7e-8, "load": n * 5e-8,
        ...          "steady_rss": 400 * MiB + 12 * n, "save_growth": 65 * MiB,
        ...          "load_growth": 193 * MiB} for n in (10**7, 10**8)]
        >>> [p.name for p in plots({"rows": rows}, tempfile.mkdtemp())]
        ['scaling_per_param.png']
    """
    rows = data["rows"]
    labels = [f"{r['params'] / 1e6:,.0f}M" for r in rows]
    time = Panel(
        "Time per parameter of each call",
        labels,
        {key: [r[key] / r["params"] * 1e9 for r in rows] for key in _CAUSES},
        "nanoseconds per parameter (log)",
        log=True,
    )
    memory = Panel(
        "Resident memory after the steps, per parameter (the process's fixed part included)",
        labels,
        {"RSS / params": [r["steady_rss"] / r["params"] for r in rows]},
        "bytes per parameter",
        anchor=(f"the state's {BYTES_PER_PARAM} bytes", float(BYTES_PER_PARAM)),
    )
    growth = Panel(
        "Peak memory growth of one checkpoint call",
        labels,
        {
            "save": [r["save_growth"] / MiB for r in rows],
            "load": [r["load_growth"] / MiB for r in rows],
        },
        "MiB",
        anchor=("largest tensor, FP32", LARGEST_TENSOR * 4 / MiB),
    )
    return [bar_panels(Path(out_dir) / "scaling_per_param.png", [time, memory, growth])]


def main(argv: list[str] | None = None) -> None:
    """Command line: ``python -m wrapped_optim._bench.scaling [--quick]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", nargs=2, metavar=("PARAMS", "ROOT"))
    args = parser.parse_args(argv)
    if args.child:
        _child(int(args.child[0]), Path(args.child[1]))
        return
    print(run(quick=args.quick))


if __name__ == "__main__":
    main()
