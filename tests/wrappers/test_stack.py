"""The stack's one home: the layer table, the walk over any optimizer, the one layer policy."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given, settings

from wrapped_optim import (
    FSDPAwareOptimizer,
    HybridSyncOptimizer,
    OptimizerWrapper,
    StackConfig,
    StagedCheckpointOptimizer,
    find_layer,
    layers,
    unwrap,
    wrap,
)
from wrapped_optim._layer_policy import MegatronSettings, no_copy_blocker, staging_blocker
from wrapped_optim._staging.engine import no_copy_decisions, staging_decisions
from wrapped_optim.config import SECTIONS, ConfigError
from wrapped_optim.optimizers import HybridOffloadOptimizer, PrecisionAwareAdamW
from wrapped_optim.stack import LAYERS, layer_spec, spec_of
from wrapped_optim.testing import strategies as ws


def _sgd() -> torch.optim.SGD:
    return torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)


# ----------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------
def test_the_table_is_the_one_list_of_layers() -> None:
    assert [spec.section for spec in LAYERS] == ["fsdp", "hybrid", "staged"]
    assert {spec.section: spec.config for spec in LAYERS} == SECTIONS
    assert [spec.wrapper for spec in LAYERS] == [
        FSDPAwareOptimizer,
        HybridSyncOptimizer,
        StagedCheckpointOptimizer,
    ]
    assert tuple(spec.section for spec in LAYERS) == ws.LAYER_ORDER
    for spec in LAYERS:  # every config option is a constructor keyword of the wrapper
        options = attrs.asdict(spec.config())
        inner = HybridOffloadOptimizer([torch.nn.Parameter(torch.ones(2))])
        assert spec.options_of(spec.wrapper(inner, **options)) == options
    with pytest.raises(ValueError, match="no layer has section 'stagd'"):
        layer_spec("stagd")


def test_wrap_builds_every_section_in_table_order() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    hybrid = HybridOffloadOptimizer([p], lr=0.1)
    stack = wrap(hybrid, {"fsdp": True, "hybrid": True, "staged": True})
    assert [spec_of(layer) for layer in layers(stack)] == [*LAYERS, None]


# ----------------------------------------------------------------------------------------
# The walk, on any optimizer
# ----------------------------------------------------------------------------------------
def test_free_functions_accept_a_bare_optimizer() -> None:
    sgd = _sgd()
    assert wrap(sgd) is sgd  # wrap added nothing: the bare optimizer comes back
    assert layers(sgd) == [sgd]
    assert unwrap(sgd) is sgd
    assert find_layer(sgd, torch.optim.SGD) is sgd
    assert find_layer(sgd, StagedCheckpointOptimizer) is None


def test_free_functions_accept_a_foreign_non_torch_optimizer() -> None:
    # A Megatron optimizer is not a torch Optimizer; the walk still treats it as the bare end.
    megatron_like = SimpleNamespace(step=lambda: None, state_dict=dict, param_groups=[])
    stack = OptimizerWrapper(megatron_like)
    assert layers(stack) == [stack, megatron_like]
    assert unwrap(stack) is megatron_like
    assert find_layer(megatron_like, OptimizerWrapper) is None


@settings(max_examples=15, deadline=None)
@given(ws.setups(kinds=["adamw", "hybrid_offload"], max_groups=1, max_params=2))
def test_free_functions_agree_with_the_wrapper_methods(setup: ws.Setup) -> None:
    _model, stack = setup.make()
    chain = layers(stack)
    assert [type(layer) for layer in chain[:-1]] == [
        layer_spec(name).wrapper for name in setup.stack.names
    ]
    assert unwrap(stack) is chain[-1]
    for layer in chain:
        assert find_layer(stack, type(layer)) is layer
    if isinstance(stack, OptimizerWrapper):
        assert stack.layers() == chain
        assert stack.unwrap() is unwrap(stack)
        for spec in LAYERS:
            assert stack.find_layer(spec.wrapper) is find_layer(stack, spec.wrapper)


# ----------------------------------------------------------------------------------------
# One policy: Megatron-config derivation and leaf derivation decide staging alike
# ----------------------------------------------------------------------------------------
class _Container:
    """A Megatron optimizer shape: ``.optimizer``, ``.config``, ``.ddp_config``."""

    def __init__(self, leaf: Any, config: Any, ddp_config: Any, distributed: bool) -> None:
        self.optimizer = leaf
        self.config = config
        self.ddp_config = ddp_config
        if distributed:  # what the staging engine recognises a DistributedOptimizer by
            self.shard_fp32_from_float16_groups: list[list[torch.Tensor]] = [[]]

    def step(self) -> None:
        self.optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return dict(self.optimizer.state_dict())


_FLAGS = list(itertools.product([False, True], repeat=4))


@pytest.mark.parametrize(("precision_aware", "offload", "distributed", "fsdp"), _FLAGS)
def test_from_megatron_and_the_staging_engine_follow_one_policy(
    precision_aware: bool, offload: bool, distributed: bool, fsdp: bool
) -> None:
    config = SimpleNamespace(
        optimizer="adam",
        use_precision_aware_optimizer=precision_aware,
        optimizer_cpu_offload=offload,
        use_distributed_optimizer=distributed,
    )
    ddp_config = SimpleNamespace(use_megatron_fsdp=fsdp)
    if precision_aware and not distributed:
        with pytest.raises(ConfigError, match="use_distributed_optimizer"):
            StackConfig.from_megatron(config, ddp_config)
        return
    if precision_aware and offload:  # Core ignores the precision-aware settings there
        with pytest.raises(ConfigError, match="optimizer_cpu_offload: cannot be combined"):
            StackConfig.from_megatron(config, ddp_config)
        return
    derived = StackConfig.from_megatron(config, ddp_config).staged

    # The leaf Megatron would build: precision-aware state is compressed, otherwise FP32.
    moments = torch.bfloat16 if precision_aware else torch.float32
    leaf = PrecisionAwareAdamW(
        [torch.nn.Parameter(torch.ones(3))], exp_avg_dtype=moments, exp_avg_sq_dtype=moments
    )
    container = _Container(leaf, config, ddp_config, distributed)
    stages = any(d.eligible for d in staging_decisions(container))
    adopts = any(d.eligible for d in no_copy_decisions(container))

    assert (derived is not False) == (stages or adopts)
    if derived is not False:
        assert (derived.stage_save, derived.chunked_load) == (stages, stages)
        assert derived.no_copy_load == adopts
    # Where the settings block a path, both report the policy's reason.
    settings_ = MegatronSettings.validated(config, ddp_config)
    if (blocker := staging_blocker(settings_)) is not None:
        assert [d.reason for d in staging_decisions(container)] == [blocker]
    if (blocker := no_copy_blocker(settings_)) is not None:
        assert [d.reason for d in no_copy_decisions(container)] == [blocker]


@pytest.mark.parametrize(
    ("inner", "config", "staged"),
    [
        ("adamw", {}, True),  # the shared-step repair
        ("adam", {}, True),
        ("sgd", {}, False),  # no per-param step tensor to share
        ("adamw", {"cpu_offload": True}, False),  # hybrid sync's resume handles it
        ("adamw", {"precision_aware": True}, False),  # needs TE: step kept per group
    ],
)
def test_wrap_adds_the_step_repair_for_torch_adam_in_a_distributed_optimizer(
    inner: str, config: dict[str, Any], staged: bool
) -> None:
    from tests.doubles.distributed import DistributedOptimizerDouble, ddp_config, megatron_config

    params = [torch.nn.Parameter(torch.ones(3))]
    leaf = {
        "adamw": lambda: torch.optim.AdamW(params, lr=0.1),
        "adam": lambda: torch.optim.Adam(params, lr=0.1),
        "sgd": lambda: torch.optim.SGD(params, lr=0.1),
    }[inner]()
    settings = {"precision_aware": False, **config}
    container = DistributedOptimizerDouble(leaf, megatron_config(**settings), ddp_config())
    wrapped = wrap(container)
    assert (type(wrapped) is StagedCheckpointOptimizer) is staged
    assert (wrapped is container) is not staged
    megatron = SimpleNamespace(
        use_distributed_optimizer=True,
        optimizer="adam" if inner != "sgd" else "sgd",
        use_precision_aware_optimizer=settings["precision_aware"],
        optimizer_cpu_offload=settings.get("cpu_offload", False),
        exp_avg_dtype=torch.float32,
        exp_avg_sq_dtype=torch.float32,
        main_params_dtype=torch.float32,
    )
    if not settings["precision_aware"]:  # the config-side derivation agrees
        assert bool(StackConfig.from_megatron(megatron).staged) is staged


def test_wrap_refuses_a_megatron_optimizer_built_precision_aware_with_cpu_offload() -> None:
    leaf = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))])
    config = SimpleNamespace(use_precision_aware_optimizer=True, optimizer_cpu_offload=True)
    container = _Container(leaf, config, SimpleNamespace(use_megatron_fsdp=False), True)
    before = leaf.state_dict()
    with pytest.raises(ConfigError, match=r"config\.optimizer_cpu_offload: cannot be combined"):
        wrap(container)
    assert leaf.state_dict() == before and not hasattr(container, "inner")
    # Either flag alone wraps.
    container.config = SimpleNamespace(
        use_precision_aware_optimizer=False, optimizer_cpu_offload=True
    )
    assert wrap(container) is not None


# ----------------------------------------------------------------------------------------
# Errors, buried layers and derivations that mutation testing found unchecked
# ----------------------------------------------------------------------------------------
def test_errors_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"'x'; the layers are fsdp, hybrid, staged$"):
        layer_spec("x")
    with pytest.raises(TypeError, match="config must be a StackConfig, a mapping or None, got 3"):
        wrap(_sgd(), 3)  # type: ignore[arg-type]
    foreign = OptimizerWrapper(StagedCheckpointOptimizer(_sgd()))
    with pytest.raises(ConfigError, match=r"^staged: is false but .* below a foreign wrapper; un"):
        wrap(foreign, {"staged": False})


def test_a_layer_buried_below_a_foreign_wrapper_leaves_the_others_to_the_config() -> None:
    """FSDP sits below a user's wrapper: it stays there, and the sections after it in the
    table are still decided (staging goes on top)."""
    foreign = OptimizerWrapper(FSDPAwareOptimizer(_sgd()))
    stack = wrap(foreign, {"staged": True})
    assert [type(layer) for layer in layers(stack)][:3] == [
        StagedCheckpointOptimizer,
        OptimizerWrapper,
        FSDPAwareOptimizer,
    ]
    assert stack.inner is foreign


@pytest.mark.parametrize("precision_aware", [False, True])
def test_derived_fsdp_layer_follows_the_megatron_precision_aware_flag(
    precision_aware: bool,
) -> None:
    """Grads in another dtype than their params derive the FSDP layer; whether it casts them
    is the container's ``use_precision_aware_optimizer`` (a precision-aware optimizer
    consumes them as they are)."""
    from tests.doubles.distributed import DistributedOptimizerDouble, ddp_config, megatron_config

    param = torch.nn.Parameter(torch.ones(3))
    param.grad_dtype = torch.bfloat16
    config = megatron_config(precision_aware=precision_aware)
    container = DistributedOptimizerDouble(torch.optim.AdamW([param]), config, ddp_config())
    fsdp = find_layer(wrap(container, {"staged": False}), FSDPAwareOptimizer)
    assert fsdp is not None and fsdp.precision_aware is precision_aware
