"""The public surface, listed once: every public module's ``__all__``, and nothing else public.

A user imports these names and the docs show them; everything else lives under an underscored
path (a private module or subpackage) and may change without notice; the benchmarks
(``wrapped-optim bench``) live in the private ``wrapped_optim._bench``.
Changing this list is changing the API: say so in CHANGELOG.md.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "wrapped_optim"

PUBLIC_API: dict[str, list[str]] = {
    "wrapped_optim": [
        "BuildConfig",
        "ConfigError",
        "FSDPAwareOptimizer",
        "FSDPConfig",
        "HybridConfig",
        "HybridOffloadOptimizer",
        "HybridSyncOptimizer",
        "LRScheduleConfig",
        "OptimizerCheckpointError",
        "OptimizerSpec",
        "OptimizerWrapper",
        "PrecisionAwareAdamW",
        "StackConfig",
        "StagedCheckpointOptimizer",
        "StagedConfig",
        "StaleMasterError",
        "__version__",
        "build_optimizer",
        "find_layer",
        "init_optimizer_state",
        "layers",
        "load_optimizer",
        "save_optimizer",
        "setup_optimizer",
        "unwrap",
        "wrap",
    ],
    "wrapped_optim.config": [
        "ConfigError",
        "FSDPConfig",
        "HybridConfig",
        "StackConfig",
        "StagedConfig",
    ],
    "wrapped_optim.wrapper": ["OptimizerWrapper"],
    "wrapped_optim.staged": ["StagedCheckpointOptimizer"],
    "wrapped_optim.hybrid": ["HybridSyncOptimizer", "StaleMasterError"],
    "wrapped_optim.fsdp": ["FSDPAwareOptimizer", "init_optimizer_state"],
    "wrapped_optim.stack": ["find_layer", "layers", "unwrap", "wrap"],
    "wrapped_optim.optimizers": [
        "HybridOffloadOptimizer",
        "PrecisionAwareAdamW",
        "TorchAdamFormatError",
        "from_torch_adam",
        "to_torch_adam",
    ],
    "wrapped_optim.optimizers.precision_adamw": [
        "PrecisionAwareAdamW",
        "kernel_step_copies",
        "kernel_steps_copy",
    ],
    "wrapped_optim.optimizers.hybrid_offload": ["HybridOffloadOptimizer"],
    "wrapped_optim.optimizers.kernels": ["cpu_kernel"],
    "wrapped_optim.optimizers.kernels.cpu_kernel": [
        "LOOP_FAMILIES",
        "status",
        "use_loops",
    ],
    "wrapped_optim.checkpoint": [
        "ConversionError",
        "OptimizerCheckpointError",
        "RollbackError",
        "StreamingLoadPlanner",
        "StreamingSavePlanner",
        "UndoJournalError",
        "convert",
        "load_optimizer",
        "names_from_model",
        "save_names",
        "save_optimizer",
    ],
    "wrapped_optim.compat": [
        "fully_shard_optimizer",
        "hybrid_optimizer_state_loading",
        "init_optimizer_state",
        "memory_efficient_fp32_optimizer_state_loading",
        "memory_efficient_precision_aware_optimizer_state_checkpointing",
        "sync_hybrid_device_optimizer_fp32_master_copies",
    ],
    "wrapped_optim.patching": ["ConcurrentPatchError", "patch_attribute"],
    "wrapped_optim.integrations": [],
    "wrapped_optim.integrations.bridge": [
        "OptimizerConfigOverrideProvider",
        "OptimizerConfigOverrideProviderContext",
        "SchedulerConfig",
        "setup_optimizer",
    ],
    "wrapped_optim.inspection": [
        "InspectError",
        "StateFormat",
        "format_report",
        "inspect_checkpoint",
    ],
    "wrapped_optim.testing": [
        "StateMismatchError",
        "assert_resume_equivalent",
        "assert_state_dict_equal",
        "assert_transparent",
        "checkpoint_roundtrip",
        "optimizer_params",
        "state_dict_differences",
        "synthetic_gradients",
    ],
    "wrapped_optim.testing.strategies": [
        "available_optimizer_kinds",
        "group_options",
        "optimizer_configs",
        "param_sets",
        "setups",
        "shapes",
        "stack_configs",
    ],
    "wrapped_optim.testing.faults": ["COMMIT_CRASH_POINTS", "crash_save_at"],
    "wrapped_optim.testing.hostile": ["HOSTILE_CHECKPOINTS", "HOSTILE_SAVE_TARGETS"],
    "wrapped_optim.testing.probe": [
        "DeviceMemoryProbe",
        "count_unstaged_expansions",
        "device_ledger",
    ],
}


def _package_modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


@pytest.mark.parametrize("module", sorted(PUBLIC_API))
def test_each_public_module_exports_exactly_its_public_names(module: str) -> None:
    imported = importlib.import_module(module)
    assert sorted(imported.__all__) == sorted(PUBLIC_API[module])
    for name in PUBLIC_API[module]:
        assert hasattr(imported, name), f"{module}.{name} is in __all__ but does not import"


@pytest.mark.parametrize("module", sorted(PUBLIC_API))
def test_no_public_module_resolves_names_lazily(module: str) -> None:
    """A module-level ``__getattr__`` is how moved-name redirects come back: none, except the
    package root's, which imports its own public names on first use (so ``import
    wrapped_optim`` and ``wrapped-optim --version`` import no torch); it redirects nothing:
    each name comes from a module that lists it in its own ``__all__``."""
    tree = ast.parse(_package_modules()[module].read_text())
    lazy = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "__getattr__"]
    if module != "wrapped_optim":
        assert lazy == []
        return
    import wrapped_optim

    sources = wrapped_optim._SOURCES  # the root's own table, read by its test
    assert set(sources) == set(PUBLIC_API[module]) - {"__version__"}
    for name, source in sources.items():
        assert name in importlib.import_module(f"wrapped_optim.{source}").__all__, name


def test_every_other_module_is_private() -> None:
    """Outside the public modules, a path component is private."""
    public_paths = [
        module
        for module in _package_modules()
        if module not in PUBLIC_API and not any(part.startswith("_") for part in module.split("."))
    ]
    assert public_paths == [], (
        f"{public_paths} are importable without an underscore: list them (and their names) in "
        "PUBLIC_API here and in CHANGELOG.md, or make the module private (_name.py)"
    )


def test_every_public_module_exists() -> None:
    assert set(PUBLIC_API) <= set(_package_modules())


_IMPORT = re.compile(r"^[ \t>.]*from (wrapped_optim[\w.]*) import (\([^)]*\)|[^\n]*)", re.MULTILINE)


def _shown_imports() -> list[tuple[str, str, str]]:
    """``(file, module, name)`` of every ``from wrapped_optim... import name`` the docs show."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    files += sorted((ROOT / "docs").rglob("*.py"))
    shown = []
    for path in files:
        for match in _IMPORT.finditer(path.read_text()):
            names = re.sub(r"#[^\n]*", "", match.group(2)).strip("()")
            for item in names.replace("\n", " ").split(","):
                name = item.split(" as ")[0].strip()
                if name:
                    shown.append((str(path.relative_to(ROOT)), match.group(1), name))
    return shown


def test_the_docs_show_imports() -> None:
    assert len(_shown_imports()) > 20  # the pattern still finds them


@pytest.mark.parametrize(("where", "module", "name"), _shown_imports())
def test_every_import_the_docs_show_works_and_is_public(where: str, module: str, name: str) -> None:
    imported = importlib.import_module(module)
    assert hasattr(imported, name), f"{where}: from {module} import {name} fails"
    assert module in PUBLIC_API, f"{where} imports from {module}, which is not public"
    assert name in PUBLIC_API[module] or f"{module}.{name}" in PUBLIC_API, (
        f"{where} shows {module}.{name}, which is not in the public API"
    )


#: The most names the public surface may hold: it fits on a page.
MAX_PUBLIC_NAMES = 80


def _surface_of(modules: dict[str, ModuleType]) -> dict[tuple[str, int], list[str]]:
    """``(name, id(object)) -> [modules exporting it]`` over the modules' ``__all__``: a name
    the package root re-exports is one entry, two objects under one name are two."""
    surface: dict[tuple[str, int], list[str]] = {}
    for module_name, module in modules.items():
        for name in getattr(module, "__all__", []):
            surface.setdefault((name, id(getattr(module, name))), []).append(module_name)
    return surface


def _public_surface() -> dict[tuple[str, int], list[str]]:
    """Every public module's names, found by walking the package (a module is public when no
    path component starts with ``_``), not read from :data:`PUBLIC_API`."""
    public = sorted(
        module
        for module in _package_modules()
        if not any(part.startswith("_") for part in module.split("."))
    )
    return _surface_of({module: importlib.import_module(module) for module in public})


def test_the_surface_counts_objects_a_reexport_once_a_shared_name_twice() -> None:
    home, root, other = (ModuleType(name) for name in ("pkg.home", "pkg", "pkg.other"))
    home.Spec = root.Spec = type("Spec", (), {})  # type: ignore[attr-defined]
    other.Spec = type("Spec", (), {})  # type: ignore[attr-defined]
    for module in (home, root, other):
        module.__all__ = ["Spec"]  # type: ignore[attr-defined]
    surface = _surface_of({"pkg.home": home, "pkg": root, "pkg.other": other})
    assert sorted(surface.values()) == [["pkg.home", "pkg"], ["pkg.other"]]


def test_the_public_surface_fits_on_a_page() -> None:
    surface = _public_surface()
    assert ("wrap", id(importlib.import_module("wrapped_optim.stack").wrap)) in surface
    listing = "\n".join(
        f"{name:<48} {', '.join(modules)}" for (name, _), modules in sorted(surface.items())
    )
    assert len(surface) <= MAX_PUBLIC_NAMES, (
        f"{len(surface)} public names (at most {MAX_PUBLIC_NAMES}); make plumbing private:\n"
        + listing
    )
