"""Megatron-Bridge's own optimizer-helper tests against wrapped_optim.compat.

Upstream file: NVIDIA-NeMo/Megatron-Bridge, tests/unit_tests/training/test_optim.py, as of
pull-request/5524 at fb58b1a8819e05c48bd1d0d715191330ef8d2943 (the version with the
precision-aware staging tests; main at 067f987df03b8355b03192d88d70f1709fedf51a has the
rest). Megatron-Bridge's PyPI sdist (0.6.2) ships no tests, so it runs from a checkout:

    WRAPPED_OPTIM_UPSTREAM_BRIDGE=/path/to/Megatron-Bridge pytest tests/upstream

Without the variable this module is skipped; tests/integrations/test_compat_contracts.py states
the same contracts in this project's words and runs everywhere.

Retargeting (upstream's assertions untouched):
* ``megatron.bridge.training.optim`` is a stand-in module holding wrapped_optim.compat's
  helpers, ``torch`` and ``_get_te_fused_adam_class`` (which the tests patch; compat does not
  consult it, see UPSTREAM_EXPECTED), so upstream's imports and ``patch`` targets resolve.
* The same stand-in holds ``wrapped_optim.integrations.bridge``'s ``setup_optimizer`` and
  ``OptimizerConfigOverrideProvider``, and ``megatron.bridge.training.config`` its
  ``SchedulerConfig``, so ``TestSetupOptimizerMuP`` runs against the port; ``EDITS`` point its
  ``patch`` targets where the port looks the names up.
* ``megatron.bridge.peft.lora`` is a stand-in: Bridge's LoRA+ overrides
  (``get_lora_plus_config_overrides``) are not re-implemented here, so their tests are listed
  as not retargeted.

Cases (51): 29 pass, 8 expected differences, 14 not run (12 LoRA+, 2 need TE on a GPU).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs  # noqa: F401 (the edited upstream code runs in this namespace)
import pytest
import torch

from tests.upstream._harness import Edit, Expectation, checkout, load_into, substituted
from wrapped_optim import compat
from wrapped_optim.integrations import bridge


def _not_retargeted(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("not a wrapped_optim.compat function (tests/upstream)")


MODULES: dict[str, dict[str, Any]] = {
    "megatron.bridge.training.optim": {
        "torch": torch,
        "_get_te_fused_adam_class": lambda: None,
        "memory_efficient_precision_aware_optimizer_state_checkpointing": (
            compat.memory_efficient_precision_aware_optimizer_state_checkpointing
        ),
        "memory_efficient_fp32_optimizer_state_loading": (
            compat.memory_efficient_fp32_optimizer_state_loading
        ),
        "sync_hybrid_device_optimizer_fp32_master_copies": (
            compat.sync_hybrid_device_optimizer_fp32_master_copies
        ),
        "setup_optimizer": bridge.setup_optimizer,
        "OptimizerConfigOverrideProvider": bridge.OptimizerConfigOverrideProvider,
    },
    "megatron.bridge.training.config": {"SchedulerConfig": bridge.SchedulerConfig},
    "megatron.bridge.peft.lora": {"get_lora_plus_config_overrides": _not_retargeted},
}

_PORT = "the port looks it up"
_DDP = (
    "the port derives its stack from the chunks' ddp_config (Bridge ignores it) and refuses "
    "non-bool flags; a bare MagicMock's auto attribute is no DDP config, so the chunks have none"
)
EDITS = [
    Edit(
        '@patch("megatron.bridge.training.optim._get_scheduler")',
        '@patch("wrapped_optim.integrations.bridge._megatron_scheduler")',
        "the port builds the scheduler in its _megatron_scheduler (same arguments)",
        count=4,
    ),
    Edit(
        '@patch("megatron.bridge.training.optim.get_megatron_optimizer")',
        '@patch("megatron.core.optimizer.get_megatron_optimizer")',
        f"{_PORT} on megatron.core.optimizer at call time",
        count=4,
    ),
    Edit(
        '@patch("megatron.bridge.training.optim.get_model_config")',
        '@patch("megatron.core.utils.get_model_config")',
        f"{_PORT} on megatron.core.utils at call time",
        count=4,
    ),
    Edit(
        '"megatron.bridge.training.optim.get_mup_config_overrides"',
        '"megatron.core.optimizer.get_mup_config_overrides", create=True',
        f"{_PORT} on megatron.core.optimizer at call time; create=True as megatron-core "
        "before muP (0.16) has no such name",
        count=3,
    ),
    Edit(
        """        cfg.lr_warmup_steps = 0
        cfg.lr_decay_steps = 1000
        cfg.wsd_decay_steps = None
""",
        """        cfg = attrs.evolve(cfg, lr_warmup_steps=0)
        cfg = attrs.evolve(cfg, lr_decay_steps=1000)
        cfg = attrs.evolve(cfg, wsd_decay_steps=None)
""",
        "the port's SchedulerConfig is frozen: the same step counts, set by attrs.evolve",
    ),
    *(
        Edit(f"{name} = MagicMock()\n", f"{name} = MagicMock(ddp_config=None)\n", _DDP)
        for name in ("        model", "        model2")
    ),
]

_STRUCTURE = (
    "deliberate: eligibility is decided by an optimizer's structure, not by class or TE "
    "import; Bridge's fake"
)
_FAKE_ADAM = f"{_STRUCTURE} FusedAdam has no set_scaled_state: not a precision-aware holder"
_FAKE_HDO = f"{_STRUCTURE} HDO is not an optimizer and has no master copies to sync"
_TE_ABSENT = (
    "deliberate: without TE, compat still serves PrecisionAwareAdamW (the portable stand-in "
    "for TE's FusedAdam), which a user without TE wants staged and loaded without copies"
)
_LORA = (
    "not retargeted: Bridge's LoRA+ overrides (get_lora_plus_config_overrides) are not "
    "re-implemented here"
)

UPSTREAM_EXPECTED: dict[str, Expectation] = {}


def _expect(kind: str, reason: str, *names: str) -> None:
    for name in names:
        UPSTREAM_EXPECTED[name] = Expectation(kind, reason)


_STAGING = "TestMemoryEfficientPrecisionAwareOptimizerStateCheckpointing::"
_LOADING = "TestMemoryEfficientFp32OptimizerStateLoading::"
_SYNC = "TestSyncHybridDeviceOptimizerFp32MasterCopies::"
_expect(
    "xfail",
    _FAKE_ADAM,
    _LOADING + "test_uses_base_loader_without_reallocating_fp32_state",
    _LOADING + "test_falls_back_for_non_fp32_incoming_state",
    _LOADING + "test_patches_all_eligible_chained_optimizers",
    # Not eligible, so its param groups are never read and upstream's KeyError never comes.
    _LOADING + "test_restores_methods_when_later_optimizer_setup_raises",
)
_expect("xfail", _TE_ABSENT, _STAGING + "test_te_unavailable_and_none_optimizer_are_noops")
_expect("xfail", _FAKE_HDO, _SYNC + "test_skips_none_shard_main_param")
_expect("xfail", _FAKE_HDO, _SYNC + "test_walks_all_three_fp32_levels")
_expect("xfail", _FAKE_HDO, _SYNC + "test_chained_optimizer_walks_each_sub_opt")
_LORA_TESTS = (
    *(f"test_non_positive_ratio_raises[{r}]" for r in ("0", "-1", "-0.5")),
    "test_a_keeps_base_lr",
    "test_b_is_ratio_times_base_lr",
    "test_none_min_lr_defaults_to_zero",
    "test_b_schedule_is_ratio_scaled_copy_of_a",
    "test_ratio_one_keeps_equal_lr",
    "test_preserves_standard_bias_wd_override",
    "test_preserves_decoupled_lr_override",
    "test_returns_param_key_keyed_mapping",
    "test_only_two_lora_name_globs_added",
)
_expect("skip", _LORA, *(f"TestGetLoraPlusConfigOverrides::{n}" for n in _LORA_TESTS))

_PATH = checkout("WRAPPED_OPTIM_UPSTREAM_BRIDGE", "tests/unit_tests/training/test_optim.py")
if _PATH is None:
    pytestmark = pytest.mark.skip(
        reason="set WRAPPED_OPTIM_UPSTREAM_BRIDGE to a Megatron-Bridge checkout to run its "
        "tests; tests/integrations/test_compat_contracts.py checks the same contracts"
    )
else:
    load_into(globals(), _PATH, EDITS, MODULES)


@pytest.fixture(autouse=True)
def _upstream_modules() -> Iterator[None]:
    with substituted(MODULES):
        yield


def test_the_upstream_file_was_loaded() -> None:
    # Collected from this module itself, so the run reports the missing checkout.
    assert "TestSyncHybridDeviceOptimizerFp32MasterCopies" in globals()
