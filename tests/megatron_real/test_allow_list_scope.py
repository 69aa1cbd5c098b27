"""torch's weights-only allow-list is never widened beyond Core's one common-state read.

megatron-core 0.16.1 reads a fully_reshardable checkpoint's common state with torch's
weights-only unpickler, and a HybridDeviceOptimizer keeps its sub-optimizer classes there.
Every route allows the classes that file names during that read only: a load that raises, a
load abandoned after its scaffold, and a load that succeeds all leave the allow-list as it
was, so a later, unrelated ``torch.load(weights_only=True)`` refuses what it refused before.
Runs on two gloo ranks; the probes on stand-ins in this process.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core.dist_checkpointing")

from megatron.core.optimizer import DistributedOptimizer

from tests.distributed.conftest import Launcher
from tests.megatron_real.dist_ckpt import load, metadata, route_optimizer, save
from tests.megatron_real.harness import build, megatron_session, train
from wrapped_optim._adapters.megatron_checkpoint import (
    _common_loader,
    _common_read_refuses_classes,
    _getter_without_alias,
    _scaffold_requests_master_alias,
)

pytestmark = pytest.mark.xdist_group("megatron_real")
# The two-rank phase is slow, as the suite's other two-rank Megatron tests; the abandoned
# load is also checked on one rank by default (test_load_repairs.py).

ROUTES = ("wrap", "stack", "setup", "compat")
FMT = "fully_reshardable"


def _refused_later(path: Path) -> bool:
    """Whether an unrelated ``torch.load(weights_only=True)`` still refuses torch's AdamW."""
    try:
        torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        return True
    return False


def _strategy() -> Any:
    """Core's registered common-state load strategy (0.16.1); ``None`` for a Core without
    that registry (0.19.2 reads the common state through DCP and accepts the classes)."""
    try:
        from megatron.core.dist_checkpointing.strategies.base import (
            StrategyAction,
            get_default_strategy,
        )
    except ImportError:
        return None
    return get_default_strategy(StrategyAction.LOAD_COMMON, "torch", 1)


def _patched() -> bool:
    """Whether Core's registered common-state loader carries this project's patch."""
    strategy = _strategy()
    return strategy is not None and "load_common" in vars(strategy)


def _build(route: str) -> tuple[Any, Any]:
    model, optimizer = build("offload_half", seed=1, setup=route == "setup")
    return model, route_optimizer(optimizer, "bare" if route in ("setup", "compat") else route)


def _phase(rank: int, world: int, root: str) -> dict[str, Any]:
    probe = Path(root, f"unrelated{rank}.pt")
    good, damaged = Path(root, "good"), Path(root, "damaged")
    seen: dict[str, Any] = {}
    Path(root).mkdir(parents=True, exist_ok=True)
    with megatron_session():
        torch.save({"optimizer_class": torch.optim.AdamW}, probe)
        seen["before"] = _refused_later(probe)
        model, optimizer = build("offload_half")
        train(model, optimizer, range(2), rank)
        save(model, optimizer, good, FMT)
        if rank == 0:  # a checkpoint whose common state reads, and whose tensors do not
            shutil.copytree(good, damaged)
            for data in (damaged / "dist").glob("*.distcp"):
                data.unlink()
        torch.distributed.barrier()
        for route in ROUTES:
            model, optimizer = _build(route)
            try:
                load(model, optimizer, damaged, FMT, route)
                seen[route, "raised"] = "no error"
            except BaseException as error:  # DCP's CheckpointException is a BaseException
                seen[route, "raised"] = type(error).__name__
            seen[route, "after_raise"] = (_refused_later(probe), _patched())
            if route != "compat":  # a scaffold built, the load abandoned
                model, optimizer = _build(route)
                optimizer.sharded_state_dict(
                    model.module.sharded_state_dict(), True, metadata=metadata(FMT)
                )
                seen[route, "abandoned"] = (_refused_later(probe), _patched())
                train(model, optimizer, range(2, 3), rank)
                seen[route, "after_step"] = (_refused_later(probe), _patched())
            model, optimizer = _build(route)
            load(model, optimizer, good, FMT, route)
            seen[route, "loaded"] = (_refused_later(probe), _patched())
    return seen


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("allow_list_scope")
    return Launcher(root, cuda_shim=False, timeout_s=600)(_phase, 2, str(root / "ckpt"))


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.distributed
@pytest.mark.slow
def test_no_route_leaves_optimizer_classes_allowed(
    observed: list[dict[str, Any]], route: str
) -> None:
    for seen in observed:
        assert seen["before"] is True
        assert seen[route, "raised"] == "CheckpointException"  # after the common read
        assert seen[route, "after_raise"] == (True, False)
        assert seen[route, "loaded"] == (True, False)  # and the load itself succeeded


@pytest.mark.parametrize("route", [r for r in ROUTES if r != "compat"])
@pytest.mark.distributed
@pytest.mark.slow
def test_an_abandoned_load_allows_nothing(observed: list[dict[str, Any]], route: str) -> None:
    core_refuses = _common_loader() is not None
    for seen in observed:
        # Between the scaffold and Core's read only Core's common loader is armed (when its
        # read refuses the classes); torch's allow-list is untouched. The next step disarms it.
        assert seen[route, "abandoned"] == (True, core_refuses)
        assert seen[route, "after_step"] == (True, False)


# --------------------------------------------------------------------------------------
# The probes: on for this Core's defects, off for a Core without them
# --------------------------------------------------------------------------------------
def _full_read(self: Any, checkpoint_dir: str) -> Any:
    """A common-state loader that trusts its own checkpoints (no weights-only read)."""
    return torch.load(Path(checkpoint_dir, "common.pt"), weights_only=False)


def test_common_read_probe() -> None:
    import megatron.core

    strategy = _strategy()
    if megatron.core.__version__ == "0.16.1":
        assert _common_read_refuses_classes(type(strategy).load_common) is True
        assert _common_loader() is strategy
    if strategy is None:  # 0.19.2: nothing to patch
        assert _common_loader() is None
    assert _common_read_refuses_classes(_full_read) is False


def _alias_free_getter(self: Any, model_param: Any) -> dict[str, Any]:
    group_index, group_order = self.model_param_group_index_map[model_param]
    main = self.optimizer.param_groups[group_index]["params"][group_order]
    state = self.optimizer.state[main]
    return {"param": main, **{k: v for k, v in state.items() if k != "master_param"}}


def test_master_alias_probe() -> None:
    getter = DistributedOptimizer._get_main_param_and_optimizer_states
    assert _scaffold_requests_master_alias(getter) is True  # 0.16.1 and 0.19.2
    assert _scaffold_requests_master_alias(_alias_free_getter) is False
    # the repair drops only the alias
    tensors = {"param": torch.ones(1), "master_param": torch.ones(1), "exp_avg": torch.zeros(1)}
    assert sorted(_getter_without_alias(lambda _: dict(tensors))(None)) == ["exp_avg", "param"]
