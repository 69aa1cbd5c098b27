"""Megatron-Core's own HybridDeviceOptimizer tests against HybridOffloadOptimizer.

Upstream file: NVIDIA/Megatron-LM, tests/unit_tests/test_optimizer_cpu_offloading.py at
d98e8a64ddf34856e74b24714e3bedb2f5a39553 (main). megatron-core's PyPI sdist (0.19.2) ships
no tests, so it runs from a checkout:

    WRAPPED_OPTIM_UPSTREAM_MEGATRON_LM=/path/to/Megatron-LM pytest tests/upstream

Retargeting (upstream's assertions untouched):
* ``megatron.core.optimizer.cpu_offloading`` is a stand-in whose ``HybridDeviceOptimizer`` is
  HybridOffloadOptimizer.
* ``megatron.core.transformer.module``'s FP32-marking helpers are in no megatron-core release
  yet; the one test that uses them is listed as not runnable.
* TE is absent, so upstream's own fallback (torch's Adam/SGD as the device optimizers) runs.
* the edits below put models and inputs on this machine's device (CUDA when there is one).
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import product
from typing import Any

import pytest
import torch

from tests.upstream._harness import Edit, Expectation, checkout, load_into, substituted
from wrapped_optim.optimizers import HybridOffloadOptimizer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _not_in_a_release(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("megatron-core main's FP32-marking helper (tests/upstream)")


MODULES: dict[str, dict[str, Any]] = {
    "megatron.core.optimizer.cpu_offloading": {"HybridDeviceOptimizer": HybridOffloadOptimizer},
    "megatron.core.transformer.module": {
        "convert_module_to_dtype_except_fp32_marked": _not_in_a_release,
        "mark_keep_in_fp32": _not_in_a_release,
    },
}

EDITS = [
    Edit(".cuda()", f".to({DEVICE!r})", "models and inputs on this machine's device", 10),
    Edit('device="cuda"', f"device={DEVICE!r}", "inputs on this machine's device"),
]

UPSTREAM_EXPECTED: dict[str, Expectation] = {
    "test_load_state_dict_with_native_fp32_param": Expectation(
        "skip", "not runnable: megatron-core main's FP32-marking helpers are in no release"
    )
}
if DEVICE == "cpu":
    # Upstream asserts that the state of the params kept on the device is a CUDA tensor;
    # on a machine without CUDA both halves are host tensors.
    _on_device = "not runnable here: asserts the non-offloaded state is on CUDA"
    for groups, fraction, overlap, steps in product(
        ("False", "True"), ("0", "0.5"), ("False", "True"), ("1", "10")
    ):
        UPSTREAM_EXPECTED[
            f"test_multi_device_hybrid_optimizer[{groups}-adam-{fraction}-{overlap}-{steps}]"
        ] = Expectation("skip", _on_device)
    for groups, fraction, steps in product(("False", "True"), ("0.5", "0"), ("1", "10")):
        UPSTREAM_EXPECTED[
            f"test_overlap_cpu_optimizer_d2h_h2d_sync_correctness[{groups}-adam-{fraction}-{steps}]"
        ] = Expectation("skip", _on_device)

_PATH = checkout(
    "WRAPPED_OPTIM_UPSTREAM_MEGATRON_LM", "tests/unit_tests/test_optimizer_cpu_offloading.py"
)
if _PATH is None:
    pytestmark = pytest.mark.skip(
        reason="set WRAPPED_OPTIM_UPSTREAM_MEGATRON_LM to a Megatron-LM checkout to run its "
        "tests; tests/optimizers/hybrid_offload/test_hybrid_offload*.py check "
        "HybridOffloadOptimizer's contracts"
    )
else:
    load_into(globals(), _PATH, EDITS, MODULES)


@pytest.fixture(autouse=True)
def _upstream_modules() -> Iterator[None]:
    with substituted(MODULES):
        yield


def test_the_upstream_file_was_loaded() -> None:
    # Collected from this module itself, so the run reports the missing checkout.
    assert "test_multi_device_hybrid_optimizer" in globals()
