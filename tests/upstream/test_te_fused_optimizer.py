"""Transformer Engine's own FusedAdam tests against PrecisionAwareAdamW.

Upstream file: NVIDIA/TransformerEngine, tests/pytorch/test_fused_optimizer.py at
d0067d0da6cb01811b8072a7d304f0e00344ce2b (main); the classes ``TestFusedAdam`` and
``TestAdamTest`` (the others test TE's FP8 tensor formats and FusedSGD). TE's PyPI sdists
(transformer_engine_torch 2.20.2; transformer_engine has none) ship no tests, so it runs from
a checkout:

    WRAPPED_OPTIM_UPSTREAM_TRANSFORMER_ENGINE=/path/to/TransformerEngine pytest tests/upstream

Retargeting (upstream's assertions untouched):
* ``te.optimizers.FusedAdam`` is PrecisionAwareAdamW (same constructor and state accessors).
* ``te.MultiheadAttention`` (only a source of parameters for the optimizer) is a torch
  module with the parameters TE's has for ``fuse_qkv_params=True`` and no input layernorm:
  the fused QKV projection (3h x h, 3h) then the output projection (h x h, h).
* ``te.is_fp8_available`` reports FP8 available: the tests it gates here keep their moments
  in FP8 (``torch.uint8``), which PrecisionAwareAdamW does on any device; those that need
  TE's FP8 parameters are listed as not runnable.
* ``gpu_autocast_ctx`` is ``torch.autocast`` on this machine's device (fp16), and the edits
  below put tensors, models and ``GradScaler`` there.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.upstream._harness import Edit, Expectation, checkout, load_into, substituted
from wrapped_optim.optimizers import PrecisionAwareAdamW

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.slow]  # about two minutes on one CPU core


def _not_runnable(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("a Transformer Engine feature that is not retargeted")


class _AttentionParameters(torch.nn.Module):
    """The trainable parameters of TE's MultiheadAttention(fuse_qkv_params=True)."""

    def __init__(self, hidden_size: int, params_dtype: torch.dtype, **_: Any) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(hidden_size, 3 * hidden_size, dtype=params_dtype)
        self.proj = torch.nn.Linear(hidden_size, hidden_size, dtype=params_dtype)


def _autocast(enabled: bool = True) -> Any:
    return torch.autocast(DEVICE, dtype=torch.float16, enabled=enabled)


class _QuantizedTensor:
    """TE's FP8 tensor class: nothing here is one."""


MODULES: dict[str, dict[str, Any]] = {
    "transformer_engine.pytorch": {
        "MultiheadAttention": _AttentionParameters,
        "quantized_model_init": _not_runnable,
        "is_bf16_available": lambda: True,
        "is_fp8_available": lambda return_reason=False: (True, "") if return_reason else True,
        "QuantizedTensor": _QuantizedTensor,
    },
    "transformer_engine.pytorch.optimizers": {
        "FusedAdam": PrecisionAwareAdamW,
        "FusedSGD": _not_runnable,
    },
    "transformer_engine.pytorch.utils": {"gpu_autocast_ctx": _autocast},
    "transformer_engine.common.recipe": {
        "DelayedScaling": _not_runnable,
        "MXFP8BlockScaling": _not_runnable,
        "Float8BlockScaling": _not_runnable,
    },
}

EDITS = [
    Edit('device="cuda"', f"device={DEVICE!r}", "tensors on this machine's device", 13),
    Edit(".cuda()", f".to({DEVICE!r})", "models and inputs on this machine's device", 15),
    Edit('GradScaler("cuda"', f"GradScaler({DEVICE!r}", "the grad scaler of this device", 6),
]

_CAPTURABLE = "not runnable: capturable=True is FusedAdam's CUDA-graph mode"
UPSTREAM_EXPECTED: dict[str, Expectation] = {
    "TestFusedAdam::test_empty_param_group_advances_step[True]": Expectation("skip", _CAPTURABLE),
    "TestAdamTest::test_grad_scaler_capturable": Expectation("skip", _CAPTURABLE),
    "TestAdamTest::test_grad_scaler_capturable_master": Expectation("skip", _CAPTURABLE),
    "TestFusedAdam::test_fp8_model_weight_cast": Expectation(
        "skip", "not runnable: needs TE's FP8 parameters (quantized_model_init)"
    ),
    "TestAdamTest::test_large_tensor": Expectation(
        "skip", "not runnable: needs 60 GiB of free accelerator memory"
    ),
}

# Out of scope: TE's FP8 tensor formats and its SGD.
_OTHER_CLASSES = ("TestFusedAdamMXFP8", "TestFusedAdamFloat8Block", "TestFusedSGD")

_PATH = checkout(
    "WRAPPED_OPTIM_UPSTREAM_TRANSFORMER_ENGINE", "tests/pytorch/test_fused_optimizer.py"
)
if _PATH is None:
    pytestmark.append(
        pytest.mark.skip(
            reason="set WRAPPED_OPTIM_UPSTREAM_TRANSFORMER_ENGINE to a TransformerEngine "
            "checkout to run its tests; tests/optimizers/precision_adamw/test_precision_adam*.py "
            "check PrecisionAwareAdamW"
        )
    )
else:
    load_into(globals(), _PATH, EDITS, MODULES)
    for _name in _OTHER_CLASSES:
        del globals()[_name]


@pytest.fixture(autouse=True)
def _upstream_modules() -> Iterator[None]:
    with substituted(MODULES):
        yield


def test_the_upstream_file_was_loaded() -> None:
    # Collected from this module itself, so the run reports the missing checkout.
    assert "TestFusedAdam" in globals() and "TestAdamTest" in globals()
