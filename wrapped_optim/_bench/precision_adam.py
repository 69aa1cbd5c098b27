"""Step time of PrecisionAwareAdamW on CPU against the memory-bandwidth floor and its peers.

Run ``wrapped-optim bench precision_adam --out DIR`` or ``python -m
wrapped_optim._bench.precision_adam`` (``--quick`` for a short run). Every configuration steps
four equal parameter tensors of ``n / 4`` elements with fresh gradients, interleaved round by
round with torch's fused AdamW on parameters of the same dtype, DeepSpeed's ``DeepSpeedCPUAdam``
(FP32, when it can be imported and built) and a STREAM-like triad that measures the memory
bandwidth at that moment; each figure is the best of its rounds, so load from other processes
hits all of them alike. The floor of a configuration is the bytes it must move per parameter
(every stored operand read once, every updated one written once) over the triad's bandwidth.
The peers of :mod:`wrapped_optim._bench._adam_peers` (torchao, bitsandbytes, torch-optimi,
DeepSpeed; optional) get rows of their own, and every row a quality figure: its training loss
on a small problem against FP32 AdamW's.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from wrapped_optim._bench._adam_peers import QUALITY_STEPS, peers, quality_loss
from wrapped_optim._bench._figures import Panel, bar_panels
from wrapped_optim.optimizers import PrecisionAwareAdamW, cpu_kernel

BF16, FP32, FP8, FP16 = torch.bfloat16, torch.float32, torch.uint8, torch.float16
#: The configuration the headline target is about (fp32 params, bf16 moments).
TARGET_CONFIG = "ours bf16 moments"

Factory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
_BF16_MOMENTS = {"exp_avg_dtype": BF16, "exp_avg_sq_dtype": BF16}
_NO_KERNEL = {"cpu_kernel": False}
_MASTER = {"master_weights": True}


def _ours(**kwargs: Any) -> Factory:
    return lambda ps: PrecisionAwareAdamW(ps, **kwargs)


@attrs.frozen
class Config:
    """One benchmarked optimizer: its label, parameter dtype, factory, the bytes per parameter
    a step must move at least (``traffic`` says which), the x-fused target,
    the fp16/FP8 loop family it runs and the class of the summary table it belongs to.

    Example:
        >>> from wrapped_optim._bench.precision_adam import CONFIGS
        >>> [c.bytes_moved for c in CONFIGS if c.label == "ours bf16 moments"]
        [20]
    """

    label: str
    dtype: torch.dtype
    factory: Factory
    bytes_moved: float
    traffic: str
    target: float | None = None
    # The fp16/FP8 moment loop family to run (cpu_kernel.LOOP_FAMILIES; None: the fastest this
    # CPU has): the AVX2 rows measure the AVX2 loops on an AVX-512 machine too.
    loops: str | None = None
    group: str | None = None
    # The torchao peer with moments of the same bits, stepped in this row's rounds too.
    torchao: str | None = None


_FP32_TRAFFIC = "p 4+4, g 4, m 4+4, v 4+4"
_SCALED_PARAMS = {"exp_avg_dtype": FP8, "exp_avg_sq_dtype": FP8}
_FP8_FP32 = "8-bit moments"
_FP8_BF16 = "bf16 params + remainders + FP8 moments"
_REMAINDERS = "bf16 params + remainders / FP32 master"
_BLOCK8 = "block-scaled 8-bit moments"
_BLOCK4 = "block-scaled 4-bit moments"
_BLOCK8_BF16 = "bf16 params + remainders + block-scaled 8-bit moments"
#: A class of ours whose peers are listed under another class: the 8-bit peers keep their
#: moments block-scaled too (torchao, bitsandbytes), so they race both kinds of ours.
PEER_CLASS = {_BLOCK8: _FP8_FP32, _BLOCK8_BF16: _FP8_BF16}
#: The label of ours with FP32 state: at or below DeepSpeedCPUAdam's time is its target.
FP32_STATE = "ours fp32 state"
# torchao's peers of the same bits (labels of _adam_peers), for the `x torchao` column.
_AO8, _AOFP8, _AO4 = "torchao AdamW8bit", "torchao AdamWFp8 (FP8 moments)", "torchao AdamW4bit"
_AO8_BF16 = "torchao AdamW8bit + bf16 stochastic rounding, bf16 params"
_INT8_TRAFFIC = "one pass: p 4+4, g 4, m 1+1, v 1+1, scales 4/256 each"
_INT4_TRAFFIC = "one pass: p 4+4, g 4, m 0.5+0.5, v 0.5+0.5, scales 4/128 each"
CONFIGS: list[Config] = [
    Config("torch AdamW foreach", FP32, lambda ps: torch.optim.AdamW(ps, foreach=True), 28,
           _FP32_TRAFFIC),
    Config(FP32_STATE, FP32, _ours(), 28, _FP32_TRAFFIC, group="FP32 state"),
    Config(TARGET_CONFIG, FP32, _ours(**_BF16_MOMENTS), 20, "p 4+4, g 4, m 2+2, v 2+2", 0.85,
           group="bf16 moments, FP32 params"),
    Config("ours bf16 moments, no CPU kernel (cpu_kernel=False)", FP32,
           _ours(**_BF16_MOMENTS, **_NO_KERNEL), 20, "p 4+4, g 4, m 2+2, v 2+2"),
    Config("ours fp16 m + FP8 v", FP32, _ours(exp_avg_dtype=FP16, exp_avg_sq_dtype=FP8), 25,
           "pass 1: g 4, m 2, v 1; pass 2: p 4+4, g 4, m 2+2, v 1+1", 1.3,
           group="fp16 m + FP8 v"),
    Config("ours fp16 m + FP8 v, AVX2 loops", FP32,
           _ours(exp_avg_dtype=FP16, exp_avg_sq_dtype=FP8), 25, "as above", 1.5, loops="avx2",
           group="fp16 m + FP8 v"),
    Config("ours FP8 moments", FP32, _ours(**_SCALED_PARAMS), 22,
           "pass 1: g 4, m 1, v 1; pass 2: p 4+4, g 4, m 1+1, v 1+1", 1.3, group=_FP8_FP32,
           torchao=_AOFP8),
    Config("ours FP8 moments, AVX2 loops", FP32, _ours(**_SCALED_PARAMS), 22, "as above", 1.5,
           loops="avx2", group=_FP8_FP32, torchao=_AOFP8),
    Config("ours FP8 moments, portable loops", FP32, _ours(**_SCALED_PARAMS), 22, "as above",
           loops="portable"),
    Config("ours FP8 moments, no CPU kernel (cpu_kernel=False)", FP32,
           _ours(**_SCALED_PARAMS, **_NO_KERNEL), 22, "as above"),
    Config("ours int8 block moments", FP32, _ours(block_moments="int8"), 16.03, _INT8_TRAFFIC,
           0.8, group=_BLOCK8, torchao=_AO8),
    Config("ours int8 block moments, AVX2 loops", FP32, _ours(block_moments="int8"), 16.03,
           "as above", loops="avx2", group=_BLOCK8, torchao=_AO8),
    Config("ours FP8 block moments", FP32, _ours(block_moments="fp8"), 16.03, _INT8_TRAFFIC,
           0.8, group=_BLOCK8, torchao=_AOFP8),
    Config("ours FP8 block moments, AVX2 loops", FP32, _ours(block_moments="fp8"), 16.03,
           "as above", loops="avx2", group=_BLOCK8, torchao=_AOFP8),
    Config("ours int4 block moments", FP32, _ours(block_moments="int4"), 14.06, _INT4_TRAFFIC,
           0.7, group=_BLOCK4, torchao=_AO4),
    Config("ours int4 block moments, AVX2 loops", FP32, _ours(block_moments="int4"), 14.06,
           "as above", loops="avx2", group=_BLOCK4, torchao=_AO4),
    Config("ours bf16 params + remainders + int8 block moments", BF16,
           _ours(**_MASTER, store_param_remainders=True, block_moments="int8"), 14.03,
           "one pass: p 2+2, rem 2+2, g 2, m 1+1, v 1+1, scales", 0.8, group=_BLOCK8_BF16,
           torchao=_AO8_BF16),
    Config("ours bf16 params + bf16 moments", BF16, _ours(**_BF16_MOMENTS), 14,
           "p 2+2, g 2, m 2+2, v 2+2", group="bf16 params + bf16 moments"),
    Config("ours bf16 params + remainders + bf16 moments", BF16,
           _ours(**_MASTER, store_param_remainders=True, **_BF16_MOMENTS), 18,
           "p 2+2, rem 2+2, g 2, m 2+2, v 2+2", group=_REMAINDERS),
    Config("ours bf16 params + fp32 master + bf16 moments", BF16,
           _ours(**_MASTER, **_BF16_MOMENTS), 20, "p 2, master 4+4, g 2, m 2+2, v 2+2",
           group=_REMAINDERS),
    Config("ours bf16 params + remainders + FP8 moments", BF16,
           _ours(**_MASTER, store_param_remainders=True, **_SCALED_PARAMS), 20,
           "pass 1: g 2, m 1, v 1; pass 2: p 2+2, rem 2+2, g 2, m 1+1, v 1+1", 1.3,
           group=_FP8_BF16, torchao=_AO8_BF16),
    Config("ours bf16 params + remainders + FP8 moments, AVX2 loops", BF16,
           _ours(**_MASTER, store_param_remainders=True, **_SCALED_PARAMS), 20, "as above",
           1.5, loops="avx2", group=_FP8_BF16, torchao=_AO8_BF16),
]  # fmt: skip


def state_bytes_per_param(optimizer: torch.optim.Optimizer) -> float:
    """Optimizer-state bytes (tensors in ``state``, plus our scales) per parameter element.

    Example:
        >>> import torch
        >>> from wrapped_optim._bench.precision_adam import state_bytes_per_param
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW, cpu_kernel
        >>> p = torch.nn.Parameter(torch.zeros(1000))
        >>> opt = PrecisionAwareAdamW([p], exp_avg_dtype=torch.bfloat16)
        >>> opt.initialize_state(p, False)
        >>> state_bytes_per_param(opt)
        6.0
    """
    total = 0
    numel = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            numel += p.numel()
            for value in optimizer.state.get(p, {}).values():
                # per-element state (block-scaled int4 codes are half as many bytes as
                # elements); 0-d step counters are not
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    total += _stored_bytes(value)
    scales: dict[Any, dict[str, torch.Tensor]] = getattr(optimizer, "scales", {})
    total += sum(s.numel() * s.element_size() for per in scales.values() for s in per.values())
    return total / max(numel, 1)


def _stored_bytes(value: torch.Tensor) -> int:
    """The bytes a state tensor holds: a wrapper subclass (torchao's 8-bit and FP8 state)
    holds its inner tensors, whatever dtype it shows outside."""
    flatten = getattr(value, "__tensor_flatten__", None)
    if type(value) is torch.Tensor or flatten is None:
        return value.numel() * value.element_size()
    names, _ = flatten()
    return sum(_stored_bytes(getattr(value, name)) for name in names)


#: The tensors' size is a multiple of this: torchao quantizes a state only when its tensor
#: splits into whole blocks (256 values; 128 for 4 bits), else it keeps FP32 moments.
_WHOLE_BLOCKS = 4096


def _part(numel: int) -> int:
    """The size of each of the four tensors of a ``numel``-parameter model: ``numel / 4``
    rounded down to whole blocks of every peer (at least one block)."""
    return max(_WHOLE_BLOCKS, numel // 4 // _WHOLE_BLOCKS * _WHOLE_BLOCKS)


def _model(dtype: torch.dtype, numel: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    part = _part(numel)
    return [torch.nn.Parameter(torch.randn(part, generator=gen).to(dtype)) for _ in range(4)]


def _triad(numel: int) -> Callable[[], float]:
    """A STREAM-like triad ``a = a + s * b`` over two FP32 arrays of ``2 * numel`` elements
    (a working set like the optimizer's, far beyond the caches at the sizes measured); one
    call returns the bytes per second it moved (12 bytes per element: two reads, one write
    into an array it just read, so no write-allocate traffic, like an in-place step)."""
    a = torch.rand(2 * numel)
    b = torch.rand(2 * numel)

    def call() -> float:
        start = time.perf_counter()
        a.add_(b, alpha=1e-9)
        return 12 * a.numel() / (time.perf_counter() - start)

    return call


@attrs.frozen
class _Timed:
    best_ms: float
    median_ms: float  # of the configuration's rounds
    fused_ms: float
    deepspeed_ms: float | None
    bandwidth: float  # best triad bytes per second during the rounds
    state_bytes: float
    # torchao's peer of the same bits (Config.torchao), stepped in the same rounds
    torchao_ms: float | None = None
    # best process CPU time (all threads) of the steps in the same rounds: "row", "fused" and
    # "deepspeed" / "torchao" where stepped; what other processes' load inflates less
    cpu_ms: dict[str, float] | None = None


def _time_config(
    config: Config, numel: int, rounds: int, peer: Factory | None, triad: Callable[[], float],
    torchao: Config | None = None,
) -> _Timed:  # fmt: skip
    """Steps the configuration, torch's fused AdamW (same dtype), DeepSpeedCPUAdam (FP32),
    torchao's peer of the same bits (``torchao``, on its own dtype) and the triad in turn,
    ``rounds`` times after a warm-up round; best of each."""
    makers: list[Factory] = [config.factory, lambda ps: torch.optim.AdamW(ps, fused=True)]
    dtypes = [config.dtype, config.dtype]
    slots: dict[str, int] = {}
    if peer is not None:
        slots["deepspeed"] = len(makers)
        makers.append(peer)
        dtypes.append(FP32)
    if torchao is not None:
        slots["torchao"] = len(makers)
        makers.append(torchao.factory)
        dtypes.append(torchao.dtype)
    runs = []
    for make, dtype in zip(makers, dtypes, strict=True):
        params = _model(dtype, numel)
        runs.append((make(params), params))
    grads = {
        dtype: [torch.randn(_part(numel), generator=torch.Generator().manual_seed(i)).to(dtype)
                for i in range(2)]
        for dtype in set(dtypes)
    }  # fmt: skip
    times: list[list[float]] = [[] for _ in runs]
    cpu: list[list[float]] = [[] for _ in runs]
    bandwidth = 0.0
    for i in range(rounds + 1):
        for k, (opt, params) in enumerate(runs):
            for j, p in enumerate(params):
                p.grad = grads[p.dtype][(i + j) % 2]
            chosen = k == 0 and config.loops is not None
            if chosen:
                cpu_kernel.use_loops(config.loops)
            start, start_cpu = time.perf_counter(), time.process_time()
            opt.step()
            elapsed, cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
            if chosen:
                cpu_kernel.use_loops()
            if i > 0:  # the first step also allocates the state
                times[k].append(elapsed)
                cpu[k].append(cpu_s)
        bandwidth = max(bandwidth, triad())
    nbytes = state_bytes_per_param(runs[0][0])
    del runs, grads
    gc.collect()
    best = {name: min(times[k]) * 1e3 for name, k in slots.items()}
    best_cpu = {name: min(cpu[k]) * 1e3 for name, k in {"row": 0, "fused": 1, **slots}.items()}
    return _Timed(
        min(times[0]) * 1e3, statistics.median(times[0]) * 1e3, min(times[1]) * 1e3,
        best.get("deepspeed"), bandwidth, nbytes, best.get("torchao"), best_cpu,
    )  # fmt: skip


def _cpu_hz() -> float | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return float(line.split(":")[1]) * 1e6
    except (OSError, ValueError):
        pass
    return None


def _rows() -> tuple[list[Config], list[str]]:
    """Our configurations this CPU runs (a loop family it lacks is a skip reason) and the
    peers that run here (the others are skip reasons)."""
    families = cpu_kernel.status().loop_families
    rows, skipped = [], []
    for config in CONFIGS:
        if config.loops is None or config.loops in families:
            rows.append(config)
        else:
            skipped.append(f"{config.label} skipped: this CPU runs {', '.join(families)}")
    found, peer_skips = peers()
    rows += [Config(p.label, p.dtype, p.factory, p.bytes_moved, p.traffic, group=p.group)
             for p in found]  # fmt: skip
    return rows, skipped + peer_skips


def _quality(config: Config) -> float:
    if config.loops is None:
        return quality_loss(config.factory, config.dtype)
    cpu_kernel.use_loops(config.loops)
    try:
        return quality_loss(config.factory, config.dtype)
    finally:
        cpu_kernel.use_loops()


_DEEPSPEED_FP32 = "DeepSpeedCPUAdam (FP32)"
# One cell of the measurements: (parameters, threads) -> label -> x torch fused.
_Cells = dict[tuple[int, int], dict[str, float]]
# A row of the targets table and (size, configuration, reasons it missed: "" when met).
_Verdict = tuple[str, tuple[str, str, str]]


@attrs.frozen
class _Spec:
    """What the page needs of a :class:`Config` (no factory: it is read back from JSON)."""

    label: str
    dtype: str  # "float32", "bfloat16"
    bytes_moved: float
    traffic: str
    target: float | None = None
    loops: str | None = None
    group: str | None = None
    torchao: str | None = None


def _spec(config: Config) -> dict[str, Any]:
    return {
        "label": config.label,
        "dtype": str(config.dtype).removeprefix("torch."),
        "bytes_moved": config.bytes_moved,
        "traffic": config.traffic,
        "target": config.target,
        "loops": config.loops,
        "group": config.group,
        "torchao": config.torchao,
    }


def collect(quick: bool = False, sizes: list[int] | None = None) -> dict[str, Any]:
    """Measures every configuration and peer and returns the rows (``sizes`` overrides the
    parameter counts, e.g. for a smoke test).

    Example:
        >>> from wrapped_optim._bench.precision_adam import collect
        >>> collect(quick=True)["cells"][0]["params"]  # doctest: +SKIP
        1000000
    """
    if sizes is None:
        sizes = [1_000_000] if quick else [10_000_000, 50_000_000]
    rounds = {n: 4 if n >= 50_000_000 else 8 for n in sizes}
    default_threads = torch.get_num_threads()
    thread_counts = [1, 2] if (os.cpu_count() or 1) >= 2 else [1]
    kernel = cpu_kernel.status()
    rows, skipped = _rows()
    deepspeed = next((c.factory for c in rows if c.label == _DEEPSPEED_FP32), None)
    by_label = {c.label: c for c in rows}
    load_before = os.getloadavg()
    cells = []
    try:
        # The quality problem is small: one thread, which a loaded machine slows least.
        torch.set_num_threads(1)
        reference = quality_loss(lambda ps: torch.optim.AdamW(ps, foreach=False), FP32)
        quality = {c.label: _quality(c) / reference for c in rows}
        for numel in sizes:
            for t in thread_counts:
                torch.set_num_threads(t)
                triad = _triad(numel)
                results = [
                    attrs.asdict(_time_config(c, numel, rounds[numel], deepspeed, triad,
                                              by_label.get(c.torchao or "")))
                    for c in rows
                ]  # fmt: skip
                del triad
                gc.collect()
                cells.append({"params": numel, "threads": t, "rounds": rounds[numel],
                              "results": results})  # fmt: skip
    finally:
        torch.set_num_threads(default_threads)
    return {
        "torch": torch.__version__,
        "processor": platform.processor() or platform.machine(),
        "hz": _cpu_hz(),
        "cpus": os.cpu_count(),
        "thread_counts": thread_counts,
        "kernel": {
            "available": kernel.available,
            "library": kernel.library.name if kernel.library else None,
            "reason": kernel.reason,
            "loops": kernel.loops,
            "loop_families": list(kernel.loop_families),
        },
        "configs": [_spec(c) for c in rows],
        "skipped": skipped,
        "quality": quality,
        "load": [load_before[0], os.getloadavg()[0]],
        "cells": cells,
    }


def _measured(data: dict[str, Any]) -> list[tuple[int, int, list[tuple[_Spec, _Timed]]]]:
    """(parameters, threads, [(configuration, timings)]) of every cell of ``data``."""
    specs = [_Spec(**c) for c in data["configs"]]
    return [
        (cell["params"], cell["threads"],
         [(spec, _Timed(**r)) for spec, r in zip(specs, cell["results"], strict=True)])
        for cell in data["cells"]
    ]  # fmt: skip


#: The configurations the headline speaks for, first found first.
_HEADLINE = (TARGET_CONFIG, "ours FP8 moments")


def headline(data: dict[str, Any]) -> str:
    """The topic's result in one sentence: at the largest size and thread count measured,
    our bf16- and FP8-moment steps against torch's fused FP32 step and its 8 bytes of state
    per parameter.

    Example:
        >>> timed = {"median_ms": 2.0, "fused_ms": 1.0, "deepspeed_ms": None,
        ...          "bandwidth": 1e10}
        >>> data = {"configs": [
        ...     {"label": TARGET_CONFIG, "dtype": "float32", "bytes_moved": 20, "traffic": ""},
        ...     {"label": "ours FP8 moments", "dtype": "float32", "bytes_moved": 22,
        ...      "traffic": ""}],
        ...     "cells": [{"params": 10**7, "threads": 2, "results": [
        ...         dict(timed, best_ms=0.8, state_bytes=4.0),
        ...         dict(timed, best_ms=1.38, state_bytes=2.0)]}]}
        >>> from textwrap import fill
        >>> print(fill(headline(data), 80))
        At 10M parameters, 2 threads: bf16 moments step in 0.80x torch's fused AdamW
        time with 4.0 bytes of state per parameter instead of 8; FP8 moments 1.38x with
        2.0.
    """
    numel, t, results = _measured(data)[-1]
    found = {spec.label: r for spec, r in results}
    parts = []
    for label, name in zip(_HEADLINE, ("bf16 moments", "FP8 moments"), strict=True):
        if label in found:
            r = found[label]
            parts.append((name, r.best_ms / r.fused_ms, r.state_bytes))
    if not parts:
        return f"At {numel / 1e6:g}M parameters no PrecisionAwareAdamW configuration ran."
    (name, ratio, state), *rest = parts
    text = (
        f"At {numel / 1e6:g}M parameters, {t} thread{'s' if t > 1 else ''}: {name} step in "
        f"{ratio:.2f}x torch's fused AdamW time with {state:.1f} bytes of state per parameter "
        "instead of 8"
    )
    text += "".join(f"; {n} {x:.2f}x with {b:.1f}" for n, x, b in rest)
    return text + "."


def render(data: dict[str, Any]) -> str:
    """The Markdown section of :func:`collect`'s ``data``.

    Example:
        >>> render.__name__
        'render'
    """
    kernel, hz, thread_counts = data["kernel"], data["hz"], data["thread_counts"]
    loops = (
        f"fp16/FP8 moments run the {kernel['loops']} loops unless a row names others; this CPU "
        f"runs {', '.join(kernel['loop_families'])}"
    )
    kernel_line = (
        f"CPU kernel: built ({kernel['library'] or '?'}; {loops})."
        if kernel["available"]
        else f"CPU kernel: unavailable ({kernel['reason']}); its rows fall back to torch ops."
    )
    specs = [_Spec(**c) for c in data["configs"]]
    lines = [
        "## PrecisionAwareAdamW vs torch and its peers, against the memory-bandwidth floor",
        "",
        f"**{headline(data)}**",
        "",
        f"torch {data['torch']}, {data['processor']}"
        f"{f' at {hz / 1e9:.2f} GHz' if hz else ''}, {' and '.join(map(str, thread_counts))} "
        "thread(s). Model: four equal parameter tensors (n / 4 rounded down to a multiple of "
        "4096 elements, so that torchao quantizes their state: it keeps FP32 moments for a "
        "tensor that does not split into its whole blocks), fresh gradients each step. Every "
        "configuration is stepped in rounds (8 at 1M and 10M parameters, 4 at 50M, after a "
        "warm-up round that also allocates the state), each round also stepping torch's "
        "`AdamW(fused=True)` on parameters of the same dtype, DeepSpeedCPUAdam on FP32 "
        "parameters and a STREAM-like triad (`a += s * b` over two FP32 arrays of 2n "
        "elements, 12 bytes per element) that measures the memory bandwidth at that moment; "
        "each figure is the best of its rounds (the median is shown too). `x torch fused`, "
        "`x DeepSpeed` and `x torchao same bits` divide a row's best time by the peer's best "
        "in the same rounds; `x torchao same bits` is torchao's optimizer with moments of "
        "the row's bits, stepped in its rounds too (int8 blocks: `AdamW8bit`; FP8 blocks "
        "and per-tensor FP8: `AdamWFp8`; int4 blocks: `AdamW4bit`; bf16-param 8-bit rows: "
        "`AdamW8bit` with bf16 stochastic rounding). The last column gives the same three "
        "ratios by the process's CPU time around each step (`time.process_time`, all its "
        "threads; best of the same rounds), which other processes' load inflates less than "
        "the wall time: time slices lost to them are not counted, spinning OpenMP workers "
        "are. `bytes` is what a "
        "step must move per parameter (each stored operand read once, each updated one "
        "written once; per-tensor fp16/FP8 moments take two passes, the first reading only "
        "what the new amax needs; block-scaled moments take one, their scales beside each "
        "block); `x floor` is the best time over `bytes * n / bandwidth`; `cycles` is "
        "CPU cycles per parameter (best time x clock x threads / n; with `bytes`, what "
        "tells a memory-bound row from a compute-bound one); `loss x FP32` is the "
        f"training loss after {QUALITY_STEPS} steps (lr 1e-3) of a 64-256-64 tanh network "
        "fitting a random teacher on one thread, with parameters in the row's dtype, over "
        "the loss of torch's FP32 AdamW on FP32 parameters (1.00: as good; a wrong or imprecise "
        "optimizer shows here however fast it is). "
        + kernel_line
        + " Peers: "
        + (", ".join(c.label for c in specs if c.group and not c.label.startswith("ours"))
           or "none")
        + ".",
        "",
        *[f"- {reason}" for reason in data["skipped"]],
        *([""] if data["skipped"] else []),
    ]  # fmt: skip
    verdicts: list[_Verdict] = []
    cells: _Cells = {}
    tables: list[str] = []
    for numel, t, results in _measured(data):
        tables += _size_table(numel, t, results, hz, data["quality"], verdicts)
        cells[numel, t] = {c.label: r.best_ms / r.fused_ms for c, r in results}
    load_before, load_after = data["load"]
    head, method = lines[:4], lines[4:]  # title and headline; how it was measured
    lines = [
        *head,
        *_class_table(specs, cells, data["quality"]),
        *method,
        *tables,
        f"Machine load (1-minute load average, {data['cpus']} CPUs) at the start and the "
        f"end: {load_before:.1f} and {load_after:.1f}: other processes shared the "
        "cores, which the interleaved rounds and best-of-N figures spread over all rows alike. "
        "When the load exceeds the cores, the CPU kernel's default thread count drops (it "
        "leaves the cores others hold) while torch's fused step, DeepSpeed and torchao keep "
        "theirs: in the 2-thread cells of a loaded run our kernel rows may step on one thread "
        "against peers whose two threads wait for each other; the 1-thread cells compare "
        "like with like.",
        "",
        "How: torch's fused AdamW needs parameter, gradient and moments in one dtype. The "
        "compiled kernel (`wrapped_optim.optimizers.kernels.cpu_kernel`, C built "
        "at first use with the "
        "system compiler, AVX-512/AVX2/baseline clones, no floating-point contraction so every "
        "clone gives the same bits) reads each stored operand once in its own format, applies "
        "TE's update in FP32 and writes back: 20 bytes per parameter for bf16 moments against "
        "28 for torch's all-FP32 step. fp16/FP8 moments take two passes: the first computes "
        "the new moments only to find their amax (the new per-tensor scale needs the whole "
        "tensor), the second redoes the same arithmetic and encodes with the new scales, so "
        "memory stays bounded and the bits equal the codecs'. Those passes run hand-written "
        "loops: AVX-512 (VBMI byte tables, 16 FP32 lanes) or AVX2 (F16C, a byte-shuffle table, "
        "8 lanes; the `AVX2 loops` rows force them on an AVX-512 machine with "
        "`cpu_kernel.use_loops`), bitwise equal to the portable loops the `portable loops` "
        'row runs. Block-scaled moments (`block_moments="int8"`, `"fp8"`, '
        '`"int4"`: one FP32 scale per 256 values, 128 for int4) take one pass: each block '
        "is decoded, updated and encoded under its own new amax, with AVX-512 and AVX2 loops "
        "of their own. Without the kernel (`cpu_kernel=False`, or no C compiler) each slice is "
        "expanded to FP32, updated by torch's fused kernel and re-encoded: several extra "
        "passes.",
        "",
        "Reproduce: `wrapped-optim bench precision_adam --out DIR` (`--quick`: 1M parameters "
        "only). The peers' rows need "
        "`pip install 'wrapped-optim[bench]' torch==2.13.0` (torchao, bitsandbytes, "
        "torch-optimi, deepspeed) and a C++ compiler; a peer that is missing or fails is "
        "listed as skipped with the reason.",
        "",
    ]
    return "\n".join(lines)


def targets(data: dict[str, Any]) -> str:
    """The project's performance targets for this topic, met or missed, with the reason of
    each miss: Markdown for the contributors' page, not the users' one.

    Example:
        >>> targets.__name__
        'targets'
    """
    hz = data["hz"]
    verdicts: list[_Verdict] = []
    for numel, t, results in _measured(data):
        _size_table(numel, t, results, hz, data["quality"], verdicts)
    return "\n".join(
        [
            "## PrecisionAwareAdamW",
            "",
            "bf16 moments: <= 0.85x torch's fused FP32 step and <= 1.2x the floor; fp16/FP8 "
            "moments: <= 1.3x torch fused with the AVX-512 loops, <= 1.5x with the AVX2 loops; "
            "block-scaled moments (one pass): int8 and FP8 blocks <= 0.8x torch fused, int4 "
            "blocks <= 0.7x; FP32 state at or below DeepSpeedCPUAdam's time; "
            "every kernel configuration faster than DeepSpeedCPUAdam (stepped in the same "
            "rounds), or the gap explained by "
            "bytes moved and cycles per parameter. A missed target's reason is listed under "
            "the table.",
            "",
            "| size | threads | configuration | x fused | x floor | vs DeepSpeed | cycles "
            "| verdict |",
            "|---|---:|---|---:|---:|---:|---:|---|",
            *[row for row, _ in verdicts],
            "",
            *[f"- {size}, {label}: {reason}" for _, (size, label, reason) in verdicts if reason],
            "",
        ]
    )


def run(quick: bool = False, sizes: list[int] | None = None) -> str:
    """Measure every configuration and peer; return a Markdown section with the tables
    (``sizes`` overrides the parameter counts, e.g. for a smoke test).

    Example:
        >>> from wrapped_optim._bench.precision_adam import run
        >>> run(quick=True).startswith("## PrecisionAwareAdamW")  # doctest: +SKIP
        True
    """
    return render(collect(quick, sizes))


def plots(data: dict[str, Any], out_dir: Path | str) -> list[Path]:
    """``precision_adam_step.png``: at the largest size and thread count measured, the step
    time against torch's fused AdamW and the state kept per parameter of what a user
    compares: on FP32 parameters, ours in each storage format and every peer (the loop-family
    and no-kernel variants are in the tables only). Needs matplotlib.

    Example:
        >>> import tempfile
        >>> data = {"configs": [{"label": TARGET_CONFIG, "dtype": "float32",
        ...                      "bytes_moved": 20, "traffic": ""}],
        ...         "cells": [{"params": 10**6, "threads": 1, "results": [
        ...             {"best_ms": 0.8, "median_ms": 0.9, "fused_ms": 1.0,
        ...              "deepspeed_ms": None, "bandwidth": 1e10, "state_bytes": 4.0}]}]}
        >>> [p.name for p in plots(data, tempfile.mkdtemp())]
        ['precision_adam_step.png']
    """
    numel, t, results = _measured(data)[-1]
    shown = [(spec, r) for spec, r in results if _compared(spec)] or results
    labels = [spec.label for spec, _ in shown]
    where = f"{numel / 1e6:g}M FP32 parameters, {t} thread{'s' if t > 1 else ''}"
    time = Panel(
        f"Step time, x torch's AdamW(fused=True) ({where}; lower is faster)",
        labels,
        {"best of the rounds": [r.best_ms / r.fused_ms for _, r in shown]},
        "x torch's fused step (log scale)",
        anchor=("torch fused = 1", 1.0),
        log=True,
    )
    # torchao keeps its 8-bit state in tensor subclasses; rows measured before
    # state_bytes_per_param read their inner tensors count them at the outer dtype's size.
    kept = [(spec, r) for spec, r in shown if not spec.label.startswith("torchao")]
    memory = Panel(
        "Optimizer state kept, bytes per parameter (lower is smaller; torchao not measured)",
        [spec.label for spec, _ in kept],
        {"state": [r.state_bytes for _, r in kept]},
        "bytes per parameter",
        anchor=("torch AdamW: 8", 8.0),
    )
    return [bar_panels(Path(out_dir) / "precision_adam_step.png", [time, memory])]


#: Rows that vary an implementation detail (loop family, kernel off): on the page, not the figure.
_DETAIL_ROWS = ("AVX2 loops", "portable loops", "no CPU kernel")


def _compared(spec: _Spec) -> bool:
    """A row the figure shows: FP32 parameters (torch's fused step's own case), ours in the
    configurations a user picks and the peers, not the implementation-detail variants."""
    return spec.dtype == "float32" and not any(word in spec.label for word in _DETAIL_ROWS)


def _size_table(
    numel: int, t: int, results: list[tuple[_Spec, _Timed]], hz: float | None,
    quality: dict[str, float], verdicts: list[_Verdict],
) -> list[str]:  # fmt: skip
    """The table of one size and thread count (appending each row's verdict)."""
    bandwidth = max(r.bandwidth for _, r in results)
    ds = [r.deepspeed_ms for _, r in results if r.deepspeed_ms is not None]
    ds_ms = min(ds) if ds else None
    fp32_fused = min(r.fused_ms for c, r in results if c.dtype == "float32")
    lines = [
        f"### {numel / 1e6:g}M parameters, {t} thread{'s' if t > 1 else ''}",
        "",
        f"Triad bandwidth: {bandwidth / 1e9:.2f} GB/s. torch fused AdamW (FP32, 28 bytes): "
        f"{fp32_fused:.1f} ms, x floor {fp32_fused / (28 * numel / bandwidth * 1e3):.2f}."
        + (
            f" DeepSpeedCPUAdam (FP32, 28 bytes): {ds_ms:.1f} ms, x floor "
            f"{ds_ms / (28 * numel / bandwidth * 1e3):.2f}."
            if ds_ms is not None else ""
        ),
        "",
        "| configuration | param dtype | bytes | best / median ms | x torch fused | x floor "
        "| x DeepSpeed | x torchao same bits | cycles | state B/param | loss x FP32 "
        "| CPU time x fused / DeepSpeed / torchao |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for config, r in results:
        floor_ms = config.bytes_moved * numel / bandwidth * 1e3
        x_fused = r.best_ms / r.fused_ms
        # DeepSpeed and torchao as stepped in this row's own rounds
        x_ds = "n/a" if r.deepspeed_ms is None else f"{r.best_ms / r.deepspeed_ms:.2f}"
        x_ao = "" if r.torchao_ms is None else f"{r.best_ms / r.torchao_ms:.2f}"
        cycles = r.best_ms * 1e-3 * hz * t / numel if hz else None
        lines.append(
            f"| {config.label} | {config.dtype} | "
            f"{config.bytes_moved:g} | {r.best_ms:.1f} / {r.median_ms:.1f} | "
            f"{x_fused:.2f} | {r.best_ms / floor_ms:.2f} | {x_ds} | {x_ao} | "
            f"{'n/a' if cycles is None else f'{cycles:.1f}'} | {r.state_bytes:.2f} | "
            f"{quality[config.label]:.2f} | {_cpu_ratios(r.cpu_ms)} |"
        )
        verdict = _verdict(config, numel, t, x_fused, r.best_ms / floor_ms, r.best_ms,
                           r.deepspeed_ms, cycles)  # fmt: skip
        if verdict is not None:
            verdicts.append(verdict)
    return [*lines, ""]


def _cpu_ratios(cpu_ms: dict[str, float] | None) -> str:
    """The row's CPU time over the fused step's, DeepSpeed's and torchao's ("-" where one
    was not stepped; empty for rows measured before CPU time was)."""
    if cpu_ms is None:
        return ""
    row = cpu_ms["row"]
    return " / ".join(
        f"{row / cpu_ms[k]:.2f}" if k in cpu_ms else "-" for k in ("fused", "deepspeed", "torchao")
    )


def _span(values: list[float]) -> str:
    if not values:
        return "-"
    low, high = min(values), max(values)
    return f"{low:.2f}" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}"


def _class_table(
    rows: Sequence[Config | _Spec], cells: _Cells, quality: dict[str, float] | None = None
) -> list[str]:
    """Per class, ours (each loop family) and the fastest peer, x torch fused on parameters
    of the same dtype, over every size and thread count measured (the peers of a class in
    :data:`PEER_CLASS` are those of the class it names); with ``quality``, the loss x FP32
    of ours and of the peers named."""
    groups = list(dict.fromkeys(c.group for c in rows if c.group))
    lines = [
        "### Against the peers: step time x torch's fused AdamW (same param dtype)",
        "",
        "Lower is faster; torch's `AdamW(fused=True)` is 1.00. Range over the sizes and "
        "thread counts below; per cell the best of our rows in the "
        "class (the AVX2 column: its `AVX2 loops` rows where the class has hand-written "
        "loops, else the same rows, which do not depend on the loop family) and the best "
        "peer (block-scaled 8-bit classes race the 8-bit peers, whose moments are "
        "block-scaled too)"
        + ("; `loss x FP32`: the quality figure of our rows in the class and of the peers "
           "named." if quality is not None else "."),
        "",
        "| class | ours, AVX-512 loops | ours, AVX2 loops | fastest peer |"
        + (" loss x FP32, ours; peers |" if quality is not None else ""),
        "|---|---:|---:|---|" + ("---|" if quality is not None else ""),
    ]  # fmt: skip
    for group in groups:
        members = [c for c in rows if c.group == group]
        ours = [c for c in members if c.label.startswith("ours")]
        if not ours:
            continue  # a class of peers only (raced by a class of PEER_CLASS)
        native = [c.label for c in ours if c.loops is None]
        avx2 = [c.label for c in ours if c.loops == "avx2"] or native
        classes = {group, PEER_CLASS.get(group, group)}
        rivals = [c for c in rows if c.group in classes]  # not the rows of no class
        others = [c.label for c in rivals if not c.label.startswith("ours")]
        best_peer: list[float] = []
        names: set[str] = set()
        for cell in cells.values():
            if others:
                name = min(others, key=cell.__getitem__)
                names.add(name)
                best_peer.append(cell[name])
        named = " (" + ", ".join(sorted(names)) + ")" if names else ""
        line = (
            f"| {group} | {_span([min(cell[x] for x in native) for cell in cells.values()])} | "
            f"{_span([min(cell[x] for x in avx2) for cell in cells.values()])} | "
            f"{_span(best_peer)}{named} |"
        )
        if quality is not None:
            peers = _span([quality[n] for n in sorted(names)])
            line += f" {_span([quality[x] for x in native])}; {peers} |"
        lines.append(line)
    return [*lines, ""]


def _verdict(
    config: _Spec, numel: int, threads: int, x_fused: float, x_floor: float, best_ms: float,
    ds_ms: float | None, cycles: float | None,
) -> _Verdict | None:  # fmt: skip
    """A row of the targets table for configurations that run in the kernel (and ours with
    FP32 state, whose target is DeepSpeedCPUAdam's time), and the reasons a missed target
    was missed (listed under the table)."""
    if config.target is None and config.label != FP32_STATE:
        return None
    reasons = []
    if config.target is not None and x_fused > config.target:
        reasons.append(
            f"x fused {x_fused:.2f} > {config.target}: {config.bytes_moved:g} bytes/param at "
            f"{x_floor:.2f}x the floor, compute-bound at "
            f"{'n/a' if cycles is None else f'{cycles:.1f}'} cycles/param"
        )
    if config.label == TARGET_CONFIG and x_floor > 1.2:
        reasons.append(f"x floor {x_floor:.2f} > 1.2")
    vs_ds = "n/a"
    if ds_ms is not None:
        vs_ds = f"{best_ms / ds_ms:.2f}"
        if best_ms > ds_ms:
            reasons.append(
                f"{best_ms / ds_ms:.2f}x DeepSpeed's time in the same rounds, moving "
                f"{config.bytes_moved:g} bytes/param against its 28, at "
                f"{'n/a' if cycles is None else f'{cycles:.1f}'} cycles/param "
                f"({x_floor:.2f}x its floor)"
            )
    size = f"{numel / 1e6:g}M, {threads} thread{'s' if threads > 1 else ''}"
    row = (
        f"| {numel / 1e6:g}M | {threads} | {config.label} | {x_fused:.2f} | {x_floor:.2f} | "
        f"{vs_ds} | {'n/a' if cycles is None else f'{cycles:.1f}'} | "
        f"{'missed' if reasons else 'met'} |"
    )
    return row, (size, config.label, "; ".join(reasons))


#: The rows of :func:`side_by_side`: ours (by label; ", AVX2 loops" runs the AVX2 family)
#: and the 8-bit and 4-bit peers, each beside torch's fused FP32 step.
SIDE_BY_SIDE = (
    "ours fp32 state", "ours FP8 moments", "ours FP8 moments, AVX2 loops",
    "ours int8 block moments", "ours int8 block moments, AVX2 loops", "ours FP8 block moments",
    "ours FP8 block moments, AVX2 loops", "ours int4 block moments",
    "ours int4 block moments, AVX2 loops", "torchao AdamW8bit", "torchao AdamW4bit",
    "torchao AdamWFp8 (FP8 moments)", "bitsandbytes AdamW8bit", _DEEPSPEED_FP32,
)  # fmt: skip


def _side_rows() -> tuple[list[Config], list[str]]:
    rows, skipped = _rows()
    by_label = {c.label: c for c in rows}
    families = cpu_kernel.status().loop_families
    chosen = []
    for label in SIDE_BY_SIDE:
        base, _, avx2 = label.partition(", AVX2 loops")
        if label in by_label:
            chosen.append(by_label[label])
        elif avx2 == "" and base in by_label and "avx2" in families:
            chosen.append(attrs.evolve(by_label[base], label=label, loops="avx2"))
        elif not any(label in s for s in skipped):
            skipped.append(f"{label} skipped: not run here")
    return chosen, skipped


def side_by_side(
    sizes: Sequence[int] = (10_000_000, 50_000_000), rounds: int = 6, quality: bool = True
) -> str:
    """One thread (torch's and the kernel's), every :data:`SIDE_BY_SIDE` row and torch's fused
    FP32 AdamW stepped in turn round by round: a Markdown table of each row's best thread CPU
    time (``time.thread_time``: what a busy machine inflates least) and best wall time, both
    over the fused step's, with its state bytes and quality (loss over FP32 AdamW's; left
    out, as nan, with ``quality=False``: it takes longer than the timing on a busy machine).

    Example:
        >>> from wrapped_optim._bench.precision_adam import side_by_side
        >>> print(side_by_side([1_000_000], rounds=2))  # doctest: +SKIP
    """
    rows, skipped = _side_rows()
    losses: dict[str, float] = {}
    if quality:
        reference = quality_loss(lambda ps: torch.optim.AdamW(ps, foreach=False), FP32)
        losses = {c.label: _quality(c) / reference for c in rows}
    fused = Config("torch AdamW fused (FP32)", FP32,
                   lambda ps: torch.optim.AdamW(ps, fused=True), 28, _FP32_TRAFFIC)  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    lines = [
        "| params | configuration | cpu ms | x fused (cpu) | wall ms | x fused (wall) | "
        "cycles/param (cpu) | bytes/param | state B/param | loss x FP32 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    hz = _cpu_hz() or 0.0
    try:
        for numel in sizes:
            runs = []
            for config in [fused, *rows]:
                params = _model(config.dtype, numel)
                runs.append((config, config.factory(params), params))
            grads = {
                d: [torch.randn(_part(numel), generator=torch.Generator().manual_seed(i)).to(d)
                    for i in range(2)]
                for d in {c.dtype for c, _, _ in runs}
            }  # fmt: skip
            cpu: list[list[float]] = [[] for _ in runs]
            wall: list[list[float]] = [[] for _ in runs]
            for i in range(rounds + 1):
                for k, (config, opt, params) in enumerate(runs):
                    for j, p in enumerate(params):
                        p.grad = grads[p.dtype][(i + j) % 2]
                    if config.loops is not None:
                        cpu_kernel.use_loops(config.loops)
                    start, start_cpu = time.perf_counter(), time.thread_time()
                    opt.step()
                    cpu_s, wall_s = time.thread_time() - start_cpu, time.perf_counter() - start
                    if config.loops is not None:
                        cpu_kernel.use_loops()
                    if i > 0:  # the first step also allocates the state
                        cpu[k].append(cpu_s * 1e3)
                        wall[k].append(wall_s * 1e3)
            base_cpu, base_wall = min(cpu[0]), min(wall[0])
            for k, (config, opt, _) in enumerate(runs):
                c, w = min(cpu[k]), min(wall[k])
                loss = losses.get(config.label, 1.0 if k == 0 else float("nan"))
                lines.append(
                    f"| {numel // 1_000_000}M | {config.label} | {c:.1f} | {c / base_cpu:.2f} | "
                    f"{w:.1f} | {w / base_wall:.2f} | {c * 1e-3 * hz / numel:.2f} | "
                    f"{config.bytes_moved:g} | {state_bytes_per_param(opt):.2f} | {loss:.3f} |"
                )
            del runs, grads
            gc.collect()
    finally:
        torch.set_num_threads(threads)
    load = os.getloadavg()[0]
    notes = [f"{s}" for s in skipped if any(label in s for label in SIDE_BY_SIDE)]
    return "\n".join([*lines, "", f"load average after: {load:.1f}; clock {hz / 1e9:.2f} GHz",
                      *notes])  # fmt: skip


def main() -> None:
    """Command-line entry point: print the Markdown section."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one small size, few rounds")
    parser.add_argument(
        "--side-by-side", action="store_true",
        help="one thread: ours and the 8-/4-bit peers beside torch's fused step, thread CPU "
        "and wall time (10M and 50M parameters; 1M with --quick)",
    )  # fmt: skip
    parser.add_argument("--no-quality", action="store_true", help="side by side: no loss column")
    args = parser.parse_args()
    if args.side_by_side:
        sizes = [1_000_000] if args.quick else [10_000_000, 50_000_000]
        print(side_by_side(sizes, 2 if args.quick else 6, quality=not args.no_quality))
        return
    print(run(quick=args.quick))


if __name__ == "__main__":
    main()
