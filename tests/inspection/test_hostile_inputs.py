"""The hostile-input catalogue of wrapped_optim.testing.hostile, against ``inspect`` (in a
real process: a hang is a timeout, a traceback is more than one line) and ``save_optimizer``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from wrapped_optim.checkpoint import load_optimizer, save_optimizer
from wrapped_optim.testing import assert_state_dict_equal, checkpoint_roundtrip
from wrapped_optim.testing.hostile import HOSTILE_CHECKPOINTS, HOSTILE_SAVE_TARGETS

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kind", sorted(HOSTILE_CHECKPOINTS))
def test_inspect_refuses_a_hostile_checkpoint_in_one_line(kind: str, tmp_path: Path) -> None:
    """Without --trust: exit 2, one line on stderr, nothing on stdout (no value read from
    outside the checkpoint directory is printed), within the timeout (a FIFO never blocks)."""
    path = HOSTILE_CHECKPOINTS[kind](tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "wrapped_optim._cli", "inspect", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("wrapped-optim inspect: error:"), lines[:5]
    assert done.stdout == ""


@pytest.mark.parametrize("kind", sorted(HOSTILE_SAVE_TARGETS))
def test_a_save_to_a_hostile_target_moves_or_deletes_nothing_outside_it(
    kind: str, tmp_path: Path
) -> None:
    path, victim = HOSTILE_SAVE_TARGETS[kind](tmp_path)
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.ones(4)
    opt.step()
    for _ in range(2):  # a second save goes through the state the first one left
        try:
            save_optimizer(opt, path)
        except FileExistsError as error:
            assert "reserves for its own staging" in str(error)
        else:
            fresh = torch.optim.AdamW([torch.nn.Parameter(torch.ones(4))], lr=1.0)
            load_optimizer(fresh, path)
            assert_state_dict_equal(
                checkpoint_roundtrip(opt.state_dict()), checkpoint_roundtrip(fresh.state_dict())
            )
    assert (victim / "precious.txt").read_text() == "keep"
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith((".old", ".saving"))]
    assert leftovers == [n for n in (".ckpt.old", ".ckpt.saving") if (tmp_path / n).is_symlink()]
