"""Compatibility path of :mod:`wrapped_optim.testing.probe` (the probe lives in the testing kit).

Example:
    >>> from wrapped_optim.probe import DeviceMemoryProbe
    >>> DeviceMemoryProbe("cpu").source
    'ledger'
"""

from wrapped_optim.testing.probe import DeviceMemoryProbe, count_unstaged_expansions, device_ledger

__all__ = ["DeviceMemoryProbe", "count_unstaged_expansions", "device_ledger"]
