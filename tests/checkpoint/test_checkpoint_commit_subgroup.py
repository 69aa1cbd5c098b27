"""A save committed in a process subgroup that leaves out global rank 0
(``wrapped_optim.checkpoint._commit``): the subgroup's own rank 0 coordinates, and every
barrier is the subgroup's. Real gloo, three processes: this test's process is global rank 1
(the subgroup's rank 0, so that the commit's calls are seen here), two helper processes are
global ranks 0 and 2."""

from __future__ import annotations

import multiprocessing
import os
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from wrapped_optim.checkpoint._commit import CheckpointCommit

WORLD = 3
SUBGROUP = [1, 2]
# A barrier on the wrong group (global rank 0 never enters one) fails after this, not never.
COLLECTIVE_TIMEOUT = timedelta(seconds=10)
START_TIMEOUT = timedelta(seconds=120)  # a helper process importing torch on a busy machine


def _save_in_subgroup(rank: int, target: Path) -> None:
    """What a rank of the subgroup does: two saves, one committed, one aborted."""
    group = dist.new_group(SUBGROUP)
    commit = CheckpointCommit(target, group)
    commit.prepare()
    assert commit.staging.is_dir(), "the staging directory is made before any rank goes on"
    (commit.staging / f"__{rank}_0.distcp").write_text(f"data {rank}")
    dist.barrier(group)  # as DCP does: every rank has written before the commit
    commit.commit()
    assert sorted(os.listdir(target)) == ["__1_0.distcp", "__2_0.distcp"], os.listdir(target)
    failed = CheckpointCommit(target, group)
    failed.prepare()
    failed.abort()
    dist.barrier(group)
    assert not failed.staging.exists(), "the aborted save's staging directory stays"
    assert os.listdir(target.parent) == ["ckpt"]  # the lock released and removed


def _helper(rank: int, port: int, target: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=START_TIMEOUT)
    try:
        store.set(f"up/{rank}", "1")
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=WORLD, timeout=COLLECTIVE_TIMEOUT
        )
        if rank in SUBGROUP:
            _save_in_subgroup(rank, Path(target))
        else:
            dist.new_group(SUBGROUP)  # every rank creates every group
            store.wait(["done"], START_TIMEOUT)
        store.set(f"result/{rank}", "ok")
    except BaseException:
        store.set(f"result/{rank}", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow  # about 8 s: two helper processes start and import torch
def test_the_subgroups_rank_zero_commits_and_only_the_subgroup_waits(tmp_path: Path) -> None:
    assert not dist.is_initialized()
    store = dist.TCPStore(
        "127.0.0.1", 0, WORLD, is_master=True, timeout=START_TIMEOUT, wait_for_workers=False
    )
    target = tmp_path / "ckpt"
    spawn = multiprocessing.get_context("spawn")
    helpers = [
        spawn.Process(target=_helper, args=(rank, store.port, str(target))) for rank in (0, 2)
    ]
    for helper in helpers:
        helper.start()
    try:
        store.wait(["up/0", "up/2"], START_TIMEOUT)
        dist.init_process_group(
            "gloo", store=store, rank=1, world_size=WORLD, timeout=COLLECTIVE_TIMEOUT
        )
        try:
            _save_in_subgroup(1, target)
        finally:
            store.set("done", "1")
            dist.destroy_process_group()
        for helper in helpers:
            helper.join(START_TIMEOUT.total_seconds())
        results = {rank: store.get(f"result/{rank}").decode() for rank in (0, 2)}
        assert results == {0: "ok", 2: "ok"}, results
    finally:
        store.set("done", "1")
        for helper in helpers:
            if helper.is_alive():
                helper.kill()
                helper.join()
