"""Benchmark: extra device memory and time of staged vs unstaged optimizer checkpoints.

For models of 10M to 200M parameters (quick mode: up to 50M), each with one very large
embedding, a ``PrecisionAwareAdamW`` with bf16 ``exp_avg`` and fp16 ``exp_avg_sq`` is
checkpointed three ways:

* unstaged -- the bare optimizer: every FP32 expansion stays on the device until the state
  dict is dropped; loading quantizes each whole FP32 tensor on the device;
* whole-tensor -- staging one expansion at a time to the host (the only option for holders
  without the chunk API, e.g. TE FusedAdam);
* chunked -- :class:`~wrapped_optim.StagedCheckpointOptimizer`: one ``chunk_bytes`` scratch
  on the device, decoded into host buffers; loads quantize chunk by chunk.

Peak extra device bytes come from :class:`~wrapped_optim.testing.probe.DeviceMemoryProbe`.
On a CPU that is the staging engine's ledger; the unstaged baseline is put on the ledger by
:func:`~wrapped_optim.testing.probe.count_unstaged_expansions` (expansions while alive; for
loads, one whole FP32 tensor per ``set_scaled_state`` call, a lower bound). The CUDA
figures come from ``python -m tests.gpu.gpu_staged``.
Run: ``python -m wrapped_optim._bench.staged``.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import torch

from wrapped_optim._bench._figures import Panel, bar_panels
from wrapped_optim._staging.engine import staged_save
from wrapped_optim.staged import StagedCheckpointOptimizer
from wrapped_optim.testing.probe import DeviceMemoryProbe, count_unstaged_expansions

MiB = 1 << 20
HIDDEN = 1024
EMBEDDING_SHARE = 0.4


def build_model_optimizer(
    total_params: int, *, device: str = "cpu", seed: int = 0
) -> tuple[Any, list[torch.nn.Parameter]]:
    """A model of about ``total_params`` FP32 parameters (40% in one embedding) and its
    ``PrecisionAwareAdamW`` with random bf16/fp16 moments.

    Example:
        >>> opt, params = build_model_optimizer(3_000)
        >>> sum(p.numel() for p in params) >= 3_000
        True
    """
    from wrapped_optim.optimizers import PrecisionAwareAdamW

    gen = torch.Generator(device=device).manual_seed(seed)
    rows = max(1, int(total_params * EMBEDDING_SHARE) // HIDDEN)
    shapes: list[tuple[int, ...]] = [(rows, HIDDEN)]
    rest = total_params - rows * HIDDEN
    while rest >= HIDDEN * HIDDEN:
        shapes.append((HIDDEN, HIDDEN))
        rest -= HIDDEN * HIDDEN
    if rest > 0:
        shapes.append((rest,))
    params = [
        torch.nn.Parameter(torch.randn(s, generator=gen, device=device) * 0.02) for s in shapes
    ]
    opt = PrecisionAwareAdamW(
        params, lr=1e-4, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.float16
    )
    for p in params:
        m = torch.randn(p.shape, generator=gen, device=device).mul_(1e-3)
        opt.set_scaled_state(p, "exp_avg", m)
        del m
        v = torch.rand(p.shape, generator=gen, device=device).mul_(1e-6)
        opt.set_scaled_state(p, "exp_avg_sq", v)
        del v
    for group in opt.param_groups:
        group["step"] = 10
    return opt, params


def whole_tensor_state_dict(opt: Any, chunk_bytes: int) -> Any:
    """``opt.state_dict()`` with whole-tensor staging, even if ``opt`` has the chunk API.

    Example:
        >>> import torch
        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> sorted(whole_tensor_state_dict(sgd, 1 << 20))
        ['param_groups', 'state']
    """
    with staged_save(opt, chunk_bytes=chunk_bytes, chunked=False):
        return opt.state_dict()


def _probed(
    fn: Callable[[], Any], device: torch.device, baseline_of: Any = None
) -> tuple[Any, tuple[float, float], int]:
    """Result, (wall seconds, process CPU seconds) and peak extra device bytes of one call
    (``baseline_of``: count the unstaged expansions of that stack on the ledger)."""
    gc.collect()
    observe = count_unstaged_expansions(baseline_of) if baseline_of is not None else nullcontext()
    with DeviceMemoryProbe(device) as probe, observe:
        start, cpu_start = time.perf_counter(), time.process_time()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return result, seconds, probe.peak_extra_bytes


def _rotated(names: list[str], round_index: int) -> list[str]:
    """The modes in the order of one round: each round starts one mode later, so no mode is
    always measured first (after the previous round's frees) or last."""
    shift = round_index % len(names)
    return names[shift:] + names[:shift]


def ratios(row: dict[str, Any], kind: str, mode: str, base: str = "unstaged") -> dict[str, float]:
    """``mode`` over ``base`` time for ``kind`` ("save" or "load") by three estimators.

    ``best``: best wall time over best wall time; ``paired``: the median, over rounds, of the
    ratio of the two calls of one round (measured next to each other, so a busy machine slows
    both alike); ``cpu``: best process CPU time over best process CPU time (all threads; what
    other processes' load changes least).

    Example:
        >>> row = {"save_rounds": {"unstaged": [(1.0, 0.9), (2.0, 1.0)],
        ...                        "chunked": [(1.1, 0.9), (1.8, 1.0)]}}
        >>> ratios(row, "save", "chunked")
        {'best': 1.1, 'paired': 1.0, 'cpu': 1.0}
    """
    a, b = row[f"{kind}_rounds"][mode], row[f"{kind}_rounds"][base]
    paired = statistics.median(x[0] / y[0] for x, y in zip(a, b, strict=True))
    return {
        "best": round(min(x[0] for x in a) / min(y[0] for y in b), 4),
        "paired": round(paired, 4),
        "cpu": round(min(x[1] for x in a) / max(min(y[1] for y in b), 1e-9), 4),
    }


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["state"].keys() == b["state"].keys() and all(
        entry.keys() == b["state"][i].keys()
        and all(
            torch.equal(v, b["state"][i][k]) and v.dtype == b["state"][i][k].dtype
            for k, v in entry.items()
        )
        for i, entry in a["state"].items()
    )


def measure(
    total_params: int, *, chunk_bytes: int, reps: int = 5, check: bool = True
) -> dict[str, Any]:
    """Peak extra device bytes and the times of ``reps`` rounds for one model size.

    Each round runs every mode once, interleaved, in an order rotated from round to round
    (see :func:`ratios` for the estimators); ``save_time`` / ``load_time`` keep the best wall
    time per mode and ``*_rounds`` every (wall, CPU) pair. One state dict is alive at a time
    (two when ``check``).

    Example:
        >>> row = measure(20_000, chunk_bytes=4096, reps=1)
        >>> row["save_peak"]["chunked"] <= 4096
        True
    """
    opt, params = build_model_optimizer(total_params)
    wrapped = StagedCheckpointOptimizer(opt, chunk_bytes=chunk_bytes)
    device = params[0].device
    row: dict[str, Any] = {
        "params": sum(p.numel() for p in params),
        "largest": max(p.numel() for p in params),
        "save_peak": {},
        "save_time": {},
        "load_peak": {},
        "load_time": {},
        "save_rounds": {},
        "load_rounds": {},
        "rounds": reps,
    }

    def record(kind: str, mode: str, seconds: tuple[float, float], peak: int) -> None:
        row[f"{kind}_rounds"].setdefault(mode, []).append(seconds)
        row[f"{kind}_time"][mode] = min(row[f"{kind}_time"].get(mode, float("inf")), seconds[0])
        row[f"{kind}_peak"][mode] = max(row[f"{kind}_peak"].get(mode, 0), peak)

    saves: dict[str, tuple[Callable[[], Any], Any]] = {
        "unstaged": (opt.state_dict, opt),
        "whole": (partial(whole_tensor_state_dict, opt, chunk_bytes), None),
        "chunked": (wrapped.state_dict, None),
    }
    for rep in range(reps):
        reference = None
        for mode in _rotated(list(saves), rep):
            fn, baseline_of = saves[mode]
            result, seconds, peak = _probed(fn, device, baseline_of)
            record("save", mode, seconds, peak)
            if check and rep == 0:
                if reference is None:
                    reference = result
                elif not _same_state(result, reference):
                    raise AssertionError(f"{mode} state dict differs from the first mode's")
            del result
        del reference

    checkpoint = wrapped.state_dict()  # FP32 on the host
    loads: dict[str, tuple[Callable[[], Any], Any]] = {
        "unstaged": (partial(opt.load_state_dict, checkpoint), opt),
        "chunked": (partial(wrapped.load_state_dict, checkpoint), None),
    }
    for rep in range(reps):
        for mode in _rotated(list(loads), rep):
            fn, baseline_of = loads[mode]
            _, seconds, peak = _probed(fn, device, baseline_of)
            record("load", mode, seconds, peak)
    return row


def _mib(nbytes: int) -> str:
    return f"{nbytes / MiB:,.1f}"


def collect(quick: bool = False) -> dict[str, Any]:
    """Measures every size (10M to 200M parameters; ``quick``: up to 50M) and returns the
    rows with the settings they were measured with (JSON-able).

    Example:
        >>> collect.__name__
        'collect'
    """
    sizes = (
        [10_000_000, 25_000_000, 50_000_000]
        if quick
        else [10_000_000, 50_000_000, 100_000_000, 200_000_000]
    )
    chunk_bytes = 4 * MiB
    rounds = 3 if quick else 5
    rows = [
        measure(size, chunk_bytes=chunk_bytes, reps=rounds, check=size <= 50_000_000)
        for size in sizes
    ]
    return {
        "chunk_bytes": chunk_bytes,
        "rounds": rounds,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }


def headline(data: dict[str, Any]) -> str:
    """The topic's result in one sentence, from the largest model measured.

    Example:
        >>> row = {"params": 200e6, "save_peak": {"unstaged": 1600 * MiB, "chunked": 0},
        ...        "load_peak": {"chunked": 4 * MiB},
        ...        "save_rounds": {"unstaged": [(1.0, 1.0)], "chunked": [(0.96, 1.0)]}}
        >>> from textwrap import fill
        >>> print(fill(headline({"chunk_bytes": 4 * MiB, "rows": [row]}), 80))
        Chunked staging at 200M parameters: at most 4.0 MiB of extra device memory (the
        4 MiB chunk) instead of 1,600.0 MiB for an unstaged save, at 0.96x its save
        time.
    """
    r = data["rows"][-1]
    peak = max(r["save_peak"]["chunked"], r["load_peak"]["chunked"])
    return (
        f"Chunked staging at {r['params'] / 1e6:.0f}M parameters: at most {_mib(peak)} MiB of "
        f"extra device memory (the {data['chunk_bytes'] // MiB} MiB chunk) instead of "
        f"{_mib(r['save_peak']['unstaged'])} MiB for an unstaged save, at "
        f"{ratios(r, 'save', 'chunked')['paired']:.2f}x its save time."
    )


def render(data: dict[str, Any]) -> str:
    """The Markdown section of :func:`collect`'s ``data``.

    Example:
        >>> render.__name__
        'render'
    """
    rows, chunk_bytes, rounds = data["rows"], data["chunk_bytes"], data["rounds"]
    lines = [
        "## Staged checkpoints (StagedCheckpointOptimizer)",
        "",
        f"**{headline(data)}**",
        "",
        "PrecisionAwareAdamW, bf16 `exp_avg`, fp16 `exp_avg_sq`, FP32 params; 40% of each",
        f"model is one embedding of width {HIDDEN}; `chunk_bytes` = {chunk_bytes // MiB} MiB;",
        "device: CPU (peak extra device bytes from the staging ledger, see notes); times from",
        f"{rounds} rounds per size, each running every mode once, in an order rotated from",
        f"round to round; torch threads: {data['threads']}.",
        "",
        "### Peak extra device memory (MiB)",
        "",
        "*Load, whole-tensor*: a TE-style loader that takes one whole FP32 tensor per call (a",
        "lower bound).",
        "",
        "| params | largest tensor | save unstaged | save whole-tensor | save chunked "
        "| load, whole-tensor | load chunked |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        sp, lp = r["save_peak"], r["load_peak"]
        lines.append(
            f"| {r['params'] / 1e6:.0f}M | {r['largest'] / 1e6:.1f}M | {_mib(sp['unstaged'])} "
            f"| {_mib(sp['whole'])} | {_mib(sp['chunked'])} | {_mib(lp['unstaged'])} "
            f"| {_mib(lp['chunked'])} |"
        )
    lines += [
        "",
        "### Time",
        "",
        "Ratios to the unstaged call: *paired* is the median over rounds of the two calls' ratio",
        "within one round (neighbours in time see the same machine load), *best* the best wall",
        "time over the best, *CPU* the best process CPU time (all threads) over the best.",
        "",
        "| params | unstaged (s) | whole-tensor (paired) | chunked (paired) | best | CPU |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        whole, chunked = ratios(r, "save", "whole"), ratios(r, "save", "chunked")
        lines.append(
            f"| {r['params'] / 1e6:.0f}M | {r['save_time']['unstaged']:.3f} "
            f"| {whole['paired']:.2f}x | {chunked['paired']:.2f}x | {chunked['best']:.2f}x "
            f"| {chunked['cpu']:.2f}x |"
        )
    lines += [
        "",
        "Loads:",
        "",
        "| params | unstaged (s) | chunked (paired) |",
        "|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['params'] / 1e6:.0f}M | {r['load_time']['unstaged']:.3f} "
            f"| {ratios(r, 'load', 'chunked')['paired']:.2f}x |"
        )
    bound_ok = all(r["save_peak"]["chunked"] <= chunk_bytes for r in rows) and all(
        r["load_peak"]["chunked"] <= chunk_bytes for r in rows
    )
    lines += [
        "",
        f"Chunked peak <= chunk_bytes at every size: **{'yes' if bound_ok else 'NO'}**.",
        "",
        "Notes: on a CPU there is no separate device memory. The ledger counts what the staging",
        "engine keeps on the source device: for saves the scratch and whole expansions it",
        "allocates itself (measured), for chunked loads the one chunk it hands to the holder's",
        "`write_scaled_state_chunked` per call (the holder's contract, not a measurement). The",
        "unstaged save counts every expansion while the bare state dict holds it (measured by",
        "object lifetime). The bare-load column models a whole-tensor loader like TE's: one",
        "whole FP32 tensor on the device per `set_scaled_state` call (a lower bound);",
        "PrecisionAwareAdamW's own `set_scaled_state` already slices its work (at most",
        "max(chunk_numel, 2^20) elements at a time), so its bare load is bounded too, at a size",
        "the wrapper replaces by `chunk_bytes`. PrecisionAwareAdamW loads into its existing",
        "storage, so there is no load-time storage beside it to count.",
        "The time columns are the real bare and wrapped loads of PrecisionAwareAdamW.",
        "Real CUDA figures: `python -m tests.gpu.gpu_staged`.",
        "",
        "Reproduce: `wrapped-optim bench staged --out DIR` (`--quick` for up to 50M).",
        "",
    ]
    return "\n".join(lines)


#: The project's target: a chunked save within this factor of the unstaged one (paired).
SAVE_TARGET = 1.1


def targets(data: dict[str, Any]) -> str:
    """The chunked save's time target per size, met or missed (the contributors' page).

    Example:
        >>> row = {"params": 1e7, "save_rounds": {"unstaged": [(1.0, 1.0)],
        ...                                       "chunked": [(1.2, 1.0)]}}
        >>> print(targets({"rows": [row]}).splitlines()[-1])
        | 10M | 1.20x | missed |
    """
    lines = [
        "## Staged checkpoints",
        "",
        f"A chunked save within {SAVE_TARGET}x of the unstaged one (paired ratio).",
        "",
        "| params | chunked save (paired) | verdict |",
        "|---:|---:|---|",
    ]
    for r in data["rows"]:
        paired = ratios(r, "save", "chunked")["paired"]
        verdict = "met" if paired <= SAVE_TARGET else "missed"
        lines.append(f"| {r['params'] / 1e6:.0f}M | {paired:.2f}x | {verdict} |")
    return "\n".join(lines)


def run(quick: bool = False) -> str:
    """Runs the benchmark and returns its Markdown section.

    Example:
        >>> run.__name__
        'run'
    """
    return render(collect(quick))


def plots(data: dict[str, Any], out_dir: Path | str) -> list[Path]:
    """``staged_cost.png``: peak extra device memory and time per size against the unstaged
    save, from :func:`collect`'s ``data`` (needs matplotlib).

    Example:
        >>> import tempfile
        >>> row = {"params": 1e7, "save_peak": {"unstaged": 80 * MiB, "whole": 16 * MiB,
        ...        "chunked": 0}, "load_peak": {"unstaged": 16 * MiB, "chunked": 4 * MiB},
        ...        "save_rounds": {m: [(1.0, 1.0)] for m in ("unstaged", "whole", "chunked")},
        ...        "load_rounds": {m: [(1.0, 1.0)] for m in ("unstaged", "chunked")}}
        >>> [p.name for p in plots({"chunk_bytes": 4 * MiB, "rows": [row]}, tempfile.mkdtemp())]
        ['staged_cost.png']
    """
    rows = data["rows"]
    labels = [f"{r['params'] / 1e6:.0f}M" for r in rows]
    memory = Panel(
        "Peak extra device memory of one checkpoint call",
        labels,
        {
            "save unstaged": [r["save_peak"]["unstaged"] / MiB for r in rows],
            "save whole-tensor": [r["save_peak"]["whole"] / MiB for r in rows],
            "save chunked": [r["save_peak"]["chunked"] / MiB for r in rows],
            "load chunked": [r["load_peak"]["chunked"] / MiB for r in rows],
        },
        "MiB",
        anchor=(f"chunk_bytes ({data['chunk_bytes'] // MiB} MiB)", data["chunk_bytes"] / MiB),
    )
    time = Panel(
        "Time against the unstaged call (paired median over rounds)",
        labels,
        {
            "save whole-tensor": [ratios(r, "save", "whole")["paired"] for r in rows],
            "save chunked": [ratios(r, "save", "chunked")["paired"] for r in rows],
            "load chunked": [ratios(r, "load", "chunked")["paired"] for r in rows],
        },
        "x the unstaged call",
        anchor=("unstaged = 1", 1.0),
    )
    return [bar_panels(Path(out_dir) / "staged_cost.png", [memory, time])]


if __name__ == "__main__":
    import sys

    print(run(quick="--quick" in sys.argv[1:]))
