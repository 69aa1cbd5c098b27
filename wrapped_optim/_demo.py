"""``wrapped-optim demo``: the project's promises, shown on a small model in under a minute.

Two scenarios, both on a tiny GPT-style model with bf16 weights and a stack built from a
TOML config (by default PrecisionAwareAdamW with bf16 moments under hybrid CPU offload, with
staged checkpoints):

1. *Crash and resume*: train, checkpoint half-way (the run goes on undisturbed), rebuild the
   stack from the config with a different random init, load the checkpoint, run the second
   half again -- and compare with the run that never stopped, bit for bit. The checkpoint's
   peak expansion bytes are measured staged and unstaged.
2. *Fine-tuning from weights* (a model-only load): with the bare offload optimizer the first
   step writes its stale FP32 masters into the model, which lands back on its fresh random
   init (and the loss with it); with HybridSyncOptimizer in the stack the run continues from
   the loaded weights. Measured as a distance between weights, so it shows at any number of
   steps.

Progress goes to stderr: a bar on a terminal, a line per tenth of each run otherwise.
"""

from __future__ import annotations

import copy
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

import attrs
import torch

from wrapped_optim._builder import build_optimizer
from wrapped_optim._demo_model import TinyGPT, batch_for_step, lm_loss
from wrapped_optim.hybrid import HybridSyncOptimizer
from wrapped_optim.stack import find_layer, unwrap
from wrapped_optim.testing.probe import DeviceMemoryProbe, count_unstaged_expansions

__all__ = ["DEFAULT_CONFIG", "DemoResult", "load_demo_config", "run_demo"]

DEFAULT_CONFIG = """\
# The demo's stack: PrecisionAwareAdamW (bf16 moments) under hybrid CPU offload,
# with HybridSyncOptimizer and staged checkpoints.
[optimizer]
name = "hybrid_offload"
offload_fraction = 0.5
cpu_optimizer_cls = "precision_adamw"
gpu_optimizer_cls = "precision_adamw"
lr = 3e-3
weight_decay = 0.01
exp_avg_dtype = "bf16"
exp_avg_sq_dtype = "bf16"

[schedule]
warmup_steps = 20
warmup_start_factor = 0.1
style = "cosine"
decay_steps = 200
min_lr = 3e-4

[hybrid]
on_stale = "refresh"

[staged]
chunk_bytes = "16KiB"
"""

_FINE_TUNE_STEPS = 5


@attrs.frozen
class DemoResult:
    """What the demo measured; ``ok`` is False when any verification failed.

    Example:
        >>> DemoResult(rows=(("resume bit-identical", "yes", "PASS"),), ok=True).ok
        True
    """

    rows: tuple[tuple[str, str, str], ...]
    ok: bool


def load_demo_config(path: str | Path | None = None) -> dict[str, Any]:
    """The demo's config as a dict: the built-in one, or a TOML file in the same layout.

    Example:
        >>> load_demo_config()["optimizer"]["name"]
        'hybrid_offload'
    """
    import tomllib

    if path is None:
        return tomllib.loads(DEFAULT_CONFIG)
    with open(path, "rb") as file:
        return tomllib.load(file)


class _Progress:
    """Progress of one run: a redrawn bar on a terminal, a line every tenth otherwise (a
    piped or logged run still shows that it is moving); silent when disabled."""

    width = 30

    def __init__(self, stream: TextIO | None, total: int, label: str) -> None:
        self.stream, self.total, self.label = stream, total, label
        self.drawn = -1
        self.tty = stream is not None and stream.isatty()

    def update(self, done: int, loss: float) -> None:
        if self.stream is None:
            return
        if self.tty:
            filled = int(self.width * done / self.total)
            if filled == self.drawn and done != self.total:
                return  # redraw only when the bar moves
            self.drawn = filled
            bar = "#" * filled + "." * (self.width - filled)
            line = f"\r{self.label:<28} [{bar}] {done:>4}/{self.total} loss {loss:7.4f}"
            self.stream.write(line + ("\n" if done == self.total else ""))
        else:
            tenth = 10 * done // self.total
            if tenth == self.drawn:
                return
            self.drawn = tenth
            self.stream.write(f"{self.label}: step {done}/{self.total}, loss {loss:.4f}\n")
        self.stream.flush()


def _make(config: Mapping[str, Any], seed: int, device: str) -> tuple[torch.nn.Module, Any, Any]:
    torch.manual_seed(seed)
    model = TinyGPT().to(device=device, dtype=torch.bfloat16)
    optimizer, scheduler = build_optimizer(model, copy.deepcopy(dict(config)))
    return model, optimizer, scheduler


def _train(
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    steps: range,
    device: str,
    progress: Callable[[int, float], None] | None = None,
) -> list[float]:
    losses = []
    for step in steps:
        loss = lm_loss(model, batch_for_step(step, device=device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(step + 1, losses[-1])
    return losses


def _same_params(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def _state_dicts_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.cpu(), b.cpu())
        )
    if isinstance(a, Mapping):
        return (
            isinstance(b, Mapping)
            and a.keys() == b.keys()
            and all(_state_dicts_equal(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(_state_dicts_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    return bool(a == b)


def _expansion_peaks(optimizer: Any, device: str) -> tuple[int, int, bool]:
    """Peak expansion bytes of a staged and an unstaged state dict, and whether they match."""
    with DeviceMemoryProbe(device) as staged_probe:
        staged = optimizer.state_dict()
    bare = unwrap(optimizer)
    with DeviceMemoryProbe(device) as bare_probe, count_unstaged_expansions(bare):
        unstaged = bare.state_dict()
    return (
        staged_probe.peak_extra_bytes,
        bare_probe.peak_extra_bytes,
        _state_dicts_equal(staged, unstaged),
    )


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def run_demo(
    *,
    steps: int = 200,
    device: str = "cpu",
    config_path: str | Path | None = None,
    progress: bool = True,
    out: TextIO | None = None,
) -> DemoResult:
    """Runs both scenarios, prints a summary table and returns what was measured.

    Example:
        >>> import io
        >>> result = run_demo(steps=8, progress=False, out=io.StringIO())
        >>> result.ok
        True
    """
    out = out if out is not None else sys.stdout
    bar_stream = sys.stderr if progress else None
    config = load_demo_config(config_path)
    started = time.perf_counter()
    half = steps // 2

    # 1. Crash and resume: the run is checkpointed half-way (which must not disturb it) and
    # goes on; a rebuilt stack loads the checkpoint and runs the second half again.
    model_u, opt_u, sched_u = _make(config, 0, device)
    bar = _Progress(bar_stream, steps, "training run")
    losses_u = _train(model_u, opt_u, sched_u, range(half), device, bar.update)
    staged_peak, unstaged_peak, staged_equal = _expansion_peaks(opt_u, device)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "checkpoint.pt"
        torch.save(
            {
                "model": model_u.state_dict(),
                "optimizer": opt_u.state_dict(),
                "scheduler": sched_u.state_dict() if sched_u is not None else None,
            },
            path,
        )
        checkpoint_bytes = path.stat().st_size
        pretrained = {k: v.clone() for k, v in model_u.state_dict().items()}
        saved = torch.load(path, weights_only=True)
    losses_u += _train(model_u, opt_u, sched_u, range(half, steps), device, bar.update)

    model_r, opt_r, sched_r = _make(config, 1, device)  # another init: all must come from disk
    model_r.load_state_dict(saved["model"])
    opt_r.load_state_dict(saved["optimizer"])
    if sched_r is not None:
        sched_r.load_state_dict(saved["scheduler"])
    bar = _Progress(bar_stream, steps - half, "resumed from the checkpoint")
    losses_r = _train(
        model_r,
        opt_r,
        sched_r,
        range(half, steps),
        device,
        lambda d, loss: bar.update(d - half, loss),
    )
    resumed_identical = _same_params(model_u, model_r) and losses_u[half:] == losses_r

    # 2. Fine-tuning from weights (model-only load), with and without HybridSyncOptimizer.
    fine_tune: dict[str, list[float]] = {}
    drift: dict[str, float] = {}  # how far step 1 moved the model from the loaded weights
    synced_masters = 0
    for label, stack_override in (("without sync", False), ("with HybridSyncOptimizer", None)):
        variant = copy.deepcopy(config)
        variant.pop("schedule", None)  # a constant lr keeps the comparison simple
        if stack_override is False:
            variant["hybrid"] = False
        model_f, opt_f, _ = _make(variant, 2, device)  # fresh init, fresh masters
        fresh = [q.detach().clone() for q in model_f.parameters()]
        model_f.load_state_dict(pretrained)  # model-only load
        loaded = [q.detach().clone() for q in model_f.parameters()]
        sync = find_layer(opt_f, HybridSyncOptimizer)
        if stack_override is None and sync is not None:
            synced_masters = len(sync.stale_masters())
        bar = _Progress(bar_stream, _FINE_TUNE_STEPS, f"fine-tune {label}")
        fine_tune[label] = _train(model_f, opt_f, None, range(half, half + 1), device, None)
        drift[label] = _relative_distance(list(model_f.parameters()), loaded, fresh)
        fine_tune[label] += _train(
            model_f, opt_f, None, range(half + 1, half + _FINE_TUNE_STEPS), device, None
        )
        bar.update(_FINE_TUNE_STEPS, fine_tune[label][-1])
    with torch.no_grad():
        model_p = TinyGPT().to(device=device, dtype=torch.bfloat16)
        model_p.load_state_dict(pretrained)
        pretrained_loss = float(lm_loss(model_p, batch_for_step(half, device=device)))
    without, with_sync = fine_tune["without sync"], fine_tune["with HybridSyncOptimizer"]
    # Stale masters written into the model send it back towards the fresh init: a distance
    # measured in units of (fresh init - loaded weights), which needs no training progress.
    weights_lost = drift["without sync"] > 0.5
    weights_kept = drift["with HybridSyncOptimizer"] < 0.2
    chunk_bytes = _chunk_bytes(config)
    bounded = chunk_bytes is None or staged_peak <= chunk_bytes

    elapsed = time.perf_counter() - started
    rows = (
        ("final loss (uninterrupted / resumed)", f"{losses_u[-1]:.4f} / {losses_r[-1]:.4f}", ""),
        (
            "resume bit-identical (params, losses)",
            "yes" if resumed_identical else "NO",
            _verdict(resumed_identical),
        ),
        ("checkpoint size", f"{checkpoint_bytes / 1024:.1f} KiB", ""),
        ("peak expansion bytes, unstaged", f"{unstaged_peak:,}", ""),
        (
            "peak expansion bytes, staged",
            f"{staged_peak:,} (chunk {chunk_bytes or '-'})",
            _verdict(bounded),
        ),
        ("staged state dict == unstaged", "yes" if staged_equal else "NO", _verdict(staged_equal)),
        ("fine-tune: loaded model's loss", f"{pretrained_loss:.4f}", ""),
        ("fine-tune loss steps 1-2, no sync", f"{without[0]:.4f} -> {without[1]:.4f}", ""),
        ("fine-tune loss steps 1-2, synced", f"{with_sync[0]:.4f} -> {with_sync[1]:.4f}", ""),
        ("stale masters synced before step 1", str(synced_masters), _verdict(synced_masters > 0)),
        (
            "step 1 undid the load, no sync",
            f"{drift['without sync']:.2f} of the way back to the fresh init",
            _verdict(weights_lost),
        ),
        (
            "step 1 kept the load, synced",
            f"{drift['with HybridSyncOptimizer']:.4f} of the way back",
            _verdict(weights_kept),
        ),
        ("time", f"{elapsed:.1f} s on {device}", ""),
    )
    ok = all(verdict != "FAIL" for _, _, verdict in rows)
    _print_table(out, rows, opt_u)
    return DemoResult(rows=rows, ok=ok)


def _relative_distance(
    params: list[torch.Tensor], loaded: list[torch.Tensor], fresh: list[torch.Tensor]
) -> float:
    """|params - loaded| / |fresh - loaded| over all parameters (0: still the loaded weights,
    1: as far from them as the fresh init)."""
    moved = sum(
        float((p.detach().float() - q.float()).square().sum())
        for p, q in zip(params, loaded, strict=True)
    )
    span = sum(
        float((f.float() - q.float()).square().sum()) for f, q in zip(fresh, loaded, strict=True)
    )
    return (moved / span) ** 0.5 if span else 0.0


def _chunk_bytes(config: Mapping[str, Any]) -> int | None:
    from wrapped_optim.config import StagedConfig

    staged = config.get("staged")
    if not isinstance(staged, Mapping):
        return None
    return StagedConfig(**staged).chunk_bytes


def _sub_optimizer_lines(optimizer: Any) -> list[str]:
    """The leaf's sub-optimizers (a hybrid offload optimizer's host and device halves) with
    their state dtypes, drawn under the leaf as ``repr`` draws the layers."""
    leaf = unwrap(optimizer)
    subs = list(getattr(leaf, "sub_optimizers", []))
    labels = ["host", "device"] if len(subs) == 2 else ["sub-optimizer"] * len(subs)
    indent = " " * (3 * (len(repr(optimizer).splitlines()) - 1))
    lines = []
    for index, (label, sub) in enumerate(zip(labels, subs, strict=True)):
        dtypes = getattr(sub, "name_to_dtype_map", {})
        states = ", ".join(
            f"{name}={str(dtypes[name]).removeprefix('torch.')}"
            for name in ("exp_avg", "exp_avg_sq")
            if name in dtypes
        )
        branch = "└─" if index == len(subs) - 1 else "├─"
        lines.append(f"{indent}{branch} {label}: {type(sub).__name__}({states})")
    return lines


def _print_table(out: TextIO, rows: tuple[tuple[str, str, str], ...], optimizer: Any) -> None:
    out.write("\nThe stack:\n")
    lines = [*repr(optimizer).splitlines(), *_sub_optimizer_lines(optimizer)]
    out.write("".join(f"  {line}\n" for line in lines))
    name_width = max(len(r[0]) for r in rows)
    value_width = max(len(r[1]) for r in rows)
    out.write(f"\n{'check':<{name_width}}  {'value':<{value_width}}  verdict\n")
    out.write(f"{'-' * name_width}  {'-' * value_width}  -------\n")
    for name, value, verdict in rows:
        out.write(f"{name:<{name_width}}  {value:<{value_width}}  {verdict}\n")
    failed = [r[0] for r in rows if r[2] == "FAIL"]
    out.write("\nall verifications passed\n" if not failed else f"\nFAILED: {', '.join(failed)}\n")
