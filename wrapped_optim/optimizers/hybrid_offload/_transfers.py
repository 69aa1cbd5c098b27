"""Host <-> device copies of many tensors at once, overlapped instead of blocking one by one.

:func:`copy_all` issues every copy between a CUDA device and the host with
``non_blocking=True`` on a side stream (which first waits for the current stream) and waits
once, at the end; copies without a CUDA tensor are plain ``copy_`` calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["copy_all"]

_streams: dict[torch.device, Any] = {}


def _side_stream(device: torch.device) -> Any:
    stream = _streams.get(device)
    if stream is None:
        stream = torch.cuda.Stream(device=device)
        _streams[device] = stream
    return stream


def _cuda_side(target: Tensor, source: Tensor) -> torch.device | None:
    """The CUDA device a copy crosses to or from, or None for a copy without one."""
    if target.is_cuda:
        return target.device
    return source.device if source.is_cuda else None


def copy_all(
    pairs: Sequence[tuple[Tensor, Tensor]],
    *,
    stream_for: Callable[[torch.device], Any] | None = None,
    device_of: Callable[[Tensor, Tensor], torch.device | None] = _cuda_side,
) -> None:
    """``target.copy_(source)`` for every pair; those between a CUDA device and the host are
    issued together on a side stream of that device and waited for once, at the end.

    ``non_blocking`` is used where the host side is pinned (a copy from or into pageable
    memory would be synchronous anyway). When this returns, every copy is complete: the host
    may read and overwrite its buffers, and the device's current stream is ordered after the
    copies. ``stream_for`` and ``device_of`` (tests) replace the side-stream factory and the
    test for which device a copy crosses.

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers.hybrid_offload._transfers import copy_all
        >>> a, b = torch.zeros(2), torch.zeros(3, dtype=torch.bfloat16)
        >>> copy_all([(a, torch.ones(2)), (b, torch.full((3,), 2.0))])
        >>> a.tolist(), b.tolist()
        ([1.0, 1.0], [2.0, 2.0, 2.0])
    """
    by_device: dict[torch.device, list[tuple[Tensor, Tensor]]] = {}
    for target, source in pairs:
        device = device_of(target, source)
        if device is None:
            target.copy_(source)
            continue
        by_device.setdefault(device, []).append((target, source))
    make = stream_for or _side_stream
    for device, group in by_device.items():
        stream = make(device)
        current = torch.cuda.current_stream(device)
        stream.wait_stream(current)  # gradients complete, earlier reads of the params done
        with torch.cuda.stream(stream):
            for target, source in group:
                host = target if source.is_cuda else source
                target.copy_(source, non_blocking=host.device.type == "cpu" and host.is_pinned())
        stream.synchronize()  # the host reads or rewrites its buffers next
        current.wait_stream(stream)  # device work after this sees the new values
