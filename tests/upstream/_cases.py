"""Upstream test functions as named cases, run by hand where pytest cannot collect them.

Megatron-FSDP's tests run under torchrun (one pytest per rank); here they run inside spawned
gloo workers, which call each upstream function directly. These helpers name the cases the
way pytest does (``test[id1-id2]``, the decorator nearest the function first) from the
source alone (``ast``, so the pytest process need not import upstream's package), and expand
the same cases from the loaded functions' ``parametrize`` marks in the workers.
"""

from __future__ import annotations

import ast
import itertools
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest


def _value_id(value: Any, argname: str, index: int) -> str:
    if value is None or isinstance(value, (bool, int, float, str)):
        return str(value)
    return f"{argname}{index}"


def _mark_ids(argnames: str, values: list[Any], ids: list[str] | None) -> list[str]:
    if ids is not None:
        return list(ids)
    names = [name.strip() for name in argnames.split(",")]
    out = []
    for index, value in enumerate(values):
        parts = value if len(names) > 1 else (value,)
        out.append("-".join(_value_id(v, n, index) for v, n in zip(parts, names, strict=True)))
    return out


def names_in_source(source: str, functions: list[str]) -> list[str]:
    """The case names of ``functions`` in ``source``, as pytest would id them."""
    found: dict[str, list[str]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.FunctionDef) or node.name not in functions:
            continue
        id_lists = []
        for decorator in reversed(node.decorator_list):  # nearest the function first
            if not (
                isinstance(decorator, ast.Call)
                and ast.unparse(decorator.func).endswith("parametrize")
            ):
                continue
            argnames = ast.literal_eval(decorator.args[0])
            keywords = {k.arg: k.value for k in decorator.keywords}
            ids = ast.literal_eval(keywords["ids"]) if "ids" in keywords else None
            values = (
                list(range(len(ids))) if ids is not None else ast.literal_eval(decorator.args[1])
            )
            id_lists.append(_mark_ids(argnames, values, ids))
        found[node.name] = [
            f"{node.name}[{'-'.join(combo)}]" if combo else node.name
            for combo in itertools.product(*id_lists)
        ]
    missing = [name for name in functions if name not in found]
    if missing:
        raise RuntimeError(f"upstream no longer has {missing}; review tests/upstream")
    return [case for name in functions for case in found[name]]


def expand(function: Callable[..., Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(case name, parameter values)`` for each case of a loaded upstream function."""
    axes = []
    for mark in getattr(function, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        argnames, values = mark.args[0], list(mark.args[1])
        names = [name.strip() for name in argnames.split(",")]
        ids = _mark_ids(argnames, values, mark.kwargs.get("ids"))
        axes.append(
            [
                (ident, dict(zip(names, value if len(names) > 1 else (value,), strict=True)))
                for ident, value in zip(ids, values, strict=True)
            ]
        )
    for combo in itertools.product(*axes):
        kwargs: dict[str, Any] = {}
        for _, values in combo:
            kwargs.update(values)
        ident = "-".join(ident for ident, _ in combo)
        yield (f"{function.__name__}[{ident}]" if combo else function.__name__), kwargs


def run_case(
    function: Callable[..., Any], kwargs: dict[str, Any], fixtures: dict[str, Any]
) -> tuple[str, str]:
    """Calls one case; ``(outcome, detail)`` with outcome ``passed``/``failed``/``skipped``."""
    wanted = function.__code__.co_varnames[: function.__code__.co_argcount]
    with pytest.MonkeyPatch.context() as monkeypatch:
        available = {**fixtures, "monkeypatch": monkeypatch, **kwargs}
        try:
            function(**{name: available[name] for name in wanted})
        except pytest.skip.Exception as skipped:
            return "skipped", str(skipped)
        except BaseException:  # reported to the pytest process
            return "failed", traceback.format_exc(limit=-4)
    return "passed", ""
