"""Generic "move the optimizer state to the device" code must not move the host state.

Lightning's ``_optimizer_to_device`` (after every resume) and user loops write
``optimizer.state[p][name] = tensor.to(device)``; the host params' exposed state takes such
writes into its own tensors, which stay where they are.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
import torch

from wrapped_optim import HybridSyncOptimizer
from wrapped_optim.optimizers import HybridOffloadOptimizer, PrecisionAwareAdamW

Mover = Callable[[Any], None]


def loop_move(device: str) -> Mover:
    """What such utilities do (every key but ``step``), to ``device``."""

    def move(opt: Any) -> None:
        for state in opt.state.values():
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor):
                    state[key] = value.to(device)

    return move


def loop_clone(opt: Any) -> None:
    """A write of a new tensor with the same values over every state, ``step`` included."""
    for state in opt.state.values():
        for key, value in list(state.items()):
            if isinstance(value, torch.Tensor):
                state[key] = value.clone()


def lightning_move(opt: Any) -> None:
    optimizer = pytest.importorskip("lightning.fabric.utilities.optimizer")
    optimizer._optimizer_to_device(opt, torch.device("meta"))


BUILDS: dict[str, Callable[[list[torch.nn.Parameter]], Any]] = {
    # bf16 params: the fused host step; FP32 params: torch's fused AdamW.
    "torch": lambda params: HybridOffloadOptimizer(params, offload_fraction=1.0, lr=0.01),
    "holder": lambda params: HybridOffloadOptimizer(
        params,
        offload_fraction=1.0,
        cpu_optimizer_cls=PrecisionAwareAdamW,
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16,
        lr=0.01,
    ),
    "wrapped": lambda params: HybridSyncOptimizer(
        HybridOffloadOptimizer(params, offload_fraction=1.0, lr=0.01)
    ),
}
MOVERS: dict[str, Mover] = {
    "loop-meta": loop_move("meta"),
    "loop-clone": loop_clone,
    "lightning-meta": lightning_move,
}


def make_params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    shapes = [(8, 4), (4,), (3,)]
    return [
        torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype)) for shape in shapes
    ]


def run(opt: Any, params: list[torch.nn.Parameter], steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
        opt.step()


def host_tensors(opt: Any) -> list[torch.Tensor]:
    """Every tensor the host sub-optimizers step: their state and the host copies."""
    hybrid = getattr(opt, "inner", opt)
    tensors = list(hybrid.gpu_params_map_cpu_copy.values())
    for sub in hybrid.cpu_optimizers:
        tensors += [t for entry in sub.state.values() for t in entry.values()]
    return [t for t in tensors if isinstance(t, torch.Tensor)]


def opt_subs(opt: Any) -> list[torch.optim.Optimizer]:
    return list(getattr(opt, "inner", opt).cpu_optimizers)


@pytest.mark.parametrize("mover", sorted(MOVERS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("build", sorted(BUILDS))
def test_moving_the_state_keeps_the_host_state_and_the_steps(build, dtype, mover):
    params, twin_params = make_params(dtype), make_params(dtype)
    opt, twin = BUILDS[build](params), BUILDS[build](twin_params)
    run(opt, params, range(2))
    run(twin, twin_params, range(2))
    before = host_tensors(opt)
    values = [t.clone() for t in before]
    holder_keys = [sorted(entry) for sub in opt_subs(opt) for entry in sub.state.values()]

    MOVERS[mover](opt)

    after = host_tensors(opt)
    assert len(after) == len(before) > 0
    for old, new, value in zip(before, after, values, strict=True):
        assert new is old and new.device.type == "cpu"
        assert torch.equal(new, value)
    # A holder's own dict still keeps only the states it stores.
    assert [sorted(entry) for sub in opt_subs(opt) for entry in sub.state.values()] == holder_keys
    run(opt, params, range(2, 4))
    run(twin, twin_params, range(2, 4))
    for p, q in zip(params, twin_params, strict=True):
        assert torch.equal(p, q)
    for mine, theirs in zip(host_tensors(opt), host_tensors(twin), strict=True):
        assert torch.equal(mine, theirs)


def test_writes_through_state_land_in_the_host_storage_and_state_dict_stays_plain():
    params = make_params(torch.bfloat16)
    opt = HybridOffloadOptimizer(params, offload_fraction=0.5, lr=0.01)
    run(opt, params, range(1))
    host, device = params[0], params[-1]
    copy = opt.gpu_params_map_cpu_copy[host]
    moment = opt.cpu_optimizers[0].state[copy]["exp_avg"]
    opt.state[host]["exp_avg"] = torch.full(host.shape, 2.0)
    opt.state[host]["master_param"] = torch.ones(host.shape)
    assert opt.cpu_optimizers[0].state[copy]["exp_avg"] is moment
    assert moment.dtype == torch.float32 and bool((moment == 2).all())
    assert bool((copy == 1).all())
    # Another dtype is not a moved copy: a dict write, as torch's (never a silent cast).
    opt.state[host]["exp_avg"] = torch.full(host.shape, 3.0, dtype=torch.float64)
    assert opt.cpu_optimizers[0].state[copy]["exp_avg"].dtype == torch.float64
    assert bool((moment == 2).all())
    opt.state[host]["exp_avg"] = moment
    # Another shape is no in-place write: a dict write, as before.
    opt.state[host]["extra"] = torch.zeros(1)
    opt.state[host]["extra"] = torch.zeros(2)
    assert opt.cpu_optimizers[0].state[copy]["extra"].shape == (2,)
    del opt.state[host]["extra"]
    # The device side keeps the sub-optimizer's own dict (a write replaces, as torch's).
    assert opt.state[device] is opt.gpu_optimizer.state[opt.param_to_inner_param[device]]

    saved = opt.state_dict()
    assert all(type(entry) is dict for entry in saved["state"].values())
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert torch.equal(loaded["state"][0]["exp_avg"], moment)
    twin = HybridOffloadOptimizer(make_params(torch.bfloat16), offload_fraction=0.5, lr=0.01)
    twin.load_state_dict(loaded)
    twin_host = twin.param_groups[0]["params"][0]
    twin_copy = twin.gpu_params_map_cpu_copy[twin_host]
    assert twin.cpu_optimizers[0].state[twin_copy] is twin.state[twin_host].entries
    assert torch.equal(twin.state[twin_host]["exp_avg"], moment)


def test_a_compressed_holder_state_is_never_overwritten_by_a_cast():
    """Review finding: writing the FP32 expansion over an FP8 holder state used to cast it
    into the raw storage (ignoring the scale) and zero it."""
    params = make_params(torch.bfloat16)
    opt = HybridOffloadOptimizer(
        params, offload_fraction=1.0, lr=0.01, cpu_optimizer_cls=PrecisionAwareAdamW,
        exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8,
    )  # fmt: skip
    run(opt, params, range(2))
    holder = opt.cpu_optimizers[0]
    host = params[0]
    copy = opt.gpu_params_map_cpu_copy[host]
    stored = holder.state[copy]["exp_avg_sq"].clone()
    expanded = holder.get_unscaled_state(copy, "exp_avg_sq")
    opt.state[host]["exp_avg_sq"] = expanded
    assert torch.equal(holder.state[copy]["exp_avg_sq"], stored)
    assert torch.equal(holder.get_unscaled_state(copy, "exp_avg_sq"), expanded)
