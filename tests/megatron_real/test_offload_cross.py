"""A checkpoint saved with one CPU-offload setting resumes with any other, on two gloo ranks:
offload -> none, none -> offload and a changed offload fraction, in every format whose
payload holds the values (dp_reshardable, fully_reshardable, legacy), by every route (``wrap``,
the explicit stack, ``setup_optimizer``'s stack, compat's helpers in Bridge's order).

Each cell: after the load, every parameter's main param, moments and ``step`` (in model space)
are the saved ones bit for bit, and the run then continues to the weights of the uninterrupted
run bit for bit (the offload split changes where the math runs, not its result).

Without the project's repairs megatron-core 0.16.1 and 0.19.2 refuse none -> offload in
dp_reshardable (``...master_param from model not in state dict``), and 0.16.1 refuses
offload -> none in fully_reshardable (``UnpicklingError``; see
``test_allow_list_scope.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core.dist_checkpointing")

from tests.distributed.conftest import Launcher, mismatches, run_in_this_process
from tests.megatron_real.dist_ckpt import load, model_space_state, route_optimizer, save
from tests.megatron_real.harness import build, megatron_session, train, weights

pytestmark = pytest.mark.xdist_group("megatron_real")
# Two gloo ranks take minutes on two cores: slow, as the suite's other two-rank Megatron
# tests; one rank of the two key cells (none -> offload, offload -> none) runs by default.

SAVE_AT, MORE = 3, 2
FORMATS = ("dp_reshardable", "fully_reshardable", "legacy")
ROUTES = ("wrap", "stack", "setup", "compat")
# (saved with, resumed with): bf16 params throughout (Core refuses offload with FP32 params)
PAIRS = (
    ("bf16_distributed", "offload_half"),
    ("bf16_distributed", "offload_full"),
    ("offload_half", "bf16_distributed"),
    ("offload_full", "bf16_distributed"),
    ("offload_half", "offload_full"),
    ("offload_full", "offload_half"),
)
# The lean matrix (each direction, format and route once); the rest is slow.
LEAN = (
    ("bf16_distributed", "offload_half", "dp_reshardable", "wrap"),
    ("offload_half", "bf16_distributed", "fully_reshardable", "setup"),
    ("offload_full", "offload_half", "legacy", "stack"),
    ("bf16_distributed", "offload_full", "dp_reshardable", "compat"),
)
FULL = [
    (saved, resumed, fmt, route)
    for saved, resumed in PAIRS
    for fmt in FORMATS
    for route in ROUTES
    if (saved, resumed, fmt, route) not in LEAN
]


def _writer(route: str) -> str:
    # setup_optimizer's param groups differ (no decay on biases): it reads its own kind
    return "setup" if route == "setup" else "bare"


def _build(name: str, route: str, seed: int) -> tuple[Any, Any]:
    model, optimizer = build(name, seed=seed, setup=route == "setup")
    return model, route_optimizer(optimizer, "bare" if route in ("setup", "compat") else route)


def _phase(rank: int, world: int, root: str, cells: list[tuple[str, str, str, str]]) -> Any:
    saved: dict[Any, Any] = {}
    loaded: dict[Any, Any] = {}
    with megatron_session():
        for name, writer in sorted({(c[0], _writer(c[3])) for c in cells}):
            model, optimizer = _build(name, writer, seed=0)
            train(model, optimizer, range(SAVE_AT), rank)
            for fmt in sorted({c[2] for c in cells if c[0] == name}):
                save(model, optimizer, Path(root, name, writer, fmt), fmt)
            space = model_space_state(model, optimizer)
            train(model, optimizer, range(SAVE_AT, SAVE_AT + MORE), rank)
            saved[name, writer] = {"space": space, "weights": weights(model)}
        for cell in cells:
            name, resumed, fmt, route = cell
            model, optimizer = _build(resumed, route, seed=1)
            try:
                load(model, optimizer, Path(root, name, _writer(route), fmt), fmt, route)
            except BaseException as error:  # DCP's CheckpointException is a BaseException
                loaded[cell] = f"{type(error).__name__}: {error}"
                continue
            space = model_space_state(model, optimizer)
            train(model, optimizer, range(SAVE_AT, SAVE_AT + MORE), rank)
            loaded[cell] = {"space": space, "weights": weights(model)}
    return {"saved": saved, "loaded": loaded}


def _flat(space: dict[str, tuple[int, int, Any]]) -> dict[str, Any]:
    return {key: values for key, (_, _, values) in space.items()}


def _check(runs: list[Any], cell: tuple[str, str, str, str]) -> None:
    name, _, _, route = cell
    for rank, run in enumerate(runs):
        result = run["loaded"][cell]
        assert not isinstance(result, str), (rank, result)
        before = run["saved"][name, _writer(route)]
        assert mismatches(_flat(before["space"]), _flat(result["space"])) == [], rank
        assert mismatches(before["weights"], result["weights"]) == [], rank


def _launch(tmp_path_factory: pytest.TempPathFactory, label: str, cells: list[Any]) -> Any:
    root = tmp_path_factory.mktemp(label)
    return Launcher(root, cuda_shim=False, timeout_s=1500)(_phase, 2, str(root / "ckpt"), cells)


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One launch for the selected cells: the lean ones, and every other cell too when the
    whole matrix is selected (one spawn, each stack saved once)."""
    full = any(
        item.name.startswith("test_offload_setting_changes_on_resume_every_cell")
        for item in request.session.items
    )
    return _launch(tmp_path_factory, "offload_cross", list(LEAN) + (FULL if full else []))


ONE_RANK = (
    ("bf16_distributed", "offload_half", "dp_reshardable", "wrap"),
    ("offload_half", "bf16_distributed", "fully_reshardable", "compat"),
)


@pytest.fixture(scope="module")
def one_rank_runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("offload_cross_one_rank")
    return [run_in_this_process(_phase, root, str(root / "ckpt"), list(ONE_RANK))]


@pytest.mark.parametrize("cell", ONE_RANK, ids="-".join)
def test_offload_setting_changes_on_resume_one_rank(
    one_rank_runs: Any, cell: tuple[str, str, str, str]
) -> None:
    _check(one_rank_runs, cell)


@pytest.mark.parametrize("cell", LEAN, ids="-".join)
@pytest.mark.distributed
@pytest.mark.slow
def test_offload_setting_changes_on_resume(runs: Any, cell: tuple[str, str, str, str]) -> None:
    _check(runs, cell)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("cell", FULL, ids="-".join)
def test_offload_setting_changes_on_resume_every_cell(
    runs: Any, cell: tuple[str, str, str, str]
) -> None:
    _check(runs, cell)
