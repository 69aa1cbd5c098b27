"""copy_all: the overlapped host <-> device copies of HybridOffloadOptimizer. The CUDA ordering
is checked on CPU with a recording stand-in for torch.cuda's streams."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from wrapped_optim.optimizers import HybridOffloadOptimizer
from wrapped_optim.optimizers.hybrid_offload import _transfers as transfers


class FakeStream:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(f"{self.name} waits for {other.name}")

    def synchronize(self) -> None:
        self.log.append(f"host waits for {self.name}")


def test_device_copies_are_issued_together_then_waited_for_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Side stream waits for the current stream, every copy runs inside the side stream's
    context (non_blocking only where the host buffer is pinned), then one host wait and the
    current stream is ordered after the copies; host-only pairs are plain copies."""
    log: list[str] = []
    side, current = FakeStream(log, "side"), FakeStream(log, "current")
    active: list[Any] = []

    class Context:
        def __init__(self, stream: FakeStream) -> None:
            self.stream = stream

        def __enter__(self) -> None:
            active.append(self.stream)

        def __exit__(self, *exc: object) -> None:
            active.pop()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "stream", Context)
    fake = torch.device("cuda", 0)
    remote = [torch.zeros(3), torch.zeros(2)]  # stand-ins for CUDA tensors
    calls: list[tuple[str, bool]] = []
    original = torch.Tensor.copy_

    def recording_copy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> Any:
        where = active[-1].name if active else "none"
        calls.append((where, non_blocking))
        log.append(f"copy on {where}")
        return original(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", recording_copy)
    host_grad = torch.zeros(3)
    host_a, host_b = torch.ones(2), torch.zeros(4)
    pairs = [(host_grad, remote[0]), (remote[1], host_a), (host_b, torch.full((4,), 5.0))]
    transfers.copy_all(
        pairs,
        stream_for=lambda device: side,
        device_of=lambda t, s: fake if any(t is r or s is r for r in remote) else None,
    )
    monkeypatch.undo()
    assert log == [
        "copy on none",  # the host-only pair, at once
        "side waits for current",
        "copy on side",
        "copy on side",
        "host waits for side",
        "current waits for side",
    ]
    assert [c[1] for c in calls] == [False, False, False]  # nothing pinned on this machine
    assert remote[1].tolist() == [1.0, 1.0] and host_b.tolist() == [5.0] * 4


def test_offloaded_copies_still_round_trip_on_cpu() -> None:
    """On a CPU-only run the copies are plain copies: a step moves grads in and values out."""
    p = torch.nn.Parameter(torch.ones(5, dtype=torch.bfloat16))
    opt = HybridOffloadOptimizer(
        [p], offload_fraction=1.0, lr=0.5, weight_decay=0.0, fused_host_step=False
    )  # the unfused path: the fused host step copies nothing
    p.grad = torch.ones(5, dtype=torch.bfloat16)
    opt.step()
    inner = opt.param_to_inner_param[p]
    assert inner.grad is not None and inner.grad.tolist() == [1.0] * 5
    assert torch.allclose(inner, torch.full((5,), 0.5))  # one Adam step of lr 0.5
    assert torch.equal(p.detach(), inner.to(torch.bfloat16))  # and copied back
