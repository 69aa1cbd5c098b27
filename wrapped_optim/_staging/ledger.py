"""The bytes the staging engine keeps on source devices, recorded while alive.

A leaf module (it imports only the standard library), so the engine writes to it and the
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
from typing import Protocol

__all__ = ["LedgerObserver", "device_ledger"]


class LedgerObserver(Protocol):
    """What the ledger tells of each new level (a probe keeps the highest)."""

    def _observe(self, live: int) -> None: ...


class _DeviceLedger:
    """Bytes the staging engine holds on source devices, seen by every open probe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live = 0
        self._probes: list[LedgerObserver] = []

    @property
    def live_bytes(self) -> int:
        """Bytes currently recorded as alive."""
        return self._live

    def allocate(self, nbytes: int) -> None:
        """Records ``nbytes`` newly alive on a source device."""
        with self._lock:
            self._live += nbytes
            for probe in self._probes:
                probe._observe(self._live)

    def release(self, nbytes: int) -> None:
        """Records ``nbytes`` freed again."""
        with self._lock:
            self._live -= nbytes

    def _attach(self, probe: LedgerObserver) -> int:
        with self._lock:
            self._probes.append(probe)
            return self._live

    def _detach(self, probe: LedgerObserver) -> None:
        with self._lock:
            self._probes.remove(probe)


device_ledger = _DeviceLedger()
"""The process-wide ledger the staging engine writes to and ``DeviceMemoryProbe`` reads.

``allocate(nbytes)`` records bytes newly alive on a source device, ``release(nbytes)`` records
them freed, ``live_bytes`` is the current total. Call them yourself to put your own device
buffers on the ledger.
"""
