"""Skip marks shared by the tests of the compiled CPU kernel and of what runs on it (one
definition, so every file skips for the same, stated reason)."""

from __future__ import annotations

import pytest

from wrapped_optim.optimizers import cpu_kernel

# gcc or clang is part of every supported build machine; without one the kernel is off and
# these tests say so instead of passing vacuously.
needs_kernel = pytest.mark.skipif(
    not cpu_kernel.available(), reason=f"CPU kernel unavailable: {cpu_kernel.status().reason}"
)
