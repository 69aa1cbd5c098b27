"""``setup_optimizer`` on a machine without CUDA: Megatron's builders need it, and the error
says so and what runs on a CPU instead of torch's bare "Torch not compiled with CUDA enabled";
a config with Bridge's ``provide`` hook builds and steps there with real megatron-core."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from wrapped_optim.integrations.bridge import SchedulerConfig, setup_optimizer
from wrapped_optim.optimizers import PrecisionAwareAdamW
from wrapped_optim.stack import unwrap

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA"),
]

core = pytest.importorskip("megatron.core.optimizer")


@pytest.fixture
def parallel_state(tmp_path: Path) -> Iterator[Any]:
    """Megatron's model-parallel state (TP=PP=1) over a one-process gloo group."""
    from megatron.core import parallel_state as state

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                                world_size=1)  # fmt: skip
    state.initialize_model_parallel()
    try:
        yield state
    finally:
        state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()


def _model() -> torch.nn.Module:
    from megatron.core.distributed import DistributedDataParallelConfig

    model = torch.nn.Linear(4, 4)
    model.config = SimpleNamespace(use_mup=False)  # what Megatron's model chunks carry
    model.ddp_config = DistributedDataParallelConfig()
    return model


def _schedule() -> SchedulerConfig:
    return SchedulerConfig().with_steps(train_iters=10, global_batch_size=1)


def test_megatrons_builder_without_cuda_fails_with_what_to_do(parallel_state: Any) -> None:
    config = core.OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-5)
    with pytest.raises(RuntimeError, match="builds its optimizers on a CUDA device") as caught:
        setup_optimizer(config, _schedule(), [_model()])
    message, cause = str(caught.value), caught.value.__cause__
    # torch's words are kept: a CPU build says "Torch not compiled with CUDA enabled", a CUDA
    # build on a machine without a GPU "Found no NVIDIA driver on your system".
    assert isinstance(cause, AssertionError | RuntimeError) and str(cause) in message
    assert "`provide(model_chunks, **options)`" in message and "On a CPU" in message


def test_other_builder_errors_pass_unchanged(
    parallel_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(**kwargs: Any) -> Any:
        raise RuntimeError("a bad param group")

    monkeypatch.setattr(core, "get_megatron_optimizer", broken)
    config = core.OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-5)
    with pytest.raises(RuntimeError, match=r"^a bad param group$"):
        setup_optimizer(config, _schedule(), [_model()])


def test_a_provide_hook_builds_the_portable_stack_on_a_cpu() -> None:
    """The guide's CPU path: Megatron's config class with Bridge's hook, Megatron's scheduler."""

    class PortableConfig(core.OptimizerConfig):  # type: ignore[misc, name-defined]
        def provide(self, model_chunks: list[torch.nn.Module], **options: Any) -> Any:
            params = [p for chunk in model_chunks for p in chunk.parameters()]
            return PrecisionAwareAdamW(params, lr=self.lr, exp_avg_dtype=torch.bfloat16)

    model = _model()
    config = PortableConfig(optimizer="adam", lr=1e-3, min_lr=1e-5)
    optimizer, scheduler = setup_optimizer(config, _schedule(), [model])
    assert isinstance(unwrap(optimizer), PrecisionAwareAdamW)
    model(torch.randn(2, 4)).sum().backward()
    before = model.weight.detach().clone()
    optimizer.step()
    scheduler.step(increment=1)
    assert not torch.equal(model.weight, before)
