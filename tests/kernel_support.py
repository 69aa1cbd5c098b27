"""What the tests of the compiled CPU kernel (and of what runs on it) share: the skip mark
(one definition, so every file skips for the same, stated reason), the operand builder for
each master kind and the loop families to run."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from wrapped_optim._formats import remainders
from wrapped_optim.optimizers import cpu_kernel

# gcc or clang is part of every supported build machine; without one the kernel is off and
# these tests say so instead of passing vacuously.
needs_kernel = pytest.mark.skipif(
    not cpu_kernel.available(), reason=f"CPU kernel unavailable: {cpu_kernel.status().reason}"
)


def param_and_master(values: torch.Tensor, master: str) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """(parameter, master or None, FP32 value the kernel updates) for a master kind."""
    if master == "none":
        return values.clone(), None, values
    if master == "fp32":
        return values.to(torch.bfloat16), values.clone(), values
    if master == "fp32 copy":  # an FP32 master and the FP32 param that gets its value
        return values.clone(), values.clone(), values
    param, remainder = remainders.split_master(values)
    return param, remainder, remainders.join_master(param, remainder)


#: The fp16/FP8 moment loop families this CPU runs, fastest first (the portable loops at
#: least): the tests that check those loops run each of them.
CPU_FAMILIES = cpu_kernel.status().loop_families if cpu_kernel.available() else ("portable",)


@contextlib.contextmanager
def running(family: str) -> Iterator[None]:
    """The kernel's fp16/FP8 moments run ``family`` inside; the fastest family afterwards."""
    assert cpu_kernel.use_loops(family) == family
    try:
        yield
    finally:
        cpu_kernel.use_loops()
