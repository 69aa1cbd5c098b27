"""CPU stand-ins for the CUDA stream API, shared by the test shims that run GPU-minded code
(Megatron-FSDP in tests/distributed, megatron-core in tests/megatron_real) on one CPU: every
wait is already satisfied there, so each stand-in does nothing and says so."""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class NoOpEvent:
    """Stands in for torch.cuda.Event."""

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass


class NoOpStream:
    """Stands in for torch.cuda.Stream: ordering is trivially satisfied on a CPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = torch.device("cpu")

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        # Megatron-FSDP asserts that an event exists after recording one.
        return event if event is not None else NoOpEvent()

    def synchronize(self) -> None:
        pass


def current_stream(*args: Any, **kwargs: Any) -> NoOpStream:
    return NoOpStream()


def null_context(*args: Any, **kwargs: Any) -> contextlib.nullcontext[None]:
    return contextlib.nullcontext()


def no_op(*args: Any, **kwargs: Any) -> None:
    return None
