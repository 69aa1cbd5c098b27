"""The streaming load's own rules (wrapped_optim/checkpoint/_load.py), each on a small CPU case.

Found by mutation testing (docs/contributing/mutation.md): the state a load creates for a
fresh optimizer has the dtype torch's loader wants and is adopted as it is (no copy), a
``step`` follows ``capturable``/``fused``; a custom loader gets the checkpoint's dtypes; the
errors name the param, the state and both sides; tensor hyper-parameters are read into new
tensors; a read that narrows goes through a reused buffer of the checkpoint's dtype; the
holder path quantizes in ``chunk_bytes`` pieces and frees what it does not adopt; and a
failure is the checkpoint's only while reading.
"""

from __future__ import annotations

import contextlib
import errno
import io
import math
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tests.checkpoint.test_checkpoint import ToyPrecisionMomentum
from wrapped_optim._formats.errors import UndoJournalError
from wrapped_optim.checkpoint import (
    OptimizerCheckpointError,
    StreamingLoadPlanner,
    load_optimizer,
    save_optimizer,
)
from wrapped_optim.checkpoint._common import DEFAULT_CHUNK_BYTES
from wrapped_optim.checkpoint._journal import UndoJournal
from wrapped_optim.checkpoint._load import _COMMITTED
from wrapped_optim.testing import assert_state_dict_equal, checkpoint_roundtrip

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SHAPES = [(4, 3), (5,)]


def _params(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _stepped(opt: Any, steps: int = 2) -> Any:
    g = torch.Generator().manual_seed(1)
    params = [p for group in opt.param_groups for p in group["params"]]
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()
    return opt


def _dcp_save(state_dict: Any, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state_dict, checkpoint_id=path, no_dist=True)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _received(opt: torch.optim.Optimizer) -> dict[tuple[int, str], torch.Tensor]:
    """Records the state tensors torch's loader is handed (a load_state_dict pre-hook)."""
    seen: dict[tuple[int, str], torch.Tensor] = {}

    def hook(_: Any, state_dict: dict[str, Any]) -> None:
        for index, entry in state_dict["state"].items():
            seen.update({(index, n): v for n, v in entry.items() if isinstance(v, torch.Tensor)})

    opt.register_load_state_dict_pre_hook(hook)
    return seen


# ------------------------------------------------------------------------------------------
# New state (the optimizer has none yet)
# ------------------------------------------------------------------------------------------
def test_new_state_has_torchs_dtypes_and_is_adopted_without_a_copy(tmp_path: Path) -> None:
    source = _stepped(torch.optim.Adam(_params(), lr=0.01))
    save_optimizer(source, tmp_path)
    fresh = torch.optim.Adam(_params(torch.bfloat16), lr=1.0)
    received = _received(fresh)
    with _default_dtype(torch.float64):  # the param's dtype, never the default one
        load_optimizer(fresh, tmp_path)
    reference = torch.optim.Adam(_params(torch.bfloat16), lr=1.0)
    reference.load_state_dict(checkpoint_roundtrip(source.state_dict()))
    params = fresh.param_groups[0]["params"]
    expected = reference.state_dict()["state"]
    assert sorted(received) == sorted((i, n) for i in expected for n in expected[i])
    for (index, name), tensor in received.items():
        live = fresh.state[params[index]][name]
        assert live is tensor, (index, name)  # read into the dtype torch keeps: adopted
        want = expected[index][name]
        assert live.dtype == want.dtype and torch.equal(live, want), (index, name)
    assert received[(0, "exp_avg")].dtype == torch.bfloat16
    assert received[(0, "step")].dtype == torch.float32


STEP_CASES = {
    "adam": (lambda ps: torch.optim.Adam(ps, lr=0.1), False),
    "capturable": (lambda ps: torch.optim.Adam(ps, lr=0.1, capturable=True), True),
    "fused": (lambda ps: torch.optim.Adam(ps, lr=0.1, fused=True), True),
    # Adafactor's groups have neither option
    "adafactor": (lambda ps: torch.optim.Adafactor(ps, lr=0.1), False),
}


def _step_checkpoint(make: Any, step_dtype: torch.dtype, path: Path) -> dict[str, Any]:
    """A checkpoint of ``make``'s optimizer, its steps saved as ``step_dtype`` tensors."""
    plain = make(_params())
    for group in plain.param_groups:  # a capturable or fused step needs an accelerator
        if "capturable" in group:
            group.update(capturable=False, fused=None)
    state_dict = checkpoint_roundtrip(_stepped(plain).state_dict())
    options = {k: v for k, v in make(_params()).param_groups[0].items() if k != "params"}
    for group in state_dict["param_groups"]:
        group.update(options)  # saved as the optimizer that loads it is set
    for entry in state_dict["state"].values():
        entry["step"] = entry["step"].to(step_dtype)
    _dcp_save(state_dict, path)
    return state_dict


@pytest.mark.parametrize("case", sorted(STEP_CASES))
def test_a_new_step_is_float32_when_capturable_or_fused(case: str, tmp_path: Path) -> None:
    """torch keeps a capturable or fused step as float32, any other as it was saved."""
    make, float32 = STEP_CASES[case]
    state_dict = _step_checkpoint(make, torch.float64, tmp_path)
    fresh = make(_params(seed=3))
    received = _received(fresh)
    load_optimizer(fresh, tmp_path)
    reference = make(_params(seed=3))
    reference.load_state_dict(checkpoint_roundtrip(state_dict))
    params = fresh.param_groups[0]["params"]
    for i, (p, q) in enumerate(zip(params, reference.param_groups[0]["params"], strict=True)):
        step = fresh.state[p]["step"]
        assert step.dtype == reference.state[q]["step"].dtype
        assert step.dtype == (torch.float32 if float32 else torch.float64)
        assert step.item() == 2 and step is received[(i, "step")]


@pytest.mark.parametrize("case", sorted(STEP_CASES))
def test_new_state_never_takes_the_default_device_or_dtype(case: str, tmp_path: Path) -> None:
    """The moments on the param's device in its dtype, the step float32 on the param's
    device (capturable, fused) or on the host, adopted by torch's loader as they are."""
    make, _ = STEP_CASES[case]
    _step_checkpoint(make, torch.float32, tmp_path)
    fresh = make(_params(seed=3))
    received = _received(fresh)
    with torch.device("meta"), _default_dtype(torch.float64):
        load_optimizer(fresh, tmp_path)
    for i, p in enumerate(fresh.param_groups[0]["params"]):
        for name, tensor in fresh.state[p].items():
            assert tensor is received[(i, name)], (i, name)
            assert tensor.device.type == "cpu" and tensor.dtype == torch.float32, (i, name)


def test_a_new_step_follows_its_own_groups_options(tmp_path: Path) -> None:
    source = _stepped(torch.optim.Adam(_params(), lr=0.1))
    state_dict = checkpoint_roundtrip(source.state_dict())
    first, second = state_dict["param_groups"][0], dict(state_dict["param_groups"][0])
    state_dict["param_groups"] = [{**first, "params": [0]}, {**second, "params": [1]}]
    state_dict["param_groups"][1]["fused"] = True
    for entry in state_dict["state"].values():
        entry["step"] = entry["step"].to(torch.float64)
    _dcp_save(state_dict, tmp_path)
    params = _params(seed=3)
    fresh = torch.optim.Adam([{"params": [params[0]]}, {"params": [params[1]], "fused": True}])
    load_optimizer(fresh, tmp_path)
    assert fresh.state[params[0]]["step"].dtype == torch.float64
    assert fresh.state[params[1]]["step"].dtype == torch.float32


class _OwnLoader(torch.optim.Adam):
    """A torch optimizer with a loader of its own: records the dtypes it is handed."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.handed = {
            (i, n): v.dtype for i, e in state_dict["state"].items() for n, v in e.items()
        }
        super().load_state_dict(state_dict)


def test_a_custom_loader_gets_new_state_in_the_checkpoints_dtype(tmp_path: Path) -> None:
    source = _stepped(torch.optim.Adam(_params(torch.float64), lr=0.01))
    save_optimizer(source, tmp_path)
    fresh = _OwnLoader(_params(), lr=1.0)
    with torch.device("meta"):  # the param's device, never the default one
        load_optimizer(fresh, tmp_path)
    assert fresh.handed[(0, "exp_avg")] == torch.float64
    assert fresh.handed[(1, "exp_avg_sq")] == torch.float64
    assert fresh.handed[(0, "step")] == torch.float32
    assert fresh.state[fresh.param_groups[0]["params"][0]]["exp_avg"].dtype == torch.float32


def test_live_state_is_read_in_place_past_a_custom_loader(tmp_path: Path) -> None:
    source = _stepped(torch.optim.Adam(_params(), lr=0.01))
    save_optimizer(source, tmp_path)
    opt = _stepped(_OwnLoader(_params(seed=2), lr=1.0), steps=1)
    live = {
        (i, n): t
        for i, p in enumerate(opt.param_groups[0]["params"])
        for n, t in opt.state[p].items()
    }
    load_optimizer(opt, tmp_path)
    assert not hasattr(opt, "handed")  # its loader would rebuild what is in place already
    expected = source.state_dict()
    for (index, name), tensor in live.items():
        assert opt.state[opt.param_groups[0]["params"][index]][name] is tensor
        assert torch.equal(tensor, expected["state"][index][name]), (index, name)
    assert opt.param_groups[0]["lr"] == 0.01


# ------------------------------------------------------------------------------------------
# Errors: the param, the state and both sides named
# ------------------------------------------------------------------------------------------
def test_a_live_state_of_another_shape_names_what_the_optimizer_keeps(tmp_path: Path) -> None:
    source = _stepped(torch.optim.Adam([torch.nn.Parameter(torch.ones(3))], lr=0.1))
    save_optimizer(source, tmp_path)
    opt = _stepped(torch.optim.Adam([torch.nn.Parameter(torch.ones(4))], lr=0.1))
    with pytest.raises(OptimizerCheckpointError) as raised:
        load_optimizer(opt, tmp_path)
    assert str(raised.value) == (
        "param 0: state 'exp_avg' has shape (3,), the optimizer keeps (4,)"
    )


def test_a_new_state_that_cannot_fit_the_param_names_both_shapes(tmp_path: Path) -> None:
    source = _stepped(torch.optim.Adam([torch.nn.Parameter(torch.ones(2, 3))], lr=0.1))
    save_optimizer(source, tmp_path)
    fresh = torch.optim.Adam([torch.nn.Parameter(torch.ones(2, 4))], lr=0.1)
    with pytest.raises(OptimizerCheckpointError) as raised:
        load_optimizer(fresh, tmp_path)
    assert str(raised.value) == "param 0: state 'exp_avg' has shape (2, 3), the param has (2, 4)"


def test_a_live_state_of_another_kind_names_both_dtypes(tmp_path: Path) -> None:
    opt = _stepped(torch.optim.Adam([torch.nn.Parameter(torch.ones(3))], lr=0.1))
    state_dict = checkpoint_roundtrip(opt.state_dict())
    state_dict["state"][0]["exp_avg"] = torch.arange(3)  # integers where floats live
    _dcp_save(state_dict, tmp_path)
    with pytest.raises(OptimizerCheckpointError) as raised:
        load_optimizer(opt, tmp_path)
    assert str(raised.value) == (
        "param 0: state 'exp_avg' is torch.int64, the optimizer keeps torch.float32"
    )


def test_a_fresh_optimizer_takes_integer_state_in_its_params_dtype(tmp_path: Path) -> None:
    source = _stepped(torch.optim.SGD(_params(), lr=0.1, momentum=0.9))
    state_dict = checkpoint_roundtrip(source.state_dict())
    for index, entry in state_dict["state"].items():
        entry["momentum_buffer"] = torch.full(SHAPES[index], 3)  # int64, as torch casts it
    _dcp_save(state_dict, tmp_path)
    fresh = torch.optim.SGD(_params(seed=5), lr=1.0, momentum=0.9)
    load_optimizer(fresh, tmp_path)
    for p in fresh.param_groups[0]["params"]:
        buffer = fresh.state[p]["momentum_buffer"]
        assert buffer.dtype == torch.float32 and torch.equal(buffer, torch.full(p.shape, 3.0))


def test_an_integer_params_new_state_keeps_the_checkpoints_dtype(tmp_path: Path) -> None:
    """torch's loader casts new state to the param's dtype only for a floating param."""

    def make() -> torch.optim.SGD:
        return torch.optim.SGD([torch.zeros(3, dtype=torch.int32)], lr=0.1, momentum=0.9)

    state_dict = checkpoint_roundtrip(make().state_dict())
    state_dict["state"] = {0: {"momentum_buffer": torch.arange(3)}}  # int64
    _dcp_save(state_dict, tmp_path)
    fresh = make()
    load_optimizer(fresh, tmp_path)
    reference = make()
    reference.load_state_dict(checkpoint_roundtrip(state_dict))
    buffer = fresh.state[fresh.param_groups[0]["params"][0]]["momentum_buffer"]
    want = reference.state[reference.param_groups[0]["params"][0]]["momentum_buffer"]
    assert buffer.dtype == want.dtype == torch.int64 and torch.equal(buffer, want)


def test_a_custom_loader_is_handed_the_state_when_some_is_new(tmp_path: Path) -> None:
    source = _stepped(torch.optim.Adam(_params(), lr=0.01))
    save_optimizer(source, tmp_path)
    opt = _OwnLoader(_params(seed=2), lr=1.0)
    first, second = opt.param_groups[0]["params"]
    second.grad = torch.ones(second.shape)
    opt.step()  # state for the second param only: the first one's is new
    load_optimizer(opt, tmp_path)
    expected = source.state_dict()["state"]
    assert sorted(opt.handed) == sorted((i, n) for i in expected for n in expected[i])
    for index, p in enumerate((first, second)):
        for name, value in expected[index].items():
            assert torch.equal(opt.state[p][name], value), (index, name)


def test_an_integer_step_saved_as_an_object_loads(tmp_path: Path) -> None:
    source = _stepped(torch.optim.Adam(_params(), lr=0.01))
    state_dict = checkpoint_roundtrip(source.state_dict())
    for entry in state_dict["state"].values():
        entry["step"] = 2  # an int: a checkpoint object, not a tensor
    _dcp_save(state_dict, tmp_path)
    fresh = torch.optim.Adam(_params(seed=4), lr=1.0)
    load_optimizer(fresh, tmp_path)
    for index, p in enumerate(fresh.param_groups[0]["params"]):
        assert float(fresh.state[p]["step"]) == 2.0
        assert torch.equal(
            fresh.state[p]["exp_avg"], source.state_dict()["state"][index]["exp_avg"]
        )


# ------------------------------------------------------------------------------------------
# Values checked against the format they end in, read through a buffer when they narrow
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize(
    ("live", "saved", "big", "storage"),
    [
        (torch.float32, torch.float64, 1e39, "FP32"),
        (torch.bfloat16, torch.float32, 3.4e38, "bf16"),
    ],
    ids=["float64->float32", "float32->bf16"],
)
def test_a_value_too_large_for_the_live_state_is_refused(
    live: torch.dtype, saved: torch.dtype, big: float, storage: str, atomic: bool, tmp_path: Path
) -> None:
    """Read in the checkpoint's dtype first: the overflow is refused with its magnitude, not
    loaded as an inf (inf and NaN themselves load by default)."""
    opt = _stepped(torch.optim.Adam(_params(live), lr=0.01))
    state_dict = checkpoint_roundtrip(opt.state_dict())
    for entry in state_dict["state"].values():
        entry["exp_avg"] = entry["exp_avg"].to(saved)
    state_dict["state"][1]["exp_avg"][3] = big
    _dcp_save(state_dict, tmp_path)
    before = checkpoint_roundtrip(opt.state_dict())
    problem = f"param 1: state 'exp_avg' has a value of magnitude .* its {storage} storage"
    with pytest.raises(OptimizerCheckpointError, match=problem):
        load_optimizer(opt, tmp_path, atomic=atomic)
    if atomic:
        assert_state_dict_equal(before, checkpoint_roundtrip(opt.state_dict()))
    state_dict["state"][1]["exp_avg"][3] = 0.5
    _dcp_save(state_dict, tmp_path / "good")
    load_optimizer(opt, tmp_path / "good", atomic=atomic)
    for index, p in enumerate(opt.param_groups[0]["params"]):
        want = state_dict["state"][index]["exp_avg"].to(live)
        assert opt.state[p]["exp_avg"].dtype == live
        assert torch.equal(opt.state[p]["exp_avg"], want)


@pytest.mark.parametrize("worker", ["ahead", "held back"])
def test_a_narrowing_read_restored_after_a_later_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, worker: str
) -> None:
    """The regions read through the buffer are journaled before they are written: by the
    journal's worker, which normally runs ahead, or, held back until the rollback stops it,
    by the reader itself."""
    if worker == "held back":

        def held_back(journal: UndoJournal) -> None:
            while True:
                with journal._cond:
                    if journal._stop:
                        return
                time.sleep(0.001)

        monkeypatch.setattr(UndoJournal, "_work", held_back)
    opt = _stepped(torch.optim.Adam(_params(), lr=0.01))
    state_dict = checkpoint_roundtrip(opt.state_dict())
    for entry in state_dict["state"].values():
        entry["exp_avg"] = torch.full_like(entry["exp_avg"], 7.0, dtype=torch.float64)
    _dcp_save(state_dict, tmp_path)
    before = checkpoint_roundtrip(opt.state_dict())

    def fail(*_: Any) -> None:
        raise RuntimeError("planted after the state was read")

    opt.register_load_state_dict_post_hook(fail)
    with pytest.raises(RuntimeError, match="planted"):
        load_optimizer(opt, tmp_path)
    assert_state_dict_equal(before, checkpoint_roundtrip(opt.state_dict()))


def test_staged_reads_reuse_one_buffer_per_dtype_and_thread() -> None:
    planner = StreamingLoadPlanner(torch.optim.SGD(_params(), lr=0.1), {})
    first = planner._buffer(torch.float64, torch.Size([2, 3]))
    assert first.shape == (2, 3) and first.dtype == torch.float64
    same = planner._buffer(torch.float64, torch.Size([6]))
    smaller = planner._buffer(torch.float64, torch.Size([4]))
    assert same.data_ptr() == smaller.data_ptr() == first.data_ptr()
    other = planner._buffer(torch.float32, torch.Size([4]))
    assert other.dtype == torch.float32
    larger = planner._buffer(torch.float64, torch.Size([7]))
    assert (
        larger.numel() == 7 and planner._buffer(torch.float64, [7]).data_ptr() == larger.data_ptr()
    )
    seen: list[int] = []
    thread = threading.Thread(
        target=lambda: seen.append(planner._buffer(torch.float64, torch.Size([7])).data_ptr())
    )
    thread.start()
    thread.join()
    assert seen and seen[0] != larger.data_ptr()  # each reader thread has its own


# ------------------------------------------------------------------------------------------
# Layout, hyper-parameter tensors, odd entries
# ------------------------------------------------------------------------------------------
def test_a_state_tensor_not_at_state_param_name_is_refused(tmp_path: Path) -> None:
    opt = _stepped(torch.optim.Adam(_params(), lr=0.01))
    state_dict = checkpoint_roundtrip(opt.state_dict())
    state_dict["state"][0]["exp_avg"] = {"nested": state_dict["state"][0]["exp_avg"]}
    _dcp_save(state_dict, tmp_path)
    with pytest.raises(OptimizerCheckpointError) as raised:
        load_optimizer(opt, tmp_path)
    assert str(raised.value) == (
        "checkpoint tensor 'state.0.exp_avg.nested' is not laid out as state.<param>.<name>"
    )


def test_entries_before_the_state_and_other_tensors_are_passed_over(tmp_path: Path) -> None:
    """Groups saved first and a model tensor beside the state: neither stops the reading."""
    source = _stepped(torch.optim.Adam(_params(), lr=0.01))
    state_dict = checkpoint_roundtrip(source.state_dict())
    _dcp_save(
        {"a_model": {"weight": torch.ones(2)}, "extras": [torch.ones(1)],
         "param_groups": state_dict["param_groups"], "state": state_dict["state"]},
        tmp_path,
    )  # fmt: skip
    fresh = torch.optim.Adam(_params(seed=4), lr=1.0)
    load_optimizer(fresh, tmp_path)
    assert_state_dict_equal(state_dict, checkpoint_roundtrip(fresh.state_dict()))


def test_a_saved_tensor_lr_is_read_into_a_new_tensor_for_a_float_lr(tmp_path: Path) -> None:
    source = _stepped(torch.optim.Adam(_params(), lr=torch.tensor(0.25, dtype=torch.float64)))
    save_optimizer(source, tmp_path)
    opt = _stepped(torch.optim.Adam(_params(seed=2), lr=0.5))
    with torch.device("meta"):  # on the host (the group's value has no device)
        load_optimizer(opt, tmp_path)
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.device.type == "cpu"
    assert lr.dtype == torch.float64 and lr.item() == 0.25
    assert sorted(opt.param_groups[0]) == sorted(source.param_groups[0])


def test_a_saved_tensor_lr_goes_to_the_device_of_the_groups_tensor(tmp_path: Path) -> None:
    source = _stepped(torch.optim.Adam(_params(), lr=torch.tensor(0.25)))
    save_optimizer(source, tmp_path)
    mine = torch.tensor(0.5)
    opt = _stepped(torch.optim.Adam(_params(seed=2), lr=mine))
    with torch.device("meta"):
        load_optimizer(opt, tmp_path)
    lr = opt.param_groups[0]["lr"]
    assert lr is not mine and lr.device == mine.device and lr.item() == 0.25


def test_load_bytes_is_never_planned() -> None:
    planner = StreamingLoadPlanner(torch.optim.SGD(_params(), lr=0.1), {})
    item = ReadItem(
        type=LoadItemType.BYTE_IO,
        dest_index=MetadataIndex("param_groups.0.lr"),
        dest_offsets=torch.Size([]),
        storage_index=MetadataIndex("param_groups.0.lr"),
        storage_offsets=torch.Size([]),
        lengths=torch.Size([]),
    )
    with pytest.raises(AssertionError, match=r"unexpected object read for 'param_groups\.0\.lr'"):
        planner.load_bytes(item, io.BytesIO())
    assert repr(_COMMITTED) == "<committed to the holder's storage>"


def test_the_planner_used_directly_journals_and_checks_by_default(tmp_path: Path) -> None:
    """``dcp.load`` with the planner alone: atomic (an undo journal in the temp dir), inf
    taken as torch takes it, no weights journaled."""
    source = _stepped(torch.optim.Adam(_params(), lr=0.01))
    state_dict = checkpoint_roundtrip(source.state_dict())
    state_dict["state"][0]["exp_avg"][0, 0] = math.inf
    _dcp_save(state_dict, tmp_path)
    opt = _stepped(torch.optim.Adam(_params(seed=2), lr=0.01))
    planner = StreamingLoadPlanner(opt, {"param_groups": state_dict["param_groups"]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({}, checkpoint_id=tmp_path, planner=planner, no_dist=True)
    undo = planner.undo
    assert undo is not None
    try:
        assert undo.journal.directory == tempfile.gettempdir()
        assert undo.journal.piece_bytes == DEFAULT_CHUNK_BYTES
        assert undo.journal.written == undo.journal.planned_bytes()  # the state, no weights
        assert planner.state[0]["exp_avg"][0, 0] == math.inf
    finally:
        undo.close()


# ------------------------------------------------------------------------------------------
# Precision-aware holders
# ------------------------------------------------------------------------------------------
class _RecordingHolder(ToyPrecisionMomentum):
    """The chunked toy holder, recording what its chunked writer is handed."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params)
        self.handed: list[tuple[str, torch.Tensor, int]] = []

    def write_scaled_state_chunked(
        self, p: torch.Tensor, name: str, source: torch.Tensor, chunk_numel: int
    ) -> None:
        self.handed.append((name, source, chunk_numel))
        super().write_scaled_state_chunked(p, name, source, chunk_numel)


@pytest.mark.parametrize(("chunk_bytes", "chunk_numel"), [(2, 1), (4, 1), (8, 2), (64, 16)])
def test_a_holder_quantizes_in_chunk_bytes_and_frees_the_accumulator(
    chunk_bytes: int, chunk_numel: int, tmp_path: Path
) -> None:
    source = _stepped(ToyPrecisionMomentum(_params()))
    save_optimizer(source, tmp_path)
    opt = _stepped(_RecordingHolder(_params(seed=2)), steps=1)
    load_optimizer(opt, tmp_path, chunk_bytes=chunk_bytes)
    assert [name for name, _, _ in opt.handed] == ["exp_avg_sq"] * len(SHAPES)
    for _, accumulator, numel in opt.handed:
        assert numel == chunk_numel
        assert accumulator.untyped_storage().size() == 0  # not adopted: released at once
    for p, q in zip(opt.param_groups[0]["params"], source.param_groups[0]["params"], strict=True):
        assert torch.equal(opt.state[p]["exp_avg_sq"], source.state[q]["exp_avg_sq"])


class _TorchLoaderHolder(ToyPrecisionMomentum):
    """A holder that keeps torch's own loader."""

    load_state_dict = torch.optim.Optimizer.load_state_dict  # type: ignore[assignment]


def test_a_holder_is_installed_in_place_whatever_its_loader(tmp_path: Path) -> None:
    source = _stepped(ToyPrecisionMomentum(_params()))
    save_optimizer(source, tmp_path)
    opt = _stepped(_TorchLoaderHolder(_params(seed=2)), steps=1)
    load_optimizer(opt, tmp_path)
    for p, q in zip(opt.param_groups[0]["params"], source.param_groups[0]["params"], strict=True):
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][name], source.state[q][name]), name
    assert opt.param_groups[0]["step"] == 2


def test_a_holders_group_step_saved_as_a_float_loads_as_an_int(tmp_path: Path) -> None:
    source = _stepped(ToyPrecisionMomentum(_params()))
    state_dict = checkpoint_roundtrip(source.state_dict())
    state_dict["param_groups"][0]["step"] = 2.0
    _dcp_save(state_dict, tmp_path)
    opt = ToyPrecisionMomentum(_params(seed=2))
    load_optimizer(opt, tmp_path)
    step = opt.param_groups[0]["step"]
    assert type(step) is int and step == 2


def _remainder_adamw(seed: int, shapes: list[tuple[int, ...]] | None = None) -> Any:
    from wrapped_optim.optimizers import PrecisionAwareAdamW

    g = torch.Generator().manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16))
        for s in (shapes or SHAPES)
    ]
    return PrecisionAwareAdamW(
        params,
        lr=0.01,
        master_weights=True,
        store_param_remainders=True,
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.float16,
    )


def test_a_holders_remainders_and_bf16_moments_are_read_in_place(tmp_path: Path) -> None:
    source = _stepped(_remainder_adamw(0))
    save_optimizer(source, tmp_path)
    opt = _stepped(_remainder_adamw(2), steps=1)
    live = {(id(p), n): t for p in opt.param_groups[0]["params"] for n, t in opt.state[p].items()}
    written: list[str] = []
    for method in ("set_scaled_state", "write_scaled_state_chunked"):
        original = getattr(opt, method)
        setattr(
            opt, method, lambda p, name, *a, _o=original: (written.append(name), _o(p, name, *a))
        )
    load_optimizer(opt, tmp_path)
    assert sorted(written) == ["exp_avg_sq"] * len(SHAPES)  # only the scaled fp16 state
    for p in opt.param_groups[0]["params"]:
        assert opt.state[p]["master_param"] is live[(id(p), "master_param")]
        assert opt.state[p]["master_param"].dtype == torch.int16
        assert opt.state[p]["exp_avg"] is live[(id(p), "exp_avg")]
    for p, q in zip(opt.param_groups[0]["params"], source.param_groups[0]["params"], strict=True):
        for name in ("master_param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][name], source.state[q][name]), name


def test_a_value_too_large_for_a_holders_storage_is_refused(tmp_path: Path) -> None:
    opt = _stepped(_remainder_adamw(0))
    state_dict = checkpoint_roundtrip(opt.state_dict())
    state_dict["state"][1]["exp_avg"][2] = 3.4e38  # beyond bf16, within FP32
    _dcp_save(state_dict, tmp_path)
    before = checkpoint_roundtrip(opt.state_dict())
    problem = r"param 1: state 'exp_avg' has a value of magnitude .* its bf16 storage"
    with pytest.raises(OptimizerCheckpointError, match=problem):
        load_optimizer(opt, tmp_path)
    assert_state_dict_equal(before, checkpoint_roundtrip(opt.state_dict()))


def test_every_zero_element_holder_state_is_written(tmp_path: Path) -> None:
    """Zero-element states have no read: each is written empty, after other states too, in
    the holder's dtype on the param's device (never the defaults)."""
    shapes = [(3,), (0,), (2, 0)]
    source = _stepped(_remainder_adamw(0, shapes))
    save_optimizer(source, tmp_path)
    fresh = _remainder_adamw(1, shapes)
    with _default_dtype(torch.float64):
        load_optimizer(fresh, tmp_path)
    for p, q in zip(fresh.param_groups[0]["params"], source.param_groups[0]["params"], strict=True):
        assert fresh.state[p].keys() == source.state[q].keys()
        for name, value in source.state[q].items():
            assert fresh.state[p][name].dtype == value.dtype, name
            assert torch.equal(fresh.state[p][name], value), name


def test_a_zero_element_param_of_a_torch_optimizer_round_trips(tmp_path: Path) -> None:
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(0))]
    source = _stepped(torch.optim.Adam(params, lr=0.1))
    save_optimizer(source, tmp_path)
    fresh = torch.optim.Adam([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1.0)
    load_optimizer(fresh, tmp_path)
    assert_state_dict_equal(
        checkpoint_roundtrip(source.state_dict()), checkpoint_roundtrip(fresh.state_dict())
    )


def test_a_holder_keeps_its_own_param_names(tmp_path: Path) -> None:
    from wrapped_optim.optimizers import PrecisionAwareAdamW

    def named(names: tuple[str, str], seed: int) -> Any:
        pairs = list(zip(names, _params(seed=seed), strict=True))
        return PrecisionAwareAdamW(pairs, lr=0.01, exp_avg_dtype=torch.bfloat16)

    source = _stepped(named(("a", "b"), 0))
    save_optimizer(source, tmp_path)
    opt = _stepped(named(("x", "y"), 2), steps=1)
    load_optimizer(opt, tmp_path)
    assert opt.param_groups[0]["param_names"] == ["x", "y"]
    assert opt.param_groups[0]["lr"] == 0.01


# ------------------------------------------------------------------------------------------
# Sharded (DTensor) params on a one-process gloo group's CPU mesh
# ------------------------------------------------------------------------------------------
@pytest.fixture
def mesh(one_process_group: None) -> DeviceMesh:
    return init_device_mesh("cpu", (torch.distributed.get_world_size(),))


def _sharded(mesh: DeviceMesh, seed: int) -> list[torch.nn.Parameter]:
    return [
        torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]))
        for p in _params(seed=seed)
    ]


def _sharded_step(opt: Any, seed: int = 1) -> Any:
    for p in opt.param_groups[0]["params"]:
        full = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))
        p.grad = distribute_tensor(full, p.device_mesh, p.placements)
    opt.step()
    return opt


def _locals(opt: Any, p: torch.Tensor, name: str) -> torch.Tensor:
    value = opt.state[p][name]
    return value.to_local() if isinstance(value, DTensor) else value


def test_a_sharded_param_without_state_is_refused(mesh: DeviceMesh, tmp_path: Path) -> None:
    source = _sharded_step(torch.optim.Adam(_sharded(mesh, 0), lr=0.1))
    save_optimizer(source, tmp_path)
    fresh = torch.optim.Adam(_sharded(mesh, 1), lr=0.1)
    with pytest.raises(OptimizerCheckpointError) as raised:
        load_optimizer(fresh, tmp_path)
    assert str(raised.value) == (
        "param 0: state 'step': the optimizer has no state for this sharded (DTensor) "
        "parameter yet; initialise it first (wrapped_optim.init_optimizer_state)"
    )


@pytest.mark.parametrize("kind", ["adam", "precision"])
def test_sharded_state_is_read_into_its_shards(kind: str, mesh: DeviceMesh, tmp_path: Path) -> None:
    from wrapped_optim.optimizers import PrecisionAwareAdamW

    def make(seed: int) -> Any:
        if kind == "adam":
            return torch.optim.Adam(_sharded(mesh, seed), lr=0.1)
        return PrecisionAwareAdamW(
            _sharded(mesh, seed), lr=0.1, exp_avg_dtype=torch.bfloat16,
            exp_avg_sq_dtype=torch.float16,
        )  # fmt: skip

    source = _sharded_step(make(0))
    save_optimizer(source, tmp_path)
    opt = _sharded_step(make(1), seed=5)
    live = {(id(p), n): t for p in opt.param_groups[0]["params"] for n, t in opt.state[p].items()}
    load_optimizer(opt, tmp_path)
    for p, q in zip(opt.param_groups[0]["params"], source.param_groups[0]["params"], strict=True):
        assert opt.state[p]["exp_avg"] is live[(id(p), "exp_avg")]  # in place
        for name in source.state[q]:
            assert torch.equal(_locals(opt, p, name), _locals(source, q, name)), name


# ------------------------------------------------------------------------------------------
# load_optimizer's arguments and errors
# ------------------------------------------------------------------------------------------
def test_load_optimizer_needs_a_checkpoint_id_or_a_reader() -> None:
    with pytest.raises(ValueError) as raised:
        load_optimizer(torch.optim.SGD(_params(), lr=0.1))
    assert str(raised.value) == "load_optimizer needs a checkpoint_id or a storage_reader"


@pytest.mark.parametrize("chunk_bytes", [True, 1.5, "64", 0])
def test_chunk_bytes_must_be_a_positive_int(chunk_bytes: Any, tmp_path: Path) -> None:
    opt = _stepped(torch.optim.SGD(_params(), lr=0.1, momentum=0.9))
    save_optimizer(opt, tmp_path)
    with pytest.raises(ValueError) as raised:
        load_optimizer(opt, tmp_path, chunk_bytes=chunk_bytes)
    assert str(raised.value) == (
        f"chunk_bytes must be a positive number of bytes, got {chunk_bytes!r}"
    )
    load_optimizer(opt, tmp_path, chunk_bytes=1)  # one byte is enough


def test_a_reader_alone_is_named_by_its_repr_when_unreadable(tmp_path: Path) -> None:
    opt = _stepped(torch.optim.SGD(_params(), lr=0.1, momentum=0.9))
    save_optimizer(opt, tmp_path / "ckpt")
    (tmp_path / "ckpt" / ".metadata").write_bytes(b"not a pickle")
    reader = FileSystemReader(tmp_path / "ckpt")
    with pytest.raises(OptimizerCheckpointError) as raised:
        load_optimizer(opt, storage_reader=reader)
    assert str(raised.value).startswith(f"cannot read the checkpoint {reader!r}: ")
    good = FileSystemReader(tmp_path / "good")
    save_optimizer(opt, tmp_path / "good")
    load_optimizer(opt, storage_reader=good)  # the reader given is the one read


class _FailingReset(FileSystemReader):
    """A reader that fails before DCP runs (while it is reset for the checkpoint_id)."""

    def reset(self, checkpoint_id: Any = None) -> None:
        raise OSError(errno.EIO, "planted", "the reader")


def test_an_os_error_before_reading_is_an_unreadable_checkpoint(tmp_path: Path) -> None:
    opt = _stepped(torch.optim.SGD(_params(), lr=0.1, momentum=0.9))
    save_optimizer(opt, tmp_path)
    with pytest.raises(OptimizerCheckpointError) as raised:
        load_optimizer(opt, tmp_path, storage_reader=_FailingReset(tmp_path))
    assert str(raised.value).splitlines()[0] == (
        f"cannot read the checkpoint {tmp_path}: the reader: OSError: planted"
    )
    assert isinstance(raised.value.__cause__, OSError)


def test_the_undo_journal_goes_to_journal_dir(tmp_path: Path) -> None:
    opt = _stepped(torch.optim.Adam(_params(), lr=0.01))
    save_optimizer(opt, tmp_path / "ckpt")
    before = checkpoint_roundtrip(opt.state_dict())
    with pytest.raises(UndoJournalError, match="missing"):
        load_optimizer(opt, tmp_path / "ckpt", journal_dir=tmp_path / "missing")
    assert_state_dict_equal(before, checkpoint_roundtrip(opt.state_dict()))
    load_optimizer(opt, tmp_path / "ckpt", journal_dir=tmp_path)


def test_errors_in_saved_entries_name_the_param_or_group(tmp_path: Path) -> None:
    holder = _stepped(ToyPrecisionMomentum(_params()))
    state_dict = checkpoint_roundtrip(holder.state_dict())
    state_dict["param_groups"][0]["step"] = -1
    _dcp_save(state_dict, tmp_path / "step")
    with pytest.raises(OptimizerCheckpointError, match=r"^param group 0: invalid step -1 "):
        load_optimizer(holder, tmp_path / "step")
    opt = _stepped(torch.optim.SGD(_params(), lr=0.1, momentum=0.9))
    state_dict = checkpoint_roundtrip(opt.state_dict())
    state_dict["state"][1] = 5
    _dcp_save(state_dict, tmp_path / "entry")
    with pytest.raises(OptimizerCheckpointError) as raised:
        load_optimizer(opt, tmp_path / "entry")
    assert str(raised.value) == "param 1: state must be a dict, got int"
