"""The Megatron-Bridge port: Bridge's ``setup_optimizer`` and its scheduler settings, with
wrapped_optim's stack on top. Needs megatron-core at call time only.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import attrs
import torch

from wrapped_optim._adapters.megatron import megatron_optimizer_module
from wrapped_optim._builder import MEGATRON_LR_STYLES
from wrapped_optim._config_fields import (
    ConfigError,
    check_bool,
    check_choice,
    check_float,
    check_int_at_least,
    check_optional_int_at_least,
    from_mapping,
    is_int,
)
from wrapped_optim.config import StackConfig
from wrapped_optim.stack import wrap

__all__ = [
    "OptimizerConfigOverrideProvider",
    "OptimizerConfigOverrideProviderContext",
    "SchedulerConfig",
    "setup_optimizer",
]

logger = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    """Megatron-Bridge's LR / weight-decay scheduler settings, with Bridge's validation.

    Field names and meanings follow Bridge: iterations *or* samples, never both; warmup by
    count or by fraction. The ``*_steps`` fields megatron-core's ``OptimizerParamScheduler``
    consumes are derived by ``with_steps`` (as Bridge's ConfigContainer does) or set directly.

    Attributes:
        lr_decay_style: ``constant``, ``linear``, ``cosine``, ``inverse-square-root`` or ``WSD``.
        lr_wsd_decay_style: WSD's annealing shape (``exponential``, ``linear``, ``cosine``,
            ``minus_sqrt``).
        lr_decay_iters: Iterations of LR decay (default: the training length).
        lr_decay_samples: Samples of LR decay (sample-based training).
        lr_wsd_decay_iters: Iterations of WSD's annealing.
        lr_wsd_decay_samples: Samples of WSD's annealing.
        lr_warmup_fraction: Warmup as a fraction of the decay (excludes the two below).
        lr_warmup_iters: Warmup iterations.
        lr_warmup_samples: Warmup samples.
        lr_warmup_init: The LR the warmup starts from.
        override_opt_param_scheduler: Take these settings over a checkpoint's.
        use_checkpoint_opt_param_scheduler: Take a checkpoint's settings over these.
        start_weight_decay: The weight decay at the start (``None``: the optimizer config's).
        end_weight_decay: The weight decay at the end (``None``: the optimizer config's).
        weight_decay_incr_style: ``constant``, ``linear`` or ``cosine``.
        no_weight_decay_cond_type: Bridge's named no-weight-decay rule (``"qwen3_next"``).
        max_steps: The scheduler's total steps, in samples (set by ``with_steps``).
        lr_warmup_steps: Warmup steps, in samples (set by ``with_steps``).
        lr_decay_steps: Decay steps, in samples (set by ``with_steps``).
        wd_incr_steps: Weight-decay steps, in samples (set by ``with_steps``).
        wsd_decay_steps: WSD annealing steps, in samples (set by ``with_steps``).

    Raises:
        ConfigError: an invalid value, or iterations mixed with samples.

    Examples:
        >>> config = SchedulerConfig(lr_decay_style="cosine", lr_warmup_iters=10)
        >>> config = config.with_steps(train_iters=100, global_batch_size=8)
        >>> config.lr_warmup_steps, config.lr_decay_steps, config.wd_incr_steps
        (80, 800, 800)
    """

    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = (
        attrs.field(default="linear", validator=check_choice(*MEGATRON_LR_STYLES))
    )
    lr_wsd_decay_style: Literal["exponential", "linear", "cosine", "minus_sqrt"] = attrs.field(
        default="exponential",
        validator=check_choice("exponential", "linear", "cosine", "minus_sqrt"),
    )
    lr_decay_iters: int | None = attrs.field(default=None, validator=check_optional_int_at_least(1))
    lr_decay_samples: int | None = attrs.field(
        default=None, validator=check_optional_int_at_least(1)
    )
    lr_wsd_decay_iters: int | None = attrs.field(
        default=None, validator=check_optional_int_at_least(1)
    )
    lr_wsd_decay_samples: int | None = attrs.field(
        default=None, validator=check_optional_int_at_least(1)
    )
    lr_warmup_fraction: float | None = attrs.field(
        default=None, validator=check_float(minimum=0.0, maximum=1.0, optional=True)
    )
    lr_warmup_iters: int = attrs.field(default=0, validator=check_int_at_least(0))
    lr_warmup_samples: int = attrs.field(default=0, validator=check_int_at_least(0))
    lr_warmup_init: float = attrs.field(default=0.0, validator=check_float(minimum=0.0))
    override_opt_param_scheduler: bool = attrs.field(default=False, validator=check_bool)
    use_checkpoint_opt_param_scheduler: bool = attrs.field(default=False, validator=check_bool)
    start_weight_decay: float | None = attrs.field(
        default=None, validator=check_float(optional=True)
    )
    end_weight_decay: float | None = attrs.field(default=None, validator=check_float(optional=True))
    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = attrs.field(
        default="constant", validator=check_choice("constant", "linear", "cosine")
    )
    no_weight_decay_cond_type: Literal["qwen3_next"] | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(check_choice("qwen3_next")),
    )
    max_steps: int | None = attrs.field(default=None, validator=check_optional_int_at_least(1))
    # Derived by with_steps() (Bridge: ConfigContainer._calculate_scheduler_steps).
    lr_warmup_steps: float | None = attrs.field(
        default=None, validator=check_float(minimum=0.0, optional=True)
    )
    lr_decay_steps: int | None = attrs.field(default=None, validator=check_optional_int_at_least(1))
    wd_incr_steps: int | None = attrs.field(default=None, validator=check_optional_int_at_least(1))
    wsd_decay_steps: int | None = attrs.field(
        default=None, validator=check_optional_int_at_least(1)
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
        """Returns a copy with the scheduler's step counts derived from the training length.

        Steps are counted in samples, as in Bridge; a warmup as long as the decay is capped
        to ``lr_decay_steps - 1`` with a warning.

        Args:
            train_iters: Training iterations (iteration-based; needs ``global_batch_size``).
            global_batch_size: Samples per iteration.
            train_samples: Training samples (sample-based; excludes ``train_iters``).

        Raises:
            ConfigError: the training length is given both ways or not at all, a count is
                not positive, or a setting is of the other kind (iterations vs samples).

        Examples:
            >>> SchedulerConfig(lr_warmup_samples=10).with_steps(train_samples=1000).lr_decay_steps
            1000
        """
        if train_samples is not None:
            if train_iters is not None:
                raise ConfigError("train_iters", "cannot be combined with train_samples")
            changes, decay, warmup = self._sample_steps(train_samples)
        else:
            if train_iters is None or global_batch_size is None:
                raise ConfigError(
                    "train_iters",
                    "with_steps needs train_iters and global_batch_size, or train_samples",
                )
            changes, decay, warmup = self._iteration_steps(train_iters, global_batch_size)
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

    def _sample_steps(self, train_samples: int) -> tuple[dict[str, Any], int, float]:
        """Sample-based step counts: (the changes, the decay steps, the warmup steps)."""
        if not is_int(train_samples) or train_samples <= 0:
            raise ConfigError("train_samples", f"must be a positive int, got {train_samples}")
        if self.max_steps is not None:
            raise ConfigError("max_steps", "is only supported for iteration-based training")
        if self.lr_decay_iters is not None or self.lr_warmup_iters:
            raise ConfigError(
                "lr_decay_iters" if self.lr_decay_iters is not None else "lr_warmup_iters",
                "use the *_samples fields for sample-based training",
            )
        decay = self.lr_decay_samples if self.lr_decay_samples is not None else train_samples
        changes: dict[str, Any] = {"lr_decay_steps": decay, "wd_incr_steps": train_samples}
        if self.lr_wsd_decay_samples is not None:
            changes["wsd_decay_steps"] = self.lr_wsd_decay_samples
        warmup: float = (
            self.lr_warmup_fraction * decay
            if self.lr_warmup_fraction is not None
            else self.lr_warmup_samples
        )
        return changes, decay, warmup

    def _iteration_steps(
        self, train_iters: int, global_batch_size: int
    ) -> tuple[dict[str, Any], int, float]:
        """Iteration-based step counts (in samples): (the changes, decay steps, warmup steps)."""
        for name, value in (("train_iters", train_iters), ("global_batch_size", global_batch_size)):
            if not is_int(value) or value <= 0:
                raise ConfigError(name, f"must be a positive int, got {value!r}")
        if self.lr_decay_samples is not None or self.lr_warmup_samples:
            raise ConfigError(
                "lr_decay_samples" if self.lr_decay_samples is not None else "lr_warmup_samples",
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
        decay = decay_iters * global_batch_size
        changes: dict[str, Any] = {
            "lr_decay_iters": decay_iters,
            "lr_wsd_decay_iters": wsd_iters,
            "lr_decay_steps": decay,
            "wd_incr_steps": (self.max_steps or train_iters) * global_batch_size,
        }
        if wsd_iters is not None:
            changes["wsd_decay_steps"] = wsd_iters * global_batch_size
        warmup = (
            self.lr_warmup_fraction * decay
            if self.lr_warmup_fraction is not None
            else self.lr_warmup_iters * global_batch_size
        )
        return changes, decay, warmup

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SchedulerConfig:
        """Builds the config from a mapping of its fields.

        Args:
            data: The fields by name; an unknown key is an error.

        Raises:
            ConfigError: an unknown key or an invalid value.

        Examples:
            >>> SchedulerConfig.from_dict({"lr_decay_style": "cosine"}).lr_decay_style
            'cosine'
        """
        return from_mapping(cls, data, "")


@attrs.frozen
class OptimizerConfigOverrideProviderContext:
    """What an override provider sees (Bridge's context, same attribute names).

    Attributes:
        scheduler_config: The scheduler config passed to ``setup_optimizer``.
        optimizer_config: Megatron's ``OptimizerConfig``.
        model: The model chunks.

    Examples:
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

    Examples:
        >>> callable(OptimizerConfigOverrideProvider().build_config_overrides)
        True
    """

    def build_config_overrides(self, context: OptimizerConfigOverrideProviderContext) -> Any:
        """Returns megatron-core's standard param-group overrides for the optimizer config.

        Args:
            context: What ``setup_optimizer`` is building.

        Returns:
            ``get_standard_config_overrides(config)``, or ``None`` when it has none.
        """
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
    use_gloo_process_groups: bool = False,
    pg_collection: Any = None,
    optimizer_config_override_provider: Any = None,
    *,
    ddp_config: Any = None,
    stack: StackConfig | Mapping[str, Any] | None = None,
) -> tuple[Any, Any]:
    """Megatron-Bridge's ``setup_optimizer``, returning the wrapped optimizer and its scheduler.

    As in Bridge: param-group overrides (muP's merged on top when the model config has
    ``use_mup``), then the config's ``provide`` hook, ``get_megatron_optimizer`` or the Muon
    builder, then megatron-core's ``OptimizerParamScheduler``. The optimizer is then wrapped
    with the stack ``StackConfig.from_megatron`` derives. Needs megatron-core (and, for its
    optimizers, CUDA and initialised parallel state); a config with Bridge's ``provide`` hook
    runs on a CPU, as in the example.

    Args:
        optimizer_config: Megatron's ``OptimizerConfig``.
        scheduler_config: A ``SchedulerConfig`` with its step counts set
            (``SchedulerConfig.with_steps``), or Bridge's own.
        model: The model chunks (a module or a list of them).
        use_gloo_process_groups: Passed to megatron-core's optimizer builder.
        pg_collection: Passed to megatron-core's optimizer builder.
        optimizer_config_override_provider: Builds the param-group overrides (default:
            ``OptimizerConfigOverrideProvider``).
        ddp_config: Megatron's DDP config (default: the first model chunk's ``ddp_config``).
        stack: Explicit stack settings that override the derived ones.

    Returns:
        ``(optimizer, scheduler)``: the wrapped Megatron optimizer and its scheduler.

    Raises:
        ConfigError: ``optimizer_config.optimizer`` is not a string, or a config is invalid
            (``use_precision_aware_optimizer`` with ``optimizer_cpu_offload`` included, which
            megatron-core builds without the precision-aware settings); nothing is built.
        RuntimeError: megatron-core's builders need a CUDA device and this torch has none
            (the config has no ``provide`` hook); the message says what runs on a CPU.

    Examples:
        >>> import torch
        >>> from types import SimpleNamespace
        >>> from wrapped_optim.integrations.bridge import SchedulerConfig, setup_optimizer
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
    name = getattr(optimizer_config, "optimizer", None)
    if not isinstance(name, str):
        raise ConfigError("optimizer_config.optimizer", f"must be a string, got {name!r}")
    model_chunks = model if isinstance(model, list) else [model]
    if ddp_config is None:
        ddp_config = _ddp_config_of(model_chunks)
    # Validated before Megatron builds anything (a refused config builds no optimizer).
    stack_config = StackConfig.from_megatron(optimizer_config, ddp_config, overrides=stack)
    config_overrides = _config_overrides(
        core, optimizer_config_override_provider, optimizer_config, scheduler_config, model
    )
    optimizer = _megatron_optimizer(
        core,
        name,
        optimizer_config,
        model,
        config_overrides=config_overrides,
        use_gloo_process_groups=use_gloo_process_groups,
        pg_collection=pg_collection,
    )
    wrapped = wrap(optimizer, stack_config)
    scheduler = _megatron_scheduler(optimizer_config, scheduler_config, wrapped)
    return wrapped, scheduler


def _config_overrides(
    core: Any, provider: Any, optimizer_config: Any, scheduler_config: Any, model: Any
) -> Any:
    """Bridge's param-group overrides: the provider's (default: megatron-core's standard
    ones), with muP overrides on top when the model config has ``use_mup``."""
    from megatron.core.utils import get_model_config

    if provider is None:
        provider = OptimizerConfigOverrideProvider()
    config_overrides = provider.build_config_overrides(
        OptimizerConfigOverrideProviderContext(scheduler_config, optimizer_config, model)
    )
    model_chunks = model if isinstance(model, list) else [model]
    model_config = get_model_config(model_chunks[0])
    if not getattr(model_config, "use_mup", False):
        return config_overrides
    get_mup_config_overrides = getattr(core, "get_mup_config_overrides", None)
    if get_mup_config_overrides is None:
        raise ImportError(
            "the model config has use_mup=True, which needs a megatron-core with "
            "megatron.core.optimizer.get_mup_config_overrides (newer than the one installed)"
        )
    mup_overrides = get_mup_config_overrides(
        config=optimizer_config,
        mup_width_mult=model_config.mup_width_mult,
        optimizer_type=optimizer_config.optimizer,
    )
    if mup_overrides:
        config_overrides = {**(config_overrides or {}), **mup_overrides}
        logger.info(
            "muP enabled (width_mult=%.4g): applied %d optimizer param-group override(s)",
            model_config.mup_width_mult,
            len(mup_overrides),
        )
    return config_overrides


def _megatron_optimizer(
    core: Any, name: str, optimizer_config: Any, model: Any, **options: Any
) -> Any:
    """The optimizer Bridge builds: the config's ``provide`` hook, else megatron-core's
    builder (the Muon one for ``muon``/``soap`` names, layer-wise when ``dist``);
    ``options`` are ``config_overrides``, ``use_gloo_process_groups``, ``pg_collection``."""
    if hasattr(optimizer_config, "provide"):
        return optimizer_config.provide(model_chunks=model, **options)
    with _needs_cuda():
        if "muon" not in name and "soap" not in name:
            return core.get_megatron_optimizer(
                config=optimizer_config, model_chunks=model, **options
            )
        muon = importlib.import_module("megatron.core.optimizer.muon")
        return muon.get_megatron_muon_optimizer(
            config=optimizer_config,
            model_chunks=model,
            layer_wise_distributed_optimizer="dist" in name,
            **options,
        )


#: What torch raises when CUDA is asked for and there is none (a CPU build; no driver/device).
_NO_CUDA = ("Torch not compiled with CUDA enabled", "Found no NVIDIA driver", "no CUDA GPUs")


@contextlib.contextmanager
def _needs_cuda() -> Iterator[None]:
    """Megatron's optimizer builders put their buffers on the current CUDA device; on a
    machine without one, say that, and what runs instead, rather than torch's bare error."""
    try:
        yield
    except (AssertionError, RuntimeError) as error:
        if torch.cuda.is_available() or not any(text in str(error) for text in _NO_CUDA):
            raise
        raise RuntimeError(
            "setup_optimizer: megatron-core builds its optimizers on a CUDA device, and this "
            f"torch has none ({error}). On a CPU, give the optimizer config Bridge's "
            "`provide(model_chunks, **options)` hook returning a portable optimizer "
            "(wrapped_optim.optimizers.PrecisionAwareAdamW or HybridOffloadOptimizer): "
            "setup_optimizer then skips Megatron's builders (see the Megatron-Bridge guide, "
            "'On a CPU'); or build the stack with wrapped_optim.build_optimizer."
        ) from error


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
