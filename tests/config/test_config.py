"""StackConfig and friends: every path in, every error out names its field."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from wrapped_optim._builder import BuildConfig, LRScheduleConfig, OptimizerSpec
from wrapped_optim.config import (
    ConfigError,
    FSDPConfig,
    HybridConfig,
    StackConfig,
    StagedConfig,
)
from wrapped_optim.integrations.bridge import SchedulerConfig

# ----------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------


def test_defaults_match_the_contract() -> None:
    staged = StagedConfig()
    assert (staged.chunk_bytes, staged.stage_save, staged.no_copy_load, staged.chunked_load) == (
        64 << 20,
        True,
        True,
        True,
    )
    assert StagedConfig(1024, True, False, False) == StagedConfig(
        chunk_bytes=1024, stage_save=True, no_copy_load=False, chunked_load=False
    )
    assert HybridConfig().on_stale == "refresh"
    assert FSDPConfig().precision_aware is False
    assert StackConfig() == StackConfig(staged=None, hybrid=None, fsdp=None)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4096", 4096), ("64MiB", 64 << 20), ("1 GB", 10**9), ("2kib", 2048), ("8B", 8)],
)
def test_chunk_bytes_accepts_size_strings(text: str, expected: int) -> None:
    assert StagedConfig(chunk_bytes=text).chunk_bytes == expected


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: StagedConfig(chunk_bytes=0), "chunk_bytes"),
        (lambda: StagedConfig(chunk_bytes=3), "chunk_bytes"),
        (lambda: StagedConfig(chunk_bytes=True), "chunk_bytes"),
        (lambda: StagedConfig(chunk_bytes=1.5), "chunk_bytes"),
        (lambda: StagedConfig(chunk_bytes="lots"), "chunk_bytes"),
        (lambda: StagedConfig(stage_save=1), "stage_save"),
        (lambda: StagedConfig(no_copy_load="yes"), "no_copy_load"),
        (lambda: StagedConfig(chunked_load=None), "chunked_load"),
        (
            lambda: StagedConfig(stage_save=False, no_copy_load=False, chunked_load=False),
            "stage_save",
        ),
        (lambda: HybridConfig(on_stale="sometimes"), "on_stale"),
        (lambda: FSDPConfig(precision_aware="true"), "precision_aware"),
        (lambda: StackConfig(staged=HybridConfig()), "staged"),
        (lambda: StackConfig(hybrid=3), "hybrid"),
    ],
)
def test_invalid_values_name_the_field(make: Any, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        make()
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_configs_are_frozen() -> None:
    import attrs

    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        StagedConfig().chunk_bytes = 1  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        StackConfig().staged = None  # type: ignore[misc]


# ----------------------------------------------------------------------------------------
# from_dict / to_dict / TOML
# ----------------------------------------------------------------------------------------


def test_from_dict_three_valued_sections() -> None:
    config = StackConfig.from_dict({"staged": True, "hybrid": False, "fsdp": {}})
    assert config.staged == StagedConfig()
    assert config.hybrid is False
    assert config.fsdp == FSDPConfig()
    assert StackConfig.from_dict({}).staged is None


@pytest.mark.parametrize(
    ("data", "field", "hint"),
    [
        ({"stagd": {}}, "stagd", "did you mean 'staged'"),
        ({"staged": {"chunk_byte": 4}}, "staged.chunk_byte", "did you mean 'chunk_bytes'"),
        ({"staged": {"chunk_bytes": -1}}, "staged.chunk_bytes", ""),
        ({"hybrid": {"on_stale": "never"}}, "hybrid.on_stale", "'refresh'"),
        ({"fsdp": {"precision_aware": 2}}, "fsdp.precision_aware", ""),
        ({"fsdp": "yes"}, "fsdp", ""),
    ],
)
def test_from_dict_errors_name_the_path(data: dict[str, Any], field: str, hint: str) -> None:
    with pytest.raises(ConfigError) as info:
        StackConfig.from_dict(data)
    assert info.value.field == field
    assert hint in str(info.value)


def test_from_dict_rejects_non_mapping() -> None:
    with pytest.raises(ConfigError):
        StackConfig.from_dict([("staged", True)])  # type: ignore[arg-type]


sections = st.fixed_dictionaries(
    {},
    optional={
        "staged": st.one_of(
            st.just(False),
            st.builds(
                StagedConfig,
                chunk_bytes=st.integers(4, 1 << 40),
                stage_save=st.just(True),
                no_copy_load=st.booleans(),
                chunked_load=st.booleans(),
            ),
        ),
        "hybrid": st.one_of(
            st.just(False),
            st.builds(HybridConfig, on_stale=st.sampled_from(["refresh", "raise", "ignore"])),
        ),
        "fsdp": st.one_of(st.just(False), st.builds(FSDPConfig, precision_aware=st.booleans())),
    },
)
stack_configs = sections.map(lambda kwargs: StackConfig(**kwargs))


@given(stack_configs)
def test_dict_round_trip(config: StackConfig) -> None:
    assert StackConfig.from_dict(config.to_dict()) == config


@given(stack_configs)
def test_toml_round_trip(config: StackConfig) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "stack.toml"
        path.write_text(config.to_toml())
        assert StackConfig.from_toml(path) == config


def test_from_toml_nested_table(tmp_path: Path) -> None:
    path = tmp_path / "pyproject.toml"
    path.write_text(
        '[project]\nname = "x"\n\n[tool.wrapped_optim]\nfsdp = true\n\n'
        '[tool.wrapped_optim.staged]\nchunk_bytes = "2MiB"\nno_copy_load = false\n'
    )
    config = StackConfig.from_toml(path, table="tool.wrapped_optim")
    assert config.staged == StagedConfig(chunk_bytes=2 << 20, no_copy_load=False)
    assert config.fsdp == FSDPConfig()
    with pytest.raises(ConfigError, match="project"):
        StackConfig.from_toml(path)  # the whole document is not a stack config
    with pytest.raises(ConfigError) as info:
        StackConfig.from_toml(path, table="tool.other")
    assert info.value.field == "tool.other"


def test_from_toml_reports_toml_errors_and_field_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[staged\n")
    import tomllib

    with pytest.raises(ConfigError) as syntax:  # issue #36 item 7: one error type, the file named
        StackConfig.from_toml(bad)
    assert syntax.value.field == str(bad) and "not valid TOML" in str(syntax.value)
    assert isinstance(syntax.value.__cause__, tomllib.TOMLDecodeError)
    wrong = tmp_path / "wrong.toml"
    wrong.write_text("[hybrid]\non_stale = 'later'\n")
    with pytest.raises(ConfigError) as info:
        StackConfig.from_toml(wrong)
    assert info.value.field == "hybrid.on_stale"


def test_build_optimizer_names_a_toml_file_with_a_syntax_error(tmp_path: Path) -> None:
    from wrapped_optim import build_optimizer

    bad = tmp_path / "train.toml"
    bad.write_text("[optimizer]\nname = 'adamw'\nlr = = 0.1\n")
    with pytest.raises(ConfigError, match=r"train\.toml: is not valid TOML \(.*line 3"):
        build_optimizer([torch.nn.Parameter(torch.ones(2))], bad)


# ----------------------------------------------------------------------------------------
# Overrides
# ----------------------------------------------------------------------------------------


def test_override_mapping_merges_fields_and_stackconfig_replaces() -> None:
    base = StackConfig(staged=StagedConfig(stage_save=False, chunk_bytes=1024), hybrid=False)
    merged = base.override({"staged": {"chunk_bytes": 4096}, "hybrid": True})
    assert merged.staged == StagedConfig(stage_save=False, chunk_bytes=4096)
    assert merged.hybrid == HybridConfig()
    assert merged.fsdp is None
    replaced = base.override(StackConfig(staged=StagedConfig()))
    assert replaced.staged == StagedConfig()
    assert replaced.hybrid is False  # None in the override keeps the base
    assert base.override({"staged": False}).staged is False
    with pytest.raises(ConfigError) as info:
        base.override({"staged": {"chunk_bytes": 0}})
    assert info.value.field == "staged.chunk_bytes"
    with pytest.raises(ConfigError) as info:
        base.override({"hybrid": {"on_stal": "raise"}})
    assert info.value.field == "hybrid.on_stal"
    with pytest.raises(TypeError):
        base.override(3)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------
# from_megatron
# ----------------------------------------------------------------------------------------


def megatron(**flags: Any) -> SimpleNamespace:
    base: dict[str, Any] = {
        "optimizer": "adam",
        "use_distributed_optimizer": False,
        "use_precision_aware_optimizer": False,
        "optimizer_cpu_offload": False,
        "exp_avg_dtype": torch.float32,
        "exp_avg_sq_dtype": torch.float32,
        "main_params_dtype": torch.float32,
    }
    base.update(flags)
    return SimpleNamespace(**base)


def test_from_megatron_precision_aware_stages_save() -> None:
    config = StackConfig.from_megatron(
        megatron(
            use_precision_aware_optimizer=True,
            use_distributed_optimizer=True,
            exp_avg_dtype=torch.bfloat16,
        ),
        SimpleNamespace(use_megatron_fsdp=False),
    )
    assert config.staged == StagedConfig(stage_save=True, no_copy_load=False, chunked_load=True)
    assert config.hybrid is False
    assert config.fsdp is False


def test_from_megatron_distributed_fp32_adam_loads_without_copies() -> None:
    config = StackConfig.from_megatron(megatron(use_distributed_optimizer=True))
    assert config.staged == StagedConfig(stage_save=False, no_copy_load=True, chunked_load=False)
    assert config.fsdp is None  # no ddp_config: left to derivation from the optimizer
    assert StackConfig.from_megatron(megatron()).staged is False  # not distributed
    sgd = megatron(use_distributed_optimizer=True, optimizer="sgd")
    assert StackConfig.from_megatron(sgd).staged is False


def test_from_megatron_cpu_offload_syncs_hybrid_and_skips_staging() -> None:
    config = StackConfig.from_megatron(
        megatron(optimizer_cpu_offload=True, use_distributed_optimizer=True)
    )
    assert config.hybrid == HybridConfig()
    assert config.staged is False


def test_from_megatron_refuses_precision_aware_with_cpu_offload() -> None:
    # Core builds the HybridDeviceOptimizer without the precision-aware dtypes: refused, not
    # silently given FP32 moments (tests/megatron_real/test_precision_aware.py sees Core do it).
    settings = megatron(
        optimizer_cpu_offload=True,
        use_distributed_optimizer=True,
        use_precision_aware_optimizer=True,
        exp_avg_dtype=torch.bfloat16,
    )
    with pytest.raises(ConfigError, match="optimizer_cpu_offload: cannot be combined") as error:
        StackConfig.from_megatron(settings)
    assert "silently ignored" in str(error.value) and "Turn one of them off" in str(error.value)


def test_from_megatron_fsdp() -> None:
    ddp = SimpleNamespace(use_megatron_fsdp=True)
    plain = StackConfig.from_megatron(megatron(use_distributed_optimizer=True), ddp)
    assert plain.fsdp == FSDPConfig(precision_aware=False)
    assert plain.staged is False
    aware = StackConfig.from_megatron(
        megatron(use_distributed_optimizer=True, use_precision_aware_optimizer=True), ddp
    )
    assert aware.fsdp == FSDPConfig(precision_aware=True)


def test_from_megatron_explicit_settings_win() -> None:
    config = StackConfig.from_megatron(
        megatron(optimizer_cpu_offload=True, use_distributed_optimizer=True),
        SimpleNamespace(use_megatron_fsdp=True),
        overrides={"hybrid": {"on_stale": "raise"}, "fsdp": False, "staged": {"chunk_bytes": 8}},
    )
    assert config.hybrid == HybridConfig(on_stale="raise")
    assert config.fsdp is False
    assert config.staged == StagedConfig(chunk_bytes=8)  # off when derived: defaults + explicit
    toml_like = StackConfig.from_megatron(megatron(), overrides=StackConfig(hybrid=True))
    assert toml_like.hybrid == HybridConfig()


def test_from_megatron_with_real_megatron_config() -> None:
    core = pytest.importorskip("megatron.core.optimizer")
    real = core.OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True)
    config = StackConfig.from_megatron(real)
    assert config.staged == StagedConfig(stage_save=False, no_copy_load=True, chunked_load=False)
    offload = core.OptimizerConfig(optimizer="adam", lr=1e-3, optimizer_cpu_offload=True)
    assert StackConfig.from_megatron(offload).hybrid == HybridConfig()


@pytest.mark.parametrize(
    ("config", "ddp", "field"),
    [
        (megatron(use_precision_aware_optimizer=True), None, "use_precision_aware_optimizer"),
        (
            megatron(
                use_precision_aware_optimizer=True, use_distributed_optimizer=True, optimizer="sgd"
            ),
            None,
            "use_precision_aware_optimizer",
        ),
        (megatron(exp_avg_dtype=torch.bfloat16), None, "exp_avg_dtype"),
        (megatron(main_params_dtype=torch.float16), None, "main_params_dtype"),
        (megatron(optimizer_cpu_offload="yes"), None, "optimizer_cpu_offload"),
        (megatron(optimizer=None), None, "optimizer"),
        (megatron(), SimpleNamespace(use_megatron_fsdp=1), "use_megatron_fsdp"),
    ],
)
def test_from_megatron_errors_name_the_field(config: Any, ddp: Any, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        StackConfig.from_megatron(config, ddp)
    assert info.value.field.endswith(field)


def test_from_megatron_needs_a_config() -> None:
    with pytest.raises(TypeError):
        StackConfig.from_megatron(None)


# ----------------------------------------------------------------------------------------
# Build config (build_optimizer) and scheduler config (setup_optimizer)
# ----------------------------------------------------------------------------------------


def test_build_config_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "train.toml"
    path.write_text(
        'hybrid = false\n\n[optimizer]\nname = "precision_adamw"\nlr = 0.001\n'
        'betas = [0.9, 0.95]\nexp_avg_dtype = "bf16"\nexp_avg_sq_dtype = "fp8"\n\n'
        '[schedule]\nwarmup_steps = 10\nstyle = "cosine"\ndecay_steps = 100\nmin_lr = 1e-5\n\n'
        '[staged]\nchunk_bytes = "1MiB"\n'
    )
    config = BuildConfig.from_toml(path)
    assert config.optimizer.name == "precision_adamw"
    assert config.optimizer.options == {
        "lr": 0.001,
        "betas": (0.9, 0.95),
        "exp_avg_dtype": torch.bfloat16,
        "exp_avg_sq_dtype": torch.uint8,
    }
    assert config.schedule == LRScheduleConfig(
        warmup_steps=10, style="cosine", decay_steps=100, min_lr=1e-5
    )
    assert config.stack == StackConfig(staged=StagedConfig(chunk_bytes=1 << 20), hybrid=False)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({}, "optimizer"),
        ({"optimizer": {"lr": 1}}, "optimizer.name"),
        ({"optimizer": {"name": ""}}, "optimizer.name"),
        ({"optimizer": {"name": "sgd", "exp_avg_dtype": "fp7"}}, "optimizer.exp_avg_dtype"),
        ({"optimizer": {"name": "sgd"}, "schedul": {}}, "schedul"),
        ({"optimizer": {"name": "sgd"}, "schedule": {"warmup": 3}}, "schedule.warmup"),
        ({"optimizer": {"name": "sgd"}, "schedule": {"style": "cosine"}}, "schedule.decay_steps"),
        ({"optimizer": {"name": "sgd"}, "schedule": {"style": "WSD"}}, "schedule.style"),
        (
            {
                "optimizer": {"name": "sgd"},
                "schedule": {"warmup_steps": 5, "decay_steps": 5, "style": "linear"},
            },
            "schedule.decay_steps",
        ),
        (
            {
                "optimizer": {"name": "sgd"},
                "schedule": {"warmup_steps": 5, "warmup_start_factor": 0.0},
            },
            "schedule.warmup_start_factor",
        ),
        (
            {
                "optimizer": {"name": "sgd"},
                "schedule": {"style": "WSD", "backend": "megatron", "decay_steps": 9},
            },
            "schedule.wsd_decay_steps",
        ),
        ({"optimizer": {"name": "sgd"}, "staged": {"chunk_bytes": 0}}, "staged.chunk_bytes"),
    ],
)
def test_build_config_errors_name_the_field(data: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        BuildConfig.from_dict(data)
    assert info.value.field == field


def test_optimizer_spec_lr_required_for_schedules() -> None:
    with pytest.raises(ConfigError) as info:
        _ = OptimizerSpec(name="sgd").lr
    assert info.value.field == "optimizer.lr"


def test_scheduler_config_iteration_steps_match_bridge() -> None:
    config = SchedulerConfig(lr_decay_style="cosine", lr_warmup_iters=10, lr_decay_iters=50)
    derived = config.with_steps(train_iters=100, global_batch_size=4)
    assert derived.lr_decay_steps == 200
    assert derived.lr_warmup_steps == 40
    assert derived.wd_incr_steps == 400
    assert derived.wsd_decay_steps is None
    wsd = SchedulerConfig(lr_decay_style="WSD").with_steps(train_iters=10, global_batch_size=2)
    assert (wsd.lr_wsd_decay_iters, wsd.wsd_decay_steps) == (10, 20)
    frac = SchedulerConfig(lr_warmup_fraction=0.1).with_steps(train_iters=10, global_batch_size=3)
    assert frac.lr_warmup_steps == pytest.approx(3.0)
    capped = SchedulerConfig(max_steps=40).with_steps(train_iters=20, global_batch_size=1)
    assert (capped.lr_decay_steps, capped.wd_incr_steps) == (40, 40)


def test_scheduler_config_sample_steps_and_warmup_cap() -> None:
    derived = SchedulerConfig(lr_warmup_samples=10, lr_wsd_decay_samples=5).with_steps(
        train_samples=100
    )
    assert (derived.lr_decay_steps, derived.wd_incr_steps, derived.lr_warmup_steps) == (
        100,
        100,
        10,
    )
    assert derived.wsd_decay_steps == 5
    with pytest.warns(UserWarning, match="capping"):
        capped = SchedulerConfig(lr_warmup_iters=50).with_steps(train_iters=10, global_batch_size=1)
    assert capped.lr_warmup_steps == 9


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (
            lambda: SchedulerConfig(start_weight_decay=-0.1, end_weight_decay=0.0),
            "start_weight_decay",
        ),
        (lambda: SchedulerConfig(start_weight_decay=0.1, end_weight_decay=0.0), "end_weight_decay"),
        (
            lambda: SchedulerConfig(start_weight_decay=0.1, end_weight_decay=0.2),
            "end_weight_decay",
        ),
        (
            lambda: SchedulerConfig(
                override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=True
            ),
            "override_opt_param_scheduler",
        ),
        (lambda: SchedulerConfig(lr_decay_iters=10, lr_warmup_samples=3), "lr_warmup_samples"),
        (lambda: SchedulerConfig(lr_warmup_fraction=0.1, lr_warmup_iters=3), "lr_warmup_fraction"),
        (lambda: SchedulerConfig(lr_decay_style="step"), "lr_decay_style"),
        (lambda: SchedulerConfig(lr_wsd_decay_style="sqrt"), "lr_wsd_decay_style"),
        (lambda: SchedulerConfig(weight_decay_incr_style="exp"), "weight_decay_incr_style"),
        (lambda: SchedulerConfig(lr_warmup_fraction=1.5), "lr_warmup_fraction"),
        (lambda: SchedulerConfig(max_steps=0), "max_steps"),
        (
            lambda: SchedulerConfig(max_steps=5).with_steps(train_iters=10, global_batch_size=1),
            "max_steps",
        ),
        (lambda: SchedulerConfig(max_steps=5).with_steps(train_samples=10), "max_steps"),
        (
            lambda: SchedulerConfig(lr_warmup_iters=2).with_steps(train_samples=10),
            "lr_warmup_iters",
        ),
        (
            lambda: SchedulerConfig(lr_decay_samples=2).with_steps(
                train_iters=1, global_batch_size=1
            ),
            "lr_decay_samples",
        ),
        (lambda: SchedulerConfig().with_steps(train_iters=10), "train_iters"),
        (lambda: SchedulerConfig().with_steps(train_iters=0, global_batch_size=1), "train_iters"),
        (lambda: SchedulerConfig.from_dict({"lr_decay": 3}), "lr_decay"),
    ],
)
def test_scheduler_config_validation_names_the_field(make: Any, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        make()
    assert info.value.field == field
