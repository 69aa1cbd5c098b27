"""Megatron-Core's real precision-aware DistributedOptimizer (its own factory, PrecisionAwareAdamW
as TE's FusedAdam: :mod:`tests.megatron_real.precision_aware`) saved and resumed in fresh gloo
processes, on 2 ranks and 1, in every reshardable format, by every route.

A resume is exact when, right after the load, every parameter's master (bf16 param plus int16
remainder, or fp16 master) and moments equal the saved ones in model space, and 3 more steps
equal the uninterrupted run bitwise. Across a data-parallel change (2 -> 1, 1 -> 2) the one
parameter whose shards merge or split is re-quantized under a new per-tensor scale (FP8
moments, fp16 master): bounded here as TE's re-quantization bounds it; everything else is
exact.

The default run keeps a lean matrix; the full cross product (every config, format, route and
direction) is marked slow. Two launches of two processes do all of it: one saves (on 2 ranks,
then each rank alone saves half of the stacks as a world of one), one resumes (2 -> 2 and
1 -> 2, then each rank alone half of 2 -> 1), the slow matrix riding in the same launch when
it is selected. The save launch also measures the staged save's memory bound
(:mod:`tests.megatron_real.save_bound`) and looks at precision-aware + CPU offload.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

# Not importorskip: importing megatron.core binds its FusedAdam, and the spawned workers import
# this module before they install the stand-in.
if importlib.util.find_spec("megatron") is None:  # pragma: no cover - Megatron is optional
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from tests.distributed.conftest import (
    Launcher,
    become_solo,
    merge_solo_results,
    mismatches,
    requantized_fp8_mismatches,
)
from tests.megatron_real import save_bound
from tests.megatron_real.dist_ckpt import (
    resume_and_continue,
    route_optimizer,
    save_and_continue,
    whole_model_space,
)
from tests.megatron_real.harness import leaf, megatron_session, train
from tests.megatron_real.precision_aware import (
    PRECISION_CONFIGS,
    build_precision_aware,
    install_te_stand_in,
)

pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("megatron_real")]

SAVE_AT, MORE = 3, 3
OFFLOAD = {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5}
CONFIGS = tuple(PRECISION_CONFIGS)
FORMATS = ("dp_reshardable", "fully_reshardable", "legacy")
ROUTES = ("bare", "wrap", "stack", "setup", "compat")
WRITERS = ("bare", "wrap")


def _writer(route: str) -> str:
    return "wrap" if route in ("wrap", "stack", "setup") else "bare"


def _build(name: str, route: str, seed: int) -> tuple[Any, Any]:
    model, optimizer = build_precision_aware(name, seed, setup=route == "setup")
    if route in ("wrap", "stack"):
        optimizer = route_optimizer(optimizer, route)
    return model, optimizer


STACKS = [(name, writer) for name in CONFIGS for writer in WRITERS]


def _save_stacks(rank: int, world: int, root: str, stacks: list[Any]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    with megatron_session():
        for name, writer in stacks:
            model, optimizer = _build(name, writer, 0)
            directory = Path(root, f"world{world}", name, writer)
            out[name, writer] = save_and_continue(
                model, optimizer, directory, FORMATS, SAVE_AT, MORE, rank
            )
    return out


def _offload_probe(rank: int) -> dict[str, Any]:
    """What Core builds for precision-aware + CPU offload (bf16 moments asked for), and what
    ``wrap`` and ``setup_optimizer`` say to it."""
    from wrapped_optim import wrap

    out: dict[str, Any] = {}
    with megatron_session():
        model, optimizer = build_precision_aware("bf16_remainders", 0, **OFFLOAD)
        hybrid = leaf(optimizer).optimizer
        train(model, optimizer, range(1), rank)
        out["halves"] = sorted(
            {
                (type(sub).__name__, name, value.dtype)
                for sub in hybrid.sub_optimizers
                for state in sub.state.values()
                for name, value in state.items()
                if name in ("exp_avg", "exp_avg_sq")
            },
            key=str,
        )
        for route, attempt in (
            ("wrap", lambda: wrap(optimizer)),
            ("setup", lambda: build_precision_aware("bf16_remainders", 0, setup=True, **OFFLOAD)),
        ):
            try:
                attempt()
                out[route] = "accepted"
            except Exception as error:
                out[route] = f"{type(error).__name__}: {error}"
    return out


def _save(rank: int, world: int, root: str) -> dict[str, Any]:
    """One launch writes every checkpoint: each stack on 2 ranks, then each rank alone (a
    world of one) writes half of the stacks again. The same launch measures the staged save's
    bound and looks at precision-aware + CPU offload."""
    install_te_stand_in()
    out = {"saved2": _save_stacks(rank, world, root, STACKS)}
    out["bound"] = save_bound.measure(rank, root)
    out["offload"] = _offload_probe(rank)
    become_solo(rank)
    out["saved1"] = _save_stacks(0, 1, root, STACKS[rank::world])
    return out


def _load_cells(rank: int, root: str, saved_on: int, cells: list[Any]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    with megatron_session():
        for name, fmt, route in cells:
            directory = Path(root, f"world{saved_on}", name, _writer(route), fmt)
            model, optimizer = _build(name, route, 1)
            out[name, fmt, route] = resume_and_continue(
                model, optimizer, directory, fmt, route, range(SAVE_AT, SAVE_AT + MORE), rank
            )
    return out


def _load(
    rank: int, world: int, root: str, same_world: list[Any], resharded: list[Any]
) -> dict[str, Any]:
    """One launch, fresh processes, resumes every direction: 2 -> 2 and 1 -> 2 on 2 ranks,
    then 2 -> 1 with each rank alone resuming half of the cells."""
    install_te_stand_in()
    out = {
        "2to2": _load_cells(rank, root, 2, same_world),
        "1to2": _load_cells(rank, root, 1, resharded),
    }
    become_solo(rank)
    out["2to1"] = _load_cells(0, root, 2, resharded[rank::world])
    return out


def _cells(routes: tuple[str, ...], configs: tuple[str, ...] = CONFIGS) -> list[Any]:
    return [(name, fmt, route) for name in configs for fmt in FORMATS for route in routes]


# The default run: every config and format, bare Megatron and the two wrapped routes users
# take most (wrap, compat's loading contexts) on 2 -> 2; one wrapped route across DP changes.
# When the slow matrix is selected too, one launch resumes all of it and both read it.
LEAN_2TO2 = _cells(("bare", "wrap", "compat"))
LEAN_RESHARD = _cells(("wrap",))
FULL = _cells(ROUTES)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("precision_aware")
    launch = Launcher(root, cuda_shim=False, timeout_s=1800)
    runs = launch(_save, 2, str(root))
    return {
        "root": root,
        "launch": launch,
        "saved2": [run["saved2"] for run in runs],
        "saved1": merge_solo_results([run["saved1"] for run in runs]),
        "bound": [run["bound"] for run in runs],
        "offload": [run["offload"] for run in runs],
    }


@pytest.fixture(scope="module")
def loads(request: pytest.FixtureRequest, saved: dict[str, Any]) -> dict[str, Any]:
    full = any(item.name.startswith("test_full_matrix") for item in request.session.items)
    same_world, resharded = (FULL, FULL) if full else (LEAN_2TO2, LEAN_RESHARD)
    runs = saved["launch"](_load, 2, str(saved["root"]), same_world, resharded)
    return {
        "2to2": [run["2to2"] for run in runs],
        "1to2": [run["1to2"] for run in runs],
        "2to1": merge_solo_results([run["2to1"] for run in runs]),
    }


# --------------------------------------------------------------------------------------
# What the tests check
# --------------------------------------------------------------------------------------
def _values(space: dict[str, tuple[int, int, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: values for key, (_, _, values) in space.items()}


def _fp16_requantized(before: torch.Tensor, after: torch.Tensor) -> bool:
    """``after`` is ``before`` re-encoded in fp16 under another per-tensor scale (amax /
    32752): within half an fp16 step of the value, or of the scale in the subnormal range."""
    x, y = before.double(), after.double()
    scale = max(float(x.abs().max()), float(y.abs().max())) / 32752
    return x.shape == y.shape and bool(((x - y).abs() <= x.abs() / 1024 + scale / 2**14).all())


def _assert_resume(results: dict[str, Any], saved: dict[str, Any], cell: Any) -> None:
    name, _, route = cell
    for rank, rank_results in enumerate(results):
        outcome = rank_results[cell]
        assert "error" not in outcome, outcome.get("error")
        expected = saved[rank][name, _writer(route)]
        assert mismatches(_values(expected["space"]), _values(outcome["space"])) == []  # loaded
        assert mismatches(expected["snapshot"], outcome["snapshot"]) == []  # 3 steps on


def _assert_resharded(results: list[Any], saved: list[Any], cell: Any) -> list[str]:
    """Checks a resharded resume; returns the keys that were re-quantized (bounded)."""
    name, _, route = cell
    for outcome in (rank[cell] for rank in results):
        assert "error" not in outcome, outcome.get("error")
    before = whole_model_space([rank[name, _writer(route)]["space"] for rank in saved])
    after = whole_model_space([rank[cell]["space"] for rank in results])
    assert before.keys() == after.keys()
    moved = mismatches(before, after)
    fp8 = [k for k in moved if k.rsplit("/", 1)[1] in ("exp_avg", "exp_avg_sq")]
    fp16_master = [k for k in moved if k.endswith("/param")]
    # Only per-tensor-scaled states move: FP8 moments, an fp16 master; never bf16 or remainders.
    assert sorted(fp8 + fp16_master) == moved, moved
    if fp8:
        assert PRECISION_CONFIGS[name]["exp_avg_dtype"] == torch.uint8, fp8
        assert requantized_fp8_mismatches(before, after, fp8) == []
    if fp16_master:
        assert PRECISION_CONFIGS[name].get("main_params_dtype") == torch.float16, fp16_master
        assert all(_fp16_requantized(before[k], after[k]) for k in fp16_master)
    return moved


def _bare_megatron_defect(name: str, fmt: str) -> str | None:
    """What bare Megatron (no repairs) raises on this Core for a precision-aware resume:
    0.16.1 forwards dp_reshardable's ``padding``; 0.16.1 and 0.19.2 hand a remainder back
    as float32 after fully_reshardable and legacy saves
    (tests/adapters/test_megatron_precision_repairs.py checks the probe against Core's setter)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from wrapped_optim._adapters.megatron_precision import _setter_defects

    padding, remainder = _setter_defects(DistributedOptimizer._set_main_param_and_optimizer_states)
    if fmt == "dp_reshardable":
        return "padding" if padding else None
    if remainder and PRECISION_CONFIGS[name].get("store_param_remainders", True):
        return "master_param' has dtype torch.float32, expected torch.int16"
    return None


def _check_cell(results: dict[str, Any], saved: dict[str, Any], cell: Any, direction: str) -> None:
    name, fmt, route = cell
    if route == "bare":
        defect = _bare_megatron_defect(name, fmt)
        if defect is not None:  # Core's own defect: every rank raises it
            for rank in results[direction]:
                assert defect in rank[cell].get("error", ""), rank[cell].get("error")
            return
    if direction == "2to2":
        _assert_resume(results["2to2"], saved["saved2"], cell)
    else:
        source = saved["saved2" if direction == "2to1" else "saved1"]
        _assert_resharded(results[direction], source, cell)


@pytest.mark.parametrize("cell", LEAN_2TO2, ids=["-".join(c) for c in LEAN_2TO2])
def test_resume_on_two_ranks_is_exact(loads: Any, saved: Any, cell: Any) -> None:
    _check_cell(loads, saved, cell, "2to2")


@pytest.mark.parametrize("direction", ["2to1", "1to2"])
@pytest.mark.parametrize("cell", LEAN_RESHARD, ids=["-".join(c) for c in LEAN_RESHARD])
def test_resharded_resume_restores_the_saved_state(
    loads: Any, saved: Any, cell: Any, direction: str
) -> None:
    _check_cell(loads, saved, cell, direction)


def test_writers_agree(saved: Any) -> None:
    # The wrapped run is the bare run, bitwise, on every rank.
    for world in ("saved2", "saved1"):
        for rank in saved[world]:
            for name in CONFIGS:
                bare, wrapped = rank[name, "bare"], rank[name, "wrap"]
                assert mismatches(bare["snapshot"], wrapped["snapshot"]) == []


@pytest.mark.slow
@pytest.mark.parametrize("direction", ["2to2", "2to1", "1to2"])
@pytest.mark.parametrize("cell", FULL, ids=["-".join(c) for c in FULL])
def test_full_matrix(loads: Any, saved: Any, cell: Any, direction: str) -> None:
    _check_cell(loads, saved, cell, direction)


def test_staged_save_holds_one_chunk_of_fp32_expansion(saved: Any) -> None:
    # Each rank of 2, every config and format: the staged save keeps at most one chunk of
    # FP32 expansion on the device at once; bare Megatron keeps one whole expansion per state,
    # every compressed state's at once (the figures are in docs/bench/by_hand.md).
    chunk = save_bound.CHUNK_BYTES
    for rank in saved["bound"]:
        assert len(rank) == 2 * len(save_bound.BOUND_CONFIGS) * len(save_bound.BOUND_FORMATS)
        for (name, fmt, writer), figures in rank.items():
            assert figures["largest"] > 4 * chunk, figures  # the model is many chunks
            if writer == "staged":
                assert 0 < figures["peak"] <= chunk, (name, fmt, figures)
            else:
                assert figures["peak"] == figures["whole"], (name, fmt, figures)


def test_precision_aware_cpu_offload_is_refused_as_core_ignores_its_dtypes(saved: Any) -> None:
    for rank in saved["offload"]:
        # Core's HybridDeviceOptimizer: bf16 moments asked for, FP32 moments in both halves.
        assert {dtype for _, _, dtype in rank["halves"]} == {torch.float32}, rank["halves"]
        assert {sub for sub, _, _ in rank["halves"]} == {"AdamW", "PrecisionAwareAdamW"}
        for route in ("wrap", "setup"):
            assert rank[route].startswith("ConfigError: "), rank[route]
            assert "optimizer_cpu_offload: cannot be combined" in rank[route]
