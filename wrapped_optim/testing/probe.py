"""How much extra device memory a checkpoint call needs, measured the same way on CUDA
(the allocator's peak) and on a CPU (the staging engine's ledger).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import torch

from wrapped_optim._staging.engine import staging_decisions
from wrapped_optim._staging.ledger import device_ledger
from wrapped_optim.patching import patch_attribute

__all__ = ["DeviceMemoryProbe", "count_unstaged_expansions", "device_ledger"]


class DeviceMemoryProbe:
    """Measures the peak extra device bytes needed inside a ``with`` block.

    ``peak_extra_bytes`` is the highest allocation reached in the block minus the allocation
    when it started. On CUDA it comes from the caching allocator's peak statistics (counting
    everything); elsewhere from ``device_ledger``, the staging engine's own record of the
    expansions, scratch buffers and chunks it keeps on the source device.

    Args:
        device: The device to measure (default: the CPU).

    Attributes:
        device: The measured device.
        source: Where the figure comes from: ``"cuda"`` or ``"ledger"``.

    Examples:
        >>> from wrapped_optim.testing.probe import DeviceMemoryProbe, device_ledger
        >>> with DeviceMemoryProbe("cpu") as probe:
        ...     device_ledger.allocate(4096)
        ...     device_ledger.release(4096)
        >>> probe.peak_extra_bytes, probe.source
        (4096, 'ledger')
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.source = "cuda" if self.device.type == "cuda" else "ledger"
        self._ledger_start = 0
        self._ledger_peak = 0
        self._cuda_start = 0
        self._cuda_peak: int | None = None
        self._open = False

    def _observe(self, live: int) -> None:
        self._ledger_peak = max(self._ledger_peak, live)

    def __enter__(self) -> DeviceMemoryProbe:
        if self.source == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_start = torch.cuda.memory_allocated(self.device)
        self._ledger_start = device_ledger.attach(self._observe)
        self._ledger_peak = self._ledger_start
        self._open = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        device_ledger.detach(self._observe)
        if self.source == "cuda":
            torch.cuda.synchronize(self.device)
            self._cuda_peak = torch.cuda.max_memory_allocated(self.device)
        self._open = False

    @property
    def ledger_peak_bytes(self) -> int:
        """Peak of the staging engine's ledger above its level at entry.

        Kept on CUDA probes too, so a benchmark can set what the engine says it held next to
        what the allocator saw; bytes already alive at entry are not counted.

        Examples:
            >>> from wrapped_optim.testing.probe import DeviceMemoryProbe, device_ledger
            >>> device_ledger.allocate(1000)  # alive before the block: not counted
            >>> with DeviceMemoryProbe("cpu") as probe:
            ...     device_ledger.allocate(300)
            ...     device_ledger.release(300)
            >>> device_ledger.release(1000)
            >>> probe.ledger_peak_bytes
            300
        """
        return self._ledger_peak - self._ledger_start

    @property
    def peak_extra_bytes(self) -> int:
        """Peak extra device bytes of the block: the CUDA allocator's, else the ledger's.

        The one figure to check a staged call's bound against, whatever the device.

        Raises:
            RuntimeError: read on CUDA before the block has finished.

        Examples:
            >>> from wrapped_optim.testing.probe import DeviceMemoryProbe, device_ledger
            >>> with DeviceMemoryProbe("cpu") as probe:
            ...     device_ledger.allocate(100)
            ...     device_ledger.allocate(200)  # both alive at once: the peak is 300
            ...     device_ledger.release(200)
            ...     device_ledger.release(100)
            >>> probe.peak_extra_bytes
            300
        """
        if self.source == "cuda":
            if self._cuda_peak is None:
                raise RuntimeError("the probe's block has not finished yet")
            return self._cuda_peak - self._cuda_start
        return self.ledger_peak_bytes

    def __repr__(self) -> str:
        return f"DeviceMemoryProbe(device={self.device}, source={self.source!r})"

    def summary(self) -> dict[str, Any]:
        """The figures as a dict, so benchmark tables and JSON reports need no probe logic.

        Examples:
            >>> from wrapped_optim.testing.probe import DeviceMemoryProbe, device_ledger
            >>> with DeviceMemoryProbe("cpu") as probe:
            ...     device_ledger.allocate(256)
            ...     device_ledger.release(256)
            >>> probe.summary()
            {'device': 'cpu', 'source': 'ledger', 'peak_extra_bytes': 256, 'ledger_peak_bytes': 256}
        """
        return {
            "device": str(self.device),
            "source": self.source,
            "peak_extra_bytes": self.peak_extra_bytes,
            "ledger_peak_bytes": self.ledger_peak_bytes,
        }


def _counting_reader(holder: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    def get_unscaled_state(param: torch.Tensor, state_name: str) -> Any:
        value = original(param, state_name)
        mapping = getattr(holder, "name_to_dtype_map", {})
        if isinstance(value, torch.Tensor) and mapping.get(state_name) != torch.float32:
            nbytes = value.numel() * value.element_size()
            device_ledger.allocate(nbytes)
            weakref.finalize(value, device_ledger.release, nbytes)
        return value

    return get_unscaled_state


def _counting_writer(original: Callable[..., Any]) -> Callable[..., Any]:
    def set_scaled_state(param: torch.Tensor, state_name: str, unscaled_state: Any) -> Any:
        numel = unscaled_state.numel() if isinstance(unscaled_state, torch.Tensor) else 0
        device_ledger.allocate(numel * 4)
        try:
            return original(param, state_name, unscaled_state)
        finally:
            device_ledger.release(numel * 4)

    return set_scaled_state


@contextlib.contextmanager
def count_unstaged_expansions(stack: Any) -> Iterator[None]:
    """Puts an *unstaged* checkpoint call of a stack on the ledger, for baselines on CPU.

    Inside the block every expansion a precision-aware holder's ``get_unscaled_state``
    returns is recorded while the tensor is alive, and every ``set_scaled_state`` call records
    one whole FP32 tensor for its duration (a model of a whole-tensor loader such as TE's).
    On CUDA, measure with ``DeviceMemoryProbe`` alone instead.

    Args:
        stack: The optimizer or wrapper stack whose holders are counted.

    Examples:
        >>> import torch
        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> with DeviceMemoryProbe() as probe, count_unstaged_expansions(sgd):
        ...     _ = sgd.state_dict()
        >>> probe.peak_extra_bytes
        0
    """
    with contextlib.ExitStack() as patches:
        for decision in staging_decisions(stack):
            if not decision.eligible:
                continue
            holder = decision.optimizer
            reader = _counting_reader(holder, holder.get_unscaled_state)
            writer = _counting_writer(holder.set_scaled_state)
            patches.enter_context(patch_attribute(holder, "get_unscaled_state", reader))
            patches.enter_context(patch_attribute(holder, "set_scaled_state", writer))
        yield
