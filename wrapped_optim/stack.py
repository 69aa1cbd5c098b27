"""The wrapper stack: its one table of layers, the walk down it, and ``wrap``.

Why the layers sit in this order is in the docs' Concepts page ("The canonical order").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from wrapped_optim import _layer_policy as layer_policy
from wrapped_optim._adapters.hybrid import find_hybrid_offload
from wrapped_optim._adapters.megatron_fsdp import needs_grad_cast
from wrapped_optim._adapters.walk import walk_leaves
from wrapped_optim._staging.engine import leaf_settings, no_copy_decisions, staging_decisions
from wrapped_optim.config import (
    SECTIONS,
    ConfigError,
    FSDPConfig,
    HybridConfig,
    StackConfig,
    StagedConfig,
)
from wrapped_optim.fsdp import FSDPAwareOptimizer
from wrapped_optim.hybrid import HybridSyncOptimizer
from wrapped_optim.staged import StagedCheckpointOptimizer
from wrapped_optim.wrapper import OptimizerWrapper, find_layer, layers, unwrap

__all__ = ["find_layer", "layers", "unwrap", "wrap"]


# ----------------------------------------------------------------------------------------
# Derive rules: what wrap() adds to an optimizer when its config leaves a section undecided
# ----------------------------------------------------------------------------------------
def _derive_fsdp(base: Any) -> FSDPConfig | bool:
    if not needs_grad_cast(base):
        return False
    precision_aware = any(
        layer_policy.MegatronSettings.of(leaf.config, leaf.ddp_config).precision_aware
        for leaf in walk_leaves(base)
    )
    return FSDPConfig(precision_aware=precision_aware)


def _derive_hybrid(base: Any) -> HybridConfig | bool:
    return HybridConfig() if find_hybrid_offload(base) else False


def _derive_staged(base: Any) -> StagedConfig | bool:
    # The engine's own decisions (hybrid sub-optimizers and Megatron's settings, through
    # layer_policy, included): staging is derived exactly where it would act.
    if any(decision.eligible for decision in staging_decisions(base)):
        return StagedConfig()
    if any(decision.eligible for decision in no_copy_decisions(base)):
        return StagedConfig()  # a Megatron distributed FP32 Adam: no-copy load
    if any(_shares_steps_on_load(leaf) for leaf in walk_leaves(base)):
        return StagedConfig()  # torch's Adam in a DistributedOptimizer: the step repair
    return False


def _shares_steps_on_load(leaf: Any) -> bool:
    """A torch Adam/AdamW whose distributed optimizer's loader shares one step tensor."""
    adam = isinstance(leaf.optimizer, torch.optim.Adam | torch.optim.AdamW)
    return adam and not leaf.is_stub and layer_policy.step_repair_wanted(leaf_settings(leaf))


# ----------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------
@attrs.frozen
class LayerSpec:
    """One canonical layer: its config section, wrapper, options and derive rule.

    Attributes:
        section: the ``StackConfig`` section (``"staged"``...).
        wrapper: the wrapper class.
        config: the section's options class; its fields are the wrapper's keyword options.
        derive: ``derive(optimizer)`` -> options to add the layer with, or ``False``.
        carried: constructor options that are not config options (a callable, say), kept
            when the layer is rebuilt elsewhere in a stack.

    Examples:
        >>> spec = layer_spec("staged")
        >>> spec.wrapper.__name__, spec.config.__name__
        ('StagedCheckpointOptimizer', 'StagedConfig')
    """

    section: str
    wrapper: type[OptimizerWrapper]
    config: type
    derive: Callable[[Any], Any] = attrs.field(repr=False)
    carried: tuple[str, ...] = ()

    def options_of(self, layer: Any) -> dict[str, Any]:
        """The options ``layer`` (this spec's wrapper) was built with, to rebuild it.

        Examples:
            >>> import torch
            >>> from wrapped_optim import HybridSyncOptimizer
            >>> from wrapped_optim.optimizers import HybridOffloadOptimizer
            >>> hybrid = HybridOffloadOptimizer([torch.nn.Parameter(torch.ones(1))])
            >>> layer_spec("hybrid").options_of(HybridSyncOptimizer(hybrid, on_stale="raise"))
            {'on_stale': 'raise'}
        """
        options = {name: getattr(layer, name) for name in attrs.asdict(self.config())}
        for name in self.carried:
            if (value := getattr(layer, name)) is not None:
                options[name] = value
        return options


LAYERS: tuple[LayerSpec, ...] = (
    LayerSpec(
        section="fsdp",
        wrapper=FSDPAwareOptimizer,
        config=FSDPConfig,
        derive=_derive_fsdp,
        carried=("refresh",),
    ),
    LayerSpec(
        section="hybrid",
        wrapper=HybridSyncOptimizer,
        config=HybridConfig,
        derive=_derive_hybrid,
    ),
    LayerSpec(
        section="staged",
        wrapper=StagedCheckpointOptimizer,
        config=StagedConfig,
        derive=_derive_staged,
    ),
)
"""The canonical layers, outermost first: the one list every part of the package reads."""

_BY_SECTION = {spec.section: spec for spec in LAYERS}
if {spec.section: spec.config for spec in LAYERS} != SECTIONS:  # pragma: no cover
    raise ImportError("wrapped_optim.stack.LAYERS and StackConfig's sections disagree")


def layer_spec(section: str) -> LayerSpec:
    """The spec of the layer configured by ``section``.

    Examples:
        >>> layer_spec("fsdp").wrapper.__name__
        'FSDPAwareOptimizer'
    """
    try:
        return _BY_SECTION[section]
    except KeyError:
        raise ValueError(
            f"no layer has section {section!r}; the layers are {', '.join(_BY_SECTION)}"
        ) from None


def spec_of(layer: Any) -> LayerSpec | None:
    """The spec of the canonical layer ``layer`` is, or ``None`` (bare or foreign object).

    Examples:
        >>> import torch
        >>> from wrapped_optim import wrap
        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> spec_of(wrap(sgd, {"staged": True})).section, spec_of(sgd)
        ('staged', None)
    """
    return next((spec for spec in LAYERS if isinstance(layer, spec.wrapper)), None)


# ----------------------------------------------------------------------------------------
# wrap()
# ----------------------------------------------------------------------------------------
def _peel(optimizer: Any) -> tuple[Any, dict[str, Any]]:
    """Splits off the canonical layers on top of ``optimizer``: (base, {section: layer})."""
    found: dict[str, Any] = {}
    chain = layers(optimizer)
    for layer in chain[:-1]:  # the wrappers
        spec = spec_of(layer)
        if spec is None or spec.section in found:
            return layer, found
        found[spec.section] = layer
    return chain[-1], found


def _buried_sections(base: Any) -> set[str]:
    """Canonical layers below a foreign wrapper: present, left where they are."""
    return {spec.section for spec in map(spec_of, layers(base)[:-1]) if spec is not None}


def _as_stack_config(config: StackConfig | Mapping[str, Any] | None) -> StackConfig:
    if config is None:
        return StackConfig()
    if isinstance(config, Mapping):
        return StackConfig.from_dict(config)
    if not isinstance(config, StackConfig):
        raise TypeError(f"config must be a StackConfig, a mapping or None, got {config!r}")
    return config


def wrap(optimizer: Any, config: StackConfig | Mapping[str, Any] | None = None) -> Any:
    """Builds the canonical wrapper stack a config asks for around an optimizer.

    Per section of ``config``: a section object adds the layer with those options, ``False``
    leaves it out (and removes one already there), ``None`` keeps an existing layer or derives
    the decision from the optimizer. Re-wrapping never doubles a layer. The rules are in the
    [configuration guide](../configuration.md#wrap-deriving-from-the-optimizer-itself).

    Args:
        optimizer: The optimizer to wrap, bare or already wrapped.
        config: A ``StackConfig``, a mapping of its sections (``{"staged": {...}}``), or
            ``None`` to derive every layer from the optimizer.

    Returns:
        The outermost layer of the stack; ``optimizer`` itself when nothing changes (also a
        bare optimizer that needs no layer), so use ``layers`` and ``find_layer`` on it.

    Raises:
        ConfigError: ``config`` is invalid, or it removes a layer that sits below a foreign
            wrapper, or a Megatron optimizer in the stack was built with
            ``use_precision_aware_optimizer`` and ``optimizer_cpu_offload`` together (Core
            ignores the precision-aware settings there; the error says what to do).

    Examples:
        >>> import torch
        >>> from wrapped_optim import layers, wrap
        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
        >>> wrap(sgd) is sgd          # nothing to add for a plain SGD
        True
        >>> stacked = wrap(sgd, {"hybrid": False, "staged": {"chunk_bytes": 4096}})
        >>> [type(layer).__name__ for layer in layers(stacked)]
        ['StagedCheckpointOptimizer', 'SGD']
        >>> wrap(stacked) is stacked  # idempotent
        True
    """
    config = _as_stack_config(config)
    base, existing = _peel(optimizer)
    for leaf in walk_leaves(base):
        if leaf.config is not None:
            settings = layer_policy.MegatronSettings.of(leaf.config, leaf.ddp_config)
            layer_policy.refuse_precision_aware_offload(
                bool(settings.precision_aware), settings.cpu_offload, "config"
            )
    buried = _buried_sections(base)

    wanted: dict[str, Any] = {}  # section -> existing layer (reuse) or options (build)
    for spec in LAYERS:
        section = spec.section
        choice = getattr(config, section)
        if section in buried:
            if choice is False:
                raise ConfigError(
                    section,
                    "is false but the optimizer already has this layer below a foreign wrapper; "
                    "unwrap it first",
                )
            continue
        if choice is None:
            if section in existing:
                wanted[section] = existing[section]
                continue
            choice = spec.derive(base)
        if choice is False:
            continue
        options = attrs.asdict(choice)
        if section in existing:
            current = spec.options_of(existing[section])
            if {k: current[k] for k in options} == options:
                wanted[section] = existing[section]  # already built this way: keep it
                continue
            options.update({k: current[k] for k in spec.carried if k in current})
        wanted[section] = options

    # The same sections, each the layer already there (so none to build), in canonical order.
    unchanged = set(wanted) == set(existing) and all(
        wanted[s] is layer for s, layer in existing.items()
    )
    canonical = [s.section for s in LAYERS if s.section in existing] == list(existing)
    if unchanged and canonical:
        return optimizer

    stack = base
    for spec in reversed(LAYERS):  # innermost first
        if spec.section not in wanted:
            continue
        choice = wanted[spec.section]
        options = choice if isinstance(choice, dict) else spec.options_of(choice)
        stack = spec.wrapper(stack, **options)
    return stack
