"""Every ```python block of README.md and docs/ is a complete program that runs as a user
who installed the package runs it, or says on its first line that it is a fragment.

The convention (also in docs/index.md, "Code blocks in these docs"): a block whose first line
is a comment starting ``# fragment`` (e.g. ``# fragment: needs a Megatron model``) is an
excerpt that does not run alone; every other block runs as written, in a fresh process (a fork
of one worker that has imported torch and wrapped_optim) and an empty working directory outside
the checkout, with the package importable as installed and nothing else of the checkout:
``docs`` and ``tests`` do not import there. Blocks written as an interactive session (``>>>``)
are doctests: those of one page form one session, run in order, and their outputs are checked.
Lines ``--8<-- "path:section"`` (pymdownx.snippets, how the guides include their example
files) are replaced by that section, as the docs build does. A block whose program needs an
optional package (an extra) that is not installed is skipped, naming it; the page must name
the extra's ``pip install``. A block that only defines things also uses them.
"""

from __future__ import annotations

import ast
import doctest
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

ROOT = Path(__file__).resolve().parents[1]
FRAGMENT = "# fragment"
_FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_SNIPPET = re.compile(r'^--8<-- "([^":]+)(?::([\w-]+))?"$', re.MULTILINE)
# The optional packages a block may need, and the extra that installs each.
EXTRAS = {"megatron": "megatron", "transformer_engine": "te", "megatron_fsdp": "fsdp",
          "lightning": "frameworks", "accelerate": "frameworks", "transformers": "frameworks",
          "hypothesis": "testing", "matplotlib": "plots", "triton": None,
          "deepspeed": "bench"}  # fmt: skip
SKIP_EXIT = 3  # the worker's exit code for "needs an optional package that is not installed"


def _section(path: str, name: str | None) -> str:
    text = (ROOT / path).read_text()
    if name is None:
        return text
    start = re.search(rf"^[ \t]*# --8<-- \[start:{name}\]\n", text, re.MULTILINE)
    end = re.search(rf"^[ \t]*# --8<-- \[end:{name}\]", text, re.MULTILINE)
    assert start is not None and end is not None, f"{path} has no section {name!r}"
    lines = [  # other sections' markers inside this one are dropped, as pymdownx does
        line
        for line in text[start.end() : end.start()].splitlines(keepends=True)
        if not re.match(r"^[ \t]*# --8<-- \[(start|end):[\w-]+\]$", line.rstrip("\n"))
    ]
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


# --------------------------------------------------------------------------- the worker

# Runs in a fresh interpreter whose sys.path holds the installed package (PYTHONPATH: a folder
# with only a link to wrapped_optim) and no checkout folder. One line on stdin names a request
# file; a forked child runs it in the request's folder, its output into the request's log, and
# the worker answers with the child's exit status.
_WORKER = """
import os, sys
import torch, wrapped_optim  # what every block imports, once: children fork from here

def child(request_path):
    import doctest, json, traceback
    with open(request_path) as file:
        request = json.load(file)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1), os.dup2(log, 2), os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.chdir(request["cwd"])
    try:
        if request["kind"] == "session":
            run_session(doctest, request["sources"])
        else:
            code = compile(request["sources"][-1], request["name"], "exec")
            exec(code, {"__name__": "__main__"})
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except ModuleNotFoundError as error:
        top = (error.name or "").split(".")[0]
        if top in request["optional"]:
            print(f"needs {error.name}, not installed here")
            return request["skip_status"]
        traceback.print_exc()
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0

def run_session(doctest, sources):
    parser, globs = doctest.DocTestParser(), {"__name__": "__main__"}
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE | doctest.IGNORE_EXCEPTION_DETAIL
    runner = doctest.DocTestRunner(optionflags=flags)
    for index, source in enumerate(sources):
        test = parser.get_doctest(source, globs, f"block {index + 1}", None, 0)
        runner.run(test, out=sys.stdout.write, clear_globs=False)
        globs = test.globs  # DocTest copies the namespace it is given: carry it on
        if runner.failures:
            raise AssertionError(f"{runner.failures} doctest failure(s), above")

for line in sys.stdin:
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            status = child(line.strip())
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""


class _Worker:
    """The worker process and the folder that makes the package importable as installed."""

    def __init__(self, home: Path) -> None:
        self.site = home / "site-packages"
        self.site.mkdir()
        (self.site / "wrapped_optim").symlink_to(ROOT / "wrapped_optim", target_is_directory=True)
        env = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}
        env["PYTHONPATH"] = str(self.site)
        self._stderr = (home / "worker.log").open("w")
        self._process = subprocess.Popen(
            [sys.executable, "-c", _WORKER],
            cwd=home,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        self._log = home / "worker.log"

    def run(self, folder: Path, name: str, kind: str, sources: list[str]) -> tuple[int, str]:
        """Runs ``sources`` (a program: the last one; a session: all, in order) with ``folder /
        "work"`` as the working directory: ``(exit status, output)``."""
        assert not folder.resolve().is_relative_to(ROOT), "the blocks run outside the checkout"
        (folder / "work").mkdir()
        request = {
            "name": name, "kind": kind, "sources": sources, "cwd": str(folder / "work"),
            "log": str(folder / "output.log"), "optional": sorted(EXTRAS),
            "skip_status": SKIP_EXIT,
        }  # fmt: skip
        (folder / "request.json").write_text(json.dumps(request))
        stdin, stdout = self._pipes()
        stdin.write(f"{folder / 'request.json'}\n")
        stdin.flush()
        answer = stdout.readline()
        if not answer:
            raise RuntimeError(f"the doc-block worker died:\n{self._log.read_text()}")
        return int(answer), (folder / "output.log").read_text()

    def _pipes(self) -> tuple[IO[str], IO[str]]:
        assert self._process.stdin is not None and self._process.stdout is not None
        return self._process.stdin, self._process.stdout

    def close(self) -> None:
        stdin, _ = self._pipes()
        stdin.close()
        self._process.wait(timeout=120)
        self._stderr.close()


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Worker]:
    running = _Worker(tmp_path_factory.mktemp("doc-block-worker"))
    yield running
    running.close()


def _run(worker: _Worker, folder: Path, name: str, block: str) -> None:
    if block.startswith(">>>"):
        kind, sources = "session", [_expand(b) for b in _session_upto(name)]
    else:
        kind, sources = "program", [_expand(block)]
    status, output = worker.run(folder, name, kind, sources)
    if status == SKIP_EXIT:
        pytest.skip(output.strip().splitlines()[-1])
    assert status == 0, f"{name} failed (exit status {status}):\n{output}"


def _session_upto(name: str) -> list[str]:
    """The page's ``>>>`` blocks up to and including ``name``: one doctest session."""
    page = name.split("#")[0]
    blocks = [(n, b) for n, b in BLOCKS if n.split("#")[0] == page and b.startswith(">>>")]
    upto = [n for n, _ in blocks].index(name) + 1
    return [block for _, block in blocks[:upto]]


# --------------------------------------------------------------------------- the tests


@pytest.mark.parametrize(("name", "block"), PROGRAMS, ids=[name for name, _ in PROGRAMS])
def test_the_block_runs_as_written(name: str, block: str, tmp_path: Path, worker: _Worker) -> None:
    _run(worker, tmp_path, name, block)


def test_blocks_see_the_installed_package_and_nothing_else_of_the_checkout(
    tmp_path: Path, worker: _Worker
) -> None:
    probe = (
        "import importlib.util, pathlib, sys, wrapped_optim\n"
        "for name in ('docs', 'tests'):\n"
        "    assert importlib.util.find_spec(name) is None, f'{name} imports'\n"
        f"assert not any(pathlib.Path(p or '.').resolve() == pathlib.Path({str(ROOT)!r})\n"
        "               for p in sys.path), sys.path\n"
        "print(wrapped_optim.__file__)\n"
        "print(pathlib.Path.cwd())\n"
    )
    status, output = worker.run(tmp_path, "probe", "program", [probe])
    assert status == 0, output
    package, cwd = output.strip().splitlines()
    assert Path(package) == worker.site / "wrapped_optim" / "__init__.py"
    assert Path(cwd) == (tmp_path / "work").resolve()


def test_a_block_that_imports_the_checkout_fails(tmp_path: Path, worker: _Worker) -> None:
    """What a user meets: the guides' example folder is not an installed module."""
    status, output = worker.run(
        tmp_path, "checkout", "program", ["from docs.guides.examples import toy"]
    )
    assert status == 1 and "No module named 'docs'" in output


def _top_level_imports(source: str) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _program_text(block: str) -> str:
    """The block's Python: a session's examples without their outputs."""
    if not block.startswith(">>>"):
        return _expand(block)
    return "".join(example.source for example in doctest.DocTestParser().get_examples(block))


def test_a_page_names_the_extra_its_blocks_need() -> None:
    """A block importing an optional package runs for a user who installed the extra the page
    names: ``pip install 'wrapped-optim[EXTRA]'``."""
    missing = []
    for name, block in PROGRAMS:
        page = (ROOT / name.split("#")[0]).read_text()
        for module in sorted(_top_level_imports(_program_text(block)) & set(EXTRAS)):
            extra = EXTRAS[module]
            if extra is not None and f"pip install 'wrapped-optim[{extra}]'" not in page:
                missing.append(f"{name} imports {module}: the page does not say "
                               f"pip install 'wrapped-optim[{extra}]'")  # fmt: skip
    assert not missing, "\n".join(missing)


_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _only_defines(source: str) -> bool:
    """True when the program defines functions or classes and no top-level statement but
    imports and definitions calls anything: it would run and test nothing."""
    body = ast.parse(source).body
    if not any(isinstance(node, _DEFINITIONS) for node in body):
        return False
    for node in body:
        if isinstance(node, (*_DEFINITIONS, ast.Import, ast.ImportFrom)):
            continue
        if any(isinstance(inner, ast.Call) for inner in ast.walk(node)):
            return False
    return True


def test_a_block_that_defines_things_also_uses_them() -> None:
    idle = [name for name, block in PROGRAMS
            if not block.startswith(">>>") and _only_defines(_expand(block))]  # fmt: skip
    assert not idle, f"blocks that define functions or classes and never call them: {idle}"
    assert _only_defines("import torch\ndef f() -> None:\n    print(1)\nX = {'a': 1}\n")
    assert not _only_defines("def f() -> None:\n    pass\nf()\n")
    assert not _only_defines("import torch\n")  # imports alone: the program checks them
