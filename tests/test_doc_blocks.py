"""Every ```python block of README.md and docs/ is a complete program, run here, or says on its
first line that it is a fragment.

The convention (also in docs/index.md, "Code blocks in these docs"): a block whose first line
is a comment starting ``# fragment`` (e.g. ``# fragment: needs a Megatron model``) is an
excerpt that does not run alone; every other block runs as written, in a fresh namespace and an
empty working directory. Blocks written as an interactive session (``>>>``) are doctests: those
of one page form one session, run in order, and their outputs are checked. Lines ``--8<--
"path:section"`` (pymdownx.snippets, how the guides include their example files) are replaced
by that section, as the docs build does. A block whose program needs an optional framework that
is not installed is skipped, naming it.
"""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FRAGMENT = "# fragment"
_FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_SNIPPET = re.compile(r'^--8<-- "([^":]+)(?::([\w-]+))?"$', re.MULTILINE)
_OPTIONAL = ("megatron", "transformer_engine", "lightning", "accelerate", "transformers",
             "triton", "deepspeed", "matplotlib")  # fmt: skip


def _section(path: str, name: str | None) -> str:
    text = (ROOT / path).read_text()
    if name is None:
        return text
    start = re.search(rf"^[ \t]*# --8<-- \[start:{name}\]\n", text, re.MULTILINE)
    end = re.search(rf"^[ \t]*# --8<-- \[end:{name}\]", text, re.MULTILINE)
    assert start is not None and end is not None, f"{path} has no section {name!r}"
    lines = text[start.end() : end.start()].splitlines(keepends=True)
    indent = min((len(line) - len(line.lstrip()) for line in lines if line.strip()), default=0)
    return "".join(line[indent:] if line.strip() else line for line in lines)


def _expand(block: str) -> str:
    return _SNIPPET.sub(lambda m: _section(m.group(1), m.group(2)), block)


def _blocks() -> list[tuple[str, str]]:
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for i, match in enumerate(_FENCE.finditer(page.read_text())):
            found.append((f"{page.relative_to(ROOT)}#{i + 1}", match.group(1)))
    return found


BLOCKS = _blocks()
PROGRAMS = [(name, block) for name, block in BLOCKS if not block.startswith(FRAGMENT)]


def test_the_convention_is_followed_and_documented() -> None:
    assert len(BLOCKS) >= 30, "the docs lost their code blocks (or the fence pattern broke)"
    for name, block in BLOCKS:
        first = block.splitlines()[0] if block.strip() else ""
        assert FRAGMENT not in block[len(first) :], f"{name}: the marker goes on the first line"
    assert f"`{FRAGMENT}" in (ROOT / "docs" / "index.md").read_text()


@pytest.mark.parametrize(("name", "block"), PROGRAMS, ids=[name for name, _ in PROGRAMS])
def test_the_block_runs_as_written(
    name: str, block: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = _expand(block)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    try:
        if source.startswith(">>>"):
            _run_session(name)
        else:
            exec(compile(source, name, "exec"), {"__name__": "__main__"})
    except ModuleNotFoundError as error:
        if error.name and error.name.split(".")[0] in _OPTIONAL:
            pytest.skip(f"needs {error.name}, not installed here")
        raise


def _run_session(name: str) -> None:
    """The page's ``>>>`` blocks up to and including ``name``, as one doctest session."""
    page = name.split("#")[0]
    blocks = [(n, b) for n, b in BLOCKS if n.split("#")[0] == page and b.startswith(">>>")]
    upto = [n for n, _ in blocks].index(name) + 1
    parser, globs = doctest.DocTestParser(), {"__name__": "__main__"}
    runner = doctest.DocTestRunner(
        optionflags=doctest.ELLIPSIS
        | doctest.NORMALIZE_WHITESPACE
        | doctest.IGNORE_EXCEPTION_DETAIL
    )
    for block_name, block in blocks[:upto]:
        test = parser.get_doctest(block, globs, block_name, block_name, 0)
        report: list[str] = []
        runner.run(test, out=report.append, clear_globs=False)
        globs = test.globs  # DocTest copies the namespace it is given: carry it on
        assert not runner.failures, "".join(report)
