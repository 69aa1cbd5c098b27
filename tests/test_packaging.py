"""The source distribution carries a runnable test suite, and the metadata is current."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import wrapped_optim

ROOT = Path(__file__).resolve().parents[1]


def test_the_sdist_carries_the_suite_and_no_built_library(tmp_path: Path) -> None:
    code = (
        "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    )
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr
    name = result.stdout.strip().splitlines()[-1]
    with tarfile.open(tmp_path / name) as archive:
        members = {m.split("/", 1)[1] for m in archive.getnames() if "/" in m}
        info = archive.extractfile(f"{name.removesuffix('.tar.gz')}/PKG-INFO")
        assert info is not None
        metadata = info.read().decode()
    in_repo = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("*.py")
               if "__pycache__" not in p.parts}  # fmt: skip
    assert in_repo <= members, sorted(in_repo - members)  # conftest, subfolders, helpers
    assert {"setup.py", "mkdocs.yml", "README.md", "docs/index.md"} <= members
    assert not [m for m in members if m.endswith(".so")]
    # The one version source: the package's __version__, read by setuptools.
    assert f"\nVersion: {wrapped_optim.__version__}\n" in metadata


def test_the_license_is_an_spdx_expression() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"


def test_the_version_is_written_once() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"\n## [{wrapped_optim.__version__}] - " in changelog  # each release has its entry


def test_pre_commit_runs_the_checks_ci_runs() -> None:
    import yaml

    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    entries = {hook["entry"] for repo in config["repos"] for hook in repo["hooks"]}
    ci_checks = {
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.startswith((".venv/bin/ruff", ".venv/bin/mypy"))
    }
    assert len(ci_checks) == 3 and ci_checks == entries


def test_the_docs_state_the_requirements_pyproject_declares() -> None:
    """docs/index.md's requirements sentence names requires-python's minimum and every
    dependency with its minimum version (it once said Python 3.10+ and no NumPy)."""
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    page = " ".join((ROOT / "docs" / "index.md").read_text().split())
    match = re.search(r"wrapped_optim needs (.*?)\(pip installs", page)
    assert match is not None, "docs/index.md lost its 'wrapped_optim needs ...' sentence"
    sentence = match.group(1)
    python = project["requires-python"].removeprefix(">=")
    assert f"Python {python}+" in sentence
    shown = {"torch": "PyTorch"}  # how the page names a distribution, where it differs
    for requirement in project["dependencies"]:
        parsed = re.fullmatch(r"([\w-]+)>=([\d.]+)", requirement)
        assert parsed is not None, f"{requirement}: not name>=version; teach this test"
        name, minimum = parsed.groups()
        spelled = shown.get(name, name)
        assert re.search(rf"{re.escape(spelled)} {re.escape(minimum)}(\+| or newer)", sentence,
                         re.IGNORECASE), (requirement, sentence)  # fmt: skip
