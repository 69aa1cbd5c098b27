"""Validated, frozen configuration of the wrapper stack: which layers, and their options.

The guide, with the TOML form and the rules of derivation, is the docs' Configuration page.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import attrs

from wrapped_optim import _layer_policy as layer_policy
from wrapped_optim._config_fields import (
    ConfigError,
    check_bool,
    check_choice,
    check_int_at_least,
    from_mapping,
    known_keys,
    read_toml,
    to_bytes,
    toml_value,
)

__all__ = [
    "ConfigError",
    "FSDPConfig",
    "HybridConfig",
    "StackConfig",
    "StagedConfig",
]


# ----------------------------------------------------------------------------------------
# One section per wrapper
# ----------------------------------------------------------------------------------------
@attrs.frozen
class StagedConfig:
    """Options of ``wrapped_optim.StagedCheckpointOptimizer`` (memory-bounded checkpoints).

    Attributes:
        chunk_bytes: the most expanded (FP32) state held on the device at once; an int or a
            size string such as ``"64MiB"``.
        stage_save: move each expanded precision-aware state to the host as it is produced.
        no_copy_load: let FP32 Adam state adopt the loader's tensors instead of copying them.
        chunked_load: quantize compressed state chunk by chunk when loading.

    Raises:
        ConfigError: a value is invalid, or all three switches are off (turn the layer off
            with ``staged=False`` instead).

    Examples:
        >>> StagedConfig(chunk_bytes="1MiB").chunk_bytes
        1048576
        >>> StagedConfig(stage_save=False).no_copy_load
        True
    """

    chunk_bytes: int = attrs.field(
        default=64 << 20, converter=to_bytes, validator=check_int_at_least(4)
    )
    stage_save: bool = attrs.field(default=True, validator=check_bool)
    no_copy_load: bool = attrs.field(default=True, validator=check_bool)
    chunked_load: bool = attrs.field(default=True, validator=check_bool)

    def __attrs_post_init__(self) -> None:
        if not (self.stage_save or self.no_copy_load or self.chunked_load):
            raise ConfigError(
                "stage_save",
                "stage_save, no_copy_load and chunked_load are all false, so the layer would do "
                "nothing; set the section to false to turn it off",
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StagedConfig:
        """Builds the section from a mapping of its options.

        Args:
            data: The options by name; a key that is not an option is an error.

        Raises:
            ConfigError: an unknown key or an invalid value.

        Examples:
            >>> StagedConfig.from_dict({"chunk_bytes": 4096}).chunk_bytes
            4096
        """
        return from_mapping(cls, data, "")


@attrs.frozen
class HybridConfig:
    """Options of ``wrapped_optim.HybridSyncOptimizer`` (CPU/GPU offloaded optimizers).

    Attributes:
        on_stale: what ``step`` does when a master copy is stale: ``"refresh"`` it from the
            model weights, ``"raise"``, or ``"ignore"`` (step anyway).

    Raises:
        ConfigError: ``on_stale`` is not one of the three choices.

    Examples:
        >>> HybridConfig().on_stale
        'refresh'
    """

    on_stale: Literal["refresh", "raise", "ignore"] = attrs.field(
        default="refresh", validator=check_choice("refresh", "raise", "ignore")
    )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HybridConfig:
        """Builds the section from a mapping of its options.

        Args:
            data: The options by name; a key that is not an option is an error.

        Raises:
            ConfigError: an unknown key or an invalid value.

        Examples:
            >>> HybridConfig.from_dict({"on_stale": "raise"})
            HybridConfig(on_stale='raise')
        """
        return from_mapping(cls, data, "")


@attrs.frozen
class FSDPConfig:
    """Options of ``wrapped_optim.FSDPAwareOptimizer`` (sharded params, foreign grad dtypes).

    Attributes:
        precision_aware: the inner optimizer consumes grads of a different dtype itself (TE's
            precision-aware FusedAdam), so grads are not cast before the step.

    Raises:
        ConfigError: ``precision_aware`` is not a bool.

    Examples:
        >>> FSDPConfig(precision_aware=True).precision_aware
        True
    """

    precision_aware: bool = attrs.field(default=False, validator=check_bool)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FSDPConfig:
        """Builds the section from a mapping of its options.

        Args:
            data: The options by name; a key that is not an option is an error.

        Raises:
            ConfigError: an unknown key or an invalid value.

        Examples:
            >>> FSDPConfig.from_dict({})
            FSDPConfig(precision_aware=False)
        """
        return from_mapping(cls, data, "")


def _section_converter(name: str, cls: type) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        if value is True:
            return cls()
        if isinstance(value, Mapping):
            return from_mapping(cls, value, name)
        return value

    return convert


def _check_section(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    cls = attribute.metadata["section"]
    if value is None or value is False or isinstance(value, cls):
        return
    raise ConfigError(
        attribute.name,
        f"must be a {cls.__name__}, a table of its options, true (on, defaults), false (off) or "
        f"absent (derive); got {value!r}",
    )


def _section_field(name: str, cls: type) -> Any:
    # The section's options class rides on the field: StackConfig's fields are the one list
    # of sections this module knows (wrapped_optim.stack.LAYERS pairs them with wrappers).
    return attrs.field(
        default=None,
        converter=_section_converter(name, cls),
        validator=_check_section,
        metadata={"section": cls},
    )


@attrs.frozen
class StackConfig:
    """Which wrappers a stack gets (outermost first: fsdp, hybrid, staged) and their options.

    Each section is a section object (layer on), ``False`` (layer off) or ``None`` (let
    derivation decide). ``True`` and mappings are converted to section objects.

    Attributes:
        staged: ``StagedCheckpointOptimizer``'s section (``StagedConfig``).
        hybrid: ``HybridSyncOptimizer``'s section (``HybridConfig``).
        fsdp: ``FSDPAwareOptimizer``'s section (``FSDPConfig``).

    Raises:
        ConfigError: a section is not a section object, a mapping, a bool or ``None``.

    Examples:
        >>> config = StackConfig.from_dict({"staged": {"chunk_bytes": "8MiB"}, "hybrid": False})
        >>> config.staged.chunk_bytes, config.hybrid, config.fsdp
        (8388608, False, None)
        >>> StackConfig(fsdp=True).fsdp
        FSDPConfig(precision_aware=False)
    """

    staged: StagedConfig | Literal[False] | None = _section_field("staged", StagedConfig)  # noqa: RUF009
    hybrid: HybridConfig | Literal[False] | None = _section_field("hybrid", HybridConfig)  # noqa: RUF009
    fsdp: FSDPConfig | Literal[False] | None = _section_field("fsdp", FSDPConfig)  # noqa: RUF009

    # ------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StackConfig:
        """Builds a config from ``{"staged": {...} | bool, "hybrid": ..., "fsdp": ...}``.

        Args:
            data: The sections by name; an unknown section or option is an error.

        Raises:
            ConfigError: an unknown key or an invalid value, named by its dotted path.

        Examples:
            >>> StackConfig.from_dict({"fsdp": {"precision_aware": True}}).fsdp.precision_aware
            True
        """
        return from_mapping(cls, data, "")

    @classmethod
    def from_toml(cls, path: str | Path, *, table: str | None = None) -> StackConfig:
        """Reads ``[staged]``, ``[hybrid]`` and ``[fsdp]`` from a TOML file.

        Args:
            path: The TOML file.
            table: A dotted table holding the sections (e.g. ``"tool.wrapped_optim"`` in a
                pyproject.toml); without it the whole document is the config.

        Raises:
            ConfigError: an unknown table or key, or an invalid value.

        Examples:
            >>> import pathlib, tempfile
            >>> path = pathlib.Path(tempfile.mkdtemp()) / "stack.toml"
            >>> _ = path.write_text('hybrid = false\\n[staged]\\nchunk_bytes = "4MiB"\\n')
            >>> StackConfig.from_toml(path).staged.chunk_bytes
            4194304
        """
        return cls.from_dict(read_toml(path, table))

    @classmethod
    def from_megatron(
        cls,
        optimizer_config: Any,
        ddp_config: Any = None,
        *,
        overrides: StackConfig | Mapping[str, Any] | None = None,
    ) -> StackConfig:
        """Derives the stack from Megatron's OptimizerConfig (and DDP config), as Bridge would.

        Any object with Megatron's attribute names works. A known flag that is false gives
        ``False`` (layer off); with no ``ddp_config`` the FSDP section stays ``None``. The
        rules are in the docs' Configuration page ("Deriving from Megatron's configs").

        Args:
            optimizer_config: Megatron's ``OptimizerConfig`` (or a look-alike).
            ddp_config: Megatron's ``DistributedDataParallelConfig``, if any.
            overrides: Explicit settings that win over derived ones (see ``override``).

        Raises:
            ConfigError: a Megatron setting is invalid (named by its field).

        Examples:
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
        """Returns this config with explicit settings put on top.

        Args:
            explicit: A ``StackConfig`` (replaces every section it does not leave ``None``)
                or a mapping, merged finer: a table of options is merged field by field into
                this config's section (or the defaults when it is off or undecided),
                ``True``/``False`` and section objects replace it, absent keys keep it.

        Raises:
            TypeError: ``explicit`` is neither a ``StackConfig`` nor a mapping.
            ConfigError: an unknown key or an invalid value.

        Examples:
            >>> base = StackConfig(staged=StagedConfig(stage_save=False))
            >>> base.override({"staged": {"chunk_bytes": 1024}}).staged.stage_save
            False
            >>> base.override(StackConfig(staged=False)).staged
            False
        """
        if isinstance(explicit, StackConfig):
            changes = {
                name: getattr(explicit, name)
                for name in SECTIONS
                if getattr(explicit, name) is not None
            }
            return attrs.evolve(self, **changes)
        if not isinstance(explicit, Mapping):
            raise TypeError(
                f"overrides must be a StackConfig or a mapping, got {type(explicit).__name__}"
            )
        known_keys(StackConfig, explicit, "")
        changes = {}
        for name, value in explicit.items():
            if isinstance(value, Mapping):
                current = getattr(self, name)
                base = attrs.asdict(current) if attrs.has(type(current)) else {}
                known_keys(SECTIONS[name], value, name)
                value = from_mapping(SECTIONS[name], {**base, **value}, name)
            changes[name] = value
        return attrs.evolve(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data (``from_dict(to_dict())`` gives it back).

        Examples:
            >>> StackConfig(hybrid=True, staged=False).to_dict()
            {'staged': False, 'hybrid': {'on_stale': 'refresh'}}
        """
        result: dict[str, Any] = {}
        for name in SECTIONS:
            value = getattr(self, name)
            if value is None:
                continue
            result[name] = False if value is False else attrs.asdict(value)
        return result

    def to_toml(self) -> str:
        """The config as TOML text that ``from_toml`` reads back.

        Examples:
            >>> print(StackConfig(fsdp=True, hybrid=False).to_toml())
            hybrid = false
            <BLANKLINE>
            [fsdp]
            precision_aware = false
            <BLANKLINE>
        """
        data = self.to_dict()
        lines = [f"{k} = {toml_value(v)}" for k, v in data.items() if v is False]
        for name, options in data.items():
            if options is False:
                continue
            if lines:
                lines.append("")
            lines.append(f"[{name}]")
            lines.extend(f"{k} = {toml_value(v)}" for k, v in options.items())
        return "\n".join(lines) + "\n"


#: Section name -> its options class, in StackConfig's field order.
SECTIONS: dict[str, type] = {
    field.name: field.metadata["section"] for field in attrs.fields(StackConfig)
}


def _derive_from_megatron(optimizer_config: Any, ddp_config: Any) -> StackConfig:
    settings = layer_policy.MegatronSettings.validated(optimizer_config, ddp_config)
    switches = layer_policy.staged_switches(settings)
    wants_fsdp = layer_policy.fsdp_layer_wanted(settings)
    fsdp: FSDPConfig | Literal[False] | None = None
    if wants_fsdp is not None:
        fsdp = FSDPConfig(precision_aware=bool(settings.precision_aware)) if wants_fsdp else False
    return StackConfig(
        staged=StagedConfig(**switches) if switches is not None else False,
        hybrid=HybridConfig() if layer_policy.hybrid_layer_wanted(settings) else False,
        fsdp=fsdp,
    )
