"""Shared test configuration: hypothesis profiles and thread limits for 2-core CI."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import torch
from hypothesis import HealthCheck, settings

# "ci" keeps the suite inside its time budget; "thorough" is for local, on-demand runs:
#   HYPOTHESIS_PROFILE=thorough pytest
settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.register_profile(
    "thorough",
    max_examples=500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=10, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(1)

# The compiled CPU AdamW kernel comes from the package build (`pip install -e .`; its name
# carries the hash of the C sources, so a stale one is never loaded), else it is built afresh
# for each test run into a private cache, so a build in the user's cache never stands in for
# the source under test.
if "WRAPPED_OPTIM_KERNEL_CACHE" not in os.environ:
    _kernel_cache = tempfile.mkdtemp(prefix="wrapped-optim-kernel-")
    os.environ["WRAPPED_OPTIM_KERNEL_CACHE"] = _kernel_cache
    atexit.register(shutil.rmtree, _kernel_cache, ignore_errors=True)
