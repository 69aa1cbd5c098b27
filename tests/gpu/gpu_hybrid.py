"""GPU check: HybridSyncOptimizer around Megatron-Core's real HybridDeviceOptimizer.

Needs CUDA and megatron-core. Builds the real HybridDeviceOptimizer on CUDA bf16 params (half
the numel offloaded to pinned host FP32 copies, FP32 working copies for the rest) and checks,
on real training of a small model:

1. model-only load, unwrapped: the loss collapses at step 2 (stale copies written back);
2. model-only load, wrapped: training matches an optimizer built after the load;
3. ``on_stale="raise"`` raises before anything is stepped;
4. full resume through the wrapper: continues like the uninterrupted run, masters restored.

Reproduce: ``python -m tests.gpu.gpu_hybrid``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from wrapped_optim.hybrid import HybridSyncOptimizer, StaleMasterError

from ._report import Section, main_of, require_cuda, require_megatron, row_table

__all__ = ["run"]


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return (
        torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
        .to(torch.bfloat16)
        .cuda()
    )


def _hdo(model: torch.nn.Module, lr: float = 3e-3) -> Any:
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    # Distinct classes: HybridDeviceOptimizer decides where loaded state lives with
    # isinstance(sub_optimizer, cpu_optimizer_cls), and torch's AdamW subclasses Adam.
    return HybridDeviceOptimizer(
        list(model.parameters()),
        offload_fraction=0.5,
        cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=torch.optim.Adam,
        param_update_in_fp32=True,
        overlap_cpu_optimizer_d2h_h2d=False,
        lr=lr,
        weight_decay=0.0,
    )


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(256, 64, generator=gen)
    y = torch.sin(x @ torch.randn(64, 1, generator=gen))
    return x.to(torch.bfloat16).cuda(), y.cuda()


def _train(model: torch.nn.Module, opt: Any, steps: int) -> list[float]:
    x, y = _data()
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = ((model(x).float() - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    torch.cuda.synchronize()
    return losses


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b, strict=True))


def run() -> Section:
    """Runs the checks on CUDA; a failed check is a failure of the section.

    Raises :class:`~tests.gpu._report.NotRun` without CUDA or megatron-core.

    Example:
        >>> import torch
        >>> if torch.cuda.is_available():  # doctest: +SKIP
        ...     print(run().markdown)
    """
    require_cuda("gpu_hybrid")
    require_megatron()
    rows: list[tuple[str, bool, str]] = []

    pretrained_model = _model(0)
    _train(pretrained_model, _hdo(pretrained_model, lr=2e-2), 150)
    pretrained = copy.deepcopy(pretrained_model.state_dict())

    # 1. unwrapped model-only load
    model = _model(1)
    opt = _hdo(model)
    model.load_state_dict(pretrained)
    bare = _train(model, opt, 2)
    rows.append(("model-only load, bare HDO collapses at step 2", bare[1] > 5 * bare[0], f"{bare}"))

    # 2. wrapped model-only load vs an optimizer built after the load
    model = _model(1)
    wrapped = HybridSyncOptimizer(_hdo(model))
    model.load_state_dict(pretrained)
    losses = _train(model, wrapped, 4)
    ref_model = _model(1)
    ref_model.load_state_dict(pretrained)
    ref_losses = _train(ref_model, _hdo(ref_model), 4)
    diff = _max_diff(_weights(model), _weights(ref_model))
    rows.append(
        (
            "model-only load, wrapped = built after load",
            losses == ref_losses and diff == 0.0,
            f"losses {losses} vs {ref_losses}, max weight diff {diff:g}",
        )
    )

    # 3. on_stale="raise"
    model = _model(1)
    strict = HybridSyncOptimizer(_hdo(model), on_stale="raise")
    model.load_state_dict(pretrained)
    before = _weights(model)
    try:
        _train(model, strict, 1)
        raised, detail = False, "no error"
    except StaleMasterError as error:
        raised, detail = True, str(error)[:80]
    unchanged = _max_diff(before, _weights(model)) == 0.0
    rows.append(('on_stale="raise" raises, nothing stepped', raised and unchanged, detail))

    # 4. full resume through the wrapper
    uninterrupted_model = _model(0)
    uninterrupted = _train(uninterrupted_model, HybridSyncOptimizer(_hdo(uninterrupted_model)), 6)
    first = _model(0)
    first_opt = HybridSyncOptimizer(_hdo(first))
    _train(first, first_opt, 3)
    model_sd = copy.deepcopy(first.state_dict())
    payload = copy.deepcopy(first_opt.state_dict())
    resumed = _model(7)
    resumed_opt = HybridSyncOptimizer(_hdo(resumed), on_stale="raise")
    resumed.load_state_dict(model_sd)
    resumed_opt.load_state_dict(payload)
    resumed_losses = _train(resumed, resumed_opt, 3)
    diff = _max_diff(_weights(resumed), _weights(uninterrupted_model))
    rows.append(
        (
            "full resume through the wrapper = uninterrupted",
            resumed_losses == uninterrupted[3:] and diff == 0.0,
            f"losses {resumed_losses} vs {uninterrupted[3:]}, max weight diff {diff:g}",
        )
    )

    title = (
        "## GPU: HybridSyncOptimizer around Megatron's HybridDeviceOptimizer\n\n"
        f"Device: {torch.cuda.get_device_name()}, torch {torch.__version__}."
    )
    return row_table(rows, title)


if __name__ == "__main__":
    raise SystemExit(main_of(run))
