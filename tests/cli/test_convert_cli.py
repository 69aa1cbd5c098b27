"""``wrapped-optim convert``, ``wrapped-optim names`` and what ``inspect`` says convert reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from wrapped_optim._cli import main

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MODEL_FILE = """
import torch

def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))

def with_optimizer():
    model = build()
    rest = [model[0].weight, model[0].bias, model[1].bias]
    return model, torch.optim.AdamW([{"params": [model[1].weight]}, {"params": rest}])
"""


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    (tmp_path / "mymodel.py").write_text(MODEL_FILE)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    return tmp_path


def test_convert_with_a_model_spec_and_back(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = f"{checkpoint / 'mymodel.py'}:build"
    src, dcp_dir, back = checkpoint / "optimizer.pt", checkpoint / "dcp", checkpoint / "back.pt"
    assert (
        main(["convert", str(src), str(dcp_dir), "--to", "dcp", "--model", spec, "--verify"]) == 0
    )
    out = capsys.readouterr()
    assert "torch-save -> dcp: 8 tensors" in out.out and "verified" in out.out
    assert "converting: 100%" in out.err
    assert (
        main(
            [
                "convert",
                str(dcp_dir),
                str(back),
                "--to",
                "torch-save",
                "--model",
                spec,
                "--no-progress",
            ]
        )
        == 0
    )
    a, b = torch.load(src), torch.load(back)
    assert a["param_groups"] == b["param_groups"]
    assert all(
        torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i]
    )
    assert main(["inspect", "--summary", str(dcp_dir)]) == 0
    assert "convert reads it as: dcp" in capsys.readouterr().out


def test_names_file_from_a_model_and_optimizer(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    names = checkpoint / "names.json"
    assert main(["names", f"{checkpoint / 'mymodel.py'}:with_optimizer", str(names)]) == 0
    assert "4 parameter names written" in capsys.readouterr().out
    import json

    assert json.loads(names.read_text())["names"] == ["1.weight", "0.weight", "0.bias", "1.bias"]


def test_errors_are_one_line_and_leave_nothing(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = checkpoint / "optimizer.pt"
    assert main(["convert", str(src), str(checkpoint / "x"), "--to", "dcp", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("wrapped-optim convert: error:") and "needs their names" in err
    assert (
        main(
            [
                "convert",
                str(src),
                str(checkpoint / "x.pt"),
                "--to",
                "torch-save",
                "--moments",
                "bf16",
                "--no-progress",
            ]
        )
        == 2
    )
    assert "--allow-lossy" in capsys.readouterr().err
    assert main(["convert", str(src), str(checkpoint / "x"), "--to", "nope"]) == 2
    assert "unknown format 'nope'" in capsys.readouterr().err
    assert (
        main(["convert", str(src), str(checkpoint / "x"), "--to", "dcp", "--model", "nosuch:build"])
        == 2
    )
    assert "nosuch" in capsys.readouterr().err
    assert sorted(p.name for p in checkpoint.iterdir()) == ["mymodel.py", "optimizer.pt"]


def test_list_shows_every_format(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", "--list"]) == 0
    out = capsys.readouterr().out
    for name in ("torch-save", "dcp", "dcp-flat", "dcp-streaming"):
        assert f"\n{name} " in f"\n{out}"


def test_param_remainders_is_refused_for_a_source_without_remainders(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, dst = checkpoint / "optimizer.pt", checkpoint / "dcp"
    spec = f"{checkpoint / 'mymodel.py'}:build"
    argv = ["convert", str(src), str(dst), "--to", "dcp", "--model", spec, "--param-remainders"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "param_remainders: a torch-save source" in err
    assert "megatron-fully-reshardable" in err
    assert not dst.exists()


def test_fp8_dp_is_refused_where_the_destination_keeps_whole_tensors(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, dst = checkpoint / "optimizer.pt", checkpoint / "dcp"
    spec = f"{checkpoint / 'mymodel.py'}:build"
    argv = ["convert", str(src), str(dst), "--to", "dcp", "--model", spec]
    assert main([*argv, "--moments", "fp8", "--dp", "2", "--allow-lossy"]) == 2
    err = capsys.readouterr().err
    assert "dp=2 with fp8 moments: dcp holds the portable FP32 form" in err
    assert "megatron-fully-reshardable" in err
    assert not dst.exists()
    assert main([*argv, "--moments", "fp8", "--allow-lossy", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.count("lossy ") == 8  # every moment of the 4 parameters, with its error
