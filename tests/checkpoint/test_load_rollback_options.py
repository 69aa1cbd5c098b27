"""The atomic load puts the param groups' options back when it fails after writing them.

The fault tests of test_checkpoint_atomic.py inject while reading, before any group option is
written, and build the victim with the checkpoint's own hyper-parameters. Here the victim is
built with other hyper-parameters (``lr``, ``betas``, ``weight_decay``, ``eps``) and the fault
comes after the groups are written: in the wrapper's ``sync_after_load`` (after the hybrid
layer below it has pushed its masters into the weights) and in a torch load post-hook. The
victim must come back exactly as it was, and then train exactly like an untouched twin.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from tests.param_builders import train_on_random_grads
from wrapped_optim import HybridSyncOptimizer, OptimizerWrapper
from wrapped_optim.checkpoint import load_optimizer, save_optimizer
from wrapped_optim.optimizers import HybridOffloadOptimizer, PrecisionAwareAdamW
from wrapped_optim.testing import assert_state_dict_equal, checkpoint_roundtrip

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

CHUNK = 256  # bytes: many read items per tensor

SAVED = {"lr": 0.5, "betas": (0.9, 0.999), "weight_decay": 0.1, "eps": 1e-8}
VICTIM = {"lr": 0.01, "betas": (0.8, 0.95), "weight_decay": 0.02, "eps": 1e-6}


def _params(seed: int, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in [(24, 8), (8,)]]


def _adamw(seed: int, hyper: dict[str, Any]) -> tuple[Any, list[torch.nn.Parameter]]:
    params = _params(seed, torch.float32)
    return torch.optim.AdamW(params, **hyper), params


def _precision(seed: int, hyper: dict[str, Any]) -> tuple[Any, list[torch.nn.Parameter]]:
    params = _params(seed, torch.bfloat16)
    opt = PrecisionAwareAdamW(
        params,
        exp_avg_dtype=torch.float16,
        exp_avg_sq_dtype=torch.uint8,
        master_weights=True,
        store_param_remainders=True,
        **hyper,
    )
    return opt, params


def _bare_hybrid_precision(
    seed: int, hyper: dict[str, Any]
) -> tuple[Any, list[torch.nn.Parameter]]:
    """No wrapper: no sync_after_load, and the load journals no params for it."""
    params = _params(seed, torch.bfloat16)
    opt = HybridOffloadOptimizer(
        params,
        offload_fraction=1.0,
        cpu_optimizer_cls=PrecisionAwareAdamW,
        exp_avg_dtype=torch.float16,
        exp_avg_sq_dtype=torch.float16,
        **hyper,
    )
    return opt, params


def _hybrid_precision(seed: int, hyper: dict[str, Any]) -> tuple[Any, list[torch.nn.Parameter]]:
    opt, params = _bare_hybrid_precision(seed, hyper)
    return HybridSyncOptimizer(opt), params


def _hybrid_adamw(seed: int, hyper: dict[str, Any]) -> tuple[Any, list[torch.nn.Parameter]]:
    params = _params(seed, torch.bfloat16)
    opt = HybridOffloadOptimizer(params, offload_fraction=0.5, **hyper)
    return HybridSyncOptimizer(opt), params


Builder = Callable[[int, dict[str, Any]], tuple[Any, list[torch.nn.Parameter]]]
BUILDERS: dict[str, Builder] = {
    "adamw": _adamw,
    "precision(fp16,fp8)": _precision,
    "hybrid(precision fp16)": _hybrid_precision,
    "hybrid(adamw)": _hybrid_adamw,
    "bare hybrid(precision fp16)": _bare_hybrid_precision,
}


class Planted(OSError):
    """The failure planted after the groups are written."""


class FailingSync(OptimizerWrapper):
    """A wrapper whose post-load sync raises once its inner layers have synced."""

    armed = True

    def _on_state_loaded(self) -> None:
        if self.armed:
            raise Planted(errno.EIO, "planted failure after the param groups were written")


def _options(opt: Any) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _saved(name: str, path: Path) -> Any:
    opt, params = BUILDERS[name](0, dict(SAVED))
    train_on_random_grads(opt, params, 3, seed=1)
    save_optimizer(opt, storage_writer=FileSystemWriter(path), chunk_bytes=CHUNK)
    return checkpoint_roundtrip(opt.state_dict())


def _victim(name: str) -> tuple[Any, list[torch.nn.Parameter]]:
    opt, params = BUILDERS[name](7, dict(VICTIM))
    train_on_random_grads(opt, params, 1, seed=4)
    return opt, params


def _assert_untouched(name: str, opt: Any, params: list[torch.nn.Parameter]) -> None:
    """``opt`` equals a twin that never saw the load, and keeps training exactly like it."""
    twin, twin_params = _victim(name)
    assert _options(opt) == _options(twin)
    assert all(g["lr"] == VICTIM["lr"] for g in opt.param_groups)
    assert_state_dict_equal(
        checkpoint_roundtrip(twin.state_dict()),
        checkpoint_roundtrip(opt.state_dict()),
        names=("untouched twin", "after the failed load"),
    )
    assert all(torch.equal(a, b) for a, b in zip(params, twin_params, strict=True))
    train_on_random_grads(opt, params, 2, seed=9)
    train_on_random_grads(twin, twin_params, 2, seed=9)
    assert all(torch.equal(a, b) for a, b in zip(params, twin_params, strict=True))
    assert_state_dict_equal(
        checkpoint_roundtrip(twin.state_dict()),
        checkpoint_roundtrip(opt.state_dict()),
        names=("untouched twin", "failed load, then 2 steps"),
    )


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_failure_in_sync_after_load_restores_the_group_options(name: str, tmp_path: Path) -> None:
    """The wrapper's sync fails after the groups (and a hybrid's weights) were written."""
    good = _saved(name, tmp_path)
    opt, params = _victim(name)
    outer = FailingSync(opt)
    with pytest.raises(Planted, match="after the param groups were written"):
        load_optimizer(outer, tmp_path, chunk_bytes=CHUNK)
    _assert_untouched(name, opt, params)

    outer.armed = False  # the retry loads everything, the checkpoint's lr included
    load_optimizer(outer, tmp_path, chunk_bytes=CHUNK)
    assert all(g["lr"] == SAVED["lr"] for g in opt.param_groups)
    assert_state_dict_equal(good, checkpoint_roundtrip(opt.state_dict()), names=("saved", "retry"))


@pytest.mark.parametrize("name", ["adamw", "bare hybrid(precision fp16)"])
def test_failure_in_a_load_post_hook_restores_the_group_options(name: str, tmp_path: Path) -> None:
    """The optimizer's own loader replaced the groups (new dicts, the checkpoint's options;
    a hybrid's also its sub-optimizers' storage and copies), then a post-hook raised."""
    good = _saved(name, tmp_path)
    opt, params = _victim(name)

    def fail(optimizer: torch.optim.Optimizer) -> None:
        assert optimizer.param_groups[0]["lr"] == SAVED["lr"]  # the groups were written
        raise Planted(errno.EIO, "planted failure in a load post-hook")

    handle = opt.register_load_state_dict_post_hook(fail)
    with pytest.raises(Planted, match="post-hook"):
        load_optimizer(opt, tmp_path, chunk_bytes=CHUNK)
    handle.remove()
    _assert_untouched(name, opt, params)

    load_optimizer(opt, tmp_path, chunk_bytes=CHUNK)
    assert_state_dict_equal(good, checkpoint_roundtrip(opt.state_dict()), names=("saved", "retry"))
