"""The staging buffers (device scratch, pinned pool) and the CUDA path of a chunked read, on a
CPU: ``tests/staging/device_shim.py`` stands in for device memory, pinned memory and the
asynchronous device-to-pinned copies with their events, so the path's bounds and ordering
are checked without a GPU (``tests/gpu/gpu_staged.py`` runs it on one)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.staging.device_shim import DeviceOnCpu, install_cuda_stand_ins
from wrapped_optim._staging import buffers
from wrapped_optim._staging.buffers import DeviceScratch, PinnedPool, copy_chunks_through_pinned
from wrapped_optim._staging.ledger import device_ledger

FP32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture(autouse=True)
def _ledger_balanced() -> Iterator[None]:
    assert device_ledger.live_bytes == 0
    yield
    assert device_ledger.live_bytes == 0


# ----------------------------------------------------------------------------------------
# DeviceScratch
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("chunk_bytes", "dtype", "numel"),
    [(18, FP32, 4), (18, BF16, 9), (18, torch.uint8, 18), (3, FP32, 1), (8, torch.float64, 1)],
)
def test_scratch_chunk_is_whole_elements_and_at_least_one(
    chunk_bytes: int, dtype: torch.dtype, numel: int
) -> None:
    chunk = DeviceScratch(chunk_bytes).chunk_numel(dtype)
    assert type(chunk) is int and chunk == numel


def test_scratch_is_reused_while_it_fits_and_every_byte_is_on_the_ledger() -> None:
    cpu = torch.device("cpu")
    scratch = DeviceScratch(chunk_bytes=40)  # ten FP32 elements
    scratch.close()  # nothing held: releases nothing
    assert device_ledger.live_bytes == 0

    small = scratch.get(cpu, FP32, 3)
    assert small.numel() == 3 and small.dtype == FP32 and small.device == cpu
    assert device_ledger.live_bytes == 12
    assert scratch.get(cpu, FP32, 3) is small  # same request: same buffer
    assert scratch.get(cpu, FP32, 2) is small  # smaller: the buffer already fits
    assert device_ledger.live_bytes == 12

    larger = scratch.get(cpu, FP32, 1000)  # capped at one chunk, the old one released first
    assert larger is not small and larger.numel() == 10
    assert device_ledger.live_bytes == 40

    half = scratch.get(cpu, BF16, 3)  # another dtype: another buffer, sized by its elements
    assert half.dtype == BF16 and half.numel() == 3
    assert device_ledger.live_bytes == 6

    meta = scratch.get(torch.device("meta"), BF16, 3)  # another device: another buffer
    assert meta.device.type == "meta" and meta.numel() == 3
    assert device_ledger.live_bytes == 6

    assert scratch.get(cpu, FP32, 0).numel() == 1  # never an empty buffer
    assert device_ledger.live_bytes == 4
    scratch.close()
    assert device_ledger.live_bytes == 0
    scratch.close()  # twice: nothing more released
    assert device_ledger.live_bytes == 0


# ----------------------------------------------------------------------------------------
# PinnedPool
# ----------------------------------------------------------------------------------------


def test_pool_keeps_two_fp32_buffers_and_replaces_them_only_to_grow() -> None:
    torch.set_default_dtype(torch.float64)
    try:
        pool = PinnedPool(pin=False)
        first = pool.get(8)
    finally:
        torch.set_default_dtype(FP32)
    assert [(b.numel(), b.dtype) for b in first] == [(8, FP32), (8, FP32)]
    assert first[0].data_ptr() != first[1].data_ptr()

    again = pool.get(8)
    smaller = pool.get(3)
    assert [b.numel() for b in smaller] == [3, 3]
    for later in (again, smaller):
        assert [b.data_ptr() for b in later] == [b.data_ptr() for b in first]

    grown = pool.get(9)
    assert [b.numel() for b in grown] == [9, 9]
    assert not {b.data_ptr() for b in grown} & {b.data_ptr() for b in first}


def test_pool_pins_by_default() -> None:
    with DeviceOnCpu() as mode:
        buffers_ = PinnedPool().get(5)
    assert mode.pin_requests == [5, 5]
    assert all(mode.is_pinned(b) for b in buffers_)
    with DeviceOnCpu() as mode:
        PinnedPool(pin=False).get(5)
    assert mode.pin_requests == []


# ----------------------------------------------------------------------------------------
# copy_chunks_through_pinned
# ----------------------------------------------------------------------------------------


class _Decoder:
    """A holder whose state decodes to ``values``; logs how many copies were in flight at
    each decode."""

    def __init__(self, values: torch.Tensor, in_flight: Any) -> None:
        self.values = values
        self.in_flight = in_flight
        self.calls: list[tuple[int, int, int]] = []  # (start, count, out storage)
        self.pending_at_decode: list[int] = []

    def read_unscaled_state_chunk(
        self, param: torch.Tensor, name: str, start: int, out: torch.Tensor
    ) -> None:
        assert name == "exp_avg"
        self.pending_at_decode.append(self.in_flight())
        self.calls.append((start, out.numel(), out.data_ptr()))
        out.copy_(self.values[start : start + out.numel()])


@pytest.mark.parametrize(("numel", "step"), [(23, 4), (8, 4), (3, 4), (4, 1)])
def test_pinned_copy_alternates_two_buffers_and_lands_every_chunk_in_order(
    numel: int, step: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    mode = DeviceOnCpu(torch.device("cuda", 0))
    stand_in = install_cuda_stand_ins(monkeypatch, mode)
    monkeypatch.setattr(buffers, "_PINNED", PinnedPool())
    values = torch.arange(1, numel + 1, dtype=FP32)
    param = torch.zeros(numel)
    decoder = _Decoder(values, stand_in.unsynchronized)
    with mode:
        buffer = torch.empty(step, device="cuda")
        host = torch.empty(numel)
        copy_chunks_through_pinned(decoder, param, "exp_avg", buffer, host)

    assert torch.equal(host, values)  # every element, at its offset (the rest is NaN)
    chunks = -(-numel // step)
    starts = list(range(0, numel, step))
    assert [start for start, _, _ in decoder.calls] == starts
    assert [count for _, count, _ in decoder.calls] == [min(step, numel - s) for s in starts]
    assert {ptr for _, _, ptr in decoder.calls} == {buffer.data_ptr()}  # decoded in place
    # Two pinned buffers of one chunk, written only asynchronously and alternately.
    assert mode.pin_requests == [step, step]
    assert mode.async_copies == chunks and mode.blocking_copies_to_pinned == 0
    # The next decode overlaps the copies in flight: at most two, the oldest awaited first.
    assert decoder.pending_at_decode == [min(i, 2) for i in range(chunks)]
    assert len(stand_in.events) == chunks
    assert all(event.synchronized for event in stand_in.events)
