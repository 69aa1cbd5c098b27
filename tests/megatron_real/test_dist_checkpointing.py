"""Megatron's real checkpoint path on the real CPU stacks: ``sharded_state_dict`` +
``megatron.core.dist_checkpointing`` (and the legacy ``save_parameter_state``), resumed by
every route a user takes, on one rank (two ranks and resharding: ``test_dist_checkpointing_ranks``).

Each cell: train 3 steps, save, train 3 more (the uninterrupted run); a fresh build (another
seed), the load, 3 more steps; then weights, every FP32 master level, every moment and
per-parameter ``step`` (sub-optimizers included) and every ``lr`` equal the uninterrupted run
bit for bit. Bare Megatron's own failures are asserted as what they are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core.dist_checkpointing")

from tests.distributed.conftest import mismatches, run_in_this_process
from tests.megatron_real.dist_ckpt import (
    FORMATS,
    ROUTES,
    load,
    load_model_only,
    route_optimizer,
    save,
    snapshot,
)
from tests.megatron_real.harness import build, megatron_session, train, weights

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("megatron_real")]

SAVE_AT, MORE = 3, 3
DISTRIBUTED = ("distributed", "offload_half", "offload_full")
CKPT_CONFIGS = ("bf16", *DISTRIBUTED)
WRITERS = ("bare", "wrap", "stack", "setup")
RESUMING = ("dp_reshardable", "fully_reshardable", "legacy")
# Core 0.16.1 / 0.19.2: sharded_param_state_fs_model_space gives every ShardedTensor a
# flattened_range, which ShardedTensor.validate_metadata_integrity refuses outright.
FS_MODEL_SPACE_REFUSED = "ShardedTensor.flattened_range is not supported"


def _formats(name: str) -> tuple[str, ...]:
    # Float16OptimizerWithFloat16Params ignores the sharding type (one format) and has no
    # separate parameter-state file.
    return FORMATS if name in DISTRIBUTED else ("fully_reshardable", "legacy")


def _writer_of(route: str) -> str:
    return "bare" if route == "compat" else route  # compat loads into the bare optimizer


def _build(name: str, route: str, seed: int) -> tuple[Any, Any]:
    model, optimizer = build(name, seed=seed, setup=route == "setup")
    return model, route_optimizer(optimizer, "bare" if route == "setup" else route)


def _error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _save_phase(rank: int, world: int, name: str, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with megatron_session():  # one model-parallel state for every stack of the phase
        for writer in WRITERS:
            model, optimizer = _build(name, writer, seed=0)
            train(model, optimizer, range(SAVE_AT), rank)
            errors = {}
            for fmt in _formats(name):
                try:
                    save(model, optimizer, Path(root, writer, fmt), fmt)
                except Exception as error:  # reported to the tests, which decide
                    errors[fmt] = _error(error)
            train(model, optimizer, range(SAVE_AT, SAVE_AT + MORE), rank)
            out[writer] = {"snapshot": snapshot(model, optimizer), "save_errors": errors}
    return out


def _load_cell(rank: int, name: str, root: str, route: str, fmt: str, writer: str) -> Any:
    model, optimizer = _build(name, route, seed=1)
    try:
        load(model, optimizer, Path(root, writer, fmt), fmt, route)
    except Exception as error:
        return {"error": _error(error)}
    train(model, optimizer, range(SAVE_AT, SAVE_AT + MORE), rank)
    return {"snapshot": snapshot(model, optimizer)}


# Checkpoints move between routes: the wrapped stack reads bare Megatron's checkpoint, and
# the bare optimizer (inside compat's helpers) reads the wrapped stack's.
CROSS = (("wrap", "bare"), ("compat", "wrap"))


def _load_phase(rank: int, world: int, name: str, root: str, saved: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with megatron_session():
        for fmt in _formats(name):
            cells = [(route, _writer_of(route)) for route in ROUTES] + list(CROSS)
            for route, writer in cells:
                if fmt in saved[writer]["save_errors"]:
                    continue
                out[f"{route}<{writer}/{fmt}"] = _load_cell(rank, name, root, route, fmt, writer)
    return out


_MATRICES: dict[str, Any] = {}


@pytest.fixture(scope="module")
def matrices(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``matrix(name)``: the save and load phases of config ``name``, run once per module."""

    def matrix(name: str) -> tuple[Any, Any]:
        if name not in _MATRICES:
            root = tmp_path_factory.mktemp(f"dist_ckpt_{name}")
            saved = run_in_this_process(_save_phase, root, name, str(root / "ckpt"))
            loaded = run_in_this_process(_load_phase, root, name, str(root / "ckpt"), saved)
            _MATRICES[name] = (saved, loaded)
        return _MATRICES[name]

    yield matrix
    _MATRICES.clear()


def _resumable(names: tuple[str, ...] = CKPT_CONFIGS) -> list[tuple[str, str]]:
    return [(name, fmt) for name in names for fmt in RESUMING if fmt in _formats(name)]


def _expect_resumed(matrices: Any, name: str, route: str, fmt: str, writer: str) -> None:
    saved, loaded = matrices(name)
    cell = loaded[f"{route}<{writer}/{fmt}"]
    assert "error" not in cell, cell.get("error")
    assert mismatches(saved[writer]["snapshot"], cell["snapshot"]) == []


@pytest.mark.parametrize(("name", "fmt"), _resumable())
@pytest.mark.parametrize("route", [r for r in ROUTES if r != "bare"])
def test_every_route_resumes_bitwise(matrices: Any, name: str, fmt: str, route: str) -> None:
    _expect_resumed(matrices, name, route, fmt, _writer_of(route))


@pytest.mark.parametrize(("name", "fmt"), _resumable())
@pytest.mark.parametrize(("route", "writer"), CROSS)
def test_checkpoints_move_between_bare_and_wrapped(
    matrices: Any, name: str, fmt: str, route: str, writer: str
) -> None:
    _expect_resumed(matrices, name, route, fmt, writer)


@pytest.mark.parametrize("name", CKPT_CONFIGS)
def test_uninterrupted_runs_agree_through_the_wrappers(matrices: Any, name: str) -> None:
    saved, _ = matrices(name)
    for writer in ("wrap", "stack"):
        assert mismatches(saved["bare"]["snapshot"], saved[writer]["snapshot"]) == []


# What bare megatron-core 0.16.1 (torch's AdamW inside, no TE) does with its own checkpoints,
# loaded in Bridge's order without this project's helpers (state created first, as Core 0.17+
# does itself): None = bitwise, "differs" = loads but the run diverges, else the error.
BARE = {
    ("distributed", "dp_reshardable"): "differs",  # per-param step rewound to the scaffold's
    ("distributed", "fully_reshardable"): "KeyError: 'step'",
    ("distributed", "legacy"): "KeyError: 'step'",
    **{(name, fmt): "KeyError: tensor(" for name in DISTRIBUTED[1:] for fmt in RESUMING},
}


@pytest.mark.parametrize(("name", "fmt"), _resumable())
def test_bare_megatron_resume_as_it_is(matrices: Any, name: str, fmt: str) -> None:
    saved, loaded = matrices(name)
    cell = loaded[f"bare<bare/{fmt}"]
    expected = BARE.get((name, fmt))
    if expected is None:
        assert "error" not in cell, cell.get("error")
        assert mismatches(saved["bare"]["snapshot"], cell["snapshot"]) == []
    elif expected == "differs":
        assert "error" not in cell, cell.get("error")
        assert mismatches(saved["bare"]["snapshot"], cell["snapshot"]) != []
    else:
        assert cell.get("error", "").startswith(expected), cell


@pytest.mark.parametrize("name", DISTRIBUTED)
def test_fully_sharded_model_space_is_refused_by_core_on_every_route(
    matrices: Any, name: str
) -> None:
    saved, _ = matrices(name)
    for writer in WRITERS:
        assert FS_MODEL_SPACE_REFUSED in saved[writer]["save_errors"]["fully_sharded_model_space"]


# --------------------------------------------------------------------------------------
# Model-only loads from a distributed checkpoint (fine-tuning): weights loaded, state fresh
# --------------------------------------------------------------------------------------
MODEL_ONLY_FORMATS = ("dp_reshardable", "legacy")


def _model_only_phase(rank: int, world: int, name: str, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with megatron_session():
        model, optimizer = build(name)
        train(model, optimizer, range(SAVE_AT), rank)
        for fmt in (*MODEL_ONLY_FORMATS, "fully_reshardable"):
            save(model, optimizer, Path(root, fmt), fmt)
        pretrained = model.state_dict()
        for setup in (False, True):  # setup_optimizer's param groups differ (no decay on biases)
            # The reference: an optimizer built after the weights were loaded.
            model, optimizer = build(name, seed=1, weights=pretrained, setup=setup)
            train(model, optimizer, range(SAVE_AT, SAVE_AT + MORE), rank)
            out["reference", setup] = weights(model)
        for fmt in (*MODEL_ONLY_FORMATS, "fully_reshardable"):
            for route in ROUTES:
                model, optimizer = _build(name, route, seed=1)
                try:
                    load_model_only(model, optimizer, Path(root, fmt), fmt, route)
                except Exception as error:
                    out[route, fmt] = _error(error)
                    continue
                train(model, optimizer, range(SAVE_AT, SAVE_AT + MORE), rank)
                out[route, fmt] = weights(model)
    return out


_MODEL_ONLY: dict[str, Any] = {}


@pytest.fixture(scope="module")
def model_only(tmp_path_factory: pytest.TempPathFactory) -> Any:
    def run(name: str) -> Any:
        if name not in _MODEL_ONLY:
            root = tmp_path_factory.mktemp(f"model_only_{name}")
            _MODEL_ONLY[name] = run_in_this_process(
                _model_only_phase, root, name, str(root / "ckpt")
            )
        return _MODEL_ONLY[name]

    yield run
    _MODEL_ONLY.clear()


@pytest.mark.parametrize("fmt", MODEL_ONLY_FORMATS)
@pytest.mark.parametrize("name", DISTRIBUTED[1:])
@pytest.mark.parametrize("route", [r for r in ROUTES if r != "bare"])
def test_model_only_load_continues_from_the_loaded_weights(
    model_only: Any, name: str, fmt: str, route: str
) -> None:
    runs = model_only(name)
    assert mismatches(runs["reference", route == "setup"], runs[route, fmt]) == []


@pytest.mark.parametrize("name", DISTRIBUTED[1:])
def test_bare_model_only_load_steps_from_stale_masters(model_only: Any, name: str) -> None:
    # Megatron's reload_model_params refreshes only the DistributedOptimizer's shards; the
    # HybridDeviceOptimizer's host clones and FP32 copies keep the initial weights.
    runs = model_only(name)
    assert mismatches(runs["reference", False], runs["bare", "dp_reshardable"]) != []


@pytest.mark.parametrize("name", DISTRIBUTED[1:])
def test_model_only_load_of_a_fully_reshardable_offload_checkpoint(
    model_only: Any, name: str
) -> None:
    # megatron-core 0.16.1 keeps the HybridDeviceOptimizer's param groups (its sub-optimizer
    # classes) in the common state of a fully-reshardable checkpoint and reads that file with
    # torch's weights-only unpickler even when only the model is requested: no optimizer call
    # runs before it, so no route can allow the classes (docs/guides/megatron_bridge.md).
    # 0.19.2 reads it: then every route continues from the loaded weights.
    runs = model_only(name)
    for route in ROUTES:
        result = runs[route, "fully_reshardable"]
        if isinstance(result, str):
            assert result.startswith("UnpicklingError"), (route, result)
        elif route != "bare":
            assert mismatches(runs["reference", route == "setup"], result) == [], route
