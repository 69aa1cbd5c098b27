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
figures come from ``python -m tests.gpu.gpu_staged``. Run: ``python -m wrapped_optim.bench.staged``.
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

from wrapped_optim._staging.engine import staged_save
from wrapped_optim.staged import StagedCheckpointOptimizer
from wrapped_optim.testing.probe import DeviceMemoryProbe, count_unstaged_expansions

__all__ = [
    "build_model_optimizer",
    "measure",
    "plots",
    "ratios",
    "run",
    "whole_tensor_state_dict",
]

MiB = 1 << 20
HIDDEN = 1024
EMBEDDING_SHARE = 0.4
_LAST: list[dict[str, Any]] = []


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


def run(quick: bool = False) -> str:
    """Runs the benchmark and returns its Markdown section.

    Example:
        >>> run.__name__
        'run'
    """
    sizes = (
        [10_000_000, 25_000_000, 50_000_000]
        if quick
        else [10_000_000, 50_000_000, 100_000_000, 200_000_000]
    )
    chunk_bytes = 4 * MiB
    rounds = 3 if quick else 5
    rows = []
    for size in sizes:
        rows.append(measure(size, chunk_bytes=chunk_bytes, reps=rounds, check=size <= 50_000_000))
    _LAST[:] = rows
    lines = [
        "## Staged checkpoints (StagedCheckpointOptimizer)",
        "",
        "PrecisionAwareAdamW, bf16 `exp_avg`, fp16 `exp_avg_sq`, FP32 params; 40% of each",
        f"model is one embedding of width {HIDDEN}; `chunk_bytes` = {chunk_bytes // MiB} MiB;",
        "device: CPU (peak extra device bytes from the staging ledger, see notes); times from",
        f"{rounds} rounds per size, each running every mode once, in an order rotated from",
        f"round to round; torch threads: {torch.get_num_threads()}.",
        "",
        "### Peak extra device memory (MiB)",
        "",
        "| params | largest tensor | save unstaged | save whole-tensor | save chunked "
        "| load, TE-style whole-tensor loader (lower bound) | load chunked |",
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
        "within one round (the target's figure: neighbours in time see the same machine load),",
        "*best* the best wall time over the best, *CPU* the best process CPU time (all threads)",
        "over the best.",
        "",
        "| params | save unstaged, best (s) | whole-tensor / unstaged (paired) "
        "| chunked / unstaged: paired | best | CPU | <= 1.1x "
        "| load unstaged, best (s) | chunked / unstaged (paired) |",
        "|---:|---:|---:|---:|---:|---:|:---:|---:|---:|",
    ]
    for r in rows:
        st, lt = r["save_time"], r["load_time"]
        whole, chunked = ratios(r, "save", "whole"), ratios(r, "save", "chunked")
        load = ratios(r, "load", "chunked")
        lines.append(
            f"| {r['params'] / 1e6:.0f}M | {st['unstaged']:.3f} | {whole['paired']:.2f}x "
            f"| {chunked['paired']:.2f}x | {chunked['best']:.2f}x | {chunked['cpu']:.2f}x "
            f"| {'yes' if chunked['paired'] <= 1.1 else 'NO'} "
            f"| {lt['unstaged']:.3f} | {load['paired']:.2f}x |"
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
        "Reproduce: `python -m wrapped_optim.bench.staged` (`--quick` for up to 50M).",
        "",
    ]
    return "\n".join(lines)


def plots(out_dir: Path | str) -> list[Path]:
    """Peak extra device memory vs model size from the last :func:`run` (needs matplotlib).

    Example:
        >>> plots.__name__
        'plots'
    """
    if not _LAST:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sizes = [r["params"] / 1e6 for r in _LAST]
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, modes in (
        (axes[0], "save_peak", ("unstaged", "whole", "chunked")),
        (axes[1], "load_peak", ("unstaged", "chunked")),
    ):
        for mode in modes:
            ax.plot(sizes, [r[key][mode] / MiB for r in _LAST], marker="o", label=mode)
        ax.set_xlabel("parameters (M)")
        ax.set_ylabel("peak extra device MiB")
        ax.set_title(key.replace("_", " "))
        ax.legend()
    path = out / "staged_peak_memory.png"
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return [path]


if __name__ == "__main__":
    import sys

    print(run(quick="--quick" in sys.argv[1:]))
