from __future__ import annotations

import builtins
import importlib
import subprocess
import sys
import textwrap
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from wrapped_optim import OptimizerWrapper
from wrapped_optim._adapters import config_flag, megatron_available, walk_leaves
from wrapped_optim._adapters.megatron import megatron_optimizer_module


# Kept: the walk goes by structure so that it needs no Megatron, and these carry shapes Core
# refuses (nested chains, a context-less container); the real classes: test_walk_real_classes.
class Container:
    """Structural double of a Megatron optimizer: ``.optimizer`` plus context."""

    def __init__(self, optimizer: Any, **context: Any) -> None:
        self.optimizer = optimizer
        for key, value in context.items():
            setattr(self, key, value)

    def step(self) -> None:
        self.optimizer.step()

    def state_dict(self) -> Any:
        return self.optimizer.state_dict()


class Chain:
    def __init__(self, *children: Any) -> None:
        self.chained_optimizers = list(children)

    def step(self) -> None:
        for child in self.chained_optimizers:
            child.step()

    def state_dict(self) -> Any:
        return [child.state_dict() for child in self.chained_optimizers]


def sgd() -> torch.optim.SGD:
    return torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)


def test_walk_plain_and_wrapped() -> None:
    leaf = sgd()
    for stack in (leaf, OptimizerWrapper(leaf), OptimizerWrapper(OptimizerWrapper(leaf))):
        (context,) = walk_leaves(stack)
        assert context.optimizer is leaf and context.container is None
        assert context.config is None and not context.is_stub


def test_walk_through_nested_containers_with_context() -> None:
    a, b, c = sgd(), sgd(), sgd()
    config = SimpleNamespace(use_precision_aware_optimizer=True)
    ddp = SimpleNamespace(use_megatron_fsdp=False)
    first = Container(a, config=config, ddp_config=ddp, is_stub_optimizer=False)
    # A leaf wrapped by one of our wrappers inside a container is still found.
    second = Container(OptimizerWrapper(b), config=config)
    stub = Container(None, config=config, is_stub_optimizer=True)
    stack = OptimizerWrapper(Chain(first, Chain(second, stub), Container(c)))
    contexts = list(walk_leaves(stack))
    assert [ctx.optimizer for ctx in contexts] == [a, b, None, c]
    assert [ctx.index for ctx in contexts] == [0, 1, 2, 3]
    assert contexts[0].config is config and contexts[0].ddp_config is ddp
    assert contexts[1].container is second and contexts[1].ddp_config is None
    assert contexts[2].is_stub and not contexts[3].is_stub
    assert contexts[3].config is None


def test_walk_real_classes() -> None:
    """The walk over megatron-core's real ChainedOptimizer of real FP32Optimizers (one
    config across the chain, as Core asserts), one of them around a wrapped leaf."""
    from tests.doubles.megatron_cpu import ChainedOptimizer, OptimizerConfig, cpu_fp32_optimizer

    a, b = sgd(), sgd()
    containers = [cpu_fp32_optimizer(a), cpu_fp32_optimizer(OptimizerWrapper(b))]
    chain = ChainedOptimizer(containers)
    contexts = list(walk_leaves(OptimizerWrapper(chain)))
    assert [ctx.optimizer for ctx in contexts] == [a, b]
    assert [ctx.container for ctx in contexts] == containers
    assert [ctx.index for ctx in contexts] == [0, 1]
    for ctx, container in zip(contexts, containers, strict=True):
        assert isinstance(ctx.config, OptimizerConfig) and ctx.config is container.config
        assert ctx.ddp_config is None and not ctx.is_stub  # FP32Optimizer has no DDP config


def test_walk_rejects_unknown_objects() -> None:
    with pytest.raises(TypeError, match="cannot find the torch optimizer inside a str"):
        list(walk_leaves("not an optimizer"))


def test_config_flag() -> None:
    assert config_flag(SimpleNamespace(flag=1), "flag") is True
    assert config_flag(SimpleNamespace(), "flag") is False
    assert config_flag(None, "flag") is False


def test_megatron_detected_here() -> None:
    assert megatron_available() is True
    assert megatron_optimizer_module().__name__ == "megatron.core.optimizer"


def test_absent_megatron_is_a_normal_path(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_megatron(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("megatron"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_megatron)
    monkeypatch.setattr(importlib, "import_module", lambda name: no_megatron(name))
    with pytest.raises(ImportError, match=r"wrapped-optim\[megatron\]"):
        megatron_optimizer_module()


def test_package_imports_without_optional_packages() -> None:
    # A fresh interpreter in which megatron and transformer_engine cannot be imported.
    code = textwrap.dedent(
        """
        import sys
        OPTIONAL = ("megatron", "transformer_engine", "megatron_fsdp")
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in OPTIONAL:
                    raise ModuleNotFoundError(name)
        sys.meta_path.insert(0, Block())
        import torch, wrapped_optim
        from wrapped_optim._adapters import megatron_available, walk_leaves
        assert megatron_available() is False
        param = torch.zeros(1, requires_grad=True)
        opt = wrapped_optim.OptimizerWrapper(torch.optim.SGD([param], lr=1))
        assert len(list(walk_leaves(opt))) == 1
        assert not any(m.split(".")[0] in OPTIONAL for m in sys.modules)
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
