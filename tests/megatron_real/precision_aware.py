"""Megatron's real precision-aware DistributedOptimizer on CPU, PrecisionAwareAdamW as TE's
FusedAdam.

Two adaptations make megatron-core's own factory (``get_megatron_optimizer`` with
``use_precision_aware_optimizer=True``) build that stack without Transformer Engine; both live
here, in the test harness, never in the package:

* a module ``transformer_engine.pytorch.optimizers`` in ``sys.modules`` whose ``FusedAdam`` is
  :class:`~wrapped_optim.optimizers.PrecisionAwareAdamW` itself and whose ``FusedSGD`` is
  ``torch.optim.SGD`` (and no top-level ``transformer_engine`` package: Core's ``fp8_utils``
  would then import TE's tensor classes). Core binds ``FusedAdam`` when
  ``megatron.core.optimizer`` is first imported, so :func:`install_te_stand_in` must run in a
  fresh process before that import: the tests call it in spawned workers only;
* ``megatron.core.utils._te_version`` set to a TE release (without TE, ``is_te_min_version``
  compares ``None`` and raises in ``OptimizerConfig.__post_init__``). 2.8 is >= 2.1, so Core
  passes ``store_param_remainders`` to the optimizer, as it does under a current TE.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch

TE_MODULE = "transformer_engine.pytorch.optimizers"
TE_VERSION = "2.8.0"

# name -> OptimizerConfig fields (bf16 params, distributed optimizer, precision-aware)
PRECISION_CONFIGS: dict[str, dict[str, Any]] = {
    # Megatron's default precision-aware layout: bf16 moments, FP32 master as remainders.
    "bf16_remainders": {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16},
    "fp8_remainders": {"exp_avg_dtype": torch.uint8, "exp_avg_sq_dtype": torch.uint8},
    "bf16_fp16_master": {
        "exp_avg_dtype": torch.bfloat16,
        "exp_avg_sq_dtype": torch.bfloat16,
        "main_params_dtype": torch.float16,
        "store_param_remainders": False,
    },
}


def install_te_stand_in() -> None:
    """Makes Core see PrecisionAwareAdamW as TE's FusedAdam (see the module docstring)."""
    from wrapped_optim.optimizers import PrecisionAwareAdamW

    existing = sys.modules.get(TE_MODULE)
    if existing is None:
        if "megatron.core.optimizer" in sys.modules:
            raise RuntimeError(
                "megatron.core.optimizer was imported before the TE stand-in: install it first, "
                "in a fresh process"
            )
        module = types.ModuleType(TE_MODULE)
        module.FusedAdam = PrecisionAwareAdamW  # type: ignore[attr-defined]
        module.FusedSGD = torch.optim.SGD  # type: ignore[attr-defined]
        sys.modules[TE_MODULE] = module
    from megatron.core import utils
    from packaging.version import Version

    utils._te_version = Version(TE_VERSION)


def options(name: str, **more: Any) -> dict[str, Any]:
    """The ``OptimizerConfig`` fields of precision-aware config ``name`` (plus ``more``)."""
    return {"use_precision_aware_optimizer": True, **PRECISION_CONFIGS[name], **more}


def build_precision_aware(
    name: str,
    seed: int = 0,
    *,
    setup: bool = False,
    hidden: int | None = None,
    ddp_options: dict[str, Any] | None = None,
    **more: Any,
) -> Any:
    """``(ddp_model, optimizer)`` from Core's factory for precision-aware config ``name``,
    inside :func:`tests.megatron_real.harness.megatron_session` (``hidden``: the model's width,
    default the harness's; ``ddp_options``: more DDP config fields, e.g. several buckets)."""
    from tests.megatron_real.harness import HIDDEN, build

    return build(
        "bf16_distributed",
        seed,
        setup=setup,
        options=options(name, **more),
        hidden=HIDDEN if hidden is None else hidden,
        ddp_options=ddp_options,
    )
