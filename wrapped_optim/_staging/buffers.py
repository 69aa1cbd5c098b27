"""The buffers a staged save moves state through: one device scratch, one pinned pool.

Kept apart from the staging engine's decisions so each bound is visible in one place: the
device scratch holds at most one chunk at a time (recorded in
:data:`~wrapped_optim._staging.ledger.device_ledger`), and the pinned pool holds two chunks for the
life of the process instead of a page-locked copy of every state.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from wrapped_optim._staging.ledger import device_ledger

__all__ = ["DeviceScratch", "PinnedPool", "copy_chunks_through_pinned"]

_FP32 = torch.float32


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class DeviceScratch:
    """The device buffer a chunked read decodes into: one chunk at most, one at a time.

    Every byte it holds is recorded in :data:`~wrapped_optim._staging.ledger.device_ledger`.

    Example:
        >>> import torch
        >>> scratch = DeviceScratch(chunk_bytes=16)  # four FP32 elements
        >>> scratch.get(torch.device("cpu"), torch.float32, 100).numel()
        4
        >>> scratch.close()  # released (and un-recorded) until the next get
    """

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self._buffer: torch.Tensor | None = None

    def chunk_numel(self, dtype: torch.dtype) -> int:
        return max(1, self.chunk_bytes // torch.empty((), dtype=dtype).element_size())

    def get(self, device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
        numel = max(1, min(numel, self.chunk_numel(dtype)))
        buffer = self._buffer
        if (
            buffer is not None
            and buffer.device == device
            and buffer.dtype == dtype
            and buffer.numel() >= numel
        ):
            return buffer
        self.close()  # release before allocating: one buffer alive at a time
        buffer = torch.empty(numel, dtype=dtype, device=device)
        self._buffer = buffer
        device_ledger.allocate(_nbytes(buffer))
        return buffer

    def close(self) -> None:
        buffer, self._buffer = self._buffer, None
        if buffer is not None:
            device_ledger.release(_nbytes(buffer))


class PinnedPool:
    """Two page-locked FP32 bounce buffers of one chunk, reused by every staged save.

    A CUDA chunk goes device scratch -> pinned buffer (asynchronous) -> the checkpoint's own
    pageable host tensor, alternating between the two buffers so one copy overlaps the next
    decode. Pinning every host result instead would leave whole-state-sized pinned blocks,
    rounded up to powers of two, in torch's host cache for the life of the process; this pool
    holds two chunks, replaced only when the chunk size changes.

    Example:
        >>> pool = PinnedPool(pin=False)  # pinning needs CUDA; the reuse is the same
        >>> first = pool.get(8)
        >>> [b.data_ptr() for b in pool.get(4)] == [b.data_ptr() for b in first]
        True
    """

    def __init__(self, *, pin: bool = True) -> None:
        self.pin = pin
        self._lock = threading.Lock()
        self._buffers: list[torch.Tensor] = []

    def get(self, numel: int) -> list[torch.Tensor]:
        """The two buffers, at least ``numel`` elements each (one allocation per size)."""
        with self._lock:
            if not self._buffers or self._buffers[0].numel() < numel:
                self._buffers = []  # release the old pair before pinning the new one
                self._buffers = [
                    torch.empty(numel, dtype=_FP32, pin_memory=self.pin) for _ in range(2)
                ]
            return [b[:numel] for b in self._buffers]


_PINNED = PinnedPool()
"""The process's one pool, shared by every staged save."""


def copy_chunks_through_pinned(
    holder: Any, param: torch.Tensor, name: str, buffer: torch.Tensor, flat: torch.Tensor
) -> None:
    """The CUDA path of a chunked read: decode -> pinned (async) -> pageable host tensor.

    ``holder`` decodes ``param``'s state ``name`` chunk by chunk into the device ``buffer``;
    each chunk goes through the process's :class:`PinnedPool` into ``flat`` (host), the two
    pinned buffers alternating so a copy overlaps the next decode. Needs CUDA; the staging
    engine calls it for CUDA sources only (see ``tests/gpu/gpu_staged.py``).
    """
    step = buffer.numel()
    bounce = _PINNED.get(step)
    pending: list[tuple[torch.cuda.Event, torch.Tensor, torch.Tensor]] = []

    def finish() -> None:
        event, pinned, host = pending.pop(0)
        event.synchronize()
        host.copy_(pinned)

    for i, start in enumerate(range(0, flat.numel(), step)):
        count = min(step, flat.numel() - start)
        out = buffer[:count]
        holder.read_unscaled_state_chunk(param, name, start, out)
        if len(pending) == 2:
            finish()  # that buffer's previous copy is done before it is reused
        pinned = bounce[i % 2][:count]
        # Same stream as the next decode into ``buffer``, so the copy is ordered first.
        pinned.copy_(out, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        pending.append((event, pinned, flat[start : start + count]))
    while pending:
        finish()
