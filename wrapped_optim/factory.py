"""The factory: configuration picks the wrapper stack.

Three entry points, one stack shape:

* :func:`wrap` decorates an optimizer you already have;
* :func:`setup_optimizer` is Megatron-Bridge's ``setup_optimizer`` (same arguments, same
  builder and scheduler calls) returning the wrapped Megatron optimizer;
* :func:`build_optimizer` serves plain PyTorch users: an optimizer by name, warmup and decay
  from ``torch.optim.lr_scheduler``, the stack from the same config.

The canonical order, outermost to innermost, is
``FSDPAwareOptimizer -> HybridSyncOptimizer -> StagedCheckpointOptimizer -> optimizer``:

* staging is innermost because it changes *how state is read and written* (the format stays
  the same): every layer above, and the caller, see an ordinary state dict, and a
  ``load_state_dict`` that reaches staging has already been completed by the hybrid layer;
* hybrid sync sits above staging because it must see (and repair) the caller's checkpoint
  before the memory-bounded loader consumes it, and it must check master freshness before
  any step reaches the offloaded optimizer;
* the FSDP layer is outermost because it adapts *gradients* (casting foreign-dtype grads for
  the step, refreshing compute weights afterwards) around everything below, including the
  hybrid layer's stale-master check and the step itself.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from wrapped_optim.adapters.megatron import megatron_optimizer_module
from wrapped_optim.adapters.walk import walk_leaves
from wrapped_optim.config import (
    BuildConfig,
    ConfigError,
    FSDPConfig,
    HybridConfig,
    LRScheduleConfig,
    OptimizerSpec,
    StackConfig,
    StagedConfig,
)
from wrapped_optim.wrapper import OptimizerWrapper

__all__ = [
    "OptimizerConfigOverrideProvider",
    "OptimizerConfigOverrideProviderContext",
    "build_optimizer",
    "setup_optimizer",
    "wrap",
]

logger = logging.getLogger(__name__)

# Section name -> (module, class) of its wrapper; outermost first. Imported lazily so that
# config and setup code load without the wrapper modules' optional dependencies.
_LAYERS: dict[str, tuple[str, str]] = {
    "fsdp": ("wrapped_optim.fsdp", "FSDPAwareOptimizer"),
    "hybrid": ("wrapped_optim.hybrid", "HybridSyncOptimizer"),
    "staged": ("wrapped_optim.staged", "StagedCheckpointOptimizer"),
}


def _layer_class(section: str) -> type[OptimizerWrapper]:
    module, name = _LAYERS[section]
    cls = getattr(importlib.import_module(module), name)
    return cls


def _section_of(layer: Any) -> str | None:
    for section, (module, name) in _LAYERS.items():
        # Compare by class identity only when the module is already loaded: a layer of a
        # class never imported cannot be in the stack.
        loaded = sys.modules.get(module)
        if loaded is not None and isinstance(layer, getattr(loaded, name, ())):
            return section
    return None


# ----------------------------------------------------------------------------------------
# wrap()
# ----------------------------------------------------------------------------------------
def _derive_section(section: str, base: Any) -> Any:
    """The section derivation picks for ``base`` (an unwrapped optimizer stack), or False."""
    leaves = list(walk_leaves(base))
    if section == "staged":
        from wrapped_optim.staging import no_copy_decisions, staging_decisions

        # The engine's own decisions (hybrid sub-optimizers and Megatron's gates included):
        # staging is derived exactly where it would act.
        if any(decision.eligible for decision in staging_decisions(base)):
            return StagedConfig()
        if any(decision.eligible for decision in no_copy_decisions(base)):
            # A Megatron distributed FP32 Adam: its state can be adopted without copies.
            return StagedConfig()
        return False
    if section == "hybrid":
        from wrapped_optim.adapters.hybrid import find_hybrid_offload

        return HybridConfig() if find_hybrid_offload(base) else False
    from wrapped_optim.adapters.megatron_fsdp import needs_grad_cast

    if not needs_grad_cast(base):
        return False
    precision_aware = any(
        bool(getattr(leaf.config, "use_precision_aware_optimizer", False)) for leaf in leaves
    )
    return FSDPConfig(precision_aware=precision_aware)


def _peel(optimizer: Any) -> tuple[Any, dict[str, Any]]:
    """Splits off the canonical layers on top of ``optimizer``: (base, {section: layer})."""
    layers: dict[str, Any] = {}
    node = optimizer
    while isinstance(node, OptimizerWrapper):
        section = _section_of(node)
        if section is None or section in layers:
            break
        layers[section] = node
        node = node.inner
    return node, layers


def _buried_sections(base: Any) -> set[str]:
    """Canonical layers below a foreign wrapper: present, left where they are."""
    found = set()
    node = base
    while isinstance(node, OptimizerWrapper):
        section = _section_of(node)
        if section is not None:
            found.add(section)
        node = node.inner
    return found


def _options(section_config: Any) -> dict[str, Any]:
    return attrs.asdict(section_config)


def wrap(optimizer: Any, config: StackConfig | Mapping[str, Any] | None = None) -> Any:
    """Decorates ``optimizer`` with the canonical wrapper stack ``config`` asks for.

    Outermost to innermost: ``FSDPAwareOptimizer``, ``HybridSyncOptimizer``,
    ``StagedCheckpointOptimizer`` (the module docstring says why). Per section of ``config``:
    a section object adds the layer with those options, ``False`` leaves it out (and removes
    one already there), ``None`` keeps an existing layer or derives the decision from the
    optimizer itself — a leaf the staging engine would stage (``staging_decisions``: a
    precision-aware holder with compressed state, also as a hybrid offload optimizer's
    sub-optimizer) or a no-copy-eligible Megatron distributed optimizer -> staging; a
    hybrid offload optimizer -> hybrid sync; params whose ``grad_dtype`` differs from their
    dtype -> FSDP-aware.

    Re-wrapping never doubles a layer: canonical layers already on top are kept (also when an
    explicit section repeats their options), and when nothing changes the same object is
    returned. When layers must change (or a hand-built
    stack is out of canonical order), the canonical layers are rebuilt around the bare
    optimizer with their options (hooks registered on the replaced wrapper objects are not
    carried over). A canonical layer below a foreign wrapper is left where it is.

    Example:
        >>> import torch
        >>> from wrapped_optim.factory import wrap
        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
        >>> wrap(sgd) is sgd          # nothing to add for a plain SGD
        True
        >>> stacked = wrap(sgd, {"hybrid": False, "staged": {"chunk_bytes": 4096}})
        >>> [type(layer).__name__ for layer in stacked.layers()]
        ['StagedCheckpointOptimizer', 'SGD']
        >>> wrap(stacked) is stacked  # idempotent
        True
    """
    if config is None:
        config = StackConfig()
    elif isinstance(config, Mapping):
        config = StackConfig.from_dict(config)
    elif not isinstance(config, StackConfig):
        raise TypeError(f"config must be a StackConfig, a mapping or None, got {config!r}")

    base, existing = _peel(optimizer)
    buried = _buried_sections(base)

    wanted: dict[str, Any] = {}  # section -> existing layer (reuse) or options (build)
    for section in _LAYERS:
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
            choice = _derive_section(section, base)
        if choice is False:
            continue
        options = _options(choice)
        if section in existing:
            current = _layer_options(section, existing[section])
            if {k: current[k] for k in options} == options:
                wanted[section] = existing[section]  # already built this way: keep it
                continue
            if "refresh" in current:  # not a config option: carried over
                options["refresh"] = current["refresh"]
        wanted[section] = options

    unchanged = all(wanted.get(s) is layer for s, layer in existing.items()) and all(
        not isinstance(v, dict) for v in wanted.values()
    )
    canonical = [s for s in _LAYERS if s in existing] == list(existing)
    if unchanged and canonical and set(wanted) == set(existing):
        return optimizer

    stack = base
    for section in reversed(_LAYERS):  # innermost first
        if section not in wanted:
            continue
        choice = wanted[section]
        options = choice if isinstance(choice, dict) else _layer_options(section, choice)
        stack = _layer_class(section)(stack, **options)
    return stack


def _layer_options(section: str, layer: Any) -> dict[str, Any]:
    """The options an existing layer was built with, to rebuild it elsewhere in the stack."""
    defaults = {"staged": StagedConfig, "hybrid": HybridConfig, "fsdp": FSDPConfig}[section]()
    options = {
        name: getattr(layer, name, default) for name, default in attrs.asdict(defaults).items()
    }
    if section == "fsdp" and getattr(layer, "refresh", None) is not None:
        options["refresh"] = layer.refresh
    return options


# ----------------------------------------------------------------------------------------
# setup_optimizer(): Megatron-Bridge's entry point
# ----------------------------------------------------------------------------------------
@attrs.frozen
class OptimizerConfigOverrideProviderContext:
    """What an override provider sees (Bridge's context, same attribute names).

    Example:
        >>> OptimizerConfigOverrideProviderContext(None, None, []).model
        []
    """

    scheduler_config: Any
    optimizer_config: Any
    model: Any


class OptimizerConfigOverrideProvider:
    """Bridge's default provider: megatron-core's standard param-group overrides.

    Subclass it (or pass any object with ``build_config_overrides(context)``) to change
    per-parameter-group settings (weight-decay skips, decoupled LR...).

    Example:
        >>> callable(OptimizerConfigOverrideProvider().build_config_overrides)
        True
    """

    def build_config_overrides(self, context: OptimizerConfigOverrideProviderContext) -> Any:
        """``get_standard_config_overrides(config)``, or ``None`` when it has none."""
        core = megatron_optimizer_module()
        overrides = core.get_standard_config_overrides(config=context.optimizer_config)
        return overrides if overrides else None


def _ddp_config_of(model_chunks: list[Any]) -> Any:
    for chunk in model_chunks:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is not None:
            return ddp_config
    return None


def setup_optimizer(
    optimizer_config: Any,
    scheduler_config: Any,
    model: Any,
    use_gloo_process_groups: bool = True,
    pg_collection: Any = None,
    optimizer_config_override_provider: Any = None,
    *,
    ddp_config: Any = None,
    stack: StackConfig | Mapping[str, Any] | None = None,
) -> tuple[Any, Any]:
    """Megatron-Bridge's ``setup_optimizer``, returning the wrapped optimizer and its scheduler.

    As in Bridge: param-group overrides from ``optimizer_config_override_provider`` (default:
    megatron-core's standard overrides), with muP overrides merged on top when the model
    config has ``use_mup``; then ``optimizer_config.provide(...)`` when the config has that
    hook, else ``get_megatron_optimizer``, or ``get_megatron_muon_optimizer`` when the
    optimizer name contains ``muon`` or ``soap`` (layer-wise distributed when it contains
    ``dist``); then megatron-core's ``OptimizerParamScheduler``. The optimizer is wrapped with
    :meth:`StackConfig.from_megatron` (``ddp_config`` defaults to the first model chunk's
    ``ddp_config``; ``stack`` holds explicit settings that override derived ones).

    Needs megatron-core (and, for its optimizers, CUDA and initialised parallel state).
    ``scheduler_config`` is a :class:`wrapped_optim.config.SchedulerConfig` with its step
    counts set (:meth:`~wrapped_optim.config.SchedulerConfig.with_steps`) or Bridge's own.

    A config with Bridge's ``provide`` hook runs on a CPU, as in this example.

    Example:
        >>> import torch
        >>> from types import SimpleNamespace
        >>> from wrapped_optim.config import SchedulerConfig
        >>> from wrapped_optim.factory import setup_optimizer
        >>> model = torch.nn.Linear(2, 2)
        >>> model.config = SimpleNamespace(use_mup=False)
        >>> optimizer_config = SimpleNamespace(
        ...     optimizer="adam", lr=0.1, min_lr=0.0, weight_decay=0.0,
        ...     apply_wd_to_qk_layernorm=False, decoupled_lr=None, decoupled_min_lr=None,
        ...     provide=lambda model_chunks, **_: torch.optim.AdamW(model_chunks.parameters()))
        >>> steps = SchedulerConfig(lr_warmup_iters=1)
        >>> steps = steps.with_steps(train_iters=4, global_batch_size=1)
        >>> optimizer, scheduler = setup_optimizer(optimizer_config, steps, model)
        >>> optimizer.param_groups[0]["lr"]
        0.0
        >>> scheduler.step(1)
        >>> optimizer.param_groups[0]["lr"]
        0.1
    """
    core = megatron_optimizer_module()
    from megatron.core.utils import get_model_config

    name = getattr(optimizer_config, "optimizer", None)
    if not isinstance(name, str):
        raise ConfigError("optimizer_config.optimizer", f"must be a string, got {name!r}")
    if optimizer_config_override_provider is None:
        optimizer_config_override_provider = OptimizerConfigOverrideProvider()
    config_overrides = optimizer_config_override_provider.build_config_overrides(
        OptimizerConfigOverrideProviderContext(scheduler_config, optimizer_config, model)
    )

    model_chunks = model if isinstance(model, list) else [model]
    model_config = get_model_config(model_chunks[0])
    if getattr(model_config, "use_mup", False):
        get_mup_config_overrides = getattr(core, "get_mup_config_overrides", None)
        if get_mup_config_overrides is None:
            raise ImportError(
                "the model config has use_mup=True, which needs a megatron-core with "
                "megatron.core.optimizer.get_mup_config_overrides (newer than the one installed)"
            )
        mup_overrides = get_mup_config_overrides(
            config=optimizer_config,
            mup_width_mult=model_config.mup_width_mult,
            optimizer_type=name,
        )
        if mup_overrides:
            config_overrides = {**(config_overrides or {}), **mup_overrides}
            logger.info(
                "muP enabled (width_mult=%.4g): applied %d optimizer param-group override(s)",
                model_config.mup_width_mult,
                len(mup_overrides),
            )

    if hasattr(optimizer_config, "provide"):
        optimizer = optimizer_config.provide(
            model_chunks=model,
            config_overrides=config_overrides,
            use_gloo_process_groups=use_gloo_process_groups,
            pg_collection=pg_collection,
        )
    elif "muon" not in name and "soap" not in name:
        optimizer = core.get_megatron_optimizer(
            config=optimizer_config,
            model_chunks=model,
            config_overrides=config_overrides,
            use_gloo_process_groups=use_gloo_process_groups,
            pg_collection=pg_collection,
        )
    else:
        muon = importlib.import_module("megatron.core.optimizer.muon")
        optimizer = muon.get_megatron_muon_optimizer(
            config=optimizer_config,
            model_chunks=model,
            config_overrides=config_overrides,
            use_gloo_process_groups=use_gloo_process_groups,
            layer_wise_distributed_optimizer="dist" in name,
            pg_collection=pg_collection,
        )

    if ddp_config is None:
        ddp_config = _ddp_config_of(model_chunks)
    stack_config = StackConfig.from_megatron(optimizer_config, ddp_config, overrides=stack)
    wrapped = wrap(optimizer, stack_config)
    scheduler = _megatron_scheduler(optimizer_config, scheduler_config, wrapped)
    return wrapped, scheduler


def _megatron_scheduler(optimizer_config: Any, scheduler_config: Any, optimizer: Any) -> Any:
    scheduler_module = importlib.import_module("megatron.core.optimizer_param_scheduler")
    for name in ("lr_decay_steps", "wd_incr_steps", "lr_warmup_steps"):
        if getattr(scheduler_config, name, None) is None:
            raise ConfigError(
                f"scheduler_config.{name}",
                "is not set; derive the step counts with SchedulerConfig.with_steps(...)",
            )
    for name in ("lr", "min_lr"):
        if getattr(optimizer_config, name, None) is None:
            raise ConfigError(f"optimizer_config.{name}", "must be set for the LR scheduler")
    weight_decay = getattr(optimizer_config, "weight_decay", 0.0)
    start_wd = scheduler_config.start_weight_decay
    end_wd = scheduler_config.end_weight_decay
    return scheduler_module.OptimizerParamScheduler(
        optimizer,
        init_lr=scheduler_config.lr_warmup_init,
        max_lr=optimizer_config.lr,
        min_lr=optimizer_config.min_lr,
        lr_warmup_steps=scheduler_config.lr_warmup_steps,
        lr_decay_steps=scheduler_config.lr_decay_steps,
        lr_decay_style=scheduler_config.lr_decay_style,
        start_wd=weight_decay if start_wd is None else start_wd,
        end_wd=weight_decay if end_wd is None else end_wd,
        wd_incr_steps=scheduler_config.wd_incr_steps,
        wd_incr_style=scheduler_config.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=scheduler_config.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=scheduler_config.override_opt_param_scheduler,
        wsd_decay_steps=scheduler_config.wsd_decay_steps,
        lr_wsd_decay_style=scheduler_config.lr_wsd_decay_style,
    )


# ----------------------------------------------------------------------------------------
# build_optimizer(): plain PyTorch
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

    Example:
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
    """Builds ``(wrapped optimizer, LR scheduler or None)`` from a config for plain PyTorch.

    ``config`` is a :class:`~wrapped_optim.config.BuildConfig`, its dict form or a TOML file
    path. The optimizer comes from ``[optimizer]`` (``name`` + keywords; ``*_cls`` options
    are resolved by name too), the stack from ``[staged]``/``[hybrid]``/``[fsdp]`` (absent
    sections derived, see :func:`wrap`), and the scheduler from ``[schedule]``:
    ``torch.optim.lr_scheduler`` pieces (step it with ``scheduler.step()``) or megatron-core's
    ``OptimizerParamScheduler`` with ``backend = "megatron"`` (``scheduler.step(1)``).

    Example:
        >>> import torch
        >>> from wrapped_optim.factory import build_optimizer
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
