"""A staged save of *device* state, on a CPU: ``tests/staging/device_shim.py`` makes a
PrecisionAwareAdamW's stored states device tensors (``is_cuda``; with a CUDA ``device``, also
``.device``), so the engine takes the paths it takes on a GPU: one chunk of device scratch
at a time and, for a CUDA device, the pinned bounce buffers. The staged state dict must equal
the bare one bitwise, on the host, with the device bound kept."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.doubles.te_fused_adam import te_style
from tests.param_builders import train_on_random_grads
from tests.staging.device_shim import DeviceOnCpu, install_cuda_stand_ins
from wrapped_optim._staging import buffers
from wrapped_optim._staging.buffers import PinnedPool
from wrapped_optim._staging.engine import staged_save
from wrapped_optim.optimizers import PrecisionAwareAdamW
from wrapped_optim.testing import assert_state_dict_equal
from wrapped_optim.testing.probe import DeviceMemoryProbe, device_ledger

FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16
CHUNK_BYTES = 16  # four FP32 elements
SHAPES = [(23,), (2, 3), (3,)]  # 6, 2 and 1 chunks
COMPRESSED = ("exp_avg", "exp_avg_sq")


def _holder(cls: type = PrecisionAwareAdamW) -> tuple[Any, list[torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    opt = cls(params, lr=1e-2, exp_avg_dtype=BF16, exp_avg_sq_dtype=FP16, master_weights=True)
    train_on_random_grads(opt, params, 2, seed=4)
    return opt, params


def _on_device(mode: DeviceOnCpu, opt: Any) -> None:
    for entry in opt.state.values():
        for value in entry.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                mode.put_on_device(value)


class _Spy:
    def __init__(self, mode: DeviceOnCpu) -> None:
        self.mode = mode
        self.calls: list[tuple[int, str, int, int, bool, int]] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        original = PrecisionAwareAdamW.read_unscaled_state_chunk

        def spying(opt: Any, param: torch.Tensor, name: str, start: int, out: Any) -> None:
            on_device = self.mode.on_device(out)
            self.calls.append((param.numel(), name, start, out.numel(), on_device, out.data_ptr()))
            original(opt, param, name, start, out)

        monkeypatch.setattr(PrecisionAwareAdamW, "read_unscaled_state_chunk", spying)

    def check_chunks(self, device_scratch: bool) -> None:
        """Every compressed state of every param, in one-chunk calls at each offset, decoded
        into one scratch buffer per state (device memory where the device is not the CPU)."""
        buffers_by_state: dict[tuple[int, str], set[int]] = {}
        for numel, name, *_, ptr in self.calls:
            buffers_by_state.setdefault((numel, name), set()).add(ptr)
        assert all(len(ptrs) == 1 for ptrs in buffers_by_state.values())
        expected = [
            (numel, name, start, min(4, numel - start), device_scratch)
            for numel in (23, 6, 3)
            for name in COMPRESSED
            for start in range(0, numel, 4)
        ]
        assert sorted(call[:5] for call in self.calls) == sorted(expected)


def _assert_on_host(
    mode: DeviceOnCpu, state_dict: Any, opt: Any, names: tuple[str, ...] = COMPRESSED
) -> None:
    """The states ``names`` are host tensors, none of them the holder's own storage."""
    stored = {v.data_ptr() for e in opt.state.values() for v in e.values() if v.dim() > 0}
    for entry in state_dict["state"].values():
        for name, value in entry.items():
            if name in names:
                assert not mode.on_device(value), name
                assert value.data_ptr() not in stored, name


def _not_stored(state_dict: Any, opt: Any) -> None:
    """No compressed state of ``state_dict`` is the holder's own storage."""
    stored = {v.data_ptr() for e in opt.state.values() for v in e.values() if v.dim() > 0}
    for entry in state_dict["state"].values():
        assert not {entry[name].data_ptr() for name in COMPRESSED} & stored


@pytest.mark.parametrize(
    ("chunked", "default_dtype"),
    [(True, FP32), (True, torch.float64), (False, FP32)],
    ids=["chunked", "chunked-float64-default", "whole"],
)
def test_device_state_on_a_cpu_device_is_staged_through_one_chunk_of_scratch(
    chunked: bool, default_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    opt, _ = _holder()
    bare = opt.state_dict()
    mode = DeviceOnCpu()  # device tensors answer is_cuda, their device stays the CPU
    _on_device(mode, opt)
    spy = _Spy(mode)
    spy.install(monkeypatch)
    torch.set_default_dtype(default_dtype)  # the host copies are FP32 whatever the default
    try:
        with (
            mode,
            DeviceMemoryProbe() as probe,
            staged_save(opt, chunk_bytes=CHUNK_BYTES, chunked=chunked) as stats,
        ):
            result = opt.state_dict()
    finally:
        torch.set_default_dtype(FP32)
    assert_state_dict_equal(bare, result, names=("bare", "staged"))
    _not_stored(result, opt)
    # FP32 state in CPU memory is handed out live, as the bare optimizer does.
    for index, param in enumerate(opt.param_groups[0]["params"]):
        live = opt.state[param]["master_param"]
        assert result["state"][index]["master_param"].data_ptr() == live.data_ptr()
    assert device_ledger.live_bytes == 0
    if chunked:
        spy.check_chunks(device_scratch=False)
        assert probe.peak_extra_bytes == CHUNK_BYTES
        assert (stats.chunked_reads, stats.whole_tensor_reads) == (6, 0)
    else:
        assert spy.calls == []
        assert probe.peak_extra_bytes == 4 * 23  # the largest expansion, alone
        assert (stats.chunked_reads, stats.whole_tensor_reads) == (0, 6)
    assert stats.direct_reads == 3  # the FP32 master weights


def test_cuda_state_is_staged_through_two_pinned_buffers_on_its_own_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    opt, _ = _holder()
    bare = opt.state_dict()
    device = torch.device("cuda", 1)
    mode = DeviceOnCpu(device)
    stand_in = install_cuda_stand_ins(monkeypatch, mode)
    monkeypatch.setattr(buffers, "_PINNED", PinnedPool())
    _on_device(mode, opt)
    spy = _Spy(mode)
    spy.install(monkeypatch)
    with mode, DeviceMemoryProbe() as probe, staged_save(opt, chunk_bytes=CHUNK_BYTES):
        assert opt.state[opt.param_groups[0]["params"][0]]["exp_avg"].device == device
        result = opt.state_dict()
    assert_state_dict_equal(bare, result, names=("bare", "staged"))
    _assert_on_host(mode, result, opt, (*COMPRESSED, "master_param"))
    spy.check_chunks(device_scratch=True)
    assert probe.peak_extra_bytes == CHUNK_BYTES and device_ledger.live_bytes == 0
    # One pair of pinned chunks for the whole save; every chunk copied asynchronously.
    assert mode.pin_requests == [4, 4]
    assert mode.async_copies == len(spy.calls) and mode.blocking_copies_to_pinned == 0
    assert {event.recorded_on for event in stand_in.events} == {device}
    assert all(event.synchronized for event in stand_in.events)


def test_fp32_device_state_and_whole_expansions_come_back_as_host_copies() -> None:
    opt, _ = _holder(te_style(PrecisionAwareAdamW))
    bare = opt.state_dict()
    mode = DeviceOnCpu(torch.device("cuda", 0))
    _on_device(mode, opt)
    with mode, staged_save(opt, chunk_bytes=CHUNK_BYTES) as stats:
        result = opt.state_dict()
    assert_state_dict_equal(bare, result, names=("bare", "staged"))
    _assert_on_host(mode, result, opt, (*COMPRESSED, "master_param"))
    assert (stats.whole_tensor_reads, stats.direct_reads) == (6, 3)
