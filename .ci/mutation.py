"""Mutation testing of one core module against the tests that cover it (mutmut).

    python .ci/mutation.py MODULE [--max-children N]
    python .ci/mutation.py --list

MODULE is a key of ``MODULES`` (``_rollback``, ``checkpoint``, ...). The tracked files are
copied into ``.mutation/MODULE`` (git-ignored), a ``[tool.mutmut]`` section naming the module
and its tests is appended to that copy's pyproject.toml, and ``mutmut run`` mutates only
that module and runs only those tests. Results stay in ``.mutation/MODULE/mutants``: inspect
survivors there with ``mutmut results`` and ``mutmut show NAME``. Needs the ``mutation``
extra (``pip install -e '.[mutation]' torch==2.13.0``). See docs/contributing/mutation.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHECKPOINT_TESTS = [
    "tests/checkpoint/test_checkpoint.py",
    "tests/checkpoint/test_checkpoint_atomic.py",
    "tests/checkpoint/test_undo_journal.py",
    "tests/checkpoint/test_load_rollback_options.py",
    "tests/checkpoint/test_resume_hyperparameters.py",
    "tests/formats/test_load_limits.py",
    "tests/checkpoint/test_load_regressions.py",
    "tests/checkpoint/test_checkpoint_faults.py",
    "tests/checkpoint/test_checkpoint_common.py",
    "tests/checkpoint/test_checkpoint_pinned.py",
    "tests/checkpoint/test_checkpoint_commit.py",
    "tests/checkpoint/test_checkpoint_undo.py",
    "tests/checkpoint/test_checkpoint_deferred.py",
]

# module -> (the files mutmut mutates, the tests that cover them)
MODULES: dict[str, tuple[list[str], list[str]]] = {
    "wrapper": (
        ["wrapped_optim/wrapper.py"],
        ["tests/wrappers/test_wrapper.py", "tests/wrappers/test_stack.py"],
    ),
    "staged": (
        ["wrapped_optim/staged.py"],
        ["tests/wrappers/test_staged.py", "tests/wrappers/test_staged_megatron_calls.py"],
    ),
    "hybrid": (
        ["wrapped_optim/hybrid.py"],
        [
            "tests/wrappers/test_hybrid_sync.py",
            "tests/wrappers/test_hybrid_sync_calls.py",
            "tests/wrappers/test_stale_copies.py",
            "tests/wrappers/test_stale_watch.py",
        ],
    ),
    "fsdp": (
        ["wrapped_optim/fsdp.py"],
        ["tests/wrappers/test_fsdp.py", "tests/wrappers/test_fsdp_dtensor_grads.py"],
    ),
    "stack": (
        ["wrapped_optim/stack.py"],
        [
            "tests/wrappers/test_stack.py",
            "tests/wrappers/test_wrapper.py",
            *(
                f"tests/config/test_builder.py::test_{name}"
                for name in (
                    "wrap_plain_optimizer_is_identity",
                    "wrap_builds_canonical_order_with_options",
                    "wrap_refuses_a_hybrid_layer_with_nothing_to_sync",
                    "wrap_derives_from_the_optimizer",
                    "wrap_derives_inside_megatron_containers",
                    "rewrap_never_doubles_and_keeps_options",
                )
            ),
        ],
    ),
    "checkpoint": (["wrapped_optim/checkpoint/*.py"], CHECKPOINT_TESTS),
    # The same package one file at a time, each against the fast tests that check that file
    # (the whole package's run takes hours on a shared two-core box). Slow ones stay out: the
    # hostile-timing, killed-process and compiled-step tests (a survivor reruns them all).
    "checkpoint._common": (
        ["wrapped_optim/checkpoint/_common.py"],
        [
            "tests/checkpoint/test_checkpoint_common.py",
            "tests/checkpoint/test_checkpoint_faults.py",
        ],
    ),
    "checkpoint._commit": (
        ["wrapped_optim/checkpoint/_commit.py"],
        [
            "tests/checkpoint/test_checkpoint_commit.py",
            "tests/checkpoint/test_checkpoint_faults.py",
            # Three real gloo processes (about 8 s): a subgroup that leaves out rank 0.
            "tests/checkpoint/test_checkpoint_commit_subgroup.py",
        ],
    ),
    "checkpoint._undo": (
        ["wrapped_optim/checkpoint/_undo.py"],
        ["tests/checkpoint/test_checkpoint_undo.py", "tests/checkpoint/test_checkpoint_faults.py"],
    ),
    "checkpoint._pinned": (
        ["wrapped_optim/checkpoint/_pinned.py"],
        [
            "tests/checkpoint/test_checkpoint_pinned.py",
            "tests/checkpoint/test_checkpoint_faults.py",
        ],
    ),
    "checkpoint._deferred": (
        ["wrapped_optim/checkpoint/_deferred.py"],
        [
            "tests/checkpoint/test_checkpoint_deferred.py",
            "tests/checkpoint/test_checkpoint_faults.py",
        ],
    ),
    "checkpoint._journal": (
        ["wrapped_optim/checkpoint/_journal.py"],
        ["tests/checkpoint/test_undo_journal.py"],
    ),
    "checkpoint._save": (
        ["wrapped_optim/checkpoint/_save.py"],
        [
            "tests/checkpoint/test_checkpoint_save.py",
            "tests/checkpoint/test_checkpoint_save_shards.py",
            # Two real gloo processes (about 4 s): a save in a subgroup, told from the world.
            "tests/checkpoint/test_checkpoint_save_subgroup.py",
            "tests/checkpoint/test_checkpoint_faults.py",
            "tests/checkpoint/test_checkpoint_atomic.py",
            "tests/checkpoint/test_checkpoint.py",
        ],
    ),
    "checkpoint._load": (
        ["wrapped_optim/checkpoint/_load.py"],
        [
            "tests/checkpoint/test_checkpoint_load.py",
            "tests/checkpoint/test_checkpoint.py",
            "tests/checkpoint/test_checkpoint_faults.py",
            "tests/checkpoint/test_checkpoint_atomic.py",
            "tests/checkpoint/test_load_rollback_options.py",
            *(
                f"tests/checkpoint/test_load_regressions.py::test_load_optimizer_{name}"
                for name in (
                    "rejects_a_negative_second_moment",
                    "rejects_a_group_without_lr",
                    "rejects_a_nan_lr",
                    "reads_back_a_tensor_lr",
                    "rejects_a_nan_tensor_lr_read_from_the_checkpoint",
                )
            ),
            "tests/checkpoint/test_load_regressions.py"
            "::test_bad_tensor_param_steps_are_rejected_by_hybrid_and_streaming",
            "tests/checkpoint/test_resume_hyperparameters.py"
            "::test_dcp_load_resumes_into_other_hyper_parameters",
        ],
    ),
    "_staging": (
        # The ledger has its own entry (its process-wide instance is built at import).
        ["wrapped_optim/_staging/engine.py", "wrapped_optim/_staging/buffers.py"],
        [
            "tests/wrappers/test_staged.py",
            "tests/wrappers/test_staged_host_chunks.py",
            "tests/optimizers/hybrid_offload/test_transfers.py",
            "tests/staging/test_staging_buffers.py",
            "tests/staging/test_staging_device_state.py",
            "tests/staging/test_staging_engine_edges.py",
        ],
    ),
    "_staging.ledger": (
        ["wrapped_optim/_staging/ledger.py"],
        [
            "tests/wrappers/test_staged.py::test_probe_counts_only_its_own_block",
            "tests/staging/test_device_ledger.py",
        ],
    ),
    "_adapters.hybrid": (
        ["wrapped_optim/_adapters/hybrid.py"],
        [
            "tests/wrappers/test_hybrid_payloads.py",
            "tests/adapters/test_hybrid_layouts.py",
            "tests/wrappers/test_hybrid_sync.py",
            "tests/wrappers/test_hybrid_sync_calls.py",
            "tests/wrappers/test_stale_copies.py",
            "tests/wrappers/test_stale_watch.py",
        ],
    ),
    "_rollback": (
        ["wrapped_optim/_rollback.py"],
        [
            "tests/test_rollback.py",
            "tests/test_rollback_mutants.py",
            "tests/checkpoint/test_load_rollback_options.py",
        ],
    ),
}

PYTEST_ARGS = [
    "--hypothesis-seed=0",
    "-p",
    "no:cacheprovider",
    "-q",
    "-o",
    "addopts=",
    "-p",
    "no:logging",
    "-W",
    "ignore",
]


def _workdir(module: str) -> Path:
    work = ROOT / ".mutation" / module
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    # Tracked files and new ones not yet committed (a test being written), never ignored ones.
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    for name in files:
        if not (ROOT / name).is_file():  # deleted in the work tree, not yet committed
            continue
        target = work / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    return work


def _configure(work: Path, mutate: list[str], tests: list[str]) -> None:
    section = {
        "source_paths": ["wrapped_optim"],
        "only_mutate": mutate,
        "pytest_add_cli_args": PYTEST_ARGS,
        "pytest_add_cli_args_test_selection": tests,
    }
    lines = ["", "[tool.mutmut]"] + [
        f"{key} = {json.dumps(value)}" for key, value in section.items()
    ]
    with (work / "pyproject.toml").open("a") as pyproject:
        pyproject.write("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("module", nargs="?", choices=sorted(MODULES))
    parser.add_argument("--list", action="store_true", help="print the module -> tests map")
    parser.add_argument("--max-children", type=int, default=1)
    args = parser.parse_args()
    if args.list or args.module is None:
        for module, (mutate, tests) in MODULES.items():
            print(f"{module}: {' '.join(mutate)} <- {' '.join(tests)}")
        return 0
    mutate, tests = MODULES[args.module]
    work = _workdir(args.module)
    _configure(work, mutate, tests)
    mutmut = [sys.executable, "-m", "mutmut"]
    env = dict(os.environ)
    env.setdefault("WRAPPED_OPTIM_KERNEL_CACHE", str(ROOT / ".mutation" / "kernel"))
    run = subprocess.run(
        [*mutmut, "run", "--max-children", str(args.max_children)], cwd=work, env=env
    )
    subprocess.run([*mutmut, "export-cicd-stats"], cwd=work, env=env, check=False)
    stats_file = work / "mutants" / "mutmut-cicd-stats.json"
    if run.returncode == 0 and stats_file.exists():
        stats = json.loads(stats_file.read_text())
        killed, total = stats.get("killed", 0), stats.get("total", 0)
        score = f"{100 * killed / total:.1f}%" if total else "n/a"
        print(f"{args.module}: {killed}/{total} mutants killed ({score}); {json.dumps(stats)}")
    subprocess.run([*mutmut, "results"], cwd=work, env=env, check=False)
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
