"""What an atomic streaming load keeps to undo itself (``wrapped_optim.checkpoint._undo``):
the bytes it overwrites go to the journal, the state entries, group options and a holder's
tables are put back, and a hybrid's own loader is undone through its ``load_undo()``."""

from __future__ import annotations

import copy
import os
import threading
from pathlib import Path

import pytest
import torch

import wrapped_optim.checkpoint._journal as journal_module
from wrapped_optim._formats.errors import UndoJournalError
from wrapped_optim.checkpoint._undo import _Undo
from wrapped_optim.optimizers import HybridOffloadOptimizer, PrecisionAwareAdamW
from wrapped_optim.testing import assert_state_dict_equal


def _stepped(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.full_like(p, 0.5)
    opt.step()
    return opt


def _adam() -> tuple[torch.optim.Adam, list[torch.nn.Parameter]]:
    params = [torch.nn.Parameter(torch.arange(4.0)), torch.nn.Parameter(torch.ones(3))]
    return _stepped(torch.optim.Adam(params, lr=0.1)), params  # type: ignore[return-value]


def _open_fds() -> int:
    """Descriptors open in this process, once closed journals have finished closing."""
    while journal_module._CLOSING:
        journal_module._CLOSING.pop().join()
    return len(os.listdir("/proc/self/fd"))


def test_restore_puts_back_written_bytes_entries_and_options(tmp_path: Path) -> None:
    opt, (a, b) = _adam()
    before = copy.deepcopy(opt.state_dict())
    entry_a, exp_avg = opt.state[a], opt.state[a]["exp_avg"]
    writes = [("a.exp_avg", exp_avg), ("b.exp_avg_sq", opt.state[b]["exp_avg_sq"])]
    undo = _Undo.take(opt, writes, with_params=False, journal_dir=tmp_path, piece_bytes=8)
    assert (undo.journal.directory, undo.journal.piece_bytes) == (os.fspath(tmp_path), 8)
    undo.keep("a.exp_avg")
    exp_avg.fill_(7.0)  # the load reads into the live tensor...
    undo.keep("b.exp_avg_sq")
    opt.state[b]["exp_avg_sq"].zero_()
    entry_a["step"] = torch.tensor(99.0)  # ...replaces entries, adds and drops some
    entry_a["extra"] = torch.ones(1)
    del opt.state[b]
    opt.state[torch.nn.Parameter(torch.ones(1))] = {"step": torch.tensor(1.0)}
    opt.param_groups[0]["lr"] = 0.5
    undo.restore()
    undo.close()
    assert_state_dict_equal(opt.state_dict(), before)
    assert opt.state[a] is entry_a and opt.state[a]["exp_avg"] is exp_avg  # the same objects
    assert list(opt.state) == [a, b]
    assert opt.param_groups[0]["lr"] == 0.1


@pytest.mark.parametrize("with_params", [True, False])
def test_params_are_journaled_only_under_a_wrapper(with_params: bool, tmp_path: Path) -> None:
    opt, (a, b) = _adam()
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.2})
    weights = [a.detach().clone(), b.detach().clone()]
    undo = _Undo.take(opt, [], with_params=with_params, journal_dir=tmp_path)
    with torch.no_grad():
        a.fill_(3.0)  # a wrapper's sync_after_load() writes the weights
        b.fill_(3.0)
    undo.restore()
    undo.close()
    if with_params:
        assert torch.equal(a, weights[0]) and torch.equal(b, weights[1])
    else:
        assert torch.equal(a, torch.full((4,), 3.0)) and torch.equal(b, torch.full((3,), 3.0))


def test_no_room_for_the_regions_and_params_is_refused_before_anything_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opt, (a, _) = _adam()
    writes = [("a.exp_avg", opt.state[a]["exp_avg"])]  # 16 bytes; the params take 28
    room = {"bytes": 0}
    monkeypatch.setattr(journal_module, "_free_bytes", lambda fd: room["bytes"])
    headers = journal_module._HEADER.size * 2  # one region, plus one
    fds = _open_fds()
    room["bytes"] = 16 + 28 + headers - 1
    with pytest.raises(UndoJournalError, match=f"needs {16 + 28 + headers:,} bytes"):
        _Undo.take(opt, writes, with_params=True, journal_dir=tmp_path)
    assert _open_fds() == fds  # the journal was closed
    room["bytes"] = 16 + 28 + headers
    _Undo.take(opt, writes, with_params=True, journal_dir=tmp_path).close()
    room["bytes"] = 16 + headers
    _Undo.take(opt, writes, with_params=False, journal_dir=tmp_path).close()


def test_each_param_is_journaled_at_once_and_nothing_more(tmp_path: Path) -> None:
    opt, _ = _adam()
    undo = _Undo.take(opt, [], with_params=True, journal_dir=tmp_path)
    assert undo.journal.written == (4 + 3) * 4  # the two params' bytes, before any read
    undo.close()


def test_a_holders_scales_are_put_back_with_its_stored_state(tmp_path: Path) -> None:
    params = [torch.nn.Parameter(torch.linspace(-1, 1, 8))]
    opt = _stepped(PrecisionAwareAdamW(params, lr=0.1, exp_avg_dtype=torch.uint8))
    before = copy.deepcopy(opt.state_dict())
    entry = opt.state[params[0]]
    tensors = dict(entry)
    stored = [(("s", name), t) for name, t in entry.items() if t.numel() > 1]
    undo = _Undo.take(opt, stored, with_params=False, journal_dir=tmp_path)
    assert undo.tables is not None
    for key, _ in stored:
        undo.keep(key)
    for p in params:
        p.grad = torch.full_like(p, -4.0)
    opt.step()  # writes the stored state in place and rescales it
    stepped = params[0].detach().clone()
    undo.restore()
    undo.close()
    assert_state_dict_equal(opt.state_dict(), before)
    # the same entry and tensors (a wrapper may alias them), not copies taken at the start
    assert opt.state[params[0]] is entry
    assert all(entry[name] is tensor for name, tensor in tensors.items())
    assert torch.equal(params[0], stepped)  # no wrapper: the weights were not kept


def test_a_hybrids_own_loader_waits_for_its_regions_even_with_the_worker_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal's worker normally keeps every planned region long before the load writes;
    held back here until the loader has written, it leaves before_install() to journal what
    the hybrid's own loader overwrites, in the calling thread, so the rollback still has the
    old bytes."""
    release = threading.Event()
    work = journal_module.UndoJournal._work

    def held_back(journal: journal_module.UndoJournal) -> None:
        release.wait(timeout=30)
        work(journal)

    monkeypatch.setattr(journal_module.UndoJournal, "_work", held_back)
    params = [torch.nn.Parameter(torch.arange(6.0)), torch.nn.Parameter(torch.ones(4))]
    opt = _stepped(HybridOffloadOptimizer(params, offload_fraction=0.5, lr=0.1))
    before = copy.deepcopy(opt.state_dict())
    undo = _Undo.take(opt, [], with_params=False, journal_dir=tmp_path)
    assert undo.own is not None and undo.installs
    undo.before_install()
    changed = copy.deepcopy(before)
    with torch.no_grad():
        for entry in changed["state"].values():
            for name, value in entry.items():
                if name != "step":
                    value.fill_(2.0)
    opt.load_state_dict(changed)  # writes the sub-optimizers' tensors in place
    release.set()  # the worker now finds the regions kept (or would keep the new bytes)
    undo.restore()
    undo.close()
    assert_state_dict_equal(opt.state_dict(), before)


def test_a_plain_optimizer_keeps_no_tables_and_no_own_undo(tmp_path: Path) -> None:
    opt, _ = _adam()
    undo = _Undo.take(opt, [], with_params=False, journal_dir=tmp_path)
    assert undo.tables is None and undo.own is None and undo.installs == []
    undo.before_install()  # nothing of its own loader to journal
    undo.close()


def test_a_hybrids_own_loader_is_journaled_and_undone(tmp_path: Path) -> None:
    params = [torch.nn.Parameter(torch.arange(6.0)), torch.nn.Parameter(torch.ones(4))]
    opt = _stepped(HybridOffloadOptimizer(params, offload_fraction=0.5, lr=0.1))
    before = copy.deepcopy(opt.state_dict())
    subs = [copy.deepcopy(sub.state_dict()) for sub in opt.sub_optimizers]
    undo = _Undo.take(opt, [], with_params=False, journal_dir=tmp_path)
    assert undo.own is not None
    overwrites = list(undo.own.overwrites)
    assert overwrites and [key for key, _ in undo.installs] == [
        ("install", i) for i in range(len(overwrites))
    ]
    assert all(t is o for (_, t), o in zip(undo.installs, overwrites, strict=True))
    undo.before_install()
    changed = copy.deepcopy(before)
    changed["param_groups"][0]["lr"] = 0.5
    with torch.no_grad():
        for entry in changed["state"].values():
            for name, value in entry.items():
                if name != "step":
                    value.fill_(2.0)
    opt.load_state_dict(changed)  # its own loader writes the sub-optimizers in place
    with torch.no_grad():
        for tensor in overwrites:
            tensor.fill_(5.0)
    undo.restore()
    undo.close()
    assert_state_dict_equal(opt.state_dict(), before)
    for sub, saved in zip(opt.sub_optimizers, subs, strict=True):
        assert_state_dict_equal(sub.state_dict(), saved)
