"""``FSDPAwareOptimizer``'s cast buffers with DTensor grads (FSDP2's sharded grads) on a real
one-process gloo group: a kept buffer is reused only while the grad's layout holds (type,
placements, mesh, shape, device); on one rank ``Shard(0)`` and ``Replicate()`` have the
same local shape, so only the placements tell them apart."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from wrapped_optim.fsdp import FSDPAwareOptimizer

FULL = torch.linspace(-1.0, 1.0, 24).reshape(6, 4)


@pytest.fixture
def meshes(one_process_group: None) -> tuple[DeviceMesh, DeviceMesh]:
    """Two CPU meshes over the one rank, told apart by their dimension names."""
    return (
        init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)),
        init_device_mesh("cpu", (1,), mesh_dim_names=("shard",)),
    )


class _SeenGrads(torch.optim.Optimizer):
    """Plain SGD on each rank's shard (whatever the grad's mesh), recording the grad's
    layout as its step sees it."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.5})
        self.seen: list[tuple[Any, ...]] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for param in group["params"]:
                grad = param.grad
                assert isinstance(grad, DTensor)
                self.seen.append((grad.dtype, grad.placements, grad.device_mesh))
                param.to_local().add_(grad.to_local(), alpha=-group["lr"])
        return None


def test_a_cast_buffer_follows_the_grads_placements_and_mesh(
    meshes: tuple[DeviceMesh, DeviceMesh],
) -> None:
    dp, other = meshes
    param = torch.nn.Parameter(distribute_tensor(FULL.clone(), dp, [Shard(0)]))
    param.grad_dtype = torch.bfloat16
    inner = _SeenGrads([param])
    opt = FSDPAwareOptimizer(inner)
    layouts = [(dp, Shard(0)), (dp, Shard(0)), (dp, Replicate()), (other, Replicate())]
    allocations, expected = [], FULL.clone()
    for step, (mesh, placement) in enumerate(layouts):
        grad = (FULL * (step + 1)).to(torch.bfloat16)
        param.grad = distribute_tensor(grad, mesh, [placement])
        opt.step()
        allocations.append(opt._cast_buffers.allocations)
        expected -= 0.5 * grad.float()
        dtype, placements, seen_mesh = inner.seen[-1]
        assert dtype == torch.float32 and placements == (placement,) and seen_mesh == mesh
        assert param.grad.dtype == torch.bfloat16  # the original grad is back
    # Reused while the layout holds; a new buffer for other placements, then another mesh.
    assert allocations == [1, 1, 2, 3]
    assert opt.cast_buffer_bytes == FULL.numel() * 4
    assert torch.equal(param.to_local(), expected)  # every step saw its own grad's values
