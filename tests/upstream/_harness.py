"""Runs an upstream project's own test file against this project's re-implementations.

Nothing of upstream is stored here: the developer points an environment variable at a local
checkout (see docs/configuration.md, "Upstream test suites"), and the file is read from it,
retargeted and executed in the importing test module, so pytest collects upstream's tests
as ours. Retargeting is (1) import substitution through ``sys.modules`` and (2) a list of
textual edits, each with its reason; upstream's assertions are never edited. Every edit
must apply exactly once: when upstream changes, the run stops and says which edit to check.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest


@attrs.frozen
class Edit:
    """One textual change to the upstream file, with why it is needed."""

    old: str
    new: str
    reason: str
    count: int = 1  # how many places upstream has it


@attrs.frozen
class Expectation:
    """How one upstream test is expected to end here, when not by passing."""

    kind: str  # "xfail": a difference this project chooses; "skip": cannot run here
    reason: str


def checkout(variable: str, relative: str) -> Path | None:
    """The upstream file under the checkout ``variable`` names, or ``None`` when unset."""
    root = os.environ.get(variable)
    if not root:
        return None
    path = Path(root) / relative
    if not path.is_file():
        raise FileNotFoundError(
            f"{variable}={root!r} has no {relative}; point it at a checkout of the upstream "
            "repository (docs/configuration.md, 'Upstream test suites')"
        )
    return path


def retarget(source: str, edits: list[Edit], origin: Path) -> str:
    for edit in edits:
        count = source.count(edit.old)
        if count != edit.count:
            raise RuntimeError(
                f"{origin}: the edit for {edit.reason!r} matches {count} places (expected "
                f"{edit.count}); upstream changed: review the edit in tests/upstream"
            )
        source = source.replace(edit.old, edit.new)
    return source


def _package(name: str, attributes: Mapping[str, Any] | None = None) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []  # a package, so submodules resolve
    module.__dict__.update(attributes or {})
    return module


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


@contextmanager
def substituted(modules: Mapping[str, Mapping[str, Any]]) -> Iterator[None]:
    """Installs stand-in modules (name -> attributes) for the block, then restores.

    Parents are created as needed and linked as attributes, as an import would, so
    ``unittest.mock.patch("a.b.c.name")`` resolves them. A stand-in keeps its links after
    the block: code loaded inside it (``import a.b as m``; ``m.c``) still reaches them.
    """
    saved: dict[str, Any] = {}
    linked: list[tuple[Any, str, Any]] = []
    missing = object()
    names = set(modules)
    for name in list(names):
        parts = name.split(".")
        names.update(".".join(parts[:i]) for i in range(1, len(parts)))
    try:
        for name in sorted(names, key=lambda n: n.count(".")):
            if name not in modules and _importable(name):
                pass  # a real parent package (``megatron``) stays what it is
            else:
                saved[name] = sys.modules.get(name, missing)
                sys.modules[name] = _package(name, modules.get(name))
            parent, _, leaf = name.rpartition(".")
            if parent:
                owner = sys.modules[parent]
                if parent not in saved:  # a real module: unlink afterwards
                    linked.append((owner, leaf, getattr(owner, leaf, missing)))
                setattr(owner, leaf, sys.modules[name])
        yield
    finally:
        for owner, leaf, before in reversed(linked):
            if before is missing:
                delattr(owner, leaf)
            else:
                setattr(owner, leaf, before)
        for name, before in saved.items():
            if before is missing:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = before


def load_into(
    namespace: dict[str, Any],
    path: Path,
    edits: list[Edit],
    modules: Mapping[str, Mapping[str, Any]],
) -> None:
    """Executes the retargeted upstream file in ``namespace`` (a test module's globals)."""
    source = retarget(path.read_text(), edits, path)
    code = compile(source, str(path), "exec")
    with substituted(modules):
        exec(code, namespace)  # the developer's own checkout, by request


def mark_expected(items: list[pytest.Item]) -> None:
    """Marks each test its module's ``UPSTREAM_EXPECTED`` lists (``Class::test[params]``)."""
    for item in items:
        expected = getattr(getattr(item, "module", None), "UPSTREAM_EXPECTED", None)
        if not expected:
            continue
        entry = expected.get(item.nodeid.split("::", 1)[1])
        if entry is None:
            continue
        if entry.kind == "xfail":
            item.add_marker(pytest.mark.xfail(strict=True, reason=entry.reason))
        else:
            item.add_marker(pytest.mark.skip(reason=entry.reason))
