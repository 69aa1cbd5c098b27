"""A resume restores the hyper-parameters: into optimizers built with other options.

Rebuilding with the checkpoint's own ``lr`` hides a resume that forgets it, so here the fresh
optimizer is built with other options (``lr``, ``betas``, ``weight_decay``, ``eps``) and the
resumed run must still equal the uninterrupted one bitwise: through ``load_state_dict``,
through the DCP loader, and through the public kit's ``assert_resume_equivalent`` (which
now halves the fresh optimizer's float options itself before the load).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.param_builders import train_on_random_grads
from wrapped_optim import HybridSyncOptimizer, StagedCheckpointOptimizer
from wrapped_optim.checkpoint import load_optimizer, save_optimizer
from wrapped_optim.optimizers import HybridOffloadOptimizer, PrecisionAwareAdamW
from wrapped_optim.testing import (
    StateMismatchError,
    assert_resume_equivalent,
    assert_state_dict_equal,
    checkpoint_roundtrip,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SAVED = {"lr": 0.05, "betas": (0.9, 0.999), "weight_decay": 0.1, "eps": 1e-8}
OTHER = {"lr": 0.3, "betas": (0.5, 0.9), "weight_decay": 0.0, "eps": 1e-3}


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(11)
    return [
        torch.nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16)) for s in [(6, 5), (5,)]
    ]


def _adamw(params: list[torch.nn.Parameter], hyper: dict[str, Any]) -> Any:
    return torch.optim.AdamW([torch.nn.Parameter(p.detach().float()) for p in params], **hyper)


def _precision(params: list[torch.nn.Parameter], hyper: dict[str, Any]) -> Any:
    return StagedCheckpointOptimizer(
        PrecisionAwareAdamW(
            params,
            exp_avg_dtype=torch.bfloat16,
            exp_avg_sq_dtype=torch.uint8,
            master_weights=True,
            **hyper,
        ),
        chunk_bytes=64,
    )


def _hybrid(params: list[torch.nn.Parameter], hyper: dict[str, Any]) -> Any:
    return HybridSyncOptimizer(HybridOffloadOptimizer(params, offload_fraction=0.5, **hyper))


def _hybrid_precision(params: list[torch.nn.Parameter], hyper: dict[str, Any]) -> Any:
    return HybridSyncOptimizer(
        HybridOffloadOptimizer(
            params,
            offload_fraction=1.0,
            cpu_optimizer_cls=PrecisionAwareAdamW,
            exp_avg_dtype=torch.float16,
            exp_avg_sq_dtype=torch.float16,
            **hyper,
        )
    )


BUILDERS: dict[str, Callable[[list[torch.nn.Parameter], dict[str, Any]], Any]] = {
    "adamw": _adamw,
    "staged(precision)": _precision,
    "hybrid(adamw)": _hybrid,
    "hybrid(precision)": _hybrid_precision,
}


def _trained(name: str, steps: int) -> tuple[Any, list[torch.nn.Parameter]]:
    params = _params()
    opt = BUILDERS[name](params, dict(SAVED))
    params = [p for g in opt.param_groups for p in g["params"]]
    train_on_random_grads(opt, params, steps, seed=3)
    return opt, params


def _resume(name: str, load: Callable[[Any, Any], None]) -> None:
    """Trains 3 steps, loads into a fresh optimizer built with ``OTHER``, trains 2 more."""
    reference, reference_params = _trained(name, 3)
    train_on_random_grads(reference, reference_params, 2, seed=8)

    saver, saver_params = _trained(name, 3)
    fresh = BUILDERS[name](_params(), dict(OTHER))
    params = [p for g in fresh.param_groups for p in g["params"]]
    with torch.no_grad():
        for p, w in zip(params, saver_params, strict=True):
            p.copy_(w)  # the model checkpoint
    load(fresh, saver)
    for group in fresh.param_groups:
        assert group["lr"] == SAVED["lr"] and tuple(group["betas"]) == SAVED["betas"]
        assert group["weight_decay"] == SAVED["weight_decay"] and group["eps"] == SAVED["eps"]
    train_on_random_grads(fresh, params, 2, seed=8)
    assert all(torch.equal(a, b) for a, b in zip(params, reference_params, strict=True))
    assert_state_dict_equal(
        checkpoint_roundtrip(reference.state_dict()),
        checkpoint_roundtrip(fresh.state_dict()),
        names=("uninterrupted", "resumed into other hyper-parameters"),
    )


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_load_state_dict_resumes_into_other_hyper_parameters(name: str) -> None:
    _resume(
        name, lambda fresh, saver: fresh.load_state_dict(checkpoint_roundtrip(saver.state_dict()))
    )


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_dcp_load_resumes_into_other_hyper_parameters(name: str, tmp_path: Path) -> None:
    def load(fresh: Any, saver: Any) -> None:
        save_optimizer(saver, tmp_path, chunk_bytes=64)
        load_optimizer(fresh, tmp_path, chunk_bytes=64)

    _resume(name, load)


# ------------------------------------------------------------------------------------------
# The public kit
# ------------------------------------------------------------------------------------------
class ForgetsLR(torch.optim.AdamW):
    """A resume bug: ``load_state_dict`` keeps the optimizer's own ``lr``."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        own = [group["lr"] for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, lr in zip(self.param_groups, own, strict=True):
            group["lr"] = lr


def _make(cls: type[torch.optim.Optimizer]) -> Callable[[], tuple[Any, Any]]:
    def make() -> tuple[Any, Any]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        return model, cls(model.parameters(), lr=0.1, betas=(0.9, 0.99), weight_decay=0.01)

    return make


def test_kit_catches_a_resume_that_forgets_lr() -> None:
    assert_resume_equivalent(_make(torch.optim.AdamW), 2, 2)
    with pytest.raises(StateMismatchError, match="resumed run differs"):
        assert_resume_equivalent(_make(ForgetsLR), 2, 2)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_kit_resumes_every_stack(name: str) -> None:
    def make() -> tuple[Any, Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 2)).to(torch.bfloat16)
        opt = BUILDERS[name](list(model.parameters()), dict(SAVED))
        if name == "adamw":  # its own FP32 params: train the model's directly
            opt = torch.optim.AdamW(model.parameters(), **SAVED)
        return model, opt

    assert_resume_equivalent(make, 2, 2)
