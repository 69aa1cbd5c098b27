"""What ``wrapped-optim bench`` needs before it measures anything: the topics, their one-line
summaries and the command's options. No torch here, so building the command line (and
``wrapped-optim --version``) stays fast.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import pkgutil
import re
import sys
from pathlib import Path

PACKAGE = "wrapped_optim._bench"
#: Where ``wrapped-optim bench`` writes when ``--out`` is not given (relative to the cwd).
DEFAULT_OUT = "wrapped-optim-bench"


def discover_topics(package: str = PACKAGE) -> list[str]:
    """The benchmark topics of ``package``: every module but ``report`` and ``gpu_*``.

    Example:
        >>> from wrapped_optim._bench._topics import discover_topics
        >>> "report" in discover_topics()
        False
    """
    module = importlib.import_module(package)
    return sorted(
        info.name
        for info in pkgutil.iter_modules(module.__path__)
        if is_topic_name(info.name) and not info.ispkg
    )


def topic_summaries(package: str = PACKAGE) -> list[tuple[str, str]]:
    """``(topic, first line of its docstring)`` for every topic, read without importing it.

    Example:
        >>> from wrapped_optim._bench._topics import topic_summaries
        >>> dict(topic_summaries())["staged"].startswith("Benchmark: extra device memory")
        True
    """
    summaries = []
    for topic in discover_topics(package):
        name = f"{package}.{topic}"
        doc = sys.modules[name].__doc__ if name in sys.modules else _docstring_on_disk(name)
        paragraph = " ".join((doc or "").split("\n\n")[0].split())
        sentence = re.split(r"(?<=[.?!])\s", paragraph)[0]
        summaries.append((topic, sentence.replace("``", "")))
    return summaries


def _docstring_on_disk(module: str) -> str | None:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    return ast.get_docstring(ast.parse(Path(spec.origin).read_text()))


def is_topic_name(name: str) -> bool:
    """Whether a module of the bench package named ``name`` is a topic.

    Example:
        >>> is_topic_name("staged"), is_topic_name("report"), is_topic_name("gpu_all")
        (True, False, False)
    """
    return name != "report" and not name.startswith(("gpu_", "_"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the bench options (``TOPIC...``, ``--quick``, ``--only``, ``--out``,
    ``--no-plots``, ``--replot``) to a parser.

    Example:
        >>> import argparse
        >>> from wrapped_optim._bench._topics import add_arguments
        >>> parser = argparse.ArgumentParser()
        >>> add_arguments(parser)
        >>> args = parser.parse_args(["--quick", "--only", "a", "b", "--only", "c"])
        >>> args.quick, args.only, args.out
        (True, ['a', 'b', 'c'], 'wrapped-optim-bench')
        >>> parser.parse_args(["precision_adam", "--out", "docs"]).topics
        ['precision_adam']
    """
    parser.add_argument(
        "topics", nargs="*", metavar="TOPIC", help="run only these topics (default: all)"
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument(
        "--only",
        nargs="+",
        action="extend",
        metavar="TOPIC",
        help="run only these topics (repeatable; default: all)",
    )
    parser.add_argument(
        "--out",
        default=DEFAULT_OUT,
        help=f"folder for benchmarks.md, bench/ and img/ (default: ./{DEFAULT_OUT}; the "
        "project's docs: --out docs)",
    )
    parser.add_argument("--no-plots", action="store_true", help="do not draw figures")
    parser.add_argument(
        "--replot",
        action="store_true",
        help="measure nothing: remake the pages, headlines and figures from the rows an "
        "earlier run kept in <out>/bench/<topic>.json",
    )
