"""Runs megatron-core's optimizer stack on a CPU: the CUDA-only calls mapped to CPU ones.

megatron-core 0.16.1 assumes a GPU in calls that have nothing to do with what the tests check.
This shim replaces exactly those, for the duration of a ``with cuda_on_cpu():`` block:

* ``torch.cuda.current_device`` / ``Stream`` / ``current_stream`` / ``default_stream`` /
  ``stream`` / ``synchronize`` / ``empty_cache``: the DDP grad buffers, the distributed
  optimizer's buffers and HybridDeviceOptimizer ask for the device index and order their copies
  on streams; one CPU device has one stream, so ordering is trivially satisfied and the index is 0.
* ``device='cuda'`` / ``device=<int>`` in tensor factories, ``Tensor.cuda()``, ``Tensor.to('cuda')``
  (the loss scale, found-inf flags, grad buffers, ``state.to('cuda')`` after a load) become the
  CPU; ``pin_memory`` becomes a plain (unpinned) copy.
* The *device/host distinction* HybridDeviceOptimizer and Megatron's type checks rely on is kept:
  every tensor is a "device" tensor (``is_cuda`` is True, ``type()`` says ``torch.cuda.*Tensor``)
  except the ones made host tensors by ``.cpu()``, ``.to('cpu')``, ``pin_memory`` or
  ``device='cpu'``, and what is computed from them. So the offload split
  (``offload_fraction``), the pinned CPU copies of device params, the grad copies and the
  copy-back hooks all run as on a GPU machine, only in one memory.

What stops megatron-core on a CPU-only torch without this shim (first hit: DDP's
``_ParamAndGradBuffer.__init__`` -> ``torch.cuda.current_device()``, "Torch not compiled with
CUDA enabled"): ``torch.tensor(..., device='cuda')`` for the found-inf flag, overflow buffer
and loss scale (``optimizer.py``, ``grad_scaler.py``, ``clip_grads.py``); the param
classification ``param.type() == 'torch.cuda.FloatTensor'`` / ``'torch.cuda.BFloat16Tensor'``
in Float16OptimizerWithFloat16Params and ``DistributedOptimizer._build_model_and_main_param_groups``
(``TypeError`` for CPU types); HybridDeviceOptimizer's ``torch.cuda.current_stream()`` /
``torch.cuda.Stream()``, ``param.is_cuda`` offload split (on a plain CPU nothing is offloaded)
and ``.pin_memory()``; ``.to('cuda')`` of loaded state.

No collective needs emulating: megatron-core binds ``reduce_scatter_tensor`` and
``all_gather_into_tensor`` when it is imported, and torch 2.13's gloo backend implements both
(the two-rank tests run them).

Nothing here touches state layout, master copies, sharding or optimizer math: those are the
real megatron-core and torch code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from tests.cuda_stand_ins import NoOpStream, current_stream, no_op, null_context

_HOST = "_wrapped_optim_host"
_IS_CUDA = torch._C.TensorBase.is_cuda.__get__  # type: ignore[attr-defined]


def is_host(value: Any) -> bool:
    """Whether the shim takes ``value`` for a host tensor."""
    return isinstance(value, torch.Tensor) and bool(getattr(value, _HOST, False))


def _mark_host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        setattr(value, _HOST, True)
    return value


def make_device_tensor(value: torch.Tensor) -> None:
    """Makes ``value`` a device tensor again. A device-agnostic optimizer (PrecisionAwareAdamW)
    allocates its state with ``device=param.device``, which on a CPU reads ``"cpu"`` and so
    makes host tensors here even for a device param; on a GPU that state is device memory."""
    if is_host(value):
        delattr(value, _HOST)


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _is_cpu_device(device: Any) -> bool:
    if isinstance(device, str):
        return device == "cpu"
    return isinstance(device, torch.device) and device.type == "cpu"


_NOT_A_DEVICE_METHOD = object()


def _device_method(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What the tensor methods that ask for or move to a device return under the shim, or
    ``_NOT_A_DEVICE_METHOD`` for any other function."""
    if func == _IS_CUDA:
        return not is_host(args[0])
    if func is torch.Tensor.type and len(args) == 1 and not kwargs:
        name = func(*args)
        return name if is_host(args[0]) else name.replace("torch.", "torch.cuda.", 1)
    if func is torch.Tensor.pin_memory:
        return _mark_host(args[0].clone())
    if func is torch.Tensor.cuda:
        return args[0].clone() if is_host(args[0]) else args[0]
    if func is torch.Tensor.cpu:
        return args[0] if is_host(args[0]) else _mark_host(args[0].detach().clone())
    return _NOT_A_DEVICE_METHOD


class _CudaOnCpu(TorchFunctionMode):
    """The tensor half of the shim (see the module docstring)."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        answer = _device_method(func, args, kwargs)
        if answer is not _NOT_A_DEVICE_METHOD:
            return answer
        to_host = False
        if func is torch.Tensor.to:
            positional = list(args)
            for index, value in enumerate(positional[1:], start=1):
                if _is_cuda_device(value):
                    positional[index] = "cpu"
                    if is_host(args[0]):
                        return func(*positional, **kwargs).clone()
                elif _is_cpu_device(value):
                    to_host = True
            args = tuple(positional)
        if "device" in kwargs:
            if _is_cuda_device(kwargs["device"]):
                kwargs["device"] = "cpu"
            elif _is_cpu_device(kwargs["device"]):
                to_host = True
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
            to_host = True
        result = func(*args, **kwargs)
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if to_host and func is torch.Tensor.to and result is args[0] and not is_host(result):
            result = result.clone()  # a device-to-host move is a copy
        if to_host or any(is_host(a) for a in inputs):
            device_inputs = [a for a in inputs if not is_host(a)]
            # An op that returns one of its device inputs (in place, or ``to`` a no-op) leaves
            # it a device tensor.
            tree_map(lambda r: r if any(r is a for a in device_inputs) else _mark_host(r), result)
        return result


_FUNCTIONS = {
    (torch.cuda, "current_device"): lambda: 0,
    (torch.cuda, "Stream"): NoOpStream,
    (torch.cuda, "current_stream"): current_stream,
    (torch.cuda, "default_stream"): current_stream,
    (torch.cuda, "stream"): null_context,
    (torch.cuda, "synchronize"): no_op,
    (torch.cuda, "empty_cache"): no_op,
}


@contextlib.contextmanager
def cuda_on_cpu() -> Iterator[None]:
    """Installs the shim for the block; everything is restored on exit."""
    saved = {key: getattr(*key) for key in _FUNCTIONS}
    for (module, name), replacement in _FUNCTIONS.items():
        setattr(module, name, replacement)
    try:
        with _CudaOnCpu():
            yield
    finally:
        for (module, name), original in saved.items():
            setattr(module, name, original)
