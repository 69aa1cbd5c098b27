"""mkdocs hooks for the wrapped_optim site (not a page; excluded from the docs).

- API pages (``docs/api/*.md``) whose ``::: wrapped_optim.<module>`` is not in the source tree
  are dropped from the nav and the build, so the site builds with ``--strict`` on any branch.
- Every ``docs/bench/<topic>.md`` (one benchmark topic's saved output) is listed under
  "Benchmarks", so new topics need no nav edit.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.hooks.wrapped_optim")

_DIRECTIVE = re.compile(r"^:::\s+([\w.]+)", re.MULTILINE)
_dropped: set[str] = set()


def _module_exists(root: Path, dotted: str) -> bool:
    path = root.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _page_is_available(docs_dir: Path, root: Path, page: str) -> bool:
    source = docs_dir / page
    if not page.startswith("api/") or not source.is_file():
        return True
    modules = _DIRECTIVE.findall(source.read_text(encoding="utf-8"))
    return all(_module_exists(root, m) for m in modules)


def _filter(items: list[Any], docs_dir: Path, root: Path) -> list[Any]:
    kept: list[Any] = []
    for item in items:
        if isinstance(item, dict):
            ((title, value),) = item.items()
            if isinstance(value, list):
                kept.append({title: _filter(value, docs_dir, root)})
            elif isinstance(value, str) and not _page_is_available(docs_dir, root, value):
                _dropped.add(value)
                log.info("API page %s skipped: its module is not in this source tree", value)
            else:
                kept.append(item)
        else:
            kept.append(item)
    return kept


def _title(page: Path) -> str:
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return page.stem.replace("_", " ")


def _add_bench_pages(items: list[Any], docs_dir: Path) -> None:
    pages = sorted((docs_dir / "bench").glob("*.md"))
    if not pages:
        return
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("Benchmarks"), list):
            section = item["Benchmarks"]
            listed = {v for entry in section if isinstance(entry, dict) for v in entry.values()}
            for page in pages:
                uri = f"bench/{page.name}"
                if uri not in listed:
                    section.append({_title(page): uri})
            return


def on_config(config: Any) -> Any:
    docs_dir = Path(config["docs_dir"])
    root = Path(config["config_file_path"]).parent
    _dropped.clear()
    if config["nav"]:
        config["nav"] = _filter(config["nav"], docs_dir, root)
        _add_bench_pages(config["nav"], docs_dir)
    return config


def on_files(files: Any, config: Any) -> Any:
    for uri in sorted(_dropped):
        page = files.get_file_from_path(uri)
        if page is not None:
            files.remove(page)
    return files
