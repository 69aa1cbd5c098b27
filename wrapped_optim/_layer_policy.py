"""When Megatron's settings turn a layer of the stack on: one policy, asked by both
``StackConfig.from_megatron`` and ``wrap``, so each rule is written once. It sees settings
only and imports no optimizer code.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from wrapped_optim._adapters.megatron import config_flag
from wrapped_optim._config_fields import ConfigError

__all__ = [
    "MegatronSettings",
    "fsdp_layer_wanted",
    "hybrid_layer_wanted",
    "no_copy_blocker",
    "staged_switches",
    "staging_blocker",
    "step_repair_wanted",
]


@attrs.frozen
class MegatronSettings:
    """What Megatron's configs say about one optimizer; ``None`` where no config says.

    Attributes:
        precision_aware: ``OptimizerConfig.use_precision_aware_optimizer`` (``None``: the
            optimizer has no Megatron config, e.g. a plain torch optimizer).
        cpu_offload: ``OptimizerConfig.optimizer_cpu_offload``.
        distributed: ``use_distributed_optimizer``, or for a leaf whether its container is a
            distributed optimizer (``None``: unknown).
        megatron_fsdp: ``DistributedDataParallelConfig.use_megatron_fsdp`` (``None``: no DDP
            config given).
        optimizer: ``OptimizerConfig.optimizer`` (``None``: not checked; a leaf's structure
            decides instead).

    Example:
        >>> from types import SimpleNamespace
        >>> MegatronSettings.of(SimpleNamespace(optimizer_cpu_offload=True), None).cpu_offload
        True
        >>> MegatronSettings.of(None, None).precision_aware is None
        True
    """

    precision_aware: bool | None = None
    cpu_offload: bool = False
    distributed: bool | None = None
    megatron_fsdp: bool | None = None
    optimizer: str | None = None

    @classmethod
    def of(
        cls, config: Any, ddp_config: Any, *, distributed: bool | None = None
    ) -> MegatronSettings:
        """The settings of a leaf's container, read leniently (absent flags are off).

        Example:
            >>> from types import SimpleNamespace
            >>> config = SimpleNamespace(use_precision_aware_optimizer=True)
            >>> MegatronSettings.of(config, SimpleNamespace(use_megatron_fsdp=True))
            MegatronSettings(precision_aware=True, cpu_offload=False, distributed=None, \
megatron_fsdp=True, optimizer=None)
        """
        return cls(
            precision_aware=(
                config_flag(config, "use_precision_aware_optimizer") if config is not None else None
            ),
            cpu_offload=config_flag(config, "optimizer_cpu_offload"),
            distributed=distributed,
            megatron_fsdp=config_flag(ddp_config, "use_megatron_fsdp"),
        )

    @classmethod
    def validated(cls, optimizer_config: Any, ddp_config: Any = None) -> MegatronSettings:
        """The settings of Megatron's configs, checked as Megatron would (``ConfigError``).

        Any object with Megatron's attribute names works. Flags must be bools (``None`` reads
        as off); ``use_precision_aware_optimizer`` needs ``optimizer="adam"`` and the
        distributed optimizer, and without it every state dtype must be FP32.

        Example:
            >>> from types import SimpleNamespace
            >>> MegatronSettings.validated(SimpleNamespace(use_distributed_optimizer=True))
            MegatronSettings(precision_aware=False, cpu_offload=False, distributed=True, \
megatron_fsdp=None, optimizer='adam')
        """
        if optimizer_config is None:
            raise TypeError("from_megatron needs Megatron's OptimizerConfig (or an object like it)")
        where = "optimizer_config"
        precision_aware = _strict_flag(optimizer_config, "use_precision_aware_optimizer", where)
        distributed = _strict_flag(optimizer_config, "use_distributed_optimizer", where)
        name = getattr(optimizer_config, "optimizer", "adam")
        if not isinstance(name, str):
            raise ConfigError(f"{where}.optimizer", f"must be a string, got {name!r}")
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
        cpu_offload = _strict_flag(optimizer_config, "optimizer_cpu_offload", where)
        refuse_precision_aware_offload(precision_aware, cpu_offload, where)
        if not precision_aware:
            for dtype_name in ("exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype"):
                if not _is_fp32(getattr(optimizer_config, dtype_name, None)):
                    raise ConfigError(
                        f"{where}.{dtype_name}",
                        "must be torch.float32 unless use_precision_aware_optimizer=True",
                    )
        return cls(
            precision_aware=precision_aware,
            cpu_offload=cpu_offload,
            distributed=distributed,
            megatron_fsdp=(
                None
                if ddp_config is None
                else _strict_flag(ddp_config, "use_megatron_fsdp", "ddp_config")
            ),
            optimizer=name,
        )


def refuse_precision_aware_offload(precision_aware: bool, cpu_offload: bool, where: str) -> None:
    """Refuses Megatron's ``use_precision_aware_optimizer`` together with
    ``optimizer_cpu_offload``: megatron-core (0.16.1 to 0.19.2) builds the
    HybridDeviceOptimizer's halves without the precision-aware options, so the dtypes asked
    for are silently ignored, and its checkpoint path for the pair does not resume exactly.

    Example:
        >>> refuse_precision_aware_offload(True, False, "optimizer_config")  # either alone: fine
        >>> try:
        ...     refuse_precision_aware_offload(True, True, "optimizer_config")
        ... except ConfigError as error:
        ...     print(str(error).split(":")[0])
        optimizer_config.optimizer_cpu_offload
    """
    if precision_aware and cpu_offload:
        raise ConfigError(
            f"{where}.optimizer_cpu_offload",
            "cannot be combined with use_precision_aware_optimizer=True: megatron-core builds "
            "the HybridDeviceOptimizer's host and device optimizers without exp_avg_dtype, "
            "exp_avg_sq_dtype, main_params_dtype or store_param_remainders (both keep FP32 "
            "moments; the settings would be silently ignored), and its save and load of that "
            "pair do not restore the FP32 copies the halves step on, so a resume is not "
            "exact. Turn one of them off: offload alone keeps the same FP32 state and resumes "
            "exactly; precision-aware state alone keeps bf16/FP8 moments",
        )


def _strict_flag(config: Any, name: str, where: str) -> bool:
    value = getattr(config, name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConfigError(f"{where}.{name}", f"must be a bool, got {value!r}")
    return value


def _is_fp32(value: Any) -> bool:
    return value is None or value == torch.float32 or value in ("fp32", "float32")


def staging_blocker(settings: MegatronSettings) -> str | None:
    """Why the settings keep staged save and chunked load off, or ``None`` (allowed).

    With a Megatron config, the optimizer must be precision-aware and not CPU-offloaded (Bridge
    skips staging there); Megatron-FSDP never stages. Without a config the leaf decides.

    Example:
        >>> staging_blocker(MegatronSettings(precision_aware=True, cpu_offload=True))
        'config.optimizer_cpu_offload is on'
        >>> staging_blocker(MegatronSettings()) is None
        True
    """
    if settings.precision_aware is not None:
        if not settings.precision_aware:
            return "config.use_precision_aware_optimizer is off"
        if settings.cpu_offload:
            return "config.optimizer_cpu_offload is on"
    if settings.megatron_fsdp:
        return "ddp_config.use_megatron_fsdp is on"
    return None


def no_copy_blocker(settings: MegatronSettings) -> str | None:
    """Why the settings keep the FP32 no-copy load off, or ``None`` (allowed).

    Only a distributed optimizer's standard FP32 Adam adopts checkpoint tensors: not under
    Megatron-FSDP, precision-aware state or CPU offload.

    Example:
        >>> no_copy_blocker(MegatronSettings(distributed=True)) is None
        True
        >>> no_copy_blocker(MegatronSettings(distributed=False))
        'not inside a distributed optimizer'
    """
    if not settings.distributed:
        return "not inside a distributed optimizer"
    if settings.megatron_fsdp:
        return "ddp_config.use_megatron_fsdp is on"
    if settings.precision_aware:
        return "config.use_precision_aware_optimizer is on"
    if settings.cpu_offload:
        return "config.optimizer_cpu_offload is on"
    if settings.optimizer is not None and settings.optimizer != "adam":
        return f"config.optimizer is {settings.optimizer!r}, not 'adam'"
    return None


def staged_switches(settings: MegatronSettings) -> dict[str, bool] | None:
    """The staging layer's switches the settings call for, or ``None`` (no staging layer).

    Precision-aware state: staged save and chunked load; a distributed FP32 Adam: no-copy
    load only.

    Example:
        >>> staged_switches(MegatronSettings(precision_aware=False, distributed=True))
        {'stage_save': False, 'no_copy_load': True, 'chunked_load': False}
        >>> staged_switches(MegatronSettings(precision_aware=False)) is None
        True
    """
    if staging_blocker(settings) is None:
        return {"stage_save": True, "no_copy_load": False, "chunked_load": True}
    if no_copy_blocker(settings) is None:
        return {"stage_save": False, "no_copy_load": True, "chunked_load": False}
    return None


def step_repair_wanted(settings: MegatronSettings) -> bool:
    """Whether a leaf needs the staged layer for its step repair alone.

    megatron-core 0.16.1's ``DistributedOptimizer.load_state_dict`` without TE/Apex (torch's
    Adam/AdamW inside) writes *one* ``step`` tensor into every parameter's state, which torch
    then increments once per parameter per step: a resumed run diverges. The staged layer gives
    each parameter its own step after every load
    (:func:`wrapped_optim._adapters.megatron.unshare_steps`), so :func:`wrapped_optim.wrap`
    adds it for a torch Adam inside a distributed optimizer even where the no-copy load itself
    declines the leaf -- the same settings for which :func:`staged_switches` gives the layer
    from Megatron's configs. Not under precision-aware state (that needs TE, whose FusedAdam
    keeps the step per group), CPU offload (the hybrid sync layer's resume gives every
    parameter its own step) or Megatron-FSDP (its own optimizer loader).

    Example:
        >>> step_repair_wanted(MegatronSettings(precision_aware=False, distributed=True))
        True
        >>> step_repair_wanted(MegatronSettings(distributed=True, cpu_offload=True))
        False
    """
    return no_copy_blocker(settings) is None


def hybrid_layer_wanted(settings: MegatronSettings) -> bool:
    """Whether the settings call for hybrid sync: the optimizer is CPU-offloaded.

    Example:
        >>> hybrid_layer_wanted(MegatronSettings(cpu_offload=True))
        True
    """
    return settings.cpu_offload


def fsdp_layer_wanted(settings: MegatronSettings) -> bool | None:
    """Whether the settings call for the FSDP-aware layer (``None``: they do not say).

    Example:
        >>> fsdp_layer_wanted(MegatronSettings(megatron_fsdp=True)), fsdp_layer_wanted(
        ...     MegatronSettings())
        (True, None)
    """
    return settings.megatron_fsdp
