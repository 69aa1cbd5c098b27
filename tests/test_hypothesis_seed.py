"""Hypothesis explores a new seed each run, prints it, and ``--hypothesis-seed`` replays it.

tests/conftest.py draws the seed; each run here is a real pytest process with that conftest
as a plugin, over a probe test that records what hypothesis drew.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import os
from hypothesis import given, strategies as st

@given(st.integers(0, 10**12))
def test_probe(x):
    with open(os.environ["PROBE_OUT"], "a") as out:
        out.write(f"{x}\\n")
"""


def _run(tmp_path: Path, name: str, *args: str) -> tuple[str, list[str]]:
    out = tmp_path / f"{name}.txt"
    env = dict(os.environ, PROBE_OUT=str(out))
    env.pop("HYPOTHESIS_PROFILE", None)  # the CI profile
    env.pop("WRAPPED_OPTIM_TEST_HYPOTHESIS_SEED", None)  # a run of its own, not this one's
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "tests.conftest",
            "-p",
            "no:cacheprovider",
            f"--rootdir={tmp_path}",
            str(tmp_path / "test_probe.py"),
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    match = re.search(
        r"hypothesis seed (\d+) \(replay: pytest --hypothesis-seed=\1\)", result.stdout
    )
    assert match, result.stdout
    return match.group(1), out.read_text().split()


def test_this_run_explores_from_a_drawn_seed(request: pytest.FixtureRequest) -> None:
    assert request.config.getoption("hypothesis_seed") is not None
    assert not settings.default.derandomize  # the seed, not the test's name, picks the examples


def test_a_printed_seed_replays_the_run(tmp_path: Path) -> None:
    (tmp_path / "test_probe.py").write_text(PROBE)
    seed, drawn = _run(tmp_path, "first")
    assert len(drawn) == 25  # the ci profile's examples
    replay_seed, replayed = _run(tmp_path, "replay", f"--hypothesis-seed={seed}")
    assert replay_seed == seed and replayed == drawn
