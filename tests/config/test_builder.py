"""The factory: setup_optimizer's Megatron wiring, build_optimizer, wrap()."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from wrapped_optim._builder import (
    LRScheduleConfig,
    OptimizerSpec,
    _lr_scheduler,
    build_optimizer,
    resolve_optimizer_class,
)
from wrapped_optim.config import ConfigError, StackConfig
from wrapped_optim.fsdp import FSDPAwareOptimizer
from wrapped_optim.integrations.bridge import (
    OptimizerConfigOverrideProvider,
    OptimizerConfigOverrideProviderContext,
    SchedulerConfig,
    setup_optimizer,
)
from wrapped_optim.stack import layers, wrap
from wrapped_optim.staged import StagedCheckpointOptimizer
from wrapped_optim.wrapper import OptimizerWrapper


# megatron-core is optional: only the tests that take these fixtures need it.
@pytest.fixture
def core() -> Any:
    return pytest.importorskip("megatron.core.optimizer")


@pytest.fixture
def scheduler_module() -> Any:
    return pytest.importorskip("megatron.core.optimizer_param_scheduler")


@pytest.fixture
def muon_module() -> Any:
    return pytest.importorskip("megatron.core.optimizer.muon")


# ----------------------------------------------------------------------------------------
# setup_optimizer: what Megatron's builder and scheduler receive
# ----------------------------------------------------------------------------------------
def Chunk(use_mup: bool = False, ddp_config: Any = None) -> Any:
    """A model chunk as Megatron hands it over: a real MegatronModule with a real
    TransformerConfig, and the DDP config Megatron's DDP wrapper carries (the real wrapper
    needs a model-parallel state and process group; tests/megatron_real builds those)."""
    transformer = pytest.importorskip("megatron.core.transformer")
    distributed = pytest.importorskip("megatron.core.distributed")
    module = pytest.importorskip("megatron.core.transformer.module")
    # Core computes the width multiplier as hidden_size / mup_base_hidden_size: 4 / 1.
    mup = {"use_mup": use_mup, "mup_base_hidden_size": 1, "mup_width_mult": 4.0}
    fields = {field.name for field in dataclasses.fields(transformer.TransformerConfig)}
    with warnings.catch_warnings():  # Core's own deprecation notes on its defaults
        warnings.simplefilter("ignore")
        config = transformer.TransformerConfig(
            num_layers=1,
            hidden_size=4,
            num_attention_heads=1,
            use_cpu_initialization=True,
            **{name: value for name, value in mup.items() if name in fields},
        )
    for name, value in mup.items():
        if name not in fields:  # a Core before muP (0.16.1): the fields as 0.19 has them
            setattr(config, name, value)

    class Linear(module.MegatronModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__(config)
            self.linear = torch.nn.Linear(4, 3)

    chunk = Linear()
    chunk.ddp_config = ddp_config or distributed.DistributedDataParallelConfig()
    return chunk


def megatron_config(**kwargs: Any) -> Any:
    values: dict[str, Any] = {"optimizer": "adam", "lr": 1e-3, "min_lr": 1e-5, "weight_decay": 0.1}
    values.update(kwargs)
    return pytest.importorskip("megatron.core.optimizer").OptimizerConfig(**values)


def scheduler_config(**kwargs: Any) -> SchedulerConfig:
    values: dict[str, Any] = {
        "lr_decay_style": "cosine",
        "lr_warmup_iters": 2,
        "lr_warmup_init": 1e-6,
    }
    values.update(kwargs)
    return SchedulerConfig(**values).with_steps(train_iters=10, global_batch_size=1)


# Kept as a spy: the real builders need DDP-wrapped chunks on an initialised model-parallel
# state (tests/megatron_real drives them through setup_optimizer); each call binds to the real
# builder's signature, so setup_optimizer never passes what Core would refuse.
class Recorder:
    """Stands in for a Megatron builder: records its keyword arguments, returns an AdamW."""

    def __init__(self, chunks: list[Any], real: Any = None) -> None:
        self.chunks = chunks
        self.real = real.real if isinstance(real, Recorder) else real
        self.calls: list[dict[str, Any]] = []
        self.built: list[torch.optim.Optimizer] = []

    def __call__(self, **kwargs: Any) -> torch.optim.Optimizer:
        if self.real is not None:
            inspect.signature(self.real).bind(**kwargs)  # TypeError: Core takes no such call
        self.calls.append(kwargs)
        params = [p for chunk in self.chunks for p in chunk.parameters()]
        self.built.append(torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1))
        return self.built[-1]


def test_the_builder_spy_refuses_what_the_real_builder_would(core: Any) -> None:
    spy = Recorder([Chunk()], core.get_megatron_optimizer)
    with pytest.raises(TypeError, match="no_such_option"):
        spy(config=megatron_config(), model_chunks=spy.chunks, no_such_option=1)
    assert not spy.calls
    spy(config=megatron_config(), model_chunks=spy.chunks, use_gloo_process_groups=False)
    assert len(spy.calls) == 1


@pytest.fixture
def scheduler_calls(
    monkeypatch: pytest.MonkeyPatch, scheduler_module: Any
) -> list[tuple[Any, dict[str, Any]]]:
    calls: list[tuple[Any, dict[str, Any]]] = []
    real = scheduler_module.OptimizerParamScheduler

    class Recording(real):  # type: ignore[misc, valid-type]
        def __init__(self, optimizer: Any, **kwargs: Any) -> None:
            calls.append((optimizer, kwargs))
            super().__init__(optimizer, **kwargs)

    monkeypatch.setattr(scheduler_module, "OptimizerParamScheduler", Recording)
    return calls


def test_setup_optimizer_calls_megatron_builder_and_scheduler_with_bridge_arguments(
    monkeypatch: pytest.MonkeyPatch,
    scheduler_calls: list[tuple[Any, dict[str, Any]]],
    core: Any,
    muon_module: Any,
) -> None:
    chunks = [Chunk()]
    builder = Recorder(chunks, core.get_megatron_optimizer)
    monkeypatch.setattr(core, "get_megatron_optimizer", builder)
    monkeypatch.setattr(muon_module, "get_megatron_muon_optimizer", _must_not_be_called)
    optimizer_config = megatron_config()
    sched_config = scheduler_config(
        start_weight_decay=0.05, end_weight_decay=0.2, weight_decay_incr_style="linear"
    )
    pg = object()

    optimizer, scheduler = setup_optimizer(optimizer_config, sched_config, chunks, pg_collection=pg)

    (call,) = builder.calls
    overrides = call.pop("config_overrides")
    assert call == {
        "config": optimizer_config,
        "model_chunks": chunks,
        "use_gloo_process_groups": False,  # Bridge's default
        "pg_collection": pg,
    }
    # Bridge's default provider: megatron-core's standard overrides (no wd on biases / 1-D).
    assert [(key.name, override) for key, override in overrides.items()] == [
        ("*.bias", {"wd_mult": 0.0})
    ]
    assert optimizer is builder.built[0]  # nothing derived for a non-distributed FP32 Adam
    ((scheduled, kwargs),) = scheduler_calls
    assert scheduled is optimizer
    assert kwargs == {
        "init_lr": 1e-6,
        "max_lr": 1e-3,
        "min_lr": 1e-5,
        "lr_warmup_steps": 2,
        "lr_decay_steps": 10,
        "lr_decay_style": "cosine",
        "start_wd": 0.05,
        "end_wd": 0.2,
        "wd_incr_steps": 10,
        "wd_incr_style": "linear",
        "use_checkpoint_opt_param_scheduler": False,
        "override_opt_param_scheduler": False,
        "wsd_decay_steps": None,
        "lr_wsd_decay_style": "exponential",
    }
    # The real scheduler drives the (wrapped) optimizer's groups.
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-6)
    scheduler.step(2)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    scheduler.step(8)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-5)


def _must_not_be_called(**kwargs: Any) -> Any:
    raise AssertionError(f"unexpected builder call {kwargs}")


def test_weight_decay_defaults_to_the_optimizer_config(
    monkeypatch: pytest.MonkeyPatch, scheduler_calls: list[tuple[Any, dict[str, Any]]], core: Any
) -> None:
    chunk = Chunk()
    monkeypatch.setattr(
        core, "get_megatron_optimizer", Recorder([chunk], core.get_megatron_optimizer)
    )
    setup_optimizer(megatron_config(weight_decay=0.3), scheduler_config(), chunk)
    kwargs = scheduler_calls[0][1]
    assert (kwargs["start_wd"], kwargs["end_wd"]) == (0.3, 0.3)


def test_custom_provider_then_mup_overrides_on_top(
    monkeypatch: pytest.MonkeyPatch, core: Any
) -> None:
    chunks = [Chunk(use_mup=True), Chunk()]
    builder = Recorder(chunks, core.get_megatron_optimizer)
    monkeypatch.setattr(core, "get_megatron_optimizer", builder)
    mup_calls: list[dict[str, Any]] = []
    mup_results: list[dict[Any, Any]] = []
    # Megatron's keys and values: ParamKey -> ParamGroupOverride. Core releases that have
    # get_mup_config_overrides (0.19+) run the real one; older ones get a stand-in shaped
    # like it, whose hidden key collides with the provider's so the precedence shows.
    real_mup = getattr(core, "get_mup_config_overrides", None)
    ParamKey = core.ParamKey
    hidden, bias, embedding = (ParamKey(name=n) for n in ("*.weight", "*.bias", "*embedding*"))

    def get_mup_config_overrides(**kwargs: Any) -> dict[Any, Any]:
        mup_calls.append(kwargs)
        result = (
            real_mup(**kwargs)
            if real_mup is not None
            else {hidden: {"max_lr": 0.25}, embedding: {"max_lr": 0.5}}
        )
        mup_results.append(result)
        return result

    monkeypatch.setattr(core, "get_mup_config_overrides", get_mup_config_overrides, raising=False)
    contexts: list[Any] = []
    provided = {hidden: {"wd_mult": 0.0}, bias: {"wd_mult": 0.0}}

    class Provider:
        def build_config_overrides(self, context: Any) -> dict[str, Any]:
            contexts.append(context)
            return dict(provided)

    optimizer_config = megatron_config()
    sched = scheduler_config()
    setup_optimizer(optimizer_config, sched, chunks, False, None, Provider())

    (context,) = contexts
    assert context == OptimizerConfigOverrideProviderContext(sched, optimizer_config, chunks)
    assert mup_calls == [
        {"config": optimizer_config, "mup_width_mult": 4.0, "optimizer_type": "adam"}
    ]
    (mup,) = mup_results
    assert mup and all(isinstance(key, ParamKey) for key in mup)
    if real_mup is None:  # the stand-in's values are fields of Core's ParamGroupOverride
        scheduler = pytest.importorskip("megatron.core.optimizer_param_scheduler")
        allowed = set(scheduler.ParamGroupOverride.__annotations__)
        assert all(set(override) <= allowed for override in mup.values()), mup
    (call,) = builder.calls
    assert call["config_overrides"] == {**provided, **mup}  # muP's on top of the provider's
    if real_mup is None:
        assert call["config_overrides"][hidden] == {"max_lr": 0.25}
    assert call["use_gloo_process_groups"] is False


def test_mup_with_no_overrides_keeps_the_provider_result(
    monkeypatch: pytest.MonkeyPatch, core: Any
) -> None:
    chunk = Chunk(use_mup=True)
    builder = Recorder([chunk], core.get_megatron_optimizer)
    monkeypatch.setattr(core, "get_megatron_optimizer", builder)
    monkeypatch.setattr(core, "get_mup_config_overrides", lambda **_: {}, raising=False)
    provided = {"k": {"wd_mult": 0.0}}

    class Provider:
        def build_config_overrides(self, context: Any) -> dict[str, Any]:
            return provided

    setup_optimizer(megatron_config(), scheduler_config(), chunk, True, None, Provider())
    assert builder.calls[0]["config_overrides"] is provided


def test_mup_without_megatron_support_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, core: Any
) -> None:
    monkeypatch.delattr(core, "get_mup_config_overrides", raising=False)
    monkeypatch.setattr(core, "get_megatron_optimizer", _must_not_be_called)
    with pytest.raises(ImportError, match="get_mup_config_overrides"):
        setup_optimizer(megatron_config(), scheduler_config(), Chunk(use_mup=True))


def test_provide_hook_replaces_the_builders(
    monkeypatch: pytest.MonkeyPatch, core: Any, muon_module: Any
) -> None:
    chunk = Chunk()
    recorder = Recorder([chunk])
    monkeypatch.setattr(core, "get_megatron_optimizer", _must_not_be_called)
    monkeypatch.setattr(muon_module, "get_megatron_muon_optimizer", _must_not_be_called)

    @dataclasses.dataclass
    class ProvidingConfig(core.OptimizerConfig):  # type: ignore[misc, name-defined]
        def provide(self, **kwargs: Any) -> Any:
            return recorder(**kwargs)

    optimizer_config = ProvidingConfig(optimizer="muon", lr=1e-3, min_lr=0.0)
    optimizer, _ = setup_optimizer(optimizer_config, scheduler_config(), chunk)
    (call,) = recorder.calls
    assert set(call) == {
        "model_chunks",
        "config_overrides",
        "use_gloo_process_groups",
        "pg_collection",
    }
    assert call["model_chunks"] is chunk
    assert optimizer.param_groups[0]["params"][0] is chunk.linear.weight


@pytest.mark.parametrize(
    ("name", "layer_wise"), [("muon", False), ("dist_muon", True), ("soap", False)]
)
def test_muon_and_soap_use_the_muon_builder(
    monkeypatch: pytest.MonkeyPatch, name: str, layer_wise: bool, core: Any, muon_module: Any
) -> None:
    chunk = Chunk()
    builder = Recorder([chunk], muon_module.get_megatron_muon_optimizer)
    monkeypatch.setattr(core, "get_megatron_optimizer", _must_not_be_called)
    monkeypatch.setattr(muon_module, "get_megatron_muon_optimizer", builder)
    optimizer_config = megatron_config(optimizer=name, min_lr=0.0, weight_decay=0.0)
    setup_optimizer(optimizer_config, scheduler_config(), chunk, pg_collection="pg")
    (call,) = builder.calls
    assert call["layer_wise_distributed_optimizer"] is layer_wise
    assert call["config"] is optimizer_config
    assert call["use_gloo_process_groups"] is False
    assert call["pg_collection"] == "pg"


def test_setup_optimizer_wraps_from_the_megatron_configs(
    monkeypatch: pytest.MonkeyPatch, core: Any
) -> None:
    ddp_config = pytest.importorskip("megatron.core.distributed").DistributedDataParallelConfig
    chunk = Chunk(ddp_config=ddp_config(use_megatron_fsdp=True))
    monkeypatch.setattr(
        core, "get_megatron_optimizer", Recorder([chunk], core.get_megatron_optimizer)
    )
    optimizer, scheduler = setup_optimizer(megatron_config(), scheduler_config(), chunk)
    assert isinstance(optimizer, FSDPAwareOptimizer)
    assert optimizer.precision_aware is False
    assert isinstance(optimizer.inner, torch.optim.AdamW)
    assert scheduler.optimizer is optimizer
    # Explicit settings override derived ones; an explicit ddp_config wins over the model's.
    monkeypatch.setattr(
        core, "get_megatron_optimizer", Recorder([chunk], core.get_megatron_optimizer)
    )
    plain, _ = setup_optimizer(megatron_config(), scheduler_config(), chunk, stack={"fsdp": False})
    assert isinstance(plain, torch.optim.AdamW)
    bare, _ = setup_optimizer(
        megatron_config(),
        scheduler_config(),
        chunk,
        ddp_config=ddp_config(use_megatron_fsdp=False),
    )
    assert not isinstance(bare, OptimizerWrapper)


def test_setup_optimizer_stages_precision_aware_megatron_optimizers(
    monkeypatch: pytest.MonkeyPatch, core: Any
) -> None:
    chunk = Chunk()
    monkeypatch.setattr(
        core, "get_megatron_optimizer", Recorder([chunk], core.get_megatron_optimizer)
    )
    # megatron-core 0.16.1 refuses use_precision_aware_optimizer=True without TE: a look-alike.
    look_alike = {**vars(megatron_config()), "use_precision_aware_optimizer": True}
    look_alike["use_distributed_optimizer"] = True
    look_alike["exp_avg_dtype"] = torch.bfloat16
    precision_aware = SimpleNamespace(**look_alike)
    optimizer, _ = setup_optimizer(precision_aware, scheduler_config(), chunk)
    assert layer_names(optimizer) == ["StagedCheckpointOptimizer", "AdamW"]
    assert (optimizer.stage_save, optimizer.no_copy_load, optimizer.chunked_load) == (
        True,
        False,
        True,
    )
    monkeypatch.setattr(
        core, "get_megatron_optimizer", Recorder([chunk], core.get_megatron_optimizer)
    )
    distributed = megatron_config(use_distributed_optimizer=True)
    optimizer, _ = setup_optimizer(
        distributed, scheduler_config(), chunk, stack={"staged": {"chunk_bytes": 8}}
    )
    assert (optimizer.chunk_bytes, optimizer.stage_save, optimizer.no_copy_load) == (8, False, True)


def test_setup_optimizer_with_bridge_style_scheduler_object(
    monkeypatch: pytest.MonkeyPatch, core: Any
) -> None:
    chunk = Chunk()
    monkeypatch.setattr(
        core, "get_megatron_optimizer", Recorder([chunk], core.get_megatron_optimizer)
    )
    import attrs

    # Megatron-Bridge does not install here: its SchedulerConfig's fields on a namespace.
    bridge_like = SimpleNamespace(**attrs.asdict(scheduler_config(lr_decay_style="linear")))
    _, scheduler = setup_optimizer(megatron_config(), bridge_like, chunk)
    assert scheduler.lr_decay_style == "linear"


@pytest.mark.parametrize(
    ("optimizer_kwargs", "sched", "field"),
    [
        ({}, SchedulerConfig(), "scheduler_config.lr_decay_steps"),
        ({"min_lr": None}, None, "optimizer_config.min_lr"),
    ],
)
def test_setup_optimizer_errors_name_the_field(
    monkeypatch: pytest.MonkeyPatch,
    optimizer_kwargs: dict[str, Any],
    sched: Any,
    field: str,
    core: Any,
) -> None:
    chunk = Chunk()
    monkeypatch.setattr(
        core, "get_megatron_optimizer", Recorder([chunk], core.get_megatron_optimizer)
    )
    with pytest.raises(ConfigError) as info:
        setup_optimizer(megatron_config(**optimizer_kwargs), sched or scheduler_config(), chunk)
    assert info.value.field == field


def test_default_provider_is_megatron_standard_overrides() -> None:
    config = megatron_config(decoupled_lr=0.5)
    overrides = OptimizerConfigOverrideProvider().build_config_overrides(
        OptimizerConfigOverrideProviderContext(None, config, [])
    )
    assert {override.get("max_lr") for override in overrides.values()} == {None, 0.5}


# ----------------------------------------------------------------------------------------
# build_optimizer: names, parameters, schedules
# ----------------------------------------------------------------------------------------
NO_STACK = {"staged": False, "hybrid": False, "fsdp": False}


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("adamw", torch.optim.AdamW),
        ("AdamW", torch.optim.AdamW),
        ("sgd", torch.optim.SGD),
        ("torch.optim:Adagrad", torch.optim.Adagrad),
    ],
)
def test_optimizers_by_name(name: str, cls: type) -> None:
    assert resolve_optimizer_class(name) is cls
    model = torch.nn.Linear(2, 2)
    optimizer, scheduler = build_optimizer(
        model, {"optimizer": {"name": name, "lr": 0.1}, **NO_STACK}
    )
    assert type(optimizer) is cls
    assert scheduler is None
    assert optimizer.param_groups[0]["params"] == list(model.parameters())


def test_portable_optimizer_by_name_with_class_options() -> None:
    from wrapped_optim.optimizers import HybridOffloadOptimizer

    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    optimizer, _ = build_optimizer(
        model,
        {
            "optimizer": {
                "name": "hybrid_offload",
                "lr": 0.1,
                "offload_fraction": 1.0,
                "cpu_optimizer_cls": "sgd",
            },
            **NO_STACK,
        },
    )
    assert isinstance(optimizer, HybridOffloadOptimizer)
    assert all(isinstance(sub, torch.optim.SGD) for sub in optimizer.sub_optimizers)


def test_build_optimizer_parameters_and_groups() -> None:
    model = torch.nn.Linear(3, 3)
    model.bias.requires_grad_(False)
    optimizer, _ = build_optimizer(model, {"optimizer": {"name": "sgd", "lr": 0.1}, **NO_STACK})
    assert optimizer.param_groups[0]["params"] == [model.weight]
    groups = [{"params": [model.weight], "lr": 0.5}, {"params": [model.bias]}]
    optimizer, _ = build_optimizer(groups, {"optimizer": {"name": "sgd", "lr": 0.1}, **NO_STACK})
    assert [g["lr"] for g in optimizer.param_groups] == [0.5, 0.1]
    with pytest.raises(TypeError, match=r"nn\.Module"):
        build_optimizer(3, {"optimizer": {"name": "sgd", "lr": 0.1}})


@pytest.mark.parametrize(
    ("optimizer", "field", "text"),
    [
        ({"name": "adamx", "lr": 0.1}, "optimizer.name", "did you mean 'adamax'"),
        ({"name": "nowhere.module:Opt"}, "optimizer.name", "cannot import"),
        ({"name": "torch.optim:lr_scheduler"}, "optimizer.name", "not a class"),
        ({"name": "sgd", "lr": 0.1, "momentun": 0.9}, "optimizer", "momentun"),
        ({"name": "sgd", "lr": -1.0}, "optimizer", "Invalid learning rate"),
        (
            {"name": "hybrid_offload", "cpu_optimizer_cls": "adamq"},
            "optimizer.cpu_optimizer_cls",
            "",
        ),
    ],
)
def test_build_optimizer_errors_name_the_field(
    optimizer: dict[str, Any], field: str, text: str
) -> None:
    with pytest.raises(ConfigError) as info:
        build_optimizer(torch.nn.Linear(2, 2), {"optimizer": optimizer, **NO_STACK})
    assert info.value.field == field
    assert text in str(info.value)


def test_schedule_needs_lr_below_min_lr_check() -> None:
    with pytest.raises(ConfigError) as info:
        build_optimizer(
            torch.nn.Linear(2, 2),
            {"optimizer": {"name": "sgd", "lr": 0.1}, "schedule": {"min_lr": 0.5}, **NO_STACK},
        )
    assert info.value.field == "schedule.min_lr"


def _lrs(optimizer: Any, scheduler: Any, steps: int, megatron: bool) -> list[float]:
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        if megatron:
            scheduler.step(1)
        else:
            scheduler.step()
    return lrs


@given(
    warmup=st.integers(0, 6),
    span=st.integers(1, 12),
    style=st.sampled_from(["constant", "linear", "cosine"]),
    start=st.sampled_from([0.01, 0.25, 1.0]),
    floor=st.sampled_from([0.0, 0.1]),
)
def test_torch_schedule_matches_megatron_schedule(
    warmup: int, span: int, style: str, start: float, floor: float
) -> None:
    """The torch.optim.lr_scheduler assembly follows megatron-core's formulas."""
    import warnings

    pytest.importorskip("megatron.core.optimizer_param_scheduler")

    curves = []
    for backend in ("torch", "megatron"):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
        schedule = LRScheduleConfig(
            warmup_steps=warmup,
            warmup_start_factor=start,
            style=style,
            decay_steps=warmup + span,
            min_lr=floor * 0.5,
            backend=backend,  # type: ignore[arg-type]
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error" if backend == "torch" else "ignore")
            scheduler = _lr_scheduler(
                optimizer, OptimizerSpec(name="sgd", options={"lr": 0.5}), schedule
            )
            curves.append(_lrs(optimizer, scheduler, warmup + span + 4, backend == "megatron"))
    torch_curve, megatron_curve = curves
    assert torch_curve == pytest.approx(megatron_curve, rel=1e-9, abs=1e-12)


def test_megatron_backend_keeps_group_specific_lr_and_weight_decay() -> None:
    pytest.importorskip("megatron.core.optimizer_param_scheduler")
    model = torch.nn.Linear(2, 2)
    groups = [{"params": [model.weight]}, {"params": [model.bias], "weight_decay": 0.0, "lr": 0.05}]
    optimizer, scheduler = build_optimizer(
        groups,
        {
            "optimizer": {"name": "adamw", "lr": 0.1, "weight_decay": 0.01},
            "schedule": {"backend": "megatron", "style": "linear", "decay_steps": 4},
            **NO_STACK,
        },
    )
    scheduler.step(2)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0.0]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    assert optimizer.param_groups[1]["lr"] == pytest.approx(0.025)


# ----------------------------------------------------------------------------------------
# wrap(): the canonical stack
# ----------------------------------------------------------------------------------------
def layer_names(optimizer: Any) -> list[str]:
    return [type(layer).__name__ for layer in layers(optimizer)]


def sgd(*params: torch.Tensor) -> torch.optim.SGD:
    return torch.optim.SGD(list(params) or [torch.nn.Parameter(torch.ones(3))], lr=0.1)


def test_wrap_plain_optimizer_is_identity() -> None:
    optimizer = sgd()
    assert wrap(optimizer) is optimizer
    assert wrap(optimizer, StackConfig()) is optimizer


def test_wrap_builds_canonical_order_with_options() -> None:
    from wrapped_optim.optimizers import HybridOffloadOptimizer

    optimizer = HybridOffloadOptimizer([torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))])
    stack = wrap(
        optimizer,
        {
            "staged": {"chunk_bytes": 4096, "no_copy_load": False},
            "hybrid": {"on_stale": "raise"},
            "fsdp": {"precision_aware": True},
        },
    )
    assert layer_names(stack) == [
        "FSDPAwareOptimizer",
        "HybridSyncOptimizer",
        "StagedCheckpointOptimizer",
        "HybridOffloadOptimizer",
    ]
    fsdp, hybrid, staged, leaf = stack.layers()
    assert fsdp.precision_aware is True
    assert hybrid.on_stale == "raise"
    assert (staged.chunk_bytes, staged.stage_save, staged.no_copy_load) == (4096, True, False)
    assert leaf is optimizer
    assert wrap(stack) is stack
    assert wrap(stack, {"staged": None}) is stack


def test_wrap_refuses_a_hybrid_layer_with_nothing_to_sync() -> None:
    optimizer = sgd()
    with pytest.raises(ValueError, match=r"this stack has none \(its optimizers: SGD\); drop"):
        wrap(optimizer, {"hybrid": {"on_stale": "raise"}})
    assert layer_names(wrap(optimizer, {"hybrid": None, "staged": True})) == [
        "StagedCheckpointOptimizer",
        "SGD",
    ]


def test_wrap_derives_from_the_optimizer() -> None:
    from wrapped_optim.optimizers import HybridOffloadOptimizer, PrecisionAwareAdamW

    holder = PrecisionAwareAdamW([torch.nn.Parameter(torch.ones(4))], exp_avg_dtype=torch.bfloat16)
    assert layer_names(wrap(holder)) == ["StagedCheckpointOptimizer", "PrecisionAwareAdamW"]
    hybrid = HybridOffloadOptimizer([torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))])
    assert layer_names(wrap(hybrid)) == ["HybridSyncOptimizer", "HybridOffloadOptimizer"]
    param = torch.nn.Parameter(torch.ones(4))
    param.grad_dtype = torch.bfloat16
    stack = wrap(sgd(param))
    assert layer_names(stack) == ["FSDPAwareOptimizer", "SGD"]
    assert stack.precision_aware is False
    # Explicit False beats derivation.
    assert layer_names(wrap(holder, {"staged": False})) == ["PrecisionAwareAdamW"]


def test_wrap_derives_inside_megatron_containers() -> None:
    from tests.doubles.distributed import DistributedOptimizerDouble, ddp_config, megatron_config
    from wrapped_optim.optimizers import PrecisionAwareAdamW

    chained_optimizer = pytest.importorskip("megatron.core.optimizer").ChainedOptimizer
    leaf = PrecisionAwareAdamW([torch.nn.Parameter(torch.ones(4))])  # FP32 states
    config = megatron_config(precision_aware=False)
    # Megatron's real ChainedOptimizer around the pinned DistributedOptimizer double.
    chained = chained_optimizer([DistributedOptimizerDouble(leaf, config, ddp_config())])
    stack = wrap(chained)
    assert layer_names(stack)[0] == "StagedCheckpointOptimizer"
    assert stack.inner is chained
    stub = chained_optimizer([DistributedOptimizerDouble(None, config, ddp_config())])
    assert stub.is_stub_optimizer and wrap(stub) is stub


def test_rewrap_never_doubles_and_keeps_options() -> None:
    def refresh(group: dict[str, Any]) -> None:
        pass

    optimizer = sgd()
    fsdp = FSDPAwareOptimizer(optimizer, precision_aware=True, refresh=refresh)
    # Staging goes *inside* the existing FSDP layer, which keeps its options.
    stack = wrap(fsdp, {"staged": {"chunk_bytes": 64}})
    assert layer_names(stack) == ["FSDPAwareOptimizer", "StagedCheckpointOptimizer", "SGD"]
    assert stack.precision_aware is True and stack.refresh is refresh
    assert stack.inner.chunk_bytes == 64
    # Explicit options equal to the existing layer's keep the very same stack.
    assert wrap(stack, {"staged": {"chunk_bytes": 64}, "fsdp": {"precision_aware": True}}) is stack
    # Explicit options replace an existing layer's; the layer is not doubled.
    again = wrap(stack, {"staged": {"chunk_bytes": 128}, "fsdp": {"precision_aware": False}})
    assert layer_names(again) == layer_names(stack)
    assert again.inner.chunk_bytes == 128
    assert again.precision_aware is False and again.refresh is refresh  # refresh carried over
    # False removes a layer.
    assert layer_names(wrap(again, {"fsdp": False})) == ["StagedCheckpointOptimizer", "SGD"]
    # A hand-built stack out of canonical order is put in order, options kept.
    from wrapped_optim.hybrid import HybridSyncOptimizer
    from wrapped_optim.optimizers import HybridOffloadOptimizer

    offload = HybridOffloadOptimizer([torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))])
    hand_built = StagedCheckpointOptimizer(
        HybridSyncOptimizer(offload, on_stale="ignore"), chunk_bytes=32
    )
    ordered = wrap(hand_built)
    assert layer_names(ordered) == [
        "HybridSyncOptimizer",
        "StagedCheckpointOptimizer",
        "HybridOffloadOptimizer",
    ]
    assert ordered.on_stale == "ignore" and ordered.inner.chunk_bytes == 32
    # A canonical layer below a foreign wrapper stays where it is, never doubled.
    foreign = OptimizerWrapper(StagedCheckpointOptimizer(optimizer))
    assert wrap(foreign, {"staged": True}) is foreign
    with pytest.raises(ConfigError) as info:
        wrap(foreign, {"staged": False})
    assert info.value.field == "staged"
    with pytest.raises(TypeError):
        wrap(optimizer, 3)  # type: ignore[arg-type]


def test_full_stack_steps_and_checkpoints_like_the_bare_optimizer() -> None:
    from wrapped_optim.optimizers import HybridOffloadOptimizer

    def run(wrapped: bool) -> tuple[torch.nn.Module, dict[str, Any]]:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        optimizer: Any = HybridOffloadOptimizer(model.parameters(), lr=0.1)
        if wrapped:
            optimizer = wrap(optimizer, {"staged": True, "hybrid": True, "fsdp": True})
        scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 0.5, total_iters=2)
        for step in range(3):
            model(torch.full((1, 3), float(step))).sum().backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        return model, optimizer.state_dict()

    bare_model, bare_state = run(False)
    model, state = run(True)
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), bare_model.parameters(), strict=True)
    )
    assert state["param_groups"] == bare_state["param_groups"]
    for index, entry in bare_state["state"].items():
        assert state["state"][index].keys() == entry.keys()
        assert all(torch.equal(state["state"][index][k], v) for k, v in entry.items())


# ----------------------------------------------------------------------------------------
# End to end: TOML -> build_optimizer -> train -> checkpoint -> resume, bit-identical
# ----------------------------------------------------------------------------------------
E2E_CASES = {
    "adamw": ("adamw", torch.float32, "", ["StagedCheckpointOptimizer", "AdamW"]),
    "precision_adamw": (
        "precision_adamw",
        torch.float32,
        'exp_avg_dtype = "bf16"\nexp_avg_sq_dtype = "fp8"\n',
        ["StagedCheckpointOptimizer", "PrecisionAwareAdamW"],
    ),
    "hybrid_offload": (
        "hybrid_offload",
        torch.bfloat16,
        "offload_fraction = 0.5\n",
        ["HybridSyncOptimizer", "StagedCheckpointOptimizer", "HybridOffloadOptimizer"],
    ),
}


def _e2e_toml(name: str, extra: str) -> str:
    return (
        f'[optimizer]\nname = "{name}"\nlr = 0.01\nweight_decay = 0.01\nbetas = [0.9, 0.95]\n'
        f"{extra}\n"
        '[schedule]\nwarmup_steps = 3\nwarmup_start_factor = 0.1\nstyle = "cosine"\n'
        "decay_steps = 10\nmin_lr = 0.001\n\n"
        '[staged]\nchunk_bytes = "64B"\n'
    )


def _model(dtype: torch.dtype, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(
        dtype
    )


def _batches(dtype: torch.dtype, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1234)
    return [
        (
            torch.randn(5, 8, generator=generator).to(dtype),
            torch.randn(5, 4, generator=generator).to(dtype),
        )
        for _ in range(count)
    ]


def _train(model: torch.nn.Module, optimizer: Any, scheduler: Any, batches: list[Any]) -> None:
    for inputs, targets in batches:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs).float(), targets.float())
        loss.backward()
        optimizer.step()
        scheduler.step()


@pytest.mark.parametrize("case", list(E2E_CASES))
def test_toml_build_train_checkpoint_resume_is_bit_identical(case: str, tmp_path: Any) -> None:
    name, dtype, extra, layers = E2E_CASES[case]
    config_path = tmp_path / "train.toml"
    config_path.write_text(_e2e_toml(name, extra))
    _check_resume(config_path, dtype, layers, split=4, total=8, directory=tmp_path)


@given(
    case=st.sampled_from(list(E2E_CASES)),
    split=st.integers(1, 7),
    chunk=st.sampled_from(["4B", "64B", "1MiB"]),
)
def test_resume_after_any_step_with_any_chunk_size(case: str, split: int, chunk: str) -> None:
    import tempfile
    from pathlib import Path

    name, dtype, extra, layers = E2E_CASES[case]
    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(tmp) / "train.toml"
        config_path.write_text(_e2e_toml(name, extra).replace('"64B"', f'"{chunk}"'))
        _check_resume(config_path, dtype, layers, split=split, total=8, directory=Path(tmp))


def _check_resume(
    config_path: Any,
    dtype: torch.dtype,
    layers: list[str],
    *,
    split: int,
    total: int,
    directory: Any,
) -> None:
    batches = _batches(dtype, total)
    model = _model(dtype, seed=0)
    optimizer, scheduler = build_optimizer(model, config_path)
    assert layer_names(optimizer) == layers
    _train(model, optimizer, scheduler, batches[:split])
    checkpoint = directory / "ckpt.pt"
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
        },
        checkpoint,
    )
    staged = optimizer.find_layer(StagedCheckpointOptimizer)
    if "PrecisionAwareAdamW" in layers:  # compressed state really went through the stager
        assert staged.last_stats.staged_holders == 1 and staged.last_stats.chunked_reads > 0
    _train(model, optimizer, scheduler, batches[split:])
    expected_params = [p.detach().clone() for p in model.parameters()]
    expected_state = optimizer.state_dict()
    expected_lr = optimizer.param_groups[0]["lr"]

    resumed_model = _model(dtype, seed=1)  # different init: the checkpoint must restore it all
    resumed, resumed_scheduler = build_optimizer(resumed_model, config_path)
    saved = torch.load(checkpoint, weights_only=False)
    resumed_model.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["optimizer"])
    resumed_scheduler.load_state_dict(saved["scheduler"])
    _train(resumed_model, resumed, resumed_scheduler, batches[split:])

    for got, want in zip(resumed_model.parameters(), expected_params, strict=True):
        assert torch.equal(got, want)
    assert resumed.param_groups[0]["lr"] == expected_lr
    state = resumed.state_dict()
    assert state["param_groups"] == expected_state["param_groups"]
    for index, entry in expected_state["state"].items():
        for key, value in entry.items():
            got = state["state"][index][key]
            assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value


def test_without_megatron_core_the_errors_say_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    for name in ("megatron.core.optimizer", "megatron.core.optimizer_param_scheduler"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"wrapped-optim\[megatron\]"):
        setup_optimizer(object(), object(), torch.nn.Linear(2, 2))
    with pytest.raises(ImportError, match=r"wrapped-optim\[megatron\]"):
        build_optimizer(
            torch.nn.Linear(2, 2),
            {"optimizer": {"name": "sgd", "lr": 0.1}, "schedule": {"backend": "megatron"}},
        )
