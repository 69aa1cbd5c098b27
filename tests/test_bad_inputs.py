"""The bad-checkpoint catalogue against every stack: a clear error, nothing lost.

For each (stack, kind of bad checkpoint): loading must raise an error whose message names
what is wrong; afterwards the optimizer is bitwise what it was (state, parameters, and the next
step equals that of an optimizer that never saw the bad checkpoint) and the caller's dict is
unchanged.

Which layer gives the error: torch's own ``Optimizer.load_state_dict`` rejects only structural
damage (``torch_rejects`` cases: group and parameter counts, missing top-level keys); it
accepts every other kind silently (see ``test_torch_accepts_silently``) and fails, or computes
garbage, at a later step. Those kinds are therefore required of *our* optimizers
(PrecisionAwareAdamW, HybridOffloadOptimizer) and of every wrapper stack over them
(``validating`` targets); a wrapper over a torch optimizer must behave exactly as the bare
torch optimizer does on them (transparency) and leave the caller's dict alone.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import attrs
import pytest
import torch
from _suite_bad_checkpoints import CATALOGUE, BadCase, bad_copy
from _suite_targets import TARGETS, Target, params_snapshot

from wrapped_optim.testing import (
    assert_state_dict_equal,
    checkpoint_roundtrip,
    optimizer_params,
    state_dict_differences,
    synthetic_gradients,
)

CLEAR_ERRORS = (ValueError, TypeError, KeyError, RuntimeError)

# Real bugs found by this catalogue, reported to the lead: (target-name fragment, case) -> why.
# (None open: the HybridOffloadOptimizer and PrecisionAwareAdamW ones are fixed.)
KNOWN_BUG_RULES: dict[tuple[str, str], str] = {}


def _known_bug(target: str, case: str) -> str | None:
    for (fragment, case_name), reason in KNOWN_BUG_RULES.items():
        if fragment in target and case_name == case:
            return reason
    return None


def _applicable() -> list[Any]:
    params = []
    for target in TARGETS.values():
        good = _reference(target.name).state
        for case in CATALOGUE:
            if not case.applies(good):
                continue
            marks = []
            reason = _known_bug(target.name, case.name)
            if reason is not None:
                marks.append(pytest.mark.xfail(strict=True, reason=reason))
            params.append(pytest.param(target, case, id=f"{target.name}-{case.name}", marks=marks))
    return params


def _load_outcome(stack: Any, bad: Any) -> BaseException | None:
    try:
        stack.load_state_dict(bad)
    except Exception as error:
        return error
    return None


def _assert_untouched(target: Target, stack: Any, before: Any, params_before: list[Any]) -> None:
    assert_state_dict_equal(
        before,
        checkpoint_roundtrip(stack.state_dict()),
        names=("before", "after the rejected load"),
        headline=f"{target.name}: a rejected checkpoint changed the optimizer state",
    )
    for index, (old, new) in enumerate(zip(params_before, params_snapshot(stack), strict=True)):
        assert torch.equal(old.view(-1), new.view(-1)) or (old.numel() == 0), (
            f"{target.name}: a rejected checkpoint changed param {index}"
        )
    # Nothing hidden changed either (scales, copies, sub-optimizers): the next step equals
    # that of a twin that never saw the bad checkpoint.
    synthetic_gradients(stack, step=10)
    stack.step()
    reference = _reference(target.name)
    assert_state_dict_equal(
        reference.next_state,
        checkpoint_roundtrip(stack.state_dict()),
        names=("twin", "after the rejected load"),
        headline=f"{target.name}: the step after a rejected load differs",
    )
    for index, (a, b) in enumerate(
        zip(reference.next_params, optimizer_params(stack), strict=True)
    ):
        assert torch.equal(a, b), f"{target.name}: param {index} differs after the next step"


@attrs.frozen
class Reference:
    """A target's checkpoint after two steps, and its state and params after one more."""

    state: Any
    params: list[torch.Tensor]
    next_state: Any
    next_params: list[torch.Tensor]


@functools.cache
def _reference(name: str) -> Reference:
    _, stack = TARGETS[name].stepped()
    state, params = checkpoint_roundtrip(stack.state_dict()), params_snapshot(stack)
    synthetic_gradients(stack, step=10)
    stack.step()
    return Reference(
        state, params, checkpoint_roundtrip(stack.state_dict()), params_snapshot(stack)
    )


@pytest.mark.parametrize(("target", "case"), _applicable())
def test_bad_checkpoint(target: Target, case: BadCase) -> None:
    _, stack = target.stepped()
    reference = _reference(target.name)
    good = reference.state
    bad = bad_copy(case, good)
    bad_before = checkpoint_roundtrip(bad)
    state_before, params_before = reference.state, reference.params

    error = _load_outcome(stack, bad)

    assert_state_dict_equal(
        bad_before,
        bad,
        names=("given", "after load"),
        headline=f"{target.name}: loading modified the caller's checkpoint",
    )
    if case.torch_rejects or target.validating:
        assert error is not None, f"{target.name} accepted a bad checkpoint ({case.name})"
        assert isinstance(error, CLEAR_ERRORS), f"unclear error type {type(error).__name__}"
        message = str(error)
        assert re.search(case.mentions, message), (
            f"{target.name}/{case.name}: the error does not say what is wrong "
            f"(expected /{case.mentions}/): {type(error).__name__}: {message}"
        )
        _assert_untouched(target, stack, state_before, params_before)
    else:
        # A stack over a torch optimizer: exactly the bare torch optimizer's behaviour.
        _, bare_stack = target.stepped()
        bare = bare_stack.unwrap() if hasattr(bare_stack, "unwrap") else bare_stack
        bare_error = _load_outcome(bare, bad_copy(case, good))
        assert (error is None) == (bare_error is None), (
            f"{target.name}/{case.name}: wrapped outcome {error!r} != bare outcome {bare_error!r}"
        )
        if error is not None:
            # Torch itself is not always atomic here (``Adam.__setstate__`` can raise after
            # the state was replaced): same error as the bare optimizer is all we ask.
            assert type(error) is type(bare_error), (error, bare_error)
            return
        assert_state_dict_equal(
            checkpoint_roundtrip(bare.state_dict()),
            checkpoint_roundtrip(stack.state_dict()),
            ignore_device=True,
            names=("bare", "wrapped"),
            headline=f"{target.name}/{case.name}: wrapped load differs from bare",
        )


def test_catalogue_has_at_least_twenty_kinds() -> None:
    names = [case.name for case in CATALOGUE]
    assert len(set(names)) == len(names) >= 20


@pytest.mark.parametrize(
    "case",
    [
        c
        for c in CATALOGUE
        if c.name
        in (
            "wrong_shape",
            "nan_state",
            "missing_state_name",
            "extra_state_name",
            "unknown_param_index",
        )
    ],
    ids=lambda c: c.name,
)
def test_torch_accepts_silently(case: BadCase) -> None:
    """Why the catalogue needs our layers: torch 2.13's loader takes these without a word."""
    _, opt = TARGETS["adamw"].stepped()
    good = checkpoint_roundtrip(opt.state_dict())
    bad = bad_copy(case, good)
    opt.load_state_dict(bad)  # no error...
    # ...and the damage is now the optimizer's state, waiting for the next step.
    assert state_dict_differences(opt.state_dict(), good), f"{case.name}: nothing was taken"


# ------------------------------------------------------------------------------------------
# One validator: load_state_dict and the streaming load_optimizer reject alike
# ------------------------------------------------------------------------------------------
# Kinds DCP cannot write, so the streaming loader never sees them: a top level that is not a
# dict (dcp.save refuses it), and what DCP's flattening loses (empty dicts are dropped, so a
# missing 'state' or an empty entry of an unknown param leaves no trace; param keys are
# written as strings, so a string key reads back as the int it spells).
NOT_EXPRESSIBLE_IN_DCP = frozenset(
    {"not_a_mapping", "missing_state", "unknown_param_index", "string_param_index"}
)
PRECISION_CONFIGS: dict[str, tuple[torch.dtype, dict[str, Any]]] = {
    "fp32": (torch.float32, {}),
    "bf16-moments-masters": (
        torch.bfloat16,
        {"master_weights": True, "exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.uint8},
    ),
    "remainders": (
        torch.bfloat16,
        {"master_weights": True, "store_param_remainders": True, "exp_avg_dtype": torch.float16},
    ),
}


def _precision_opt(config: str) -> Any:
    from wrapped_optim.optimizers import PrecisionAwareAdamW

    dtype, options = PRECISION_CONFIGS[config]
    generator = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype))
        for shape in ((4, 3), (5,))
    ]
    opt = PrecisionAwareAdamW(params, lr=0.01, weight_decay=0.1, **options)
    for step in range(2):
        synthetic_gradients(opt, step)
        opt.step()
    return opt


def _parity_cases() -> list[Any]:
    cases = []
    for config in PRECISION_CONFIGS:
        good = checkpoint_roundtrip(_precision_opt(config).state_dict())
        for case in CATALOGUE:
            if case.name in NOT_EXPRESSIBLE_IN_DCP or not case.applies(good):
                continue
            cases.append(pytest.param(config, case, id=f"{config}-{case.name}"))
    return cases


def _stream_outcome(opt: Any, bad: Any, path: Any) -> BaseException | None:
    import warnings

    import torch.distributed.checkpoint as dcp

    from wrapped_optim.checkpoint import load_optimizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(bad, checkpoint_id=path, no_dist=True)
        try:
            load_optimizer(opt, path)
        except Exception as error:
            return error
    return None


@pytest.mark.parametrize(("config", "case"), _parity_cases())
def test_load_state_dict_and_load_optimizer_reject_alike(
    config: str, case: BadCase, tmp_path: Any
) -> None:
    from wrapped_optim.checkpoint import OptimizerCheckpointError

    opt = _precision_opt(config)
    good = checkpoint_roundtrip(opt.state_dict())
    params = [p.detach().clone() for p in optimizer_params(opt)]
    by_dict = _load_outcome(opt, bad_copy(case, good))
    streamed = _precision_opt(config)
    by_stream = _stream_outcome(streamed, bad_copy(case, good), tmp_path)

    assert isinstance(by_dict, OptimizerCheckpointError), f"load_state_dict: {by_dict!r}"
    assert type(by_stream) is type(by_dict), f"load_optimizer: {by_stream!r}"
    assert str(by_stream) == str(by_dict)
    assert re.search(case.mentions, str(by_dict)), str(by_dict)
    for loaded in (opt, streamed):
        assert_state_dict_equal(good, checkpoint_roundtrip(loaded.state_dict()))
        for old, new in zip(params, optimizer_params(loaded), strict=True):
            assert torch.equal(old, new)


@pytest.mark.parametrize("config", ["fp32", "bf16-moments-masters"])
def test_load_optimizer_value_fault_leaves_optimizer_unchanged(config: str, tmp_path: Any) -> None:
    case = next(c for c in CATALOGUE if c.name == "negative_second_moment")
    opt = _precision_opt(config)
    good = checkpoint_roundtrip(opt.state_dict())
    # Found while reading: every param but the last gets another step's state, so a
    # partial load would show (the streaming load undoes what it wrote, issue 17).
    other = _precision_opt(config)
    synthetic_gradients(other, 5)
    other.step()
    bad = bad_copy(case, checkpoint_roundtrip(other.state_dict()))
    assert _stream_outcome(opt, bad, tmp_path) is not None
    assert_state_dict_equal(good, checkpoint_roundtrip(opt.state_dict()))
