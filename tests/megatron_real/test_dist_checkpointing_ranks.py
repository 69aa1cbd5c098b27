"""Megatron's distributed checkpoints on two gloo ranks, resumed in fresh processes, and
resharded: saved on 2 ranks and resumed on 1, saved on 1 and resumed on 2.

A resharded resume is exact when every parameter's main param, moments and ``step`` after the
load are the saved ones (put together from each rank's slice, in model space), and the run
then continues identically by every format and route: a run from the same state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core.dist_checkpointing")

from tests.distributed.conftest import Launcher, become_solo, merge_solo_results, mismatches
from tests.megatron_real.dist_ckpt import (
    resume_and_continue,
    route_optimizer,
    save_and_continue,
    whole_model_space,
)
from tests.megatron_real.harness import build, megatron_session

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.xdist_group("megatron_real")]

SAVE_AT, MORE = 3, 3
CONFIGS = ("distributed", "offload_half")
# The formats Core declares reshardable (dp_reshardable: along data parallelism).
FORMATS = ("dp_reshardable", "fully_reshardable", "legacy")
ROUTES = ("compat", "wrap")


def _writer(route: str) -> str:
    return "bare" if route == "compat" else route


STACKS = [(name, writer) for name in CONFIGS for writer in ("bare", "wrap")]
CELLS = [(name, fmt, route) for name in CONFIGS for fmt in FORMATS for route in ROUTES]


def _save_stacks(rank: int, world: int, root: str, stacks: list[Any]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    with megatron_session():  # one model-parallel state for every stack of the phase
        for name, writer in stacks:
            model, optimizer = build(name)
            optimizer = route_optimizer(optimizer, writer)
            directory = Path(root, f"world{world}", name, writer)
            out[name, writer] = save_and_continue(
                model, optimizer, directory, FORMATS, SAVE_AT, MORE, rank
            )
    return out


def _save(rank: int, world: int, root: str) -> dict[str, Any]:
    """Every stack saved on 2 ranks, then by each rank alone (a world of one), half each."""
    out = {"saved2": _save_stacks(rank, world, root, STACKS)}
    become_solo(rank)
    out["saved1"] = _save_stacks(0, 1, root, STACKS[rank::world])
    return out


def _load_cells(rank: int, root: str, saved_on: int, cells: list[Any]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    with megatron_session():
        for name, fmt, route in cells:
            directory = Path(root, f"world{saved_on}", name, _writer(route), fmt)
            model, optimizer = build(name, seed=1)
            optimizer = route_optimizer(optimizer, route)
            out[name, fmt, route] = resume_and_continue(
                model, optimizer, directory, fmt, route, range(SAVE_AT, SAVE_AT + MORE), rank
            )
    return out


def _load(rank: int, world: int, root: str) -> dict[str, Any]:
    """Fresh processes resume 2 -> 2 and 1 -> 2, then each rank alone half of 2 -> 1."""
    out = {"2to2": _load_cells(rank, root, 2, CELLS), "1to2": _load_cells(rank, root, 1, CELLS)}
    become_solo(rank)
    out["2to1"] = _load_cells(0, root, 2, CELLS[rank::world])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("dist_ckpt_ranks")
    launch = Launcher(root, cuda_shim=False, timeout_s=1200)
    saves = launch(_save, 2, str(root))
    loads = launch(_load, 2, str(root))  # fresh processes, fresh groups
    return {
        "saved2": [run["saved2"] for run in saves],
        "saved1": merge_solo_results([run["saved1"] for run in saves]),
        "2to2": [run["2to2"] for run in loads],
        "1to2": [run["1to2"] for run in loads],
        "2to1": merge_solo_results([run["2to1"] for run in loads]),
    }


@pytest.mark.parametrize(("name", "fmt", "route"), CELLS)
def test_two_rank_resume_in_fresh_processes_is_bitwise(
    runs: dict[str, Any], name: str, fmt: str, route: str
) -> None:
    for rank in range(2):
        cell = runs["2to2"][rank][name, fmt, route]
        assert "error" not in cell, cell.get("error")
        uninterrupted = runs["saved2"][rank][name, _writer(route)]["snapshot"]
        assert mismatches(uninterrupted, cell["snapshot"]) == []


@pytest.mark.parametrize(("name", "fmt", "route"), CELLS)
@pytest.mark.parametrize(
    ("direction", "saved", "ranks_after"), [("2to1", "saved2", 1), ("1to2", "saved1", 2)]
)
def test_resharded_resume_restores_the_saved_state(
    runs: dict[str, Any],
    name: str,
    fmt: str,
    route: str,
    direction: str,
    saved: str,
    ranks_after: int,
) -> None:
    cells = [runs[direction][rank][name, fmt, route] for rank in range(ranks_after)]
    for cell in cells:
        assert "error" not in cell, cell.get("error")
    before = whole_model_space([rank[name, _writer(route)]["space"] for rank in runs[saved]])
    after = whole_model_space([cell["space"] for cell in cells])
    assert before.keys() == after.keys()
    assert mismatches(before, after) == []


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("direction", ["2to1", "1to2"])
def test_resharded_runs_continue_as_one_run_from_the_same_state(
    runs: dict[str, Any], name: str, direction: str
) -> None:
    # The same state, loaded by every format and route, continues to the same weights.
    for rank_results in runs[direction]:
        first = rank_results[name, FORMATS[0], ROUTES[0]]["snapshot"]
        for fmt in FORMATS:
            for route in ROUTES:
                assert mismatches(first, rank_results[name, fmt, route]["snapshot"]) == []
