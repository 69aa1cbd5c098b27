"""GPU check: ``setup_optimizer`` with megatron-core's real builders, no doubles.

Needs CUDA and megatron-core (Transformer Engine optional). In one process (NCCL, world size
1) it wraps a small MegatronModule in Megatron's DistributedDataParallel and, for three
optimizer configurations, calls
:func:`wrapped_optim.integrations.bridge.setup_optimizer` with the real
``get_megatron_optimizer`` and ``OptimizerParamScheduler``:

1. FP32 Adam, not distributed -> no layer;
2. distributed FP32 Adam -> ``StagedCheckpointOptimizer`` (no-copy load);
3. distributed Adam with ``optimizer_cpu_offload`` -> ``HybridSyncOptimizer`` around the real
   HybridDeviceOptimizer (and ``compat.sync_hybrid_device_optimizer_fp32_master_copies``).

For each it trains three steps through the wrapped optimizer and its scheduler and builds the
state dict through the stack. CPU tests cover the same wiring with recorded builders.

Reproduce: ``python -m tests.gpu.gpu_factory``.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch

from ._report import Section, main_of, require_cuda, require_megatron

__all__ = ["run"]

SCENARIOS: dict[str, tuple[dict[str, Any], list[str]]] = {
    "fp32 adam": ({}, []),
    "distributed fp32 adam": (
        {"use_distributed_optimizer": True},
        ["StagedCheckpointOptimizer"],
    ),
    "distributed adam + cpu offload": (
        {
            "use_distributed_optimizer": True,
            "optimizer_cpu_offload": True,
            "optimizer_offload_fraction": 0.5,
        },
        ["HybridSyncOptimizer"],
    ),
}


def _init_process_group() -> bool:
    """Start a one-rank NCCL group unless one exists; returns whether this call made it."""
    if torch.distributed.is_initialized():
        return False
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    return True


def _scenario(name: str, flags: dict[str, Any], expected: list[str]) -> str:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    from wrapped_optim import compat
    from wrapped_optim.integrations.bridge import SchedulerConfig, setup_optimizer
    from wrapped_optim.wrapper import OptimizerWrapper

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1)

    class Tiny(MegatronModule):
        def __init__(self) -> None:
            super().__init__(config)
            self.first = torch.nn.Linear(16, 32)
            self.second = torch.nn.Linear(32, 16)

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            return self.second(torch.tanh(self.first(inputs)))

    torch.manual_seed(0)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=bool(flags.get("use_distributed_optimizer", False))
    )
    model = DistributedDataParallel(config, ddp_config, Tiny().cuda())
    optimizer_config = OptimizerConfig(
        optimizer="adam", lr=1e-2, min_lr=1e-4, weight_decay=0.01, **flags
    )
    scheduler_config = SchedulerConfig(lr_decay_style="cosine", lr_warmup_iters=1)
    scheduler_config = scheduler_config.with_steps(train_iters=3, global_batch_size=1)
    optimizer, scheduler = setup_optimizer(optimizer_config, scheduler_config, [model])
    layers = [
        type(layer).__name__
        for layer in (optimizer.layers()[:-1] if isinstance(optimizer, OptimizerWrapper) else [])
    ]
    inputs = torch.randn(8, 16, device="cuda")
    losses = []
    for _ in range(3):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model(inputs).square().mean()
        loss.backward()
        model.finish_grad_sync()
        optimizer.step()
        scheduler.step(1)
        losses.append(loss.item())
    state = optimizer.state_dict()
    synced = compat.sync_hybrid_device_optimizer_fp32_master_copies(optimizer)
    with compat.memory_efficient_fp32_optimizer_state_loading(optimizer) as no_copy:
        pass
    verdict = "ok" if layers == expected and losses[-1] < losses[0] else "MISMATCH"
    return (
        f"| {name} | {', '.join(layers) or '(none)'} | {', '.join(expected) or '(none)'} | "
        f"{losses[0]:.4f} -> {losses[-1]:.4f} | {optimizer.param_groups[0]['lr']:.2e} | "
        f"{type(state).__name__} | {synced} | {no_copy} | {verdict} |"
    )


def run() -> Section:
    """Runs the scenarios (needs CUDA and megatron-core, else not run).

    Every scenario gets a row, a failing one included (a failure of the section), so a
    single report shows which of Megatron's real builders the factory wires correctly. The
    NCCL process group this check starts is destroyed before it returns.

    Example:
        >>> from tests.gpu.gpu_factory import run
        >>> print(run().markdown)  # doctest: +SKIP
        ## GPU: setup_optimizer with megatron-core's real builders
        ...
    """
    require_cuda("gpu_factory")
    require_megatron()
    created = _init_process_group()
    try:
        return _run_scenarios()
    finally:
        if created and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _run_scenarios() -> Section:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    failures: list[str] = []
    lines = [
        "## GPU: setup_optimizer with megatron-core's real builders",
        "",
        "| scenario | layers | expected | loss | lr after 3 | state_dict | hybrid synced | "
        "no-copy eligible | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    try:
        for name, (flags, expected) in SCENARIOS.items():
            try:
                row = _scenario(name, flags, expected)
            except Exception as error:  # report every scenario, not just the first failure
                last = traceback.format_exception_only(type(error), error)[-1].strip()
                row = f"| {name} | ERROR: {last} | | | | | | | FAILED |"
            if not row.endswith("| ok |"):
                failures.append(name)
            lines.append(row)
    finally:
        parallel_state.destroy_model_parallel()
    lines += ["", "Reproduce: `python -m tests.gpu.gpu_factory`."]
    return Section("\n".join(lines), failures)


if __name__ == "__main__":
    raise SystemExit(main_of(run))
