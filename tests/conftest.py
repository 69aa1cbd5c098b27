"""Shared test configuration: hypothesis profiles and thread limits for 2-core CI."""

from __future__ import annotations

import os

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
