"""A CPU stand-in for the device memory the staging engine moves state through, so its CUDA
paths (device scratch, pinned bounce buffers, asynchronous copies and their events) run on a
CPU with checkable effects.

While the :class:`DeviceOnCpu` mode is active:

* tensors registered with :meth:`DeviceOnCpu.put_on_device` (and views of them, what is
  computed from them, and tensors a factory makes with ``device="cuda..."``) are "device"
  tensors: ``is_cuda`` is True and, when the mode is given a CUDA ``device``, ``.device``
  reports it (otherwise ``.device`` stays the CPU, the model the megatron-core shim in
  ``tests/megatron_real`` uses); ``to`` between device and host is a copy;
* ``torch.empty`` poisons what it returns (NaN for floats), so an element nothing wrote is
  seen;
* ``pin_memory=True`` is recorded and dropped (no pinned allocator on a CPU-only torch);
* a ``non_blocking=True`` copy from a device tensor into a pinned one is asynchronous: the
  source is read at once (stream order: before the next decode overwrites it), but the
  pinned buffer is written only when an :class:`Event` recorded after it is synchronized.
  Synchronizing lands *every* copy queued so far (the device may have run ahead), so a host
  read before its event, or a pinned buffer reused before its host copy, shows.

:func:`install_cuda_stand_ins` replaces ``torch.cuda.Event`` and ``torch.cuda.device`` for a
test (pytest's ``monkeypatch``), recording the device each event is recorded on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

_IS_CUDA = torch._C.TensorBase.is_cuda.__get__  # type: ignore[attr-defined]
_DEVICE = torch._C.TensorBase.device.__get__  # type: ignore[attr-defined]


def _storage(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().data_ptr())


def _is_cuda_device(device: Any) -> bool:
    return str(device).startswith("cuda")


class DeviceOnCpu(TorchFunctionMode):
    """The tensor half of the stand-in (see the module docstring)."""

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__()
        self.device = device
        self._device_storages: set[int] = set()
        # Registered tensors are kept alive: a freed address reused by a host tensor must not
        # read as device memory.
        self._device_tensors: list[torch.Tensor] = []
        self._pinned_storages: set[int] = set()
        self.pin_requests: list[int] = []  # numel of each pinned allocation, in order
        self.pinned: list[torch.Tensor] = []
        self.async_copies = 0
        self.blocking_copies_to_pinned = 0
        self._queue: list[tuple[torch.Tensor, torch.Tensor]] = []

    def put_on_device(self, tensor: torch.Tensor) -> None:
        self._device_tensors.append(tensor)
        self._device_storages.add(_storage(tensor))

    def on_device(self, tensor: torch.Tensor) -> bool:
        return _storage(tensor) in self._device_storages

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return _storage(tensor) in self._pinned_storages

    def land_queued_copies(self) -> None:
        """Every asynchronous copy queued so far reaches its pinned buffer."""
        queue, self._queue = self._queue, []
        with torch._C.DisableTorchFunction():
            for target, snapshot in queue:
                target.copy_(snapshot)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func == _IS_CUDA:
            return self.on_device(args[0]) or func(*args)
        if func == _DEVICE:
            if self.device is not None and self.on_device(args[0]):
                return self.device
            return func(*args)
        if func is torch.Tensor.copy_ and self.is_pinned(args[0]):
            return self._copy_to_pinned(args[0], args[1], bool(kwargs.get("non_blocking")))
        if func is torch.Tensor.to:
            return self._to(args[0], *args[1:], **kwargs)
        on_device = _is_cuda_device(kwargs.get("device"))
        if on_device:
            kwargs["device"] = "cpu"
        pinned = bool(kwargs.pop("pin_memory", False))
        result = func(*args, **kwargs)
        self._propagate(args, kwargs, result)
        if func is torch.empty:
            result.fill_(float("nan") if result.is_floating_point() else -1)
            if on_device:
                self.put_on_device(result)
            if pinned:
                self.pin_requests.append(result.numel())
                self.pinned.append(result)
                self._pinned_storages.add(_storage(result))
        return result

    def _propagate(self, args: Any, kwargs: dict[str, Any], result: Any) -> None:
        """What is computed from device tensors is a device tensor (an in-place op on a host
        tensor leaves it a host tensor)."""
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if not any(self.on_device(a) for a in inputs):
            return
        host = {_storage(a) for a in inputs if not self.on_device(a)}
        for out in result if isinstance(result, tuple | list) else (result,):
            if isinstance(out, torch.Tensor) and _storage(out) not in host:
                self.put_on_device(out)

    def _to(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``to`` across the device/host line is a copy; on either side, torch's ``to``."""
        targets = [*args, kwargs.get("device")]
        to_device = any(_is_cuda_device(a) for a in targets)
        to_host = any(str(a) == "cpu" for a in targets)
        args = tuple("cpu" if _is_cuda_device(a) else a for a in args)
        if "device" in kwargs:
            kwargs["device"] = "cpu"
        result = tensor.to(*args, **kwargs)
        if (to_device or to_host) and to_device != self.on_device(tensor):
            result = result.clone() if result is tensor else result
            if to_device:
                self.put_on_device(result)
        return result

    def _copy_to_pinned(
        self, target: torch.Tensor, source: torch.Tensor, non_blocking: bool
    ) -> torch.Tensor:
        if non_blocking and self.on_device(source):
            self.async_copies += 1
            self._queue.append((target, source.clone()))
            return target
        self.blocking_copies_to_pinned += 1
        return target.copy_(source)


class Event:
    """Stands in for ``torch.cuda.Event``: records the current device; synchronizing lands
    every queued copy."""

    def __init__(self, stand_in: CudaStandIns) -> None:
        self._stand_in = stand_in
        self.recorded = False
        self.recorded_on: Any = None
        self.synchronized = False

    def record(self, stream: Any = None) -> None:
        self.recorded = True
        self.recorded_on = self._stand_in.current_device
        self._stand_in.events.append(self)

    def synchronize(self) -> None:
        assert self.recorded, "synchronize() on an event never recorded"
        self._stand_in.mode.land_queued_copies()
        self.synchronized = True


class CudaStandIns:
    """What a test reads back: the mode, the events in record order, the current device."""

    def __init__(self, mode: DeviceOnCpu) -> None:
        self.mode = mode
        self.events: list[Event] = []
        self.current_device: Any = torch.device("cuda", 0)

    def unsynchronized(self) -> int:
        return sum(not event.synchronized for event in self.events)

    @contextlib.contextmanager
    def device_context(self, device: Any) -> Iterator[None]:
        saved, self.current_device = self.current_device, device
        try:
            yield
        finally:
            self.current_device = saved


def install_cuda_stand_ins(monkeypatch: pytest.MonkeyPatch, mode: DeviceOnCpu) -> CudaStandIns:
    """``torch.cuda.Event`` and ``torch.cuda.device`` for this test, backed by ``mode``."""
    stand_in = CudaStandIns(mode)
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: Event(stand_in))
    monkeypatch.setattr(torch.cuda, "device", stand_in.device_context)
    return stand_in
