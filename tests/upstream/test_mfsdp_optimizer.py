"""Megatron-FSDP's own optimizer tests against wrapped_optim.compat.fully_shard_optimizer.

Upstream file: NVIDIA/Megatron-LM, tests/unit_tests/distributed/mfsdp_v2/test_optimizer.py
at 15d4b349def61d350c15998ced373404b1abfa58, the commit whose Megatron-FSDP
is the megatron-fsdp 0.6.1 release. Neither megatron-core's nor
megatron-fsdp's PyPI sdist ships tests, so it runs from a checkout:

    WRAPPED_OPTIM_UPSTREAM_MEGATRON_FSDP=/path/to/Megatron-LM pytest tests/upstream

Retargeting (upstream's assertions untouched; tests/upstream/_mfsdp.py runs it):
* ``megatron_fsdp.experimental.fully_shard_optimizer`` is compat's; the rest of
  Megatron-FSDP is the checkout's own.
* TE's ``FusedAdam`` is PrecisionAwareAdamW (TE is not installed here).
* two gloo ranks on CPU instead of torchrun's NCCL ranks: ``distributed_setup`` gives the
  fields of upstream's fixture (CPU device), and CUDA stream calls are no-ops.
"""

from __future__ import annotations

import pytest

from tests.upstream import _mfsdp
from tests.upstream._harness import Expectation

NAME = "test_optimizer.py"
CASES = _mfsdp.case_names(NAME)
UPSTREAM_EXPECTED: dict[str, Expectation] = {}

pytestmark = _mfsdp.module_marks(NAME)


@pytest.mark.parametrize("case", CASES)
def test_upstream(case: str, mfsdp_results: dict[str, list[tuple[str, str]]]) -> None:
    _mfsdp.check_ranks(mfsdp_results, f"{NAME}::{case}")


def test_the_upstream_file_was_loaded() -> None:
    # Collected from this module itself, so the run reports the missing checkout.
    assert CASES
