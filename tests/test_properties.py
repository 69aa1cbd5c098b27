"""Property suite: every wrapper stack x every inner optimizer keeps the design invariants.

For each inner optimizer kind (torch SGD/Adam/AdamW, PrecisionAwareAdamW configurations,
HybridOffloadOptimizer) and each combination of wrapper layers available on this branch,
hypothesis draws parameter sets (0-d and empty shapes, several dtypes, groups with their own
hyper-parameters, frozen parameters) and optimizer options, and checks:

* exactness: save -> load -> continue is bit-identical to never stopping;
* transparency: the wrapped stack's checkpoints equal the bare optimizer's, and checkpoints
  move between wrapped and bare stacks mid-training without changing a bit;
* staging: a staged stack saves and loads exactly what the unstaged one does;
* ``init_optimizer_state`` creates state that does not change later training.

Examples per combination scale with the hypothesis profile ("ci" by default,
``HYPOTHESIS_PROFILE=thorough`` for many more).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wrapped_optim.fsdp import init_optimizer_state
from wrapped_optim.testing import (
    assert_resume_equivalent,
    assert_state_dict_equal,
    assert_transparent,
    checkpoint_roundtrip,
    optimizer_params,
    synthetic_gradients,
)
from wrapped_optim.testing import strategies as ws

KINDS = ws.available_optimizer_kinds()
LAYERS = ws.LAYER_ORDER

# Per (kind, layer set): examples per property, from the active profile (8 of "ci"'s 25).
EXAMPLES = max(2, settings().max_examples // 3)
_SETTINGS = settings(
    max_examples=EXAMPLES,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _layer_sets(*, nonempty: bool = False) -> list[tuple[str, ...]]:
    sets = [
        combo
        for size in range(len(LAYERS) + 1)
        for combo in itertools.combinations(LAYERS, size)
        if combo or not nonempty
    ]
    return sets


def _combos(prop: str, *, nonempty: bool = False, needs: str | None = None) -> list[Any]:
    params = []
    for kind in KINDS:
        for layers in _layer_sets(nonempty=nonempty):
            if needs is not None and needs not in layers:
                continue
            if "hybrid" in layers and kind != "hybrid_offload":
                continue  # HybridSyncOptimizer refuses a stack with nothing to sync
            label = "+".join(layers) or "bare"
            params.append(pytest.param(kind, layers, id=f"{kind}-{label}"))
    return params


def _setups(kind: str, layers: tuple[str, ...]) -> st.SearchStrategy[ws.Setup]:
    return ws.setups(
        optimizers=ws.optimizer_configs(kinds=[kind]),
        stacks=ws.stack_configs(layers=layers, require_all=True),
    )


def _train(stack: Any, steps: range) -> None:
    for step in steps:
        stack.zero_grad()
        synthetic_gradients(stack, step)
        stack.step()


def _bare(setup: ws.Setup) -> ws.Setup:
    return ws.Setup(setup.params, setup.optimizer, ws.StackSpec())


# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kind", "layers"), _combos("resume"))
def test_save_load_continue_is_bit_identical(kind: str, layers: tuple[str, ...]) -> None:
    @_SETTINGS
    @given(_setups(kind, layers), st.integers(0, 2), st.integers(1, 2))
    def check(setup: ws.Setup, before: int, after: int) -> None:
        assert_resume_equivalent(setup.make, before, after)

    check()


@pytest.mark.parametrize(("kind", "layers"), _combos("transparent", nonempty=True))
def test_wrapped_and_bare_checkpoints_are_interchangeable(
    kind: str, layers: tuple[str, ...]
) -> None:
    @_SETTINGS
    @given(_setups(kind, layers), st.integers(1, 2))
    def check(setup: ws.Setup, before: int) -> None:
        _, stack = setup.make()
        _train(stack, range(before))
        assert_transparent(stack)

        if any(p.grad_dtype not in (None, p.dtype) for p in setup.params.params):
            return  # the bare optimizer cannot step on grads of another dtype (FSDP's job)
        # Mid-training moves: wrapped -> bare and bare -> wrapped continue identically.
        for source_setup, target_setup in ((setup, _bare(setup)), (_bare(setup), setup)):
            _, source = source_setup.make()
            _train(source, range(before))
            checkpoint = checkpoint_roundtrip(source.state_dict())
            model_state = checkpoint_roundtrip(
                {i: p.detach() for i, p in enumerate(optimizer_params(source))}
            )
            target_model, target = target_setup.make()
            with torch.no_grad():
                for index, param in enumerate(optimizer_params(target)):
                    param.copy_(model_state[index])
            target.load_state_dict(checkpoint)
            _train(source, range(before, before + 2))
            _train(target, range(before, before + 2))
            assert_state_dict_equal(
                checkpoint_roundtrip(source.state_dict()),
                checkpoint_roundtrip(target.state_dict()),
                ignore_device=True,
                names=("continued in place", "continued after the move"),
                headline=f"moving a checkpoint {source_setup.stack.names or 'bare'} -> "
                f"{target_setup.stack.names or 'bare'} changed training",
            )
            for index, (a, b) in enumerate(
                zip(optimizer_params(source), optimizer_params(target), strict=True)
            ):
                assert torch.equal(a, b), f"param {index} differs after the move"
            del target_model

    check()


@pytest.mark.parametrize(("kind", "layers"), _combos("staged", needs="staged"))
def test_staged_saves_and_loads_exactly_what_unstaged_does(
    kind: str, layers: tuple[str, ...]
) -> None:
    @_SETTINGS
    @given(_setups(kind, layers), st.integers(1, 2))
    def check(setup: ws.Setup, steps: int) -> None:
        unstaged = ws.Setup(
            setup.params,
            setup.optimizer,
            ws.StackSpec(tuple(layer for layer in setup.stack.layers if layer[0] != "staged")),
        )
        _, staged_stack = setup.make()
        _, plain_stack = unstaged.make()
        _train(staged_stack, range(steps))
        _train(plain_stack, range(steps))
        staged_sd = checkpoint_roundtrip(staged_stack.state_dict())
        plain_sd = checkpoint_roundtrip(plain_stack.state_dict())
        assert_state_dict_equal(
            plain_sd,
            staged_sd,
            ignore_device=True,
            names=("unstaged", "staged"),
            headline="staged save differs from unstaged save",
        )
        # Load the other's checkpoint into each, continue, compare.
        _train(staged_stack, range(steps, steps + 1))  # move away from the checkpoint first
        staged_stack.load_state_dict(checkpoint_roundtrip(plain_sd))
        plain_stack.load_state_dict(checkpoint_roundtrip(staged_sd))
        assert_state_dict_equal(
            checkpoint_roundtrip(plain_stack.state_dict()),
            checkpoint_roundtrip(staged_stack.state_dict()),
            ignore_device=True,
            names=("unstaged load", "staged load"),
            headline="staged load differs from unstaged load",
        )

    check()


@pytest.mark.parametrize("kind", [pytest.param(k, id=k) for k in KINDS])
def test_init_optimizer_state_does_not_change_training(kind: str) -> None:

    @_SETTINGS
    @given(_setups(kind, ()), st.integers(1, 2))
    def check(setup: ws.Setup, steps: int) -> None:
        _, plain = setup.make()
        _, initialised = setup.make()
        created = init_optimizer_state(initialised)
        assert created == bool(initialised.state_dict()["state"])  # SGD without momentum: none
        before = checkpoint_roundtrip([p.detach() for p in optimizer_params(initialised)])
        for index, (a, b) in enumerate(zip(before, optimizer_params(plain), strict=True)):
            assert torch.equal(a, b), f"init_optimizer_state changed param {index}"
        _train(plain, range(steps))
        _train(initialised, range(steps))
        assert_state_dict_equal(
            checkpoint_roundtrip(plain.state_dict()),
            checkpoint_roundtrip(initialised.state_dict()),
            names=("never initialised", "initialised first"),
            headline="init_optimizer_state changed later training",
        )

    check()


def test_init_optimizer_state_keeps_sgd_dampening_updates() -> None:
    def run(initialise: bool) -> torch.Tensor:
        param = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([param], lr=0.1, momentum=0.9, dampening=0.1)
        if initialise:
            init_optimizer_state(opt)
        param.grad = torch.ones(2)
        opt.step()
        return param.detach().clone()

    assert torch.equal(run(False), run(True))


@pytest.mark.parametrize("state_dtype", [torch.float16, torch.uint8], ids=["fp16", "fp8"])
def test_zero_dim_param_with_scaled_state_steps(state_dtype: torch.dtype) -> None:
    from wrapped_optim.optimizers import PrecisionAwareAdamW

    param = torch.nn.Parameter(torch.ones(()))
    opt = PrecisionAwareAdamW([param], lr=0.1, exp_avg_dtype=state_dtype)
    for _ in range(2):
        param.grad = torch.ones(())
        opt.step()
    assert opt.state_dict()["state"][0]["exp_avg"].shape == ()


def test_hybrid_sync_over_precision_adamw_loads_its_own_checkpoint() -> None:
    """A group-step optimizer under HybridSyncOptimizer gets no per-param step injected."""
    from wrapped_optim.hybrid import HybridSyncOptimizer
    from wrapped_optim.optimizers import HybridOffloadOptimizer, PrecisionAwareAdamW

    param = torch.nn.Parameter(torch.ones(2))
    opt = HybridSyncOptimizer(
        HybridOffloadOptimizer(
            [param],
            offload_fraction=1.0,
            cpu_optimizer_cls=PrecisionAwareAdamW,
            gpu_optimizer_cls=PrecisionAwareAdamW,
            lr=0.1,
        )
    )
    param.grad = torch.ones(2)
    opt.step()
    saved = checkpoint_roundtrip(opt.state_dict())
    opt.load_state_dict(opt.state_dict())
    assert_state_dict_equal(saved, checkpoint_roundtrip(opt.state_dict()))


@pytest.mark.parametrize("kind", KINDS)
def test_frozen_params_get_no_state(kind: str) -> None:
    @_SETTINGS
    @given(_setups(kind, ()))
    def check(setup: ws.Setup) -> None:
        _, opt = setup.make()
        _train(opt, range(2))
        frozen = {i for i, p in enumerate(optimizer_params(opt)) if not p.requires_grad}
        assert not frozen & set(opt.state_dict()["state"]), "frozen params got state"

    check()
