"""Megatron-FSDP's optimizer tests, run by hand in two gloo ranks (see test_mfsdp_*.py).

Upstream runs them as ``torchrun --nproc-per-node 2 pytest``; here one spawn of two gloo
workers (tests/distributed's launcher, with its CUDA shim) loads the retargeted files and
calls every selected case on both ranks, after each a barrier, as upstream's
``distributed_setup`` fixture ends. The Megatron-FSDP under test is the checkout's own
(``megatron/core/distributed/fsdp/src``, newer than any release: these tests use its
``fully_shard_context``), imported as ``megatron_fsdp`` in the workers only, so the pytest
process keeps the installed release. Only ``fully_shard_optimizer`` (and TE's ``FusedAdam``)
are retargeted.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from tests.upstream._cases import expand, names_in_source, run_case
from tests.upstream._harness import Edit, checkout, load_into, substituted

VARIABLE = "WRAPPED_OPTIM_UPSTREAM_MEGATRON_FSDP"
_DIR = "tests/unit_tests/distributed/mfsdp_v2/"
_SRC = "megatron/core/distributed/fsdp/src"
_FSDP = "megatron.core.distributed.fsdp.src.megatron_fsdp"

# Upstream file -> the calls a test must make to be selected (None: every test). From
# test_fully_shard.py, the tests that adapt their optimizer; the rest test fully_shard alone.
SELECTED: dict[str, str | None] = {
    "test_optimizer.py": None,
    "test_fully_shard.py": "fully_shard_optimizer",
}
EDITS: dict[str, list[Edit]] = {name: [] for name in SELECTED}


@attrs.frozen
class DistributedSetup:
    """What upstream's ``distributed_setup`` fixture gives a test (its conftest's fields)."""

    rank: int
    world_size: int
    device: Any


def file_path(name: str) -> Path | None:
    return checkout(VARIABLE, _DIR + name)


def functions(source: str, name: str) -> list[str]:
    """The selected test functions of upstream file ``name``, in file order."""
    calling = SELECTED[name]
    selected = []
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
            continue
        called = {ast.unparse(call.func) for call in ast.walk(node) if isinstance(call, ast.Call)}
        if calling is None or calling in called:
            selected.append(node.name)
    return selected


def case_names(name: str) -> list[str]:
    """The selected cases of upstream file ``name`` (empty without a checkout)."""
    path = file_path(name)
    if path is None:
        return []
    source = path.read_text()
    return names_in_source(source, functions(source, name))


def needs_cuda() -> bool:
    """Whether the checkout's Megatron-FSDP refuses a CPU (it does after 2026-08-06)."""
    root = os.environ.get(VARIABLE)
    if not root or torch.cuda.is_available():
        return False
    source = Path(root, _SRC, "megatron_fsdp/experimental/fully_shard.py").read_text()
    return "requires a CUDA device" in source


def _from_file(path: Path) -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location(f"upstream_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return vars(module)


def _modules(root: Path) -> dict[str, dict[str, Any]]:
    import megatron_fsdp
    import megatron_fsdp.experimental as experimental
    import megatron_fsdp.experimental.module as module
    import megatron_fsdp.mixed_precision as mixed_precision

    from wrapped_optim import compat
    from wrapped_optim.optimizers import PrecisionAwareAdamW

    return {
        # Empty parents: the installed megatron-core (and its older megatron_fsdp copy) stays
        # out of the workers.
        "megatron.core": {},
        "megatron.core.distributed": {},
        "megatron.core.distributed.fsdp": {},
        "megatron.core.distributed.fsdp.src": {},
        _FSDP: vars(megatron_fsdp),
        f"{_FSDP}.experimental": {
            **vars(experimental),
            "fully_shard_optimizer": compat.fully_shard_optimizer,
        },
        f"{_FSDP}.experimental.module": vars(module),
        f"{_FSDP}.mixed_precision": vars(mixed_precision),
        "transformer_engine.pytorch.optimizers": {"FusedAdam": PrecisionAwareAdamW},
        # upstream's own test helper, from the checkout
        "tests.unit_tests.distributed.mfsdp_v2.profiler_utils": _from_file(
            root / _DIR / "profiler_utils.py"
        ),
    }


def run_ranks(rank: int, world_size: int, root: str) -> dict[str, tuple[str, str]]:
    """In a gloo worker: every selected case of every file -> ``(outcome, detail)``."""
    sys.path.insert(0, str(Path(root) / _SRC))  # the checkout's megatron_fsdp
    import torch.distributed as dist

    modules = _modules(Path(root))
    fixtures = {"distributed_setup": DistributedSetup(rank, world_size, torch.device("cpu"))}
    results: dict[str, tuple[str, str]] = {}
    for name in SELECTED:
        path = Path(root) / _DIR / name
        namespace: dict[str, Any] = {"__name__": f"upstream_{path.stem}"}
        load_into(namespace, path, EDITS[name], modules)
        with substituted(modules):
            for function in functions(path.read_text(), name):
                for case, kwargs in expand(namespace[function]):
                    results[f"{name}::{case}"] = run_case(namespace[function], kwargs, fixtures)
                    dist.barrier()
    return results


def check_ranks(results: dict[str, list[tuple[str, str]]], case: str) -> None:
    """Passes when upstream's case passed on every rank; skips as upstream skipped it."""
    if case not in results:
        pytest.fail(f"{case} did not run in the workers (the case list and upstream disagree)")
    outcomes = results[case]
    failed = [
        f"rank {rank}:\n{detail}" for rank, (o, detail) in enumerate(outcomes) if o == "failed"
    ]
    if failed:
        pytest.fail("\n".join(failed), pytrace=False)
    if any(outcome == "skipped" for outcome, _ in outcomes):
        pytest.skip(f"upstream skips it: {outcomes[0][1]}")
    assert [outcome for outcome, _ in outcomes] == ["passed"] * len(outcomes)


def module_marks(name: str) -> list[Any]:
    """The ``pytestmark`` of the module that runs upstream file ``name``: distributed, slow,
    one xdist group, and a skip naming what is missing when the checkout cannot run it."""
    marks: list[Any] = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.xdist_group("mfsdp")]
    if file_path(name) is None:
        marks.append(
            pytest.mark.skip(
                reason=f"set {VARIABLE} to a Megatron-LM checkout to run its tests; "
                "tests/distributed/test_megatron_fsdp.py checks fully_shard_optimizer on the "
                "Megatron-FSDP release"
            )
        )
    elif needs_cuda():
        marks.append(
            pytest.mark.skip(
                reason="not runnable here: this checkout's Megatron-FSDP requires a CUDA device "
                "(fully_shard_context); check out 15d4b349de, megatron-fsdp 0.6.1's commit"
            )
        )
    return marks
