"""Tests that kill mutants of wrapped_optim/_rollback.py which tests/test_rollback.py let
survive (docs/contributing/mutation.md lists them)."""

from __future__ import annotations

import torch

from wrapped_optim._rollback import deep_clone


def test_deep_clone_copies_lists_and_tuples_with_their_tensors() -> None:
    """Kills deep_clone mutants 4-6: the list/tuple branch returning ``type(value)(None)``,
    ``type(None)(...)``, or cloning ``None`` instead of each item."""
    tensor = torch.arange(3.0)
    value = {"betas": (0.9, tensor), "history": [tensor, [tensor, 2]]}
    copy = deep_clone(value)
    assert type(copy["betas"]) is tuple and type(copy["history"]) is list
    assert copy["betas"][0] == 0.9 and copy["history"][1][1] == 2
    for cloned in (copy["betas"][1], copy["history"][0], copy["history"][1][0]):
        assert torch.equal(cloned, tensor) and cloned.data_ptr() != tensor.data_ptr()
