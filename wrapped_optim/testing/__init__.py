"""Tools to test optimizer setups: bitwise state comparison, resume and transparency checks.

The assertions need only torch; ``wrapped_optim.testing.strategies`` (hypothesis strategies
for parameter sets, optimizers and wrapper stacks) also needs ``hypothesis``;
``wrapped_optim.testing.faults`` (a save killed at each point of the checkpoint commit) and
``wrapped_optim.testing.hostile`` (checkpoints and save targets crafted against readers
and savers) need only torch.

Examples:
    >>> import torch
    >>> from wrapped_optim.testing import assert_resume_equivalent
    >>> def make():
    ...     torch.manual_seed(0)
    ...     model = torch.nn.Linear(2, 2)
    ...     return model, torch.optim.Adam(model.parameters(), lr=0.1)
    >>> assert_resume_equivalent(make, steps_before=1, steps_after=2)
"""

from wrapped_optim.testing._assertions import (
    StateMismatchError,
    assert_resume_equivalent,
    assert_state_dict_equal,
    assert_transparent,
    checkpoint_roundtrip,
    optimizer_params,
    state_dict_differences,
    synthetic_gradients,
)

__all__ = [
    "StateMismatchError",
    "assert_resume_equivalent",
    "assert_state_dict_equal",
    "assert_transparent",
    "checkpoint_roundtrip",
    "optimizer_params",
    "state_dict_differences",
    "synthetic_gradients",
]
