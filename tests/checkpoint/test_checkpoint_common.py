"""What the streaming save and load share (``wrapped_optim.checkpoint._common``): the error
that names an unreadable checkpoint's file and cause, which DCP failures are re-raised as
ours, the leaf finder's refusal of Megatron containers, and how saved keys are read back."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from wrapped_optim import OptimizerWrapper
from wrapped_optim._formats.errors import UndoJournalError
from wrapped_optim.checkpoint import OptimizerCheckpointError, load_optimizer
from wrapped_optim.checkpoint._common import (
    _int_key,
    _leaf_of,
    _path_of,
    _raise_ours,
    unreadable_checkpoint,
)
from wrapped_optim.testing import assert_state_dict_equal

_TAIL = (
    "\nNothing was loaded: the optimizer is as it was. The checkpoint is damaged or "
    "incomplete; load another one (the previous checkpoint) or save it again."
)


class _ShortRead(Exception):
    """A reader's error that names its file but has no ``strerror``."""

    def __init__(self, message: str, filename: Any) -> None:
        super().__init__(message)
        self.filename = filename


def _sgd() -> torch.optim.SGD:
    return torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)


def test_an_error_without_a_file_is_named_by_the_checkpoint() -> None:
    error = unreadable_checkpoint("ckpt", ValueError("bad bytes\nsecond line"))
    assert str(error) == f"cannot read the checkpoint ckpt: ckpt: ValueError: bad bytes{_TAIL}"
    assert isinstance(error, OptimizerCheckpointError)


def test_an_os_error_names_its_file_and_strerror() -> None:
    error = FileNotFoundError(2, "No such file or directory", "/data/ckpt/__0_0.distcp")
    message = str(unreadable_checkpoint("/data/ckpt", error)).splitlines()[0]
    assert message == (
        "cannot read the checkpoint /data/ckpt: /data/ckpt/__0_0.distcp: FileNotFoundError: "
        "No such file or directory"
    )


def test_a_file_under_the_pinned_directory_is_named_under_the_checkpoint() -> None:
    error = PermissionError(13, "Permission denied", "/proc/self/fd/17/__1_0.distcp")
    message = str(unreadable_checkpoint("/data/ckpt/", error)).splitlines()[0]
    assert message.endswith(": /data/ckpt/__1_0.distcp: PermissionError: Permission denied")
    text = _ShortRead("torn /proc/self/fd/3/__0_0.distcp", "/proc/self/fd/3/__0_0.distcp")
    message = str(unreadable_checkpoint("/data/runX", text)).splitlines()[0]
    assert message.endswith(": /data/runX/__0_0.distcp: _ShortRead: torn /data/runX/__0_0.distcp")


def test_an_error_without_strerror_gives_its_text_with_pinned_paths_renamed() -> None:
    error = _ShortRead("short read of /proc/self/fd/9/__0_0.distcp", "/proc/self/fd/9/__0_0.distcp")
    message = str(unreadable_checkpoint("/data/ckpt/", error)).splitlines()[0]
    assert message == (
        "cannot read the checkpoint /data/ckpt/: /data/ckpt/__0_0.distcp: _ShortRead: "
        "short read of /data/ckpt/__0_0.distcp"
    )
    elsewhere = _ShortRead("short read", "/data/other/__0_0.distcp")
    assert str(unreadable_checkpoint("/data/ckpt", elsewhere)).splitlines()[0] == (
        "cannot read the checkpoint /data/ckpt: /data/other/__0_0.distcp: _ShortRead: short read"
    )


@pytest.mark.parametrize("filename", ["", 7, None])
def test_an_empty_or_non_path_filename_is_not_a_file(filename: Any) -> None:
    error = _ShortRead("gone", filename)
    message = str(unreadable_checkpoint("ckpt", error)).splitlines()[0]
    assert message == "cannot read the checkpoint ckpt: ckpt: _ShortRead: gone"


def test_the_cause_is_its_first_line_cut_to_300_characters() -> None:
    long = "x" * 400
    message = str(unreadable_checkpoint("c", RuntimeError(f"  {long}\nrest  "))).splitlines()
    assert message[0] == f"cannot read the checkpoint c: c: RuntimeError: {'x' * 300}"
    empty = str(unreadable_checkpoint("c", RuntimeError("")))
    assert empty.splitlines()[0] == "cannot read the checkpoint c: c: RuntimeError: "


def test_dcp_failures_are_named_per_rank_only_when_there_are_several() -> None:
    one = CheckpointException("load", {0: (ValueError("torn"), None)})
    assert str(unreadable_checkpoint("c", one)).splitlines()[0] == (
        "cannot read the checkpoint c: c: ValueError: torn"
    )
    several = CheckpointException(
        "load",
        {0: (ValueError("torn"), None), 3: KeyError("w"), 5: ("not an error", None)},  # type: ignore[dict-item]
    )
    assert str(unreadable_checkpoint("c", several)).splitlines()[0] == (
        "cannot read the checkpoint c: c: ValueError: torn (rank 0); c: KeyError: 'w' (rank 3)"
    )


@pytest.mark.parametrize(
    "ours",
    [OptimizerCheckpointError("bad shape"), UndoJournalError("no space"), KeyboardInterrupt()],
)
@pytest.mark.parametrize("wrapped", [True, False])
def test_our_errors_and_interrupts_inside_dcp_are_raised_as_they_are(
    ours: BaseException, wrapped: bool
) -> None:
    failure = (ours, None) if wrapped else ours
    exc = CheckpointException("load", {0: (RuntimeError("other"), None), 1: failure})  # type: ignore[dict-item]
    with pytest.raises(type(ours)) as raised:
        _raise_ours(exc)
    assert raised.value is ours
    assert raised.value.__suppress_context__


def test_foreign_errors_inside_dcp_are_left_to_the_caller() -> None:
    exc = CheckpointException("load", {0: (RuntimeError("x"), None), 1: ValueError("y")})  # type: ignore[dict-item]
    assert _raise_ours(exc) is None


def test_the_leaf_of_a_wrapped_torch_optimizer_is_found() -> None:
    sgd = _sgd()
    assert _leaf_of(OptimizerWrapper(sgd)) is sgd
    assert _leaf_of(sgd) is sgd


def test_megatron_containers_are_refused_naming_their_leaves() -> None:
    with pytest.raises(TypeError) as one:
        _leaf_of(SimpleNamespace(optimizer=_sgd()))
    assert str(one.value) == (
        "save_optimizer/load_optimizer stream the state of one torch optimizer (possibly "
        "wrapped); this stack holds 1 leaf optimizer(s) (SGD) inside Megatron containers. "
        "Checkpoint Megatron optimizers through sharded_state_dict."
    )
    chained = SimpleNamespace(chained_optimizers=[_sgd(), torch.optim.Adam([torch.ones(1)])])
    with pytest.raises(TypeError, match=r"holds 2 leaf optimizer\(s\) \(SGD, Adam\) inside"):
        _leaf_of(chained)
    with pytest.raises(TypeError, match=r"holds 0 leaf optimizer\(s\) \(none\) inside"):
        _leaf_of(SimpleNamespace(chained_optimizers=[]))
    with pytest.raises(TypeError, match=r"holds 1 leaf optimizer\(s\) \(NoneType\) inside"):
        _leaf_of(SimpleNamespace(optimizer=None))  # a stub rank


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("3", 3),
        ("-2", -2),
        ("0", 0),
        ("lr", "lr"),
        ("1.5", "1.5"),
        (4, 4),
        ("", ""),
        ("-", "-"),
        ("X1", "X1"),
        # not ints, though str.isdigit() says their characters are digits: int() refuses them
        ("--1", "--1"),
        ("\u00b2", "\u00b2"),
        ("1\n", "1\n"),
    ],
)
def test_saved_keys_that_were_ints_come_back_as_ints(key: Any, expected: Any) -> None:
    assert _int_key(key) == expected
    assert type(_int_key(key)) is type(expected)


def test_a_key_path_comes_from_the_planner_data_or_is_the_key_itself() -> None:
    metadata = Metadata(state_dict_metadata={}, planner_data={"state.0.exp_avg": ["state", 0]})
    assert _path_of(metadata, "state.0.exp_avg") == ("state", 0)
    assert _path_of(metadata, "other") == ("other",)
    assert _path_of(Metadata(state_dict_metadata={}), "w") == ("w",)
    assert _path_of(Metadata(state_dict_metadata={}, planner_data=[1]), "w") == ("w",)


def test_a_state_key_that_only_looks_numeric_is_named_as_no_param(tmp_path: Path) -> None:
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    param.grad = torch.ones(2)
    opt.step()
    saved = opt.state_dict()
    saved["state"] = {"\u00b2": saved["state"][0]}  # "²": a digit to str.isdigit(), not to int()
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(OptimizerCheckpointError) as raised:
        load_optimizer(opt, tmp_path)
    assert str(raised.value).startswith(
        "param '\u00b2': the checkpoint has state for a param that no param group lists"
    )
    assert_state_dict_equal(opt.state_dict(), before)
