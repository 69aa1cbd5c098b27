"""The plain-PyTorch builder: optimizer, LR schedule and wrapper stack from one config.

Megatron's own builders are driven by ``wrapped_optim.integrations.bridge`` instead.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, cast

import attrs
import torch

from wrapped_optim._config_fields import (
    ConfigError,
    check_choice,
    check_float,
    check_int_at_least,
    check_optional_int_at_least,
    closest,
    from_mapping,
    is_number,
    read_toml,
)
from wrapped_optim.config import SECTIONS, StackConfig
from wrapped_optim.stack import wrap

__all__ = [
    "BuildConfig",
    "LRScheduleConfig",
    "OptimizerSpec",
    "build_optimizer",
    "resolve_optimizer_class",
]


# ----------------------------------------------------------------------------------------
# What to build: the optimizer and its LR schedule
# ----------------------------------------------------------------------------------------
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "uint8": torch.uint8,
    "fp8": torch.uint8,
}


def _convert_option(key: str, value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_convert_option(key, v) for v in value)
    if key.endswith("dtype") and isinstance(value, str):
        if value.removeprefix("torch.") not in _DTYPES:
            raise ConfigError(
                key, f"unknown dtype {value!r}; use one of {', '.join(sorted(_DTYPES))}"
            )
        return _DTYPES[value.removeprefix("torch.")]
    return value


def _convert_options(options: Any) -> dict[str, Any]:
    if not isinstance(options, Mapping):
        raise ConfigError("options", f"must be a mapping, got {type(options).__name__}")
    return {str(k): _convert_option(str(k), v) for k, v in options.items()}


def _check_name(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(attribute.name, f"must be a non-empty string, got {value!r}")


@attrs.frozen
class OptimizerSpec:
    """Which optimizer ``wrapped_optim.build_optimizer`` builds, and its keyword arguments.

    Attributes:
        name: a ``torch.optim`` class name (any case: ``"adamw"``, ``"SGD"``), one of the
            portable optimizers (``"precision_adamw"``, ``"hybrid_offload"``), or an import
            path ``"package.module:Class"``.
        options: constructor keywords (``lr``, ``weight_decay``...). TOML arrays become
            tuples and ``*dtype`` strings (``"bf16"``, ``"fp8"``) become torch dtypes.

    Raises:
        ConfigError: ``name`` is empty, ``options`` is not a mapping, or a dtype is unknown.

    Examples:
        >>> spec = OptimizerSpec.from_dict({"name": "adamw", "lr": 1e-3, "betas": [0.9, 0.95]})
        >>> spec.name, spec.options["betas"]
        ('adamw', (0.9, 0.95))
    """

    name: str = attrs.field(validator=_check_name)
    options: dict[str, Any] = attrs.field(factory=dict, converter=_convert_options, hash=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OptimizerSpec:
        """Builds the spec from ``{"name": ..., <keyword>: <value>, ...}``.

        Args:
            data: The ``[optimizer]`` table: ``name`` and the constructor keywords.

        Raises:
            ConfigError: ``data`` is not a mapping, has no ``name``, or holds a bad value.

        Examples:
            >>> OptimizerSpec.from_dict({"name": "sgd", "lr": 0.1}).options
            {'lr': 0.1}
        """
        if not isinstance(data, Mapping):
            raise ConfigError("optimizer", f"must be a table, got {type(data).__name__}")
        if "name" not in data:
            raise ConfigError("optimizer.name", "is required (e.g. name = 'adamw')")
        options = {k: v for k, v in data.items() if k != "name"}
        try:
            return cls(name=data["name"], options=options)
        except ConfigError as error:
            raise error.under("optimizer") from None

    @property
    def lr(self) -> float:
        """The configured learning rate (``options["lr"]``), needed by LR schedules.

        Raises:
            ConfigError: ``lr`` is missing or not a number.
        """
        lr = self.options.get("lr")
        if not is_number(lr):
            raise ConfigError("optimizer.lr", f"must be a number for an LR schedule, got {lr!r}")
        return float(cast(float, lr))


_TORCH_STYLES = ("constant", "linear", "cosine")
#: The LR decay styles of megatron-core's OptimizerParamScheduler.
MEGATRON_LR_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")


@attrs.frozen(kw_only=True)
class LRScheduleConfig:
    """Warmup and decay for ``wrapped_optim.build_optimizer``, in optimizer steps.

    With ``backend="torch"`` the schedule is assembled from ``torch.optim.lr_scheduler``
    (``LinearLR`` warmup, then ``LinearLR``/``CosineAnnealingLR`` decay, then a constant
    ``min_lr``, joined by ``SequentialLR``); ``backend="megatron"`` uses megatron-core's
    ``OptimizerParamScheduler`` (also inverse-square-root and WSD; step it with ``step(1)``).

    Attributes:
        warmup_steps: linear warmup length.
        warmup_start_factor: the warmup starts at ``lr * warmup_start_factor`` (torch's
            LinearLR needs it > 0; Megatron accepts 0).
        style: decay after warmup: ``constant``, ``linear``, ``cosine`` (+ Megatron's
            ``inverse-square-root`` and ``WSD``).
        decay_steps: the step at which decay ends (warmup included); required unless
            ``style == "constant"``.
        min_lr: the learning rate at and after ``decay_steps``.
        backend: ``"torch"`` or ``"megatron"``.
        wsd_decay_steps: WSD's annealing length (Megatron only; required for ``WSD``).
        wsd_style: WSD's annealing shape: ``exponential``, ``linear``, ``cosine`` or
            ``minus_sqrt`` (Megatron only).

    Raises:
        ConfigError: an invalid value, a style the backend lacks, a missing
            ``decay_steps``, or ``decay_steps`` not after the warmup.

    Examples:
        >>> LRScheduleConfig(warmup_steps=10, style="cosine", decay_steps=100).min_lr
        0.0
    """

    warmup_steps: int = attrs.field(default=0, validator=check_int_at_least(0))
    warmup_start_factor: float = attrs.field(
        default=1e-3, validator=check_float(minimum=0.0, maximum=1.0)
    )
    style: str = attrs.field(default="constant", validator=check_choice(*MEGATRON_LR_STYLES))
    decay_steps: int | None = attrs.field(default=None, validator=check_optional_int_at_least(1))
    min_lr: float = attrs.field(default=0.0, validator=check_float(minimum=0.0))
    backend: Literal["torch", "megatron"] = attrs.field(
        default="torch", validator=check_choice("torch", "megatron")
    )
    wsd_decay_steps: int | None = attrs.field(
        default=None, validator=check_optional_int_at_least(1)
    )
    wsd_style: str = attrs.field(
        default="exponential",
        validator=check_choice("exponential", "linear", "cosine", "minus_sqrt"),
    )

    def __attrs_post_init__(self) -> None:
        if self.backend == "torch":
            if self.style not in _TORCH_STYLES:
                raise ConfigError(
                    "style",
                    f"{self.style!r} needs backend='megatron' (torch.optim.lr_scheduler has no "
                    f"such schedule); the torch backend offers {', '.join(_TORCH_STYLES)}",
                )
            if self.warmup_steps > 0 and self.warmup_start_factor == 0.0:
                raise ConfigError(
                    "warmup_start_factor",
                    "must be > 0 with backend='torch' (torch's LinearLR cannot start at 0)",
                )
        if self.decay_steps is None and self.style != "constant":
            raise ConfigError("decay_steps", f"is required for style={self.style!r}")
        if self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise ConfigError(
                "decay_steps",
                f"({self.decay_steps}) must be greater than warmup_steps ({self.warmup_steps})",
            )
        if self.style == "WSD" and self.wsd_decay_steps is None:
            raise ConfigError("wsd_decay_steps", "is required for style='WSD'")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LRScheduleConfig:
        """Builds the schedule from a mapping of its fields.

        Args:
            data: The ``[schedule]`` table; an unknown key is an error.

        Raises:
            ConfigError: an unknown key or an invalid value.

        Examples:
            >>> LRScheduleConfig.from_dict({"warmup_steps": 5}).warmup_steps
            5
        """
        return from_mapping(cls, data, "")


@attrs.frozen(kw_only=True)
class BuildConfig:
    """Everything ``wrapped_optim.build_optimizer`` needs, e.g. from one TOML file.

    Attributes:
        optimizer: The optimizer to build (the ``[optimizer]`` table).
        schedule: The LR schedule (the optional ``[schedule]`` table), or ``None``.
        stack: The wrapper stack (the ``[staged]``, ``[hybrid]``, ``[fsdp]`` tables).

    Examples:
        >>> config = BuildConfig.from_dict({
        ...     "optimizer": {"name": "adamw", "lr": 1e-3},
        ...     "schedule": {"warmup_steps": 2, "style": "cosine", "decay_steps": 10},
        ...     "staged": {"chunk_bytes": "1MiB"}})
        >>> config.optimizer.name, config.schedule.style, config.stack.staged.chunk_bytes
        ('adamw', 'cosine', 1048576)
    """

    optimizer: OptimizerSpec
    schedule: LRScheduleConfig | None = None
    stack: StackConfig = attrs.field(factory=StackConfig)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BuildConfig:
        """Builds the config from ``{"optimizer": {...}, "schedule": {...}, "staged": ...}``.

        Args:
            data: The tables by name.

        Raises:
            ConfigError: no ``optimizer`` table, an unknown table, or an invalid value.

        Examples:
            >>> BuildConfig.from_dict({"optimizer": {"name": "sgd", "lr": 0.1}}).schedule is None
            True
        """
        if not isinstance(data, Mapping):
            raise ConfigError("config", f"must be a mapping, got {type(data).__name__}")
        rest = dict(data)
        if "optimizer" not in rest:
            raise ConfigError("optimizer", "table is required (with at least name = '...')")
        optimizer = OptimizerSpec.from_dict(rest.pop("optimizer"))
        schedule_data = rest.pop("schedule", None)
        schedule = None
        if schedule_data is not None:
            schedule = from_mapping(LRScheduleConfig, schedule_data, "schedule")
        stack_keys = [k for k in rest if k not in SECTIONS]
        if stack_keys:
            hint = closest(stack_keys[0], ["optimizer", "schedule", *SECTIONS])
            raise ConfigError(
                stack_keys[0],
                f"unknown table{hint}; expected optimizer, schedule, staged, hybrid, fsdp",
            )
        return cls(optimizer=optimizer, schedule=schedule, stack=StackConfig.from_dict(rest))

    @classmethod
    def from_toml(cls, path: str | Path, *, table: str | None = None) -> BuildConfig:
        """Reads a build config from a TOML file.

        Args:
            path: The TOML file.
            table: A dotted table holding the config (e.g. ``"tool.wrapped_optim"``); without
                it the whole document is the config.

        Raises:
            ConfigError: an unknown table or key, or an invalid value.

        Examples:
            >>> import pathlib, tempfile
            >>> path = pathlib.Path(tempfile.mkdtemp()) / "train.toml"
            >>> _ = path.write_text('[optimizer]\\nname = "adamw"\\nlr = 0.001\\n')
            >>> BuildConfig.from_toml(path).optimizer.options
            {'lr': 0.001}
        """
        return cls.from_dict(read_toml(path, table))


# ----------------------------------------------------------------------------------------
# Building it
# ----------------------------------------------------------------------------------------
_PORTABLE = {
    "precision_adamw": ("wrapped_optim.optimizers", "PrecisionAwareAdamW"),
    "precisionawareadamw": ("wrapped_optim.optimizers", "PrecisionAwareAdamW"),
    "hybrid_offload": ("wrapped_optim.optimizers", "HybridOffloadOptimizer"),
    "hybridoffloadoptimizer": ("wrapped_optim.optimizers", "HybridOffloadOptimizer"),
}


def _torch_optimizers() -> dict[str, type]:
    found = {}
    for attr in dir(torch.optim):
        value = getattr(torch.optim, attr)
        is_optimizer = isinstance(value, type) and issubclass(value, torch.optim.Optimizer)
        if is_optimizer and value is not torch.optim.Optimizer:
            found[attr.lower()] = value
    return found


def resolve_optimizer_class(name: str, *, field: str = "optimizer.name") -> type:
    """The optimizer class a config name means.

    A ``torch.optim`` class name in any case, a portable optimizer (``precision_adamw``,
    ``hybrid_offload``), or ``"package.module:Class"``.

    Examples:
        >>> resolve_optimizer_class("adamw").__name__
        'AdamW'
    """
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            value = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as error:
            raise ConfigError(field, f"cannot import {name!r}: {error}") from None
        if not isinstance(value, type):
            raise ConfigError(field, f"{name!r} is not a class")
        return value
    key = name.lower()
    if key in _PORTABLE:
        module_name, attr = _PORTABLE[key]
        return getattr(importlib.import_module(module_name), attr)
    torch_optimizers = _torch_optimizers()
    if key in torch_optimizers:
        return torch_optimizers[key]
    import difflib

    known = sorted([*torch_optimizers, "precision_adamw", "hybrid_offload"])
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(
        field,
        f"unknown optimizer {name!r}{hint}; use a torch.optim name, precision_adamw, "
        "hybrid_offload or 'package.module:Class'",
    )


def _params_of(model_or_params: Any) -> Any:
    if isinstance(model_or_params, torch.nn.Module):
        return [p for p in model_or_params.parameters() if p.requires_grad]
    if isinstance(model_or_params, torch.Tensor):
        return [model_or_params]
    if isinstance(model_or_params, Iterable):
        return list(model_or_params)
    raise TypeError(
        "build_optimizer needs a torch.nn.Module, a tensor, or an iterable of parameters or "
        f"parameter groups; got {type(model_or_params).__name__}"
    )


def _build_config(config: Any) -> BuildConfig:
    if isinstance(config, BuildConfig):
        return config
    if isinstance(config, (str, Path)):
        return BuildConfig.from_toml(config)
    if isinstance(config, Mapping):
        return BuildConfig.from_dict(config)
    raise TypeError(
        f"config must be a BuildConfig, a mapping or a TOML path, got {type(config).__name__}"
    )


def build_optimizer(
    model_or_params: Any, config: BuildConfig | Mapping[str, Any] | str | Path
) -> tuple[Any, Any]:
    """Builds a wrapped optimizer and its LR scheduler from one config, for plain PyTorch.

    The optimizer comes from ``[optimizer]`` (``*_cls`` options are resolved by name too), the
    stack from ``[staged]``/``[hybrid]``/``[fsdp]`` (absent sections derived, as ``wrap``
    does), the scheduler from ``[schedule]``.

    Args:
        model_or_params: A module (its trainable parameters), a tensor, or an iterable of
            parameters or parameter groups.
        config: A ``BuildConfig``, its dict form, or the path of a TOML file.

    Returns:
        ``(optimizer, scheduler)``: the optimizer wrapped by ``wrap``, and a
        ``torch.optim.lr_scheduler`` scheduler (step it with ``scheduler.step()``), megatron-core's
        ``OptimizerParamScheduler`` (``backend = "megatron"``; ``scheduler.step(1)``), or
        ``None`` without a schedule.

    Raises:
        ConfigError: the config is invalid or the optimizer rejects its options.
        TypeError: ``model_or_params`` or ``config`` is of an unsupported type.

    Examples:
        >>> import torch
        >>> from wrapped_optim import build_optimizer
        >>> model = torch.nn.Linear(2, 1)
        >>> opt, sched = build_optimizer(model, {
        ...     "optimizer": {"name": "adamw", "lr": 0.1},
        ...     "schedule": {"warmup_steps": 2, "warmup_start_factor": 0.5,
        ...                  "style": "linear", "decay_steps": 4}})
        >>> lrs = []
        >>> for _ in range(5):
        ...     lrs.append(round(opt.param_groups[0]["lr"], 4))
        ...     opt.step(); sched.step()
        >>> lrs
        [0.05, 0.075, 0.1, 0.05, 0.0]
    """
    build = _build_config(config)
    cls = resolve_optimizer_class(build.optimizer.name)
    options = {
        key: (
            resolve_optimizer_class(value, field=f"optimizer.{key}")
            if key.endswith("_cls") and isinstance(value, str)
            else value
        )
        for key, value in build.optimizer.options.items()
    }
    params = _params_of(model_or_params)
    try:
        optimizer = cls(params, **options)
    except (TypeError, ValueError) as error:
        raise ConfigError("optimizer", f"{cls.__name__} rejected its options: {error}") from error
    wrapped = wrap(optimizer, build.stack)
    scheduler = None
    if build.schedule is not None:
        scheduler = _lr_scheduler(wrapped, build.optimizer, build.schedule)
    return wrapped, scheduler


def _lr_scheduler(optimizer: Any, spec: OptimizerSpec, schedule: LRScheduleConfig) -> Any:
    lr = spec.lr
    if schedule.min_lr > lr:
        raise ConfigError("schedule.min_lr", f"({schedule.min_lr}) must be <= optimizer.lr ({lr})")
    if schedule.backend == "megatron":
        return _megatron_lr_scheduler(optimizer, lr, schedule)

    sched = torch.optim.lr_scheduler
    parts: list[Any] = []
    milestones: list[int] = []
    warmup = schedule.warmup_steps
    if warmup > 0:
        parts.append(
            sched.LinearLR(
                optimizer,
                start_factor=schedule.warmup_start_factor,
                end_factor=1.0,
                total_iters=warmup,
            )
        )
    if schedule.style != "constant":
        assert schedule.decay_steps is not None  # validated by LRScheduleConfig
        span = schedule.decay_steps - warmup
        floor = schedule.min_lr / lr if lr > 0 else 0.0
        if warmup > 0:
            milestones.append(warmup)
        if schedule.style == "linear":
            parts.append(sched.LinearLR(optimizer, 1.0, floor, total_iters=span))
        else:
            parts.append(sched.CosineAnnealingLR(optimizer, T_max=span, eta_min=schedule.min_lr))
            # Cosine annealing is periodic: hold min_lr once the decay is over.
            milestones.append(schedule.decay_steps)
            parts.append(sched.ConstantLR(optimizer, factor=floor, total_iters=2**62))
    if not parts:
        return sched.ConstantLR(optimizer, factor=1.0, total_iters=0)
    if len(parts) == 1:
        return parts[0]
    return sched.SequentialLR(optimizer, parts, milestones=milestones)


def _megatron_lr_scheduler(optimizer: Any, lr: float, schedule: LRScheduleConfig) -> Any:
    try:
        scheduler_module = importlib.import_module("megatron.core.optimizer_param_scheduler")
    except ImportError as error:
        raise ImportError(
            "schedule.backend = 'megatron' needs megatron-core: "
            "pip install 'wrapped-optim[megatron]'"
        ) from error
    defaults = getattr(optimizer, "defaults", {}) or {}
    weight_decay = float(defaults.get("weight_decay", 0.0))
    for group in optimizer.param_groups:
        # Megatron's scheduler writes lr and weight_decay into every group from its own
        # values; groups configured differently keep theirs through its per-group keys.
        if "weight_decay" in group and group["weight_decay"] != weight_decay:
            group.setdefault("start_wd", group["weight_decay"])
            group.setdefault("end_wd", group["weight_decay"])
        if "lr" in group and group["lr"] != lr:
            group.setdefault("max_lr", group["lr"])
    decay_steps = schedule.decay_steps or schedule.warmup_steps + 1
    return scheduler_module.OptimizerParamScheduler(
        optimizer,
        init_lr=lr * schedule.warmup_start_factor,
        max_lr=lr,
        min_lr=schedule.min_lr,
        lr_warmup_steps=schedule.warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=schedule.style,
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=False,
        wsd_decay_steps=schedule.wsd_decay_steps,
        lr_wsd_decay_style=schedule.wsd_style,
    )
