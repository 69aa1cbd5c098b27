"""Validated, frozen configuration: which wrappers a stack gets, and how they behave.

Users configure, they do not hand-assemble. A :class:`StackConfig` holds one optional section
per wrapper (``staged``, ``hybrid``, ``fsdp``). Each section is three-valued:

* a section object (``StagedConfig(...)``, or ``true`` / a table in TOML) turns the layer on
  with those options;
* ``False`` turns it off, whatever derivation would say;
* ``None`` (absent) leaves the decision to derivation — from the optimizer itself
  (:func:`wrapped_optim.wrap`) or from Megatron's configs (:meth:`StackConfig.from_megatron`).

The same shape reads from a dict, a TOML file (``[staged]``, ``[hybrid]``, ``[fsdp]`` tables)
and the attrs classes, and every rejected value raises :class:`ConfigError` naming the field.

:class:`BuildConfig` adds the ``[optimizer]`` and ``[schedule]`` tables that
:func:`wrapped_optim.build_optimizer` needs, and :class:`SchedulerConfig` mirrors
Megatron-Bridge's scheduler configuration for :func:`wrapped_optim.setup_optimizer`.
"""

from __future__ import annotations

import math
import re
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, Literal, TypeVar, cast

import attrs
import torch

__all__ = [
    "BuildConfig",
    "ConfigError",
    "FSDPConfig",
    "HybridConfig",
    "LRScheduleConfig",
    "OptimizerSpec",
    "SchedulerConfig",
    "StackConfig",
    "StagedConfig",
]

S = TypeVar("S")


class ConfigError(ValueError):
    """A configuration value or combination was rejected.

    ``field`` is the dotted path of the offending setting (``"staged.chunk_bytes"``), also the
    first word of the message.

    Example:
        >>> try:
        ...     StagedConfig(chunk_bytes=0)
        ... except ConfigError as error:
        ...     error.field
        'chunk_bytes'
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason

    def under(self, prefix: str) -> ConfigError:
        """The same error with ``prefix.`` put in front of its field path."""
        return ConfigError(f"{prefix}.{self.field}", self.reason)


# ----------------------------------------------------------------------------------------
# Field helpers
# ----------------------------------------------------------------------------------------
_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})


def _to_bytes(value: Any) -> Any:
    # "64MiB", "1 GB", "4096" -> int; anything else is left for the validator to reject.
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match is not None:
            unit = (match.group(2) or "B").lower()
            return int(match.group(1)) * _UNITS[unit]
    return value


def _check_bool(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(attribute.name, f"must be true or false, got {value!r}")


def _check_choice(*choices: str) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in choices:
            raise ConfigError(
                attribute.name, f"must be one of {', '.join(map(repr, choices))}; got {value!r}"
            )

    return check


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int_at_least(minimum: int) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not _is_int(value) or value < minimum:
            raise ConfigError(attribute.name, f"must be an integer >= {minimum}, got {value!r}")

    return check


def _check_optional_int_at_least(minimum: int) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    inner = _check_int_at_least(minimum)

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None:
            inner(instance, attribute, value)

    return check


def _check_float(
    *, minimum: float | None = None, maximum: float | None = None, optional: bool = False
) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None and optional:
            return
        if not _is_number(value) or not math.isfinite(value):
            raise ConfigError(attribute.name, f"must be a finite number, got {value!r}")
        if minimum is not None and value < minimum:
            raise ConfigError(attribute.name, f"must be >= {minimum}, got {value!r}")
        if maximum is not None and value > maximum:
            raise ConfigError(attribute.name, f"must be <= {maximum}, got {value!r}")

    return check


def _known_keys(cls: type, data: Mapping[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ConfigError(where, f"must be a table/mapping, got {type(data).__name__}")
    names = [a.name for a in attrs.fields(cls) if a.init]
    for key in data:
        if key not in names:
            hint = _closest(str(key), names)
            raise ConfigError(
                f"{where}.{key}" if where else str(key),
                f"unknown setting{hint}; {cls.__name__} accepts {', '.join(names)}",
            )
    return dict(data)


def _closest(word: str, names: list[str]) -> str:
    import difflib

    match = difflib.get_close_matches(word, names, n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _build(cls: Callable[..., S], data: Mapping[str, Any], where: str) -> S:
    kwargs = _known_keys(cast(type, cls), data, where)
    try:
        return cls(**kwargs)
    except ConfigError as error:
        raise (error.under(where) if where else error) from None


# ----------------------------------------------------------------------------------------
# One section per wrapper
# ----------------------------------------------------------------------------------------
@attrs.frozen
class StagedConfig:
    """Options of :class:`wrapped_optim.StagedCheckpointOptimizer` (memory-bounded checkpoints).

    Attributes:
        chunk_bytes: the most expanded (FP32) state held on the device at once; an int or a
            size string such as ``"64MiB"``.
        stage_save: move each expanded precision-aware state to the host as it is produced.
        no_copy_load: let FP32 Adam state adopt the loader's tensors instead of copying them.
        chunked_load: quantize compressed state chunk by chunk when loading.

    A section with all three switches off would be a layer that does nothing: turn the layer
    off with ``staged=False`` instead.

    Example:
        >>> StagedConfig(chunk_bytes="1MiB").chunk_bytes
        1048576
        >>> StagedConfig(stage_save=False).no_copy_load
        True
    """

    chunk_bytes: int = attrs.field(
        default=64 << 20, converter=_to_bytes, validator=_check_int_at_least(4)
    )
    stage_save: bool = attrs.field(default=True, validator=_check_bool)
    no_copy_load: bool = attrs.field(default=True, validator=_check_bool)
    chunked_load: bool = attrs.field(default=True, validator=_check_bool)

    def __attrs_post_init__(self) -> None:
        if not (self.stage_save or self.no_copy_load or self.chunked_load):
            raise ConfigError(
                "stage_save",
                "stage_save, no_copy_load and chunked_load are all false, so the layer would do "
                "nothing; set the section to false to turn it off",
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StagedConfig:
        """Builds the section from a mapping, rejecting unknown keys.

        Example:
            >>> StagedConfig.from_dict({"chunk_bytes": 4096}).chunk_bytes
            4096
        """
        return _build(cls, data, "")


@attrs.frozen
class HybridConfig:
    """Options of :class:`wrapped_optim.HybridSyncOptimizer` (CPU/GPU offloaded optimizers).

    Attributes:
        on_stale: what ``step`` does when a master copy is stale: ``"refresh"`` it from the
            model weights, ``"raise"``, or ``"ignore"`` (step anyway).

    Example:
        >>> HybridConfig().on_stale
        'refresh'
    """

    on_stale: Literal["refresh", "raise", "ignore"] = attrs.field(
        default="refresh", validator=_check_choice("refresh", "raise", "ignore")
    )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HybridConfig:
        """Builds the section from a mapping, rejecting unknown keys.

        Example:
            >>> HybridConfig.from_dict({"on_stale": "raise"})
            HybridConfig(on_stale='raise')
        """
        return _build(cls, data, "")


@attrs.frozen
class FSDPConfig:
    """Options of :class:`wrapped_optim.FSDPAwareOptimizer` (sharded params, foreign grad dtypes).

    Attributes:
        precision_aware: the inner optimizer consumes grads of a different dtype itself (TE's
            precision-aware FusedAdam), so grads are not cast before the step.

    Example:
        >>> FSDPConfig(precision_aware=True).precision_aware
        True
    """

    precision_aware: bool = attrs.field(default=False, validator=_check_bool)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FSDPConfig:
        """Builds the section from a mapping, rejecting unknown keys.

        Example:
            >>> FSDPConfig.from_dict({})
            FSDPConfig(precision_aware=False)
        """
        return _build(cls, data, "")


_SECTIONS: dict[str, type] = {"staged": StagedConfig, "hybrid": HybridConfig, "fsdp": FSDPConfig}


def _section_converter(cls: type) -> Callable[[Any], Any]:
    name = next(n for n, c in _SECTIONS.items() if c is cls)

    def convert(value: Any) -> Any:
        if value is True:
            return cls()
        if isinstance(value, Mapping):
            return _build(cls, value, name)
        return value

    return convert


def _check_section(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    cls = _SECTIONS[attribute.name]
    if value is None or value is False or isinstance(value, cls):
        return
    raise ConfigError(
        attribute.name,
        f"must be a {cls.__name__}, a table of its options, true (on, defaults), false (off) or "
        f"absent (derive); got {value!r}",
    )


def _section_field(cls: type) -> Any:
    return attrs.field(default=None, converter=_section_converter(cls), validator=_check_section)


def _toml_module() -> ModuleType:
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    try:
        import tomli
    except ImportError:
        raise ImportError(
            "reading TOML on Python 3.10 needs the 'tomli' package (pip install tomli); "
            "Python 3.11+ has tomllib built in"
        ) from None
    return cast(ModuleType, tomli)


def _read_toml(path: str | Path, table: str | None) -> dict[str, Any]:
    toml = _toml_module()
    with open(path, "rb") as handle:
        document = cast(dict[str, Any], toml.load(handle))
    if table is None:
        return document
    node: Any = document
    for part in table.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise ConfigError(table, f"no such table in {path}")
        node = node[part]
    if not isinstance(node, Mapping):
        raise ConfigError(table, f"is not a table in {path}")
    return dict(node)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise TypeError(f"cannot write {value!r} to TOML")


@attrs.frozen
class StackConfig:
    """Which wrappers a stack gets (outermost first: fsdp, hybrid, staged) and their options.

    Each section is a section object (layer on), ``False`` (layer off) or ``None`` (let
    derivation decide). ``True`` and mappings are converted to section objects.

    Example:
        >>> config = StackConfig.from_dict({"staged": {"chunk_bytes": "8MiB"}, "hybrid": False})
        >>> config.staged.chunk_bytes, config.hybrid, config.fsdp
        (8388608, False, None)
        >>> StackConfig(fsdp=True).fsdp
        FSDPConfig(precision_aware=False)
    """

    staged: StagedConfig | Literal[False] | None = _section_field(StagedConfig)  # noqa: RUF009
    hybrid: HybridConfig | Literal[False] | None = _section_field(HybridConfig)  # noqa: RUF009
    fsdp: FSDPConfig | Literal[False] | None = _section_field(FSDPConfig)  # noqa: RUF009

    # ------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StackConfig:
        """Builds a config from ``{"staged": {...} | bool, "hybrid": ..., "fsdp": ...}``.

        Example:
            >>> StackConfig.from_dict({"fsdp": {"precision_aware": True}}).fsdp.precision_aware
            True
        """
        return _build(cls, data, "")

    @classmethod
    def from_toml(cls, path: str | Path, *, table: str | None = None) -> StackConfig:
        """Reads ``[staged]``, ``[hybrid]`` and ``[fsdp]`` from a TOML file.

        ``table`` selects a nested table holding them (e.g. ``"tool.wrapped_optim"`` in a
        pyproject.toml); without it the whole document is the config and any other table is
        an error. Python 3.10 needs the ``tomli`` package.

        Example:
            >>> import pathlib, tempfile
            >>> path = pathlib.Path(tempfile.mkdtemp()) / "stack.toml"
            >>> _ = path.write_text('hybrid = false\\n[staged]\\nchunk_bytes = "4MiB"\\n')
            >>> StackConfig.from_toml(path).staged.chunk_bytes
            4194304
        """
        return cls.from_dict(_read_toml(path, table))

    @classmethod
    def from_megatron(
        cls,
        optimizer_config: Any,
        ddp_config: Any = None,
        *,
        overrides: StackConfig | Mapping[str, Any] | None = None,
    ) -> StackConfig:
        """Derives the stack from Megatron's OptimizerConfig (and DDP config), as Bridge would.

        Any object with Megatron's attribute names works (megatron-core refuses
        ``use_precision_aware_optimizer=True`` without TE installed). Derivation:

        * ``use_precision_aware_optimizer`` -> staged save and chunked load;
        * distributed FP32 Adam (``use_distributed_optimizer``, ``optimizer="adam"``, FP32
          moments, not precision-aware) -> no-copy load;
        * ``optimizer_cpu_offload`` -> hybrid sync (and no staging: Bridge skips it there);
        * ``ddp_config.use_megatron_fsdp`` -> FSDP-aware (precision-aware when the optimizer
          is) and no staging.

        A flag that is known and false gives ``False`` (layer off); with no ``ddp_config`` the
        FSDP section stays ``None`` (derive from the optimizer). ``overrides`` (explicit
        settings) win over derived ones; see :meth:`override`.

        Example:
            >>> from types import SimpleNamespace
            >>> megatron = SimpleNamespace(use_precision_aware_optimizer=True,
            ...     use_distributed_optimizer=True, optimizer="adam")
            >>> explicit = {"staged": {"chunk_bytes": 4096}}
            >>> config = StackConfig.from_megatron(megatron, overrides=explicit)
            >>> config.staged
            StagedConfig(chunk_bytes=4096, stage_save=True, no_copy_load=False, chunked_load=True)
            >>> config.hybrid
            False
        """
        derived = _derive_from_megatron(optimizer_config, ddp_config)
        return derived if overrides is None else derived.override(overrides)

    # ------------------------------------------------------------------------------------
    def override(self, explicit: StackConfig | Mapping[str, Any]) -> StackConfig:
        """This config with ``explicit`` settings put on top.

        A :class:`StackConfig` replaces every section it does not leave ``None``. A mapping is
        finer grained: a table of options is merged field by field into this config's section
        (or into the defaults when the section is off or undecided), ``True``/``False`` and
        section objects replace it, and absent keys keep it.

        Example:
            >>> base = StackConfig(staged=StagedConfig(stage_save=False))
            >>> base.override({"staged": {"chunk_bytes": 1024}}).staged.stage_save
            False
            >>> base.override(StackConfig(staged=False)).staged
            False
        """
        if isinstance(explicit, StackConfig):
            changes = {
                name: getattr(explicit, name)
                for name in _SECTIONS
                if getattr(explicit, name) is not None
            }
            return attrs.evolve(self, **changes)
        if not isinstance(explicit, Mapping):
            raise TypeError(
                f"overrides must be a StackConfig or a mapping, got {type(explicit).__name__}"
            )
        _known_keys(StackConfig, explicit, "")
        changes = {}
        for name, value in explicit.items():
            if isinstance(value, Mapping):
                current = getattr(self, name)
                base = attrs.asdict(current) if attrs.has(type(current)) else {}
                _known_keys(_SECTIONS[name], value, name)
                value = _build(_SECTIONS[name], {**base, **value}, name)
            changes[name] = value
        return attrs.evolve(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data (``from_dict(to_dict())`` gives it back).

        Example:
            >>> StackConfig(hybrid=True, staged=False).to_dict()
            {'staged': False, 'hybrid': {'on_stale': 'refresh'}}
        """
        result: dict[str, Any] = {}
        for name in _SECTIONS:
            value = getattr(self, name)
            if value is None:
                continue
            result[name] = False if value is False else attrs.asdict(value)
        return result

    def to_toml(self) -> str:
        """The config as TOML text that :meth:`from_toml` reads back.

        Example:
            >>> print(StackConfig(fsdp=True, hybrid=False).to_toml())
            hybrid = false
            <BLANKLINE>
            [fsdp]
            precision_aware = false
            <BLANKLINE>
        """
        data = self.to_dict()
        lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if v is False]
        for name, options in data.items():
            if options is False:
                continue
            if lines:
                lines.append("")
            lines.append(f"[{name}]")
            lines.extend(f"{k} = {_toml_value(v)}" for k, v in options.items())
        return "\n".join(lines) + "\n"


def _megatron_bool(config: Any, name: str, where: str) -> bool:
    value = getattr(config, name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConfigError(f"{where}.{name}", f"must be a bool, got {value!r}")
    return value


def _is_fp32(value: Any) -> bool:
    return value is None or value == torch.float32 or value in ("fp32", "float32")


def _derive_from_megatron(optimizer_config: Any, ddp_config: Any) -> StackConfig:
    if optimizer_config is None:
        raise TypeError("from_megatron needs Megatron's OptimizerConfig (or an object like it)")
    where = "optimizer_config"
    precision_aware = _megatron_bool(optimizer_config, "use_precision_aware_optimizer", where)
    offload = _megatron_bool(optimizer_config, "optimizer_cpu_offload", where)
    distributed = _megatron_bool(optimizer_config, "use_distributed_optimizer", where)
    fsdp: bool | None = None
    if ddp_config is not None:
        fsdp = _megatron_bool(ddp_config, "use_megatron_fsdp", "ddp_config")
    name = getattr(optimizer_config, "optimizer", "adam")
    if not isinstance(name, str):
        raise ConfigError(f"{where}.optimizer", f"must be a string, got {name!r}")

    # Megatron's own validation, for objects that bypassed it.
    if precision_aware and name != "adam":
        raise ConfigError(
            f"{where}.use_precision_aware_optimizer",
            f"is only supported with optimizer='adam', got optimizer={name!r}",
        )
    if precision_aware and not distributed:
        raise ConfigError(
            f"{where}.use_precision_aware_optimizer",
            "is only supported with use_distributed_optimizer=True",
        )
    if not precision_aware:
        for dtype_name in ("exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype"):
            if not _is_fp32(getattr(optimizer_config, dtype_name, None)):
                raise ConfigError(
                    f"{where}.{dtype_name}",
                    "must be torch.float32 unless use_precision_aware_optimizer=True",
                )

    staged: StagedConfig | Literal[False] = False
    if not offload and not fsdp:
        if precision_aware:
            staged = StagedConfig(stage_save=True, no_copy_load=False, chunked_load=True)
        elif distributed and name == "adam":
            staged = StagedConfig(stage_save=False, no_copy_load=True, chunked_load=False)
    hybrid: HybridConfig | Literal[False] = HybridConfig() if offload else False
    fsdp_section: FSDPConfig | Literal[False] | None = None
    if fsdp is not None:
        fsdp_section = FSDPConfig(precision_aware=precision_aware) if fsdp else False
    return StackConfig(staged=staged, hybrid=hybrid, fsdp=fsdp_section)


# ----------------------------------------------------------------------------------------
# build_optimizer: the optimizer and its LR schedule
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
    """Which optimizer :func:`wrapped_optim.build_optimizer` builds, and its keyword arguments.

    Attributes:
        name: a ``torch.optim`` class name (any case: ``"adamw"``, ``"SGD"``), one of the
            portable optimizers (``"precision_adamw"``, ``"hybrid_offload"``), or an import
            path ``"package.module:Class"``.
        options: constructor keywords (``lr``, ``weight_decay``...). TOML arrays become
            tuples and ``*dtype`` strings (``"bf16"``, ``"fp8"``) become torch dtypes.

    Example:
        >>> spec = OptimizerSpec.from_dict({"name": "adamw", "lr": 1e-3, "betas": [0.9, 0.95]})
        >>> spec.name, spec.options["betas"]
        ('adamw', (0.9, 0.95))
    """

    name: str = attrs.field(validator=_check_name)
    options: dict[str, Any] = attrs.field(factory=dict, converter=_convert_options, hash=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OptimizerSpec:
        """``{"name": ..., <keyword>: <value>, ...}`` -> spec (every other key is an option).

        Example:
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
        """The configured learning rate (``options["lr"]``), needed by LR schedules."""
        lr = self.options.get("lr")
        if not _is_number(lr):
            raise ConfigError("optimizer.lr", f"must be a number for an LR schedule, got {lr!r}")
        return float(cast(float, lr))


_TORCH_STYLES = ("constant", "linear", "cosine")
_MEGATRON_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")


@attrs.frozen(kw_only=True)
class LRScheduleConfig:
    """Warmup and decay for :func:`wrapped_optim.build_optimizer`, in optimizer steps.

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
        wsd_decay_steps / wsd_style: WSD's annealing length and shape (Megatron only).

    Example:
        >>> LRScheduleConfig(warmup_steps=10, style="cosine", decay_steps=100).min_lr
        0.0
    """

    warmup_steps: int = attrs.field(default=0, validator=_check_int_at_least(0))
    warmup_start_factor: float = attrs.field(
        default=1e-3, validator=_check_float(minimum=0.0, maximum=1.0)
    )
    style: str = attrs.field(default="constant", validator=_check_choice(*_MEGATRON_STYLES))
    decay_steps: int | None = attrs.field(default=None, validator=_check_optional_int_at_least(1))
    min_lr: float = attrs.field(default=0.0, validator=_check_float(minimum=0.0))
    backend: Literal["torch", "megatron"] = attrs.field(
        default="torch", validator=_check_choice("torch", "megatron")
    )
    wsd_decay_steps: int | None = attrs.field(
        default=None, validator=_check_optional_int_at_least(1)
    )
    wsd_style: str = attrs.field(
        default="exponential",
        validator=_check_choice("exponential", "linear", "cosine", "minus_sqrt"),
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
        """Builds the schedule from a mapping, rejecting unknown keys.

        Example:
            >>> LRScheduleConfig.from_dict({"warmup_steps": 5}).warmup_steps
            5
        """
        return _build(cls, data, "")


@attrs.frozen(kw_only=True)
class BuildConfig:
    """Everything :func:`wrapped_optim.build_optimizer` needs, e.g. from one TOML file.

    TOML layout: ``[optimizer]`` (``name`` + keywords), ``[schedule]`` (optional, see
    :class:`LRScheduleConfig`) and the stack sections ``[staged]``, ``[hybrid]``,
    ``[fsdp]`` (or ``staged = false``...).

    Example:
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

        Example:
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
            schedule = _build(LRScheduleConfig, schedule_data, "schedule")
        stack_keys = [k for k in rest if k not in _SECTIONS]
        if stack_keys:
            hint = _closest(stack_keys[0], ["optimizer", "schedule", *_SECTIONS])
            raise ConfigError(
                stack_keys[0],
                f"unknown table{hint}; expected optimizer, schedule, staged, hybrid, fsdp",
            )
        return cls(optimizer=optimizer, schedule=schedule, stack=StackConfig.from_dict(rest))

    @classmethod
    def from_toml(cls, path: str | Path, *, table: str | None = None) -> BuildConfig:
        """Reads a build config from TOML (``table`` selects a nested table).

        Example:
            >>> import pathlib, tempfile
            >>> path = pathlib.Path(tempfile.mkdtemp()) / "train.toml"
            >>> _ = path.write_text('[optimizer]\\nname = "adamw"\\nlr = 0.001\\n')
            >>> BuildConfig.from_toml(path).optimizer.options
            {'lr': 0.001}
        """
        return cls.from_dict(_read_toml(path, table))


# ----------------------------------------------------------------------------------------
# setup_optimizer: Megatron-Bridge's scheduler configuration
# ----------------------------------------------------------------------------------------
@attrs.frozen(kw_only=True)
class SchedulerConfig:
    """Megatron-Bridge's LR / weight-decay scheduler settings, with Bridge's validation.

    Field names and meanings follow Bridge (iterations *or* samples, never both; warmup by
    count or by fraction). The ``*_steps`` fields that megatron-core's
    ``OptimizerParamScheduler`` consumes are derived from the training length by
    :meth:`with_steps` (Bridge computes them in its ConfigContainer), or set directly.
    ``start_weight_decay`` / ``end_weight_decay`` left ``None`` take the optimizer config's
    ``weight_decay`` in :func:`wrapped_optim.setup_optimizer`.

    Example:
        >>> config = SchedulerConfig(lr_decay_style="cosine", lr_warmup_iters=10)
        >>> config = config.with_steps(train_iters=100, global_batch_size=8)
        >>> config.lr_warmup_steps, config.lr_decay_steps, config.wd_incr_steps
        (80, 800, 800)
    """

    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = (
        attrs.field(default="linear", validator=_check_choice(*_MEGATRON_STYLES))
    )
    lr_wsd_decay_style: Literal["exponential", "linear", "cosine", "minus_sqrt"] = attrs.field(
        default="exponential",
        validator=_check_choice("exponential", "linear", "cosine", "minus_sqrt"),
    )
    lr_decay_iters: int | None = attrs.field(
        default=None, validator=_check_optional_int_at_least(1)
    )
    lr_decay_samples: int | None = attrs.field(
        default=None, validator=_check_optional_int_at_least(1)
    )
    lr_wsd_decay_iters: int | None = attrs.field(
        default=None, validator=_check_optional_int_at_least(1)
    )
    lr_wsd_decay_samples: int | None = attrs.field(
        default=None, validator=_check_optional_int_at_least(1)
    )
    lr_warmup_fraction: float | None = attrs.field(
        default=None, validator=_check_float(minimum=0.0, maximum=1.0, optional=True)
    )
    lr_warmup_iters: int = attrs.field(default=0, validator=_check_int_at_least(0))
    lr_warmup_samples: int = attrs.field(default=0, validator=_check_int_at_least(0))
    lr_warmup_init: float = attrs.field(default=0.0, validator=_check_float(minimum=0.0))
    override_opt_param_scheduler: bool = attrs.field(default=False, validator=_check_bool)
    use_checkpoint_opt_param_scheduler: bool = attrs.field(default=False, validator=_check_bool)
    start_weight_decay: float | None = attrs.field(
        default=None, validator=_check_float(optional=True)
    )
    end_weight_decay: float | None = attrs.field(
        default=None, validator=_check_float(optional=True)
    )
    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = attrs.field(
        default="constant", validator=_check_choice("constant", "linear", "cosine")
    )
    no_weight_decay_cond_type: Literal["qwen3_next"] | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(_check_choice("qwen3_next")),
    )
    max_steps: int | None = attrs.field(default=None, validator=_check_optional_int_at_least(1))
    # Derived by with_steps() (Bridge: ConfigContainer._calculate_scheduler_steps).
    lr_warmup_steps: float | None = attrs.field(
        default=None, validator=_check_float(minimum=0.0, optional=True)
    )
    lr_decay_steps: int | None = attrs.field(
        default=None, validator=_check_optional_int_at_least(1)
    )
    wd_incr_steps: int | None = attrs.field(default=None, validator=_check_optional_int_at_least(1))
    wsd_decay_steps: int | None = attrs.field(
        default=None, validator=_check_optional_int_at_least(1)
    )

    def __attrs_post_init__(self) -> None:
        # Bridge's SchedulerConfig.finalize(), as errors that name the field.
        if self.start_weight_decay is not None:
            if self.start_weight_decay < 0.0:
                raise ConfigError(
                    "start_weight_decay", f"must be >= 0, got {self.start_weight_decay}"
                )
            if self.end_weight_decay is None or self.end_weight_decay < self.start_weight_decay:
                raise ConfigError(
                    "end_weight_decay",
                    f"must be >= start_weight_decay ({self.start_weight_decay}), "
                    f"got {self.end_weight_decay}",
                )
            if (
                self.weight_decay_incr_style == "constant"
                and self.end_weight_decay != self.start_weight_decay
            ):
                # megatron-core's scheduler asserts this on its first step.
                raise ConfigError(
                    "end_weight_decay",
                    "must equal start_weight_decay with weight_decay_incr_style='constant'",
                )
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ConfigError(
                "override_opt_param_scheduler",
                "cannot be set together with use_checkpoint_opt_param_scheduler",
            )
        iteration_fields = {
            "lr_decay_iters": self.lr_decay_iters is not None,
            "lr_warmup_iters": self.lr_warmup_iters != 0,
            "lr_wsd_decay_iters": self.lr_wsd_decay_iters is not None,
        }
        sample_fields = {
            "lr_decay_samples": self.lr_decay_samples is not None,
            "lr_warmup_samples": self.lr_warmup_samples != 0,
            "lr_wsd_decay_samples": self.lr_wsd_decay_samples is not None,
        }
        if any(iteration_fields.values()) and any(sample_fields.values()):
            used = [n for n, on in {**iteration_fields, **sample_fields}.items() if on]
            raise ConfigError(
                next(n for n, on in sample_fields.items() if on),
                f"iteration-based and sample-based fields cannot be mixed (set: {', '.join(used)})",
            )
        if self.lr_warmup_fraction is not None and (self.lr_warmup_iters or self.lr_warmup_samples):
            raise ConfigError(
                "lr_warmup_fraction",
                "cannot be combined with lr_warmup_iters or lr_warmup_samples; use one of them",
            )

    def with_steps(
        self,
        *,
        train_iters: int | None = None,
        global_batch_size: int | None = None,
        train_samples: int | None = None,
    ) -> SchedulerConfig:
        """A copy with the scheduler's step counts derived from the training length.

        Iteration-based (``train_iters`` and ``global_batch_size``) or sample-based
        (``train_samples``) as in Bridge; steps are counted in samples, and a warmup as long
        as the decay is capped to ``lr_decay_steps - 1`` with a warning.

        Example:
            >>> SchedulerConfig(lr_warmup_samples=10).with_steps(train_samples=1000).lr_decay_steps
            1000
        """
        changes: dict[str, Any] = {}
        if train_samples is not None:
            if train_iters is not None:
                raise ConfigError("train_iters", "cannot be combined with train_samples")
            if not _is_int(train_samples) or train_samples <= 0:
                raise ConfigError("train_samples", f"must be a positive int, got {train_samples}")
            if self.max_steps is not None:
                raise ConfigError("max_steps", "is only supported for iteration-based training")
            if self.lr_decay_iters is not None or self.lr_warmup_iters:
                raise ConfigError(
                    "lr_decay_iters" if self.lr_decay_iters is not None else "lr_warmup_iters",
                    "use the *_samples fields for sample-based training",
                )
            decay = self.lr_decay_samples if self.lr_decay_samples is not None else train_samples
            changes["lr_decay_steps"] = decay
            changes["wd_incr_steps"] = train_samples
            if self.lr_wsd_decay_samples is not None:
                changes["wsd_decay_steps"] = self.lr_wsd_decay_samples
            warmup: float = (
                self.lr_warmup_fraction * decay
                if self.lr_warmup_fraction is not None
                else self.lr_warmup_samples
            )
        else:
            if train_iters is None or global_batch_size is None:
                raise ConfigError(
                    "train_iters",
                    "with_steps needs train_iters and global_batch_size, or train_samples",
                )
            for name, value in (
                ("train_iters", train_iters),
                ("global_batch_size", global_batch_size),
            ):
                if not _is_int(value) or value <= 0:
                    raise ConfigError(name, f"must be a positive int, got {value!r}")
            if self.lr_decay_samples is not None or self.lr_warmup_samples:
                raise ConfigError(
                    "lr_decay_samples"
                    if self.lr_decay_samples is not None
                    else "lr_warmup_samples",
                    "use the *_iters fields for iteration-based training",
                )
            decay_iters = self.lr_decay_iters
            if self.max_steps is not None:
                if self.max_steps < train_iters:
                    raise ConfigError(
                        "max_steps", f"({self.max_steps}) must be >= train_iters ({train_iters})"
                    )
                decay_iters = self.max_steps
            elif decay_iters is None:
                decay_iters = train_iters
            wsd_iters = self.lr_wsd_decay_iters
            if wsd_iters is None and self.lr_decay_style == "WSD":
                wsd_iters = decay_iters
            changes["lr_decay_iters"] = decay_iters
            changes["lr_wsd_decay_iters"] = wsd_iters
            decay = decay_iters * global_batch_size
            changes["lr_decay_steps"] = decay
            changes["wd_incr_steps"] = (self.max_steps or train_iters) * global_batch_size
            if wsd_iters is not None:
                changes["wsd_decay_steps"] = wsd_iters * global_batch_size
            warmup = (
                self.lr_warmup_fraction * decay
                if self.lr_warmup_fraction is not None
                else self.lr_warmup_iters * global_batch_size
            )
        if warmup >= decay:
            warnings.warn(
                f"lr_warmup_steps ({warmup}) >= lr_decay_steps ({decay}); capping lr_warmup_steps "
                f"to {decay - 1}",
                UserWarning,
                stacklevel=2,
            )
            warmup = decay - 1
        changes["lr_warmup_steps"] = warmup
        return attrs.evolve(self, **changes)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SchedulerConfig:
        """Builds the config from a mapping, rejecting unknown keys.

        Example:
            >>> SchedulerConfig.from_dict({"lr_decay_style": "cosine"}).lr_decay_style
            'cosine'
        """
        return _build(cls, data, "")
