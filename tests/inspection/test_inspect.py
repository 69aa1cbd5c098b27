"""Checkpoint inspection: torch.save files and DCP directories, every format, every refusal."""

from __future__ import annotations

import math
import tempfile
import warnings
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from wrapped_optim.inspection import (
    InspectError,
    StateFormat,
    format_report,
    inspect_checkpoint,
)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for i in range(steps):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(i), dtype=_dtype(model))
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()


def _dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def _dcp_save(state: dict[str, Any], path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=path, no_dist=True)


def _portable_state(
    shapes: list[tuple[int, ...]], *, step: int, master: torch.dtype | None
) -> dict[str, Any]:
    """FusedAdam's portable format, built by hand: FP32 moments, the step in the groups."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for i, shape in enumerate(shapes):
        entry = {"exp_avg": torch.randn(shape), "exp_avg_sq": torch.rand(shape)}
        if master is torch.int16:
            entry["master_param"] = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16)
        elif master is not None:
            entry["master_param"] = torch.randn(shape, dtype=master)
        state[i] = entry
    group = {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.01,
        "bias_correction": True,
        "step": step,
        "params": list(range(len(shapes))),
    }
    return {"state": state, "param_groups": [group]}


# --------------------------------------------------------------------------- torch.save


def test_torch_adamw_file_reports_every_state(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    _train(model, opt, 3)
    path = tmp_path / "optim.pt"
    torch.save(opt.state_dict(), path)

    report = inspect_checkpoint(path)

    assert report.kind == "torch.save"
    assert report.file_bytes == path.stat().st_size
    (opt_report,) = report.optimizers
    assert opt_report.location == ""
    assert opt_report.format is StateFormat.TORCH
    assert opt_report.description == "torch optimizer state; floating state FP32"
    assert opt_report.steps == (3,)
    assert opt_report.step_source == "per-parameter"
    expected = [
        (str(i), name, value.dtype, tuple(value.shape), value.numel() * value.element_size())
        for i, states in opt.state_dict()["state"].items()
        for name, value in states.items()
    ]
    got = [(t.param, t.name, t.dtype, t.shape, t.nbytes) for t in opt_report.tensors]
    assert got == expected
    (group,) = opt_report.param_groups
    assert group.num_params == 4
    assert group.option("lr") == "0.003"
    assert group.option("params") is None
    assert opt_report.notes == ()


def test_bf16_torch_state_is_flagged_not_fp32(tmp_path: Path) -> None:
    model = _model().to(torch.bfloat16)
    opt = torch.optim.Adam(model.parameters())
    _train(model, opt, 2)
    torch.save(opt.state_dict(), tmp_path / "bf16.pt")

    (opt_report,) = inspect_checkpoint(tmp_path / "bf16.pt").optimizers

    assert opt_report.format is StateFormat.TORCH
    assert "bfloat16" in opt_report.description
    assert any("not all FP32" in note for note in opt_report.notes)
    moments = [t for t in opt_report.tensors if t.name == "exp_avg"]
    assert all(t.dtype == torch.bfloat16 and t.nbytes == math.prod(t.shape) * 2 for t in moments)


def test_precision_aware_portable_format(tmp_path: Path) -> None:
    torch.save(_portable_state([(8, 4), (4,)], step=17, master=torch.float32), tmp_path / "te.pt")

    (opt_report,) = inspect_checkpoint(tmp_path / "te.pt").optimizers

    assert opt_report.format is StateFormat.PRECISION_AWARE
    assert opt_report.steps == (17,)
    assert opt_report.step_source == "param_groups"
    assert {t.name for t in opt_report.tensors} == {"exp_avg", "exp_avg_sq", "master_param"}
    assert opt_report.total_bytes == 3 * (32 + 4) * 4
    assert opt_report.notes == ()


def test_remainder_masters_are_detected(tmp_path: Path) -> None:
    torch.save(_portable_state([(6,), (2, 3)], step=4, master=torch.int16), tmp_path / "rem.pt")

    (opt_report,) = inspect_checkpoint(tmp_path / "rem.pt").optimizers

    assert opt_report.format is StateFormat.REMAINDER_MASTERS
    masters = [t for t in opt_report.tensors if t.name == "master_param"]
    assert [(t.dtype, t.nbytes) for t in masters] == [(torch.int16, 12), (torch.int16, 12)]
    assert "int16" in format_report(inspect_checkpoint(tmp_path / "rem.pt"))


def test_compressed_moments_in_portable_layout_are_noted(tmp_path: Path) -> None:
    sd = _portable_state([(4,)], step=1, master=None)
    sd["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"].to(torch.bfloat16)
    torch.save(sd, tmp_path / "odd.pt")

    (opt_report,) = inspect_checkpoint(tmp_path / "odd.pt").optimizers

    assert opt_report.format is StateFormat.PRECISION_AWARE
    assert any("exp_avg:bfloat16" in note for note in opt_report.notes)


def test_nested_and_listed_state_dicts_are_all_found(tmp_path: Path) -> None:
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, sgd, 1)
    fresh = torch.optim.AdamW(model.parameters())
    torch.save(
        {
            "model": model.state_dict(),
            "optim": sgd.state_dict(),
            "chained": [fresh.state_dict(), _portable_state([(2,)], step=9, master=None)],
        },
        tmp_path / "all.pt",
    )

    report = inspect_checkpoint(tmp_path / "all.pt")

    assert [o.location for o in report.optimizers] == ["optim", "chained[0]", "chained[1]"]
    assert [o.format for o in report.optimizers] == [
        StateFormat.TORCH,
        StateFormat.EMPTY,
        StateFormat.PRECISION_AWARE,
    ]
    assert {t.name for t in report.optimizers[0].tensors} == {"momentum_buffer"}
    assert report.optimizers[0].steps == ()
    assert report.optimizers[1].tensors == ()


def test_format_report_lists_states_steps_and_groups(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    _train(model, opt, 2)
    torch.save({"optim": opt.state_dict()}, tmp_path / "c.pt")
    report = inspect_checkpoint(tmp_path / "c.pt")

    full = format_report(report)
    short = format_report(report, per_param=False)

    assert "optimizer state at optim" in full
    assert "format: torch optimizer state; floating state FP32" in full
    assert "steps: 2 (per-parameter)" in full
    assert "exp_avg_sq  4      float32  92 B" in full  # 23 params x 4 bytes
    assert "0      exp_avg     float32  (3, 4)  48" in full
    assert "[0] 4 params; lr=0.0005" in full
    assert "per parameter:" in full and "per parameter:" not in short
    assert "per state name:" in short


@given(
    shapes=st.lists(
        st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple), min_size=1, max_size=4
    ),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
)
def test_reported_dtypes_shapes_and_bytes_match_the_saved_tensors(
    shapes: list[tuple[int, ...]], dtype: torch.dtype
) -> None:
    state = {
        i: {"step": torch.tensor(3.0), "momentum": torch.zeros(shape, dtype=dtype)}
        for i, shape in enumerate(shapes)
    }
    sd = {"state": state, "param_groups": [{"lr": 0.1, "params": list(state)}]}
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(sd, Path(tmp) / "p.pt")
        (opt_report,) = inspect_checkpoint(Path(tmp) / "p.pt").optimizers

    momenta = [t for t in opt_report.tensors if t.name == "momentum"]
    assert [(t.dtype, t.shape) for t in momenta] == [(dtype, s) for s in shapes]
    itemsize = torch.empty((), dtype=dtype).element_size()
    assert [t.nbytes for t in momenta] == [math.prod(s) * itemsize for s in shapes]
    assert opt_report.steps == (3,)


# --------------------------------------------------------------------------- DCP


def test_dcp_nested_fqn_state_dict(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    _train(model, opt, 2)
    osd = get_optimizer_state_dict(model, opt)
    _dcp_save({"model": model.state_dict(), "optim": osd}, tmp_path / "ckpt")

    report = inspect_checkpoint(tmp_path / "ckpt")

    assert report.kind == "dcp"
    (opt_report,) = report.optimizers
    assert opt_report.location == "optim"
    assert opt_report.format is StateFormat.TORCH
    assert opt_report.steps == (2,)
    got = {(t.param, t.name): (t.dtype, t.shape) for t in opt_report.tensors}
    want = {
        (fqn, name): (value.dtype, tuple(value.shape))
        for fqn, states in osd["state"].items()
        for name, value in states.items()
    }
    assert got == want
    (group,) = opt_report.param_groups
    assert group.num_params == 4 and group.option("lr") == "0.002"


def test_dcp_flattened_optimizer_state_dict(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.SGD(
        [
            {"params": model[0].parameters(), "lr": 0.1},
            {"params": model[2].parameters(), "lr": 0.2},
        ],
        momentum=0.9,
    )
    _train(model, opt, 1)
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    _dcp_save({"optim": get_optimizer_state_dict(model, opt, options=options)}, tmp_path / "flat")

    (opt_report,) = inspect_checkpoint(tmp_path / "flat").optimizers

    assert {t.param for t in opt_report.tensors} == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert [(g.num_params, g.option("lr")) for g in opt_report.param_groups] == [
        (2, "0.1"),
        (2, "0.2"),
    ]
    assert any("flattened" in note for note in opt_report.notes)


def test_dcp_precision_aware_reads_only_small_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _dcp_save(
        {"optimizer": _portable_state([(64, 32), (32,)], step=11, master=torch.int16)},
        tmp_path / "te",
    )
    loaded_keys: list[str] = []
    real_load = dcp.load

    def recording_load(state_dict: dict[str, Any], **kwargs: Any) -> Any:
        loaded_keys.extend(state_dict)
        return real_load(state_dict, **kwargs)

    monkeypatch.setattr(dcp, "load", recording_load)

    (opt_report,) = inspect_checkpoint(tmp_path / "te").optimizers

    assert opt_report.format is StateFormat.REMAINDER_MASTERS
    assert opt_report.steps == (11,)
    assert opt_report.param_groups[0].option("bias_correction") == "True"
    assert loaded_keys, "param-group options must be read from the data files"
    assert all(".param_groups." in key for key in loaded_keys), loaded_keys  # no state tensors


# --------------------------------------------------------------------------- refusals


def test_missing_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InspectError, match="no such file or directory"):
        inspect_checkpoint(tmp_path / "absent.pt")


def test_text_file_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello\n")
    with pytest.raises(InspectError, match=r"notes\.txt: not a .*torch\.save file"):
        inspect_checkpoint(tmp_path / "notes.txt")


def test_empty_and_truncated_files_are_refused(tmp_path: Path) -> None:
    (tmp_path / "empty.pt").write_bytes(b"")
    model = _model()
    torch.save(torch.optim.SGD(model.parameters(), lr=0.1).state_dict(), tmp_path / "ok.pt")
    data = (tmp_path / "ok.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    for name in ("empty.pt", "cut.pt"):
        with pytest.raises(InspectError, match=name):
            inspect_checkpoint(tmp_path / name)


def test_plain_directory_is_not_a_dcp_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    with pytest.raises(InspectError, match=r"no \.metadata file"):
        inspect_checkpoint(tmp_path / "dir")


def test_corrupt_dcp_metadata_is_refused(tmp_path: Path) -> None:
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(InspectError, match="unreadable DCP metadata"):
        inspect_checkpoint(tmp_path / "bad")


def test_model_only_checkpoint_has_no_optimizer_state(tmp_path: Path) -> None:
    torch.save({"model": _model().state_dict(), "epoch": 3}, tmp_path / "model.pt")
    with pytest.raises(InspectError, match=r"no optimizer state dict found.*model, epoch"):
        inspect_checkpoint(tmp_path / "model.pt")
    torch.save(torch.zeros(3), tmp_path / "tensor.pt")
    with pytest.raises(InspectError, match="single tensor"):
        inspect_checkpoint(tmp_path / "tensor.pt")


def test_dcp_model_only_checkpoint_has_no_optimizer_state(tmp_path: Path) -> None:
    _dcp_save({"model": _model().state_dict()}, tmp_path / "model")
    with pytest.raises(InspectError, match="no optimizer state dict found"):
        inspect_checkpoint(tmp_path / "model")


class _Custom:
    def __init__(self) -> None:
        self.value = 1


def test_arbitrary_pickles_are_only_loaded_when_trusted(tmp_path: Path) -> None:
    sgd = torch.optim.SGD(_model().parameters(), lr=0.1)
    torch.save({"args": _Custom(), "optimizer": sgd.state_dict()}, tmp_path / "pickle.pt")

    with pytest.raises(InspectError, match=r"_Custom object.*--trust"):
        inspect_checkpoint(tmp_path / "pickle.pt")

    (opt_report,) = inspect_checkpoint(tmp_path / "pickle.pt", trusted=True).optimizers
    assert opt_report.location == "optimizer" and opt_report.format is StateFormat.EMPTY


def test_legacy_non_zip_files_are_read(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    _train(model, opt, 1)
    torch.save(opt.state_dict(), tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)

    (opt_report,) = inspect_checkpoint(tmp_path / "legacy.pt").optimizers

    assert opt_report.format is StateFormat.TORCH and opt_report.steps == (1,)


# ------------------------------------------------------------ real portable optimizers


@pytest.mark.parametrize(
    ("options", "expected", "master"),
    [
        (
            {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16},
            StateFormat.PRECISION_AWARE,
            None,
        ),
        (
            {"master_weights": True, "exp_avg_dtype": torch.uint8},
            StateFormat.PRECISION_AWARE,
            torch.float32,
        ),
        (
            {"master_weights": True, "store_param_remainders": True},
            StateFormat.REMAINDER_MASTERS,
            torch.int16,
        ),
    ],
)
def test_precision_aware_adamw_checkpoints(
    options: dict[str, Any],
    expected: StateFormat,
    master: torch.dtype | None,
    tmp_path: Path,
) -> None:
    from wrapped_optim.optimizers import PrecisionAwareAdamW

    model = _model().to(torch.bfloat16) if master is torch.int16 else _model()
    opt = PrecisionAwareAdamW(model.parameters(), lr=1e-3, **options)
    _train(model, opt, 3)
    torch.save({"optimizer": opt.state_dict()}, tmp_path / "pa.pt")
    _dcp_save({"optimizer": opt.state_dict()}, tmp_path / "pa_dcp")

    for path in (tmp_path / "pa.pt", tmp_path / "pa_dcp"):
        (opt_report,) = inspect_checkpoint(path).optimizers
        assert opt_report.format is expected, path
        assert opt_report.steps == (3,) and opt_report.step_source == "param_groups"
        assert opt_report.notes == ()
        moments = [t for t in opt_report.tensors if t.name in ("exp_avg", "exp_avg_sq")]
        assert moments and all(t.dtype == torch.float32 for t in moments)  # FP32 expansions
        masters = {t.dtype for t in opt_report.tensors if t.name == "master_param"}
        assert masters == ({master} if master is not None else set())


def test_hybrid_offload_checkpoint_is_torch_state_with_masters(tmp_path: Path) -> None:
    from wrapped_optim.optimizers import HybridOffloadOptimizer

    model = _model().to(torch.bfloat16)
    opt = HybridOffloadOptimizer(model.parameters(), offload_fraction=0.5, lr=1e-3)
    _train(model, opt, 2)
    torch.save(opt.state_dict(), tmp_path / "hybrid.pt")

    (opt_report,) = inspect_checkpoint(tmp_path / "hybrid.pt").optimizers

    assert opt_report.format is StateFormat.TORCH
    assert opt_report.steps == (2,) and opt_report.step_source == "per-parameter"
    masters = [t for t in opt_report.tensors if t.name == "master_param"]
    assert len(masters) == 4 and all(t.dtype == torch.float32 for t in masters)
    assert any("master_param present" in note for note in opt_report.notes)


class _RunsCode:
    """A pickle that, when unpickled, creates a file: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (Path.touch, (self.marker,))


def _adamw_dcp(path: Path) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt, 1)
    _dcp_save(opt.state_dict(), path)


@pytest.mark.parametrize("where", ["top", "inside"])
def test_malicious_dcp_metadata_runs_no_code_without_trust(where: str, tmp_path: Path) -> None:
    """Issue 20 item 1: on main, inspect unpickled .metadata with a plain pickle.load."""
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    from wrapped_optim._cli import run_inspect

    checkpoint, marker = tmp_path / "ckpt", tmp_path / "code-ran"
    _adamw_dcp(checkpoint)
    if where == "top":
        payload: Any = _RunsCode(marker)
    else:  # hidden inside an otherwise valid Metadata
        payload = Metadata(state_dict_metadata={}, planner_data={"x": _RunsCode(marker)})
    (checkpoint / ".metadata").write_bytes(pickle.dumps(payload))
    with pytest.raises(InspectError, match="--trust"):
        inspect_checkpoint(checkpoint)
    assert run_inspect(str(checkpoint)) == 2
    assert not marker.exists()


def test_safe_metadata_reader_reads_every_real_checkpoint_kind(tmp_path: Path) -> None:
    from wrapped_optim.checkpoint import save_optimizer
    from wrapped_optim.optimizers import PrecisionAwareAdamW

    p = torch.nn.Parameter(torch.randn(64, 4, dtype=torch.bfloat16))
    opt = PrecisionAwareAdamW(
        [p], exp_avg_dtype=torch.uint8, master_weights=True, store_param_remainders=True
    )
    p.grad = torch.ones_like(p)
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_optimizer(opt, tmp_path / "streamed", chunk_bytes=128)
    report = inspect_checkpoint(tmp_path / "streamed")
    assert report.optimizers[0].format is StateFormat.REMAINDER_MASTERS


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_missing_or_truncated_shard_is_one_line_and_exit_2(
    damage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 20 item 9: on main a CheckpointException escaped with a traceback (exit 1)."""
    from wrapped_optim._cli import main

    _adamw_dcp(tmp_path)
    for shard in tmp_path.glob("*.distcp"):
        if damage == "missing":
            shard.unlink()
        else:
            shard.write_bytes(shard.read_bytes()[:40])
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err and "could not read values" in err
