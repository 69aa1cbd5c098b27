"""``save_optimizer`` coordinates over the process group it is given
(``wrapped_optim.checkpoint._save``), in the calling thread and in an asynchronous save's.
Real gloo, two processes: this test's process is global rank 1 and saves alone in the
subgroup ``[1]``; a helper process, global rank 0, never enters a collective, so a save that
used the default group would wait for it and fail after the group's timeout. And with
``refuse_non_finite`` every rank refuses when one rank's state is not finite."""

from __future__ import annotations

import contextlib
import multiprocessing
import traceback
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from wrapped_optim.checkpoint import save_optimizer

WORLD = 2
COLLECTIVE_TIMEOUT = timedelta(seconds=10)  # a collective on the wrong group fails after this
START_TIMEOUT = timedelta(seconds=120)  # the helper importing torch on a busy machine


@contextlib.contextmanager
def _as_rank_0(port: int) -> Iterator[dist.TCPStore]:
    """A spawned helper's side: global rank 0 of the gloo group that ``_as_rank_1`` serves;
    an exception inside is reported as the helper's result, and the group is torn down."""
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=START_TIMEOUT)
    try:
        store.set("up/0", "1")
        dist.init_process_group(
            "gloo", store=store, rank=0, world_size=WORLD, timeout=COLLECTIVE_TIMEOUT
        )
        yield store
    except BaseException:
        store.set("result/0", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _helper(port: int) -> None:
    with _as_rank_0(port) as store:
        dist.new_group([1])  # every rank creates every group
        store.wait(["done"], START_TIMEOUT)
        store.set("result/0", "ok")


def _read_back(path: Path, shape: torch.Size) -> torch.Tensor:
    out = {"state": {0: {"exp_avg": torch.zeros(shape)}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, checkpoint_id=path, no_dist=True)
    return out["state"][0]["exp_avg"]


@contextlib.contextmanager
def _as_rank_1(helper: Callable[[int], None], **values: str) -> Iterator[dist.TCPStore]:
    """This process as global rank 1 of a real gloo group, ``helper`` spawned as rank 0 (the
    store holding ``values`` first); on exit the helper is told it is done and joined."""
    assert not dist.is_initialized()
    store = dist.TCPStore(
        "127.0.0.1", 0, WORLD, is_master=True, timeout=START_TIMEOUT, wait_for_workers=False
    )
    for key, value in values.items():
        store.set(key, value)
    process = multiprocessing.get_context("spawn").Process(target=helper, args=(store.port,))
    process.start()
    try:
        store.wait(["up/0"], START_TIMEOUT)
        dist.init_process_group(
            "gloo", store=store, rank=1, world_size=WORLD, timeout=COLLECTIVE_TIMEOUT
        )
        try:
            yield store
        finally:
            store.set("done", "1")
            dist.destroy_process_group()
        process.join(START_TIMEOUT.total_seconds())
    finally:
        store.set("done", "1")
        if process.is_alive():
            process.kill()
            process.join()


@pytest.mark.slow  # about 5 s: a helper process starts and imports torch
def test_a_save_in_a_subgroup_waits_for_the_subgroup_only(tmp_path: Path) -> None:
    with _as_rank_1(_helper) as store:
        group = dist.new_group([1])
        param = torch.nn.Parameter(torch.ones(4, 2))
        opt = torch.optim.AdamW([param], lr=0.1)
        param.grad = torch.linspace(-1.0, 1.0, 8).reshape(4, 2)
        opt.step()
        # refuse_non_finite: its ranks agree over the subgroup too (a one-rank group: no
        # collective at all)
        save_optimizer(
            opt, tmp_path / "sync", process_group=group, chunk_bytes=8, refuse_non_finite=True
        )
        future = save_optimizer(
            opt,
            tmp_path / "async",
            process_group=group,
            chunk_bytes=8,
            async_=True,
            refuse_non_finite=True,
        )
        future.result(timeout=START_TIMEOUT.total_seconds())
        for name in ("sync", "async"):
            read = _read_back(tmp_path / name, param.shape)
            assert torch.equal(read, opt.state[param]["exp_avg"]), name
    assert store.get("result/0").decode() == "ok"


def _refusing_helper(port: int) -> None:
    """Global rank 0: its own state holds an inf; it saves with refuse_non_finite."""
    with _as_rank_0(port) as store:
        opt = _stepped(torch.tensor([1.0, float("inf"), 3.0, 4.0]))
        try:
            save_optimizer(opt, store.get("path").decode(), refuse_non_finite=True)
            store.set("result/0", "saved")
        except ValueError as exc:
            store.set("result/0", str(exc))
        store.wait(["done"], START_TIMEOUT)


def _stepped(grad: torch.Tensor) -> torch.optim.Optimizer:
    param = torch.nn.Parameter(torch.ones_like(grad))
    opt = torch.optim.AdamW([param], lr=0.1)
    param.grad = grad
    opt.step()
    return opt


@pytest.mark.slow  # about 5 s: a helper process starts and imports torch
def test_every_rank_refuses_when_one_ranks_state_is_not_finite(tmp_path: Path) -> None:
    """Rank 1's state is finite, rank 0's (its shard, in a sharded run) is not: both raise at
    once, and nothing is written. Rank 1 used to go on into the save's first collective and
    wait there for rank 0, which had refused, until the group's timeout."""
    target = tmp_path / "refused"
    with _as_rank_1(_refusing_helper, path=str(target)) as store:
        opt = _stepped(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        with pytest.raises(ValueError) as refused:
            save_optimizer(opt, target, refuse_non_finite=True)
        store.wait(["result/0"], START_TIMEOUT)
        own = store.get("result/0").decode()
    assert own.startswith("param 0: state 'exp_avg' holds non-finite values"), own
    assert str(refused.value) == f"rank 0 of the save's process group refused it: {own}"
    assert not target.exists() and list(tmp_path.iterdir()) == []
