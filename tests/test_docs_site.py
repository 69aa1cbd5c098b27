"""The documentation site as a reader gets it: highlighted code without a network, the pages a
newcomer looks for linked from the front, and user pages free of the project's issue numbers."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _mkdocs() -> dict[str, Any]:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert isinstance(config, dict)
    return config


def _extension(config: dict[str, Any], name: str) -> dict[str, Any] | None:
    for entry in config["markdown_extensions"]:
        if entry == name:
            return {}
        if isinstance(entry, dict) and name in entry:
            return entry[name] or {}
    return None


def test_code_is_highlighted_at_build_time_with_nothing_from_a_cdn() -> None:
    config = _mkdocs()
    assert config["theme"].get("highlightjs") is False, "highlight.js loads from a CDN"
    highlight = _extension(config, "pymdownx.highlight")
    assert highlight is not None and highlight.get("use_pygments", True) is True
    for asset in [*config.get("extra_css", []), *config.get("extra_javascript", [])]:
        assert "//" not in asset, f"{asset} is fetched from the network"
        assert (ROOT / "docs" / asset).is_file(), f"{asset} is not in docs/"
    styles = (ROOT / "docs" / "css" / "pygments.css").read_text()
    assert "css/pygments.css" in config["extra_css"] and ".highlight .k " in styles


def test_a_python_block_renders_with_pygments_classes() -> None:
    markdown = pytest.importorskip("markdown", reason="the docs extra builds the site")
    html = markdown.markdown(
        "```python\nimport torch\n```\n",
        extensions=["pymdownx.superfences", "pymdownx.highlight"],
        extension_configs={"pymdownx.highlight": {"use_pygments": True}},
    )
    assert '<span class="kn">import</span>' in html


def _nav_pages(entries: list[Any]) -> list[str]:
    pages = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages.extend(_nav_pages(value) if isinstance(value, list) else [value])
    return pages


def test_switching_from_adamw_is_a_page_the_front_pages_link() -> None:
    assert "migrating.md" in _nav_pages(_mkdocs()["nav"])
    assert "(migrating.md)" in (ROOT / "docs" / "index.md").read_text()
    assert "(docs/migrating.md)" in (ROOT / "README.md").read_text()
    assert (
        "## Switching from"
        not in (ROOT / "docs" / "precision_adam.md")
        .read_text()
        .split("## Switching from `torch.optim.AdamW`")[1]
    ), "the migration text lives on its own page, precision_adam.md only points to it"


# A reference to an upstream project's tracker names the project ("Megatron-LM #5071",
# "NeMo-RL #2371/#2372"); the project's own issues are not for users' pages.
_ISSUE_WORDS = re.compile(r"\bissues?\s+#?\d+|\(issues?\b", re.IGNORECASE)
_NUMBER = re.compile(r"#\d+")
# The upstream trackers the pages cite; "NeMo-RL #2371/#2372" chains with a slash.
_UPSTREAM_PROJECTS = ("Megatron-LM", "Megatron-Bridge", "NeMo-RL", "pytorch", "TE", "verl",
                      "torchtitan", "prime-rl", "SkyRL", "DeepSpeed", "torchao")  # fmt: skip
_UPSTREAM = re.compile(rf"(\b({'|'.join(map(re.escape, _UPSTREAM_PROJECTS))}) |/)$")


def issue_references(text: str) -> list[str]:
    """The project-issue references in ``text``: "issue 29", "(issues ...", a bare "#38"."""
    found = [m.group(0) for m in _ISSUE_WORDS.finditer(text)]
    for match in _NUMBER.finditer(text):
        if not _UPSTREAM.search(text[max(0, match.start() - 40) : match.start()]):
            found.append(match.group(0))
    return found


def test_the_reference_finder() -> None:
    assert issue_references("Targets (issues 16 and 29)") == ["(issues"]
    assert issue_references("fixed in #38, see issue 29") == ["issue 29", "#38"]
    assert issue_references("Megatron-LM #5071, NeMo-RL #2371/#2372, pytorch #191918") == []


def test_no_page_names_the_projects_issues() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    named = {}
    for page in pages:
        relative = page.relative_to(ROOT).as_posix()
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
        if references := issue_references(text):
            named[relative] = references
    assert not named, f"pages that name the project's issues: {named}"


def test_benchmark_pages_for_users_show_results_not_verdicts() -> None:
    """Targets met or missed are the contributors' page's; the users' pages show results."""
    pages = [ROOT / "docs" / "benchmarks.md", *sorted((ROOT / "docs" / "bench").glob("*.md"))]
    verdicts = re.compile(r"\b(missed|NOT met|targets?)\b", re.IGNORECASE)
    found = {p.name: sorted(set(verdicts.findall(p.read_text()))) for p in pages}
    assert not {name: words for name, words in found.items() if words}
    contributors = (ROOT / "docs" / "contributing" / "bench_targets.md").read_text()
    assert "## PrecisionAwareAdamW" in contributors and "| verdict |" in contributors
