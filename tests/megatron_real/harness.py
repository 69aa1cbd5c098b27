"""Builds megatron-core 0.16.1's real optimizer stacks on CPU, the way a Megatron user gets them.

``parallel_state.initialize_model_parallel`` over the current gloo group, a two-layer model
under Megatron's ``DistributedDataParallel``, and ``get_megatron_optimizer(OptimizerConfig(...))``
for each entry of :data:`CONFIGS`. Everything runs inside :func:`megatron_session`, which
installs the CPU shim (:mod:`tests.megatron_real.shim`) and tears the model-parallel state down
again, so a process can build several stacks one after another.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from tests.megatron_real.shim import cuda_on_cpu

# name -> (bf16 params, use_distributed_optimizer, offload fraction or None)
CONFIGS: dict[str, tuple[bool, bool, float | None]] = {
    "fp32": (False, False, None),  # FP32Optimizer around torch AdamW
    "bf16": (True, False, None),  # Float16OptimizerWithFloat16Params
    "distributed": (False, True, None),  # DistributedOptimizer, FP32 params
    "offload_half": (True, True, 0.5),  # HybridDeviceOptimizer inside DistributedOptimizer
    "offload_full": (True, True, 1.0),
}
# Built by name only (not iterated with CONFIGS): a DistributedOptimizer over bf16 params, no
# offload, the base of Megatron's precision-aware configs and the offload-free side of the
# offload-change resumes (Core refuses offload with FP32 params).
BF16_DISTRIBUTED = {"bf16_distributed": (True, True, None)}
HIDDEN = 8
STEPS = 3


@contextlib.contextmanager
def megatron_session() -> Iterator[None]:
    """The shim plus Megatron's model-parallel state (TP=PP=1) over the default group."""
    from megatron.core import parallel_state

    with cuda_on_cpu():
        parallel_state.initialize_model_parallel()
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()


def build(
    name: str,
    seed: int = 0,
    weights: dict[str, Any] | None = None,
    *,
    setup: bool = False,
    options: dict[str, Any] | None = None,
    hidden: int = HIDDEN,
    ddp_options: dict[str, Any] | None = None,
    bias_dtype: torch.dtype | None = None,
) -> tuple[Any, Any]:
    """``(ddp_model, optimizer)`` for config ``name``; inside :func:`megatron_session`.

    ``weights`` (a model state dict) is loaded into the model before the optimizer is built.
    ``setup``: the optimizer comes from :func:`wrapped_optim.integrations.bridge.setup_optimizer`
    (Megatron's standard param-group overrides, the derived stack) instead of a bare
    ``get_megatron_optimizer`` call. ``options``: more ``OptimizerConfig`` fields (the
    precision-aware ones of :mod:`tests.megatron_real.precision_aware`). ``hidden``: the
    model's width (a larger model for memory measurements). ``ddp_options``: more
    ``DistributedDataParallelConfig`` fields (``overlap_grad_reduce`` and a small
    ``bucket_size`` give several buckets). ``bias_dtype``: the biases' dtype, when it differs
    from the weights' (one grad buffer per param dtype; each of Megatron's param groups,
    matrices and biases, keeps one dtype).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    bf16, distributed, fraction = {**CONFIGS, **BF16_DISTRIBUTED}[name]
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=1,
        use_cpu_initialization=True,
        bf16=bf16,
        params_dtype=dtype,
    )

    class TwoLayer(MegatronModule):
        def __init__(self) -> None:
            super().__init__(config)
            self.first = torch.nn.Linear(hidden, hidden)
            self.second = torch.nn.Linear(hidden, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if bias_dtype is None:
                return self.second(torch.tanh(self.first(x)))
            first, second = self.first, self.second  # weight @ x + a bias of another dtype
            hidden = torch.tanh(torch.nn.functional.linear(x, first.weight) + first.bias)
            out = torch.nn.functional.linear(hidden.to(second.weight.dtype), second.weight)
            return out + second.bias

    torch.manual_seed(seed)
    module = TwoLayer().to(dtype)
    if bias_dtype is not None:
        for bias in (module.first.bias, module.second.bias):
            bias.data = bias.data.to(bias_dtype)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed, grad_reduce_in_fp32=True, **(ddp_options or {})
    )
    model = DistributedDataParallel(config, ddp_config, module)
    if weights is not None:
        model.load_state_dict(weights)
    offload: dict[str, Any] = {}
    if fraction is not None:
        offload = {"optimizer_cpu_offload": True, "optimizer_offload_fraction": fraction}
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=1e-2,
        min_lr=1e-2,
        weight_decay=0.01,
        use_distributed_optimizer=distributed,
        bf16=bf16,
        clip_grad=0.0,
        **offload,
        **(options or {}),
    )
    if setup:
        from wrapped_optim.integrations.bridge import SchedulerConfig, setup_optimizer

        schedule = SchedulerConfig(lr_decay_style="constant").with_steps(
            train_iters=100, global_batch_size=1
        )
        # Gloo groups, as get_megatron_optimizer's default: the legacy save_parameter_state
        # gathers over them (megatron-core 0.19 asserts they exist).
        optimizer, _ = setup_optimizer(
            optimizer_config, schedule, [model], use_gloo_process_groups=True
        )
        return model, optimizer
    return model, get_megatron_optimizer(optimizer_config, [model])


def train(model: Any, optimizer: Any, steps: range, rank: int = 0) -> None:
    """Megatron's step sequence on data fixed by (step, rank): the same data in every run."""
    dtype = next(model.parameters()).dtype
    width = model.module.first.in_features
    for step in steps:
        generator = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(4, width, generator=generator).to(dtype)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        model(x).float().square().mean().backward()
        model.finish_grad_sync()
        success, _, _ = optimizer.step()
        assert success, "the step was skipped"


def weights(model: Any) -> dict[str, torch.Tensor]:
    """The model's weights, cloned."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def leaf(optimizer: Any) -> Any:
    """The one Megatron optimizer under the ChainedOptimizer get_megatron_optimizer returns."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        assert len(chained) == 1
        return chained[0]
    return optimizer


def bare(optimizer: Any) -> Any:
    """The optimizer under every wrapped_optim layer."""
    while hasattr(optimizer, "inner"):
        optimizer = optimizer.inner
    return optimizer


def full_state(optimizer: Any) -> Any:
    """What Megatron checkpoints for the optimizer, as one torch-saveable object.

    ``state_dict()``; for a DistributedOptimizer (whose ``state_dict`` holds no per-parameter
    state) also its ``dp_reshardable`` parameter state, which ``load_state_dict`` reads back.
    ``get_parameter_state_dp_reshardable`` does not write the per-entry ``padding`` flag its
    loader filters on (the sharded variant adds it), so it is added here as ``False``.
    """
    state = optimizer.state_dict()
    distributed = leaf(bare(optimizer))
    if not hasattr(distributed, "get_parameter_state_dp_reshardable"):
        return state
    param_state = distributed.get_parameter_state_dp_reshardable()
    for key, per_dtype in param_state.items():
        if isinstance(key, int):
            for buckets in per_dtype.values():
                for bucket in buckets:
                    for entry in bucket:
                        entry["padding"] = False
    return {**state, "param_state": param_state, "param_state_sharding_type": "dp_reshardable"}


def load_full_state(optimizer: Any, state: Any) -> None:
    """Loads :func:`full_state`'s object. Under ``no_grad``: Megatron's parameter-state loader
    copies into views of FP32 model params, which autograd refuses outside it."""
    with torch.no_grad():
        optimizer.load_state_dict(state)
