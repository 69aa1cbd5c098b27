"""The bytes the staging engine keeps on source devices, recorded while alive.

It imports only the standard library, so the engine writes to it and the
testing kit's :class:`~wrapped_optim.testing.probe.DeviceMemoryProbe` reads it, without
either importing the other. Every open probe is told each new level.

Examples:
    >>> from wrapped_optim._staging.ledger import device_ledger
    >>> before = device_ledger.live_bytes
    >>> device_ledger.allocate(64)
    >>> device_ledger.live_bytes - before
    64
    >>> device_ledger.release(64)
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["LedgerObserver", "device_ledger"]


#: Called with each new level (a probe keeps the highest).
LedgerObserver = Callable[[int], None]


class _DeviceLedger:
    """Bytes the staging engine holds on source devices, seen by every open probe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live = 0
        self._observers: list[LedgerObserver] = []

    @property
    def live_bytes(self) -> int:
        """Bytes currently recorded as alive."""
        return self._live

    def allocate(self, nbytes: int) -> None:
        """Records ``nbytes`` newly alive on a source device."""
        with self._lock:
            self._live += nbytes
            for observer in self._observers:
                observer(self._live)

    def release(self, nbytes: int) -> None:
        """Records ``nbytes`` freed again."""
        with self._lock:
            self._live -= nbytes

    def attach(self, observer: LedgerObserver) -> int:
        """Calls ``observer`` with each new level from now on; returns the level now."""
        with self._lock:
            self._observers.append(observer)
            return self._live

    def detach(self, observer: LedgerObserver) -> None:
        """Stops calling ``observer`` (one attached earlier)."""
        with self._lock:
            self._observers.remove(observer)


device_ledger = _DeviceLedger()
"""The process-wide ledger the staging engine writes to and ``DeviceMemoryProbe`` reads.

``allocate(nbytes)`` records bytes newly alive on a source device, ``release(nbytes)`` records
them freed, ``live_bytes`` is the current total. Call them yourself to put your own device
buffers on the ledger.
"""
