"""Wrapping real megatron-core optimizers (which are not torch Optimizers)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from tests.doubles.megatron_cpu import ChainedOptimizer, cpu_fp32_optimizer, megatron_group
from wrapped_optim import OptimizerWrapper
from wrapped_optim._adapters import walk_leaves


@pytest.fixture(scope="module", autouse=True)
def single_process_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """megatron-core asks torch.distributed for the rank when it warns about stubs."""
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_wrapping_a_megatron_optimizer() -> None:
    param = torch.nn.Parameter(torch.ones(3))
    leaf = torch.optim.AdamW([megatron_group([param])], lr=0.1)
    opt = OptimizerWrapper(cpu_fp32_optimizer(leaf))
    assert opt.param_groups is leaf.param_groups
    assert opt.state is leaf.state
    assert torch.equal(opt.get_loss_scale(), torch.tensor([1.0]))
    param.grad = torch.ones(3)
    success, grad_norm, zeros = opt.step()  # Megatron's step takes no closure
    assert success is True and grad_norm is None and zeros is None
    assert bool((param < 1).all())
    opt.zero_grad()
    assert param.grad is None
    opt.reload_model_params()  # Megatron API forwarded
    state = opt.state_dict()
    opt.load_state_dict(state)
    assert opt.state_dict()["state"][0]["step"] == 1


def test_wrapping_a_megatron_chained_optimizer() -> None:
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    leaves = [torch.optim.AdamW([megatron_group([p])], lr=0.1) for p in params]
    chained = ChainedOptimizer([cpu_fp32_optimizer(leaf) for leaf in leaves])
    opt = OptimizerWrapper(chained)

    assert [g["params"][0] for g in opt.param_groups] == params
    assert opt.chained_optimizers is chained.chained_optimizers
    assert opt.is_stub_optimizer is False
    assert opt.config.lr == 0.1
    opt.state[(0, params[0])] = {"marker": 1}  # ChainedOptimizer's ProxyDict, forwarded
    assert leaves[0].state[params[0]] == {"marker": 1}
    leaves[0].state.clear()

    contexts = list(walk_leaves(opt))
    assert [c.optimizer for c in contexts] == leaves
    assert [c.container for c in contexts] == chained.chained_optimizers
    assert all(c.config == chained.config and not c.is_stub for c in contexts)

    state = opt.state_dict()
    assert isinstance(state, list) and len(state) == 2
    opt.load_state_dict(state)
    assert repr(opt) == "OptimizerWrapper()\n└─ ChainedOptimizer(param_groups=2)"


def test_walk_marks_megatron_stubs() -> None:
    param = torch.nn.Parameter(torch.ones(2))
    real = cpu_fp32_optimizer(torch.optim.SGD([param], lr=0.1))
    stub = cpu_fp32_optimizer(None, lr=0.1)
    contexts = list(walk_leaves(ChainedOptimizer([stub, real])))
    assert [(c.optimizer is None, c.is_stub, c.index) for c in contexts] == [
        (True, True, 0),
        (False, False, 1),
    ]
