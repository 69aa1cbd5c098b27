"""PrecisionLayout: the one value PrecisionAwareAdamW's step, state and loading functions read
its options from. Its rules must describe the storage the optimizer really creates."""

from __future__ import annotations

import copy

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wrapped_optim.optimizers import PrecisionAwareAdamW
from wrapped_optim.optimizers.precision_adamw._layout import STATE_NAMES, PrecisionLayout

MOMENTS = [torch.float32, torch.float16, torch.bfloat16, torch.uint8]


@settings(max_examples=40, deadline=None)
@given(
    param_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    exp_avg_dtype=st.sampled_from(MOMENTS),
    exp_avg_sq_dtype=st.sampled_from(MOMENTS),
    master_weights=st.booleans(),
    master_weight_dtype=st.sampled_from([torch.float32, torch.float16]),
    store_param_remainders=st.booleans(),
)
def test_the_layout_describes_the_storage_the_optimizer_creates(
    param_dtype: torch.dtype,
    exp_avg_dtype: torch.dtype,
    exp_avg_sq_dtype: torch.dtype,
    master_weights: bool,
    master_weight_dtype: torch.dtype,
    store_param_remainders: bool,
) -> None:
    p = torch.nn.Parameter(torch.randn(5).to(param_dtype))
    opt = PrecisionAwareAdamW(
        [p],
        master_weights=master_weights,
        master_weight_dtype=master_weight_dtype,
        exp_avg_dtype=exp_avg_dtype,
        exp_avg_sq_dtype=exp_avg_sq_dtype,
        store_param_remainders=store_param_remainders,
    )
    opt.initialize_state(p, opt.layout.uses_remainder(p))
    layout = opt.layout
    for name in STATE_NAMES:
        if name not in opt.state[p]:
            assert name == "master_param" and not master_weights
            continue
        assert opt.state[p][name].dtype == layout.storage_dtype(p, name), name
        assert (name in opt.scales.get(p, {})) is layout.is_scaled(p, name), name
        expansion = opt.get_unscaled_state(p, name)
        assert expansion.dtype == layout.expansion_dtype(p, name), name
    remainder = master_weights and store_param_remainders and master_weight_dtype == torch.float32
    assert layout.uses_remainder(p) is (remainder and param_dtype == torch.bfloat16)


def test_the_layout_follows_the_options_and_is_frozen() -> None:
    opt = PrecisionAwareAdamW(
        [torch.zeros(2)], adam_w_mode=False, chunk_numel=64, fused=False, cpu_kernel=False,
        exp_avg_dtype=torch.float8_e4m3fn,
    )  # fmt: skip
    layout = opt.layout
    assert layout == PrecisionLayout(
        exp_avg_dtype=torch.uint8, adam_w_mode=False, chunk_numel=64, fused=False,
        cpu_kernel=False,
    )  # fmt: skip
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        layout.chunk_numel = 1  # type: ignore[misc]
    assert copy.deepcopy(opt).layout == layout
