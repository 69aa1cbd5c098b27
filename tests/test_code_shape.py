"""The shape the package keeps, checked like any other contract.

* no import cycle among its modules, counting the imports under ``if TYPE_CHECKING:``;
* no module reads or writes another object's ``_private`` attribute (``self``, ``cls`` and
  ``super()`` are the only owners it may reach through), except the foreign (torch, os,
  Triton) names listed in :data:`FOREIGN_PRIVATES`, each with its reason;
* no function over :data:`MAX_FUNCTION_LINES` lines of code (its docstring not counted)
  outside the benchmarks and the demo.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "wrapped_optim"

MAX_FUNCTION_LINES = 100

#: Private attributes of foreign objects the package may use, each with why.
FOREIGN_PRIVATES = {
    "_foreach_add_": "torch._foreach_add_: the multi-tensor op torch.optim's own steps call",
    "_foreach_copy_": "torch._foreach_copy_: the multi-tensor copy torch.optim's steps call",
    "_fused_adam_": "torch._fused_adam_: torch's fused Adam kernel, given our operands",
    "_fused_adamw_": "torch._fused_adamw_: torch's fused AdamW kernel, given our operands",
    "_optimizer_state_dict_pre_hooks": "torch.optim.Optimizer's hook registry: fired as torch does",
    "_optimizer_state_dict_post_hooks": "torch.optim.Optimizer's hook registry, likewise",
    "_optimizer_load_state_dict_pre_hooks": "torch.optim.Optimizer's hook registry, likewise",
    "_optimizer_load_state_dict_post_hooks": "torch.optim.Optimizer's hook registry, likewise",
    "_version": "Tensor._version: torch's in-place write counter (tells a written tensor)",
    "_base": "Tensor._base: the tensor a view was taken of (None for a base)",
    "_exit": "os._exit: ends a deliberately crashed save's process without clean-up",
    "_elementwise_max": "triton.language.standard._elementwise_max: Triton's max combiner",
}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _where(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# ----------------------------------------------------------------------------------------
# Import cycles
# ----------------------------------------------------------------------------------------
def _imports(source: str, module: str, modules: set[str], is_package: bool = False) -> set[str]:
    """The package modules ``module`` imports when loaded or type-checked: module level,
    including ``if``/``try`` blocks and ``if TYPE_CHECKING:`` (not function bodies)."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                for alias in node.names:
                    found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)

    visit(ast.parse(source).body)
    return found & modules


def _modules_in_cycles() -> set[str]:
    paths = _modules()
    # The package __init__ runs before any submodule anyway: edges into it are not cycles.
    graph = {
        name: _imports(path.read_text(), name, set(paths), path.name == "__init__.py")
        - {name, "wrapped_optim"}
        for name, path in paths.items()
    }

    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        todo = list(graph[start])
        while todo:
            node = todo.pop()
            if node not in seen:
                seen.add(node)
                todo.extend(graph[node])
        return seen

    return {name for name in graph if name in reach(name)}


def test_the_import_walk_sees_type_checking_imports() -> None:
    source = "if TYPE_CHECKING:\n    from . import stack\nelse:\n    import wrapped_optim.fsdp\n"
    modules = {"wrapped_optim.stack", "wrapped_optim.fsdp", "wrapped_optim.config"}
    assert _imports(source, "wrapped_optim.config", modules) == modules - {"wrapped_optim.config"}


def test_no_import_cycle_among_the_package_modules_even_under_type_checking() -> None:
    assert sorted(_modules_in_cycles()) == []


# ----------------------------------------------------------------------------------------
# Private attributes
# ----------------------------------------------------------------------------------------
def _is_own(owner: ast.expr) -> bool:
    if isinstance(owner, ast.Name):
        return owner.id in ("self", "cls")
    return (
        isinstance(owner, ast.Call)
        and isinstance(owner.func, ast.Name)
        and owner.func.id == "super"
    )


def _private_reaches(tree: ast.AST) -> Iterator[str]:
    """Every ``x._name`` (not a dunder) whose ``x`` is not ``self``, ``cls`` or ``super()``."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and not _is_own(node.value)
        ):
            yield node.attr


def _private_reaches_in_package() -> set[tuple[str, str]]:
    return {
        (_where(path), attr)
        for path in _modules().values()
        for attr in _private_reaches(ast.parse(path.read_text()))
    }


def test_the_private_rule_flags_foreign_owners_only() -> None:
    source = "self._a; cls._b; super()._c; other._d; self.x._e; f()._g; obj.__dict__"
    assert sorted(_private_reaches(ast.parse(source))) == ["_d", "_e", "_g"]


def test_no_module_reaches_into_another_objects_private_attributes() -> None:
    reaches = {(where, attr) for where, attr in _private_reaches_in_package()}
    offenders = {(where, attr) for where, attr in reaches if attr not in FOREIGN_PRIVATES}
    assert sorted(offenders) == [], (
        "pass explicit operands (or call a public method) instead of reading another object's "
        "private attribute; a foreign library's private needs an entry in FOREIGN_PRIVATES"
    )


def _own_attribute_names() -> set[str]:
    """The attributes this package's classes define: class-body names, ``self._x = ...``."""
    names: set[str] = set()
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for member in node.body:
                    if isinstance(member, ast.FunctionDef | ast.AsyncFunctionDef):
                        names.add(member.name)
                    elif isinstance(member, ast.Assign):
                        names.update(t.id for t in member.targets if isinstance(t, ast.Name))
                    elif isinstance(member, ast.AnnAssign) and isinstance(member.target, ast.Name):
                        names.add(member.target.id)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and _is_own(node.value)
            ):
                names.add(node.attr)
    return names


def test_the_allowed_foreign_privates_are_foreign_and_used() -> None:
    used = {attr for _, attr in _private_reaches_in_package()}
    assert sorted(set(FOREIGN_PRIVATES) - used) == [], "no longer used: drop from FOREIGN_PRIVATES"
    assert sorted(set(FOREIGN_PRIVATES) & _own_attribute_names()) == [], "ours, not foreign"
    assert all(reason.strip() for reason in FOREIGN_PRIVATES.values())


# ----------------------------------------------------------------------------------------
# Function length
# ----------------------------------------------------------------------------------------
def _code_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from ``def`` to the function's end, less its docstring."""
    assert function.end_lineno is not None
    lines = function.end_lineno - function.lineno + 1
    first = function.body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
        and first.end_lineno is not None
    ):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, int]]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield prefix + node.name, _code_lines(node)
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def _exempt_from_length(path: Path) -> bool:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] == "_bench" or parts[0] in ("_demo.py", "_demo_model.py")


def test_the_length_rule_counts_code_not_docstrings() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(3))
    source = f'class A:\n    def f(self):\n        """Doc\n\n        more."""\n{body}\n'
    source = source.replace("\n    x", "\n        x")
    assert list(_functions(ast.parse(source))) == [("A.f", 4)]


def test_no_function_is_over_the_length_limit() -> None:
    long = {
        f"{_where(path)}:{name}"
        for path in _modules().values()
        if not _exempt_from_length(path)
        for name, lines in _functions(ast.parse(path.read_text()))
        if lines > MAX_FUNCTION_LINES
    }
    assert sorted(long) == [], (
        f"functions over {MAX_FUNCTION_LINES} lines: split them into named steps"
    )


# ----------------------------------------------------------------------------------------
# Faces
# ----------------------------------------------------------------------------------------
#: Imports of another package's private module the package keeps, each with why.
CROSSINGS: dict[tuple[str, str], str] = {}


def _owner(module: str) -> str | None:
    """The package whose plumbing ``module`` is: the path before its first private part
    (None for a public module). Everything inside that package may import it: the top
    level's private modules (``_formats``, ``_adapters``, ``_rollback``, ...) are the floor
    every package stands on, ``optimizers/_step_checks.py`` the optimizers' floor."""
    parts = module.split(".")
    for index, part in enumerate(parts):
        if part.startswith("_"):
            return ".".join(parts[:index])
    return None


def _crossings() -> set[tuple[str, str]]:
    paths = _modules()
    found = set()
    for name, path in paths.items():
        for imported in _imports(path.read_text(), name, set(paths), path.name == "__init__.py"):
            owner = _owner(imported)
            if owner is not None and name != owner and not name.startswith(owner + "."):
                found.add((name, imported))
    return found


def test_the_face_rule_tells_plumbing_from_floor() -> None:
    assert _owner("wrapped_optim.optimizers.precision_adamw._step") == (
        "wrapped_optim.optimizers.precision_adamw"
    )
    assert _owner("wrapped_optim._formats.codecs") == "wrapped_optim"
    assert _owner("wrapped_optim.optimizers.kernels.cpu_kernel") is None


def test_packages_meet_through_their_faces() -> None:
    """No module imports another package's private module (its plumbing): the optimizer
    families reach each other and the kernels through the faces, and the kernels import
    neither family."""
    assert sorted(_crossings() - set(CROSSINGS)) == []
    assert sorted(set(CROSSINGS) - _crossings()) == []  # a crossing gone leaves the list


def test_the_kernels_know_no_optimizer() -> None:
    paths = _modules()
    kernels = "wrapped_optim.optimizers.kernels"
    families = (
        "wrapped_optim.optimizers.precision_adamw",
        "wrapped_optim.optimizers.hybrid_offload",
    )
    imported = {
        target
        for name, path in paths.items()
        if name == kernels or name.startswith(kernels + ".")
        for target in _imports(path.read_text(), name, set(paths), path.name == "__init__.py")
    }
    assert sorted(t for t in imported if t.startswith(families)) == []
