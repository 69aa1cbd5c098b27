"""Process memory as the kernel counts it, for the benchmarks that run in child processes."""

from __future__ import annotations

import re


def proc_status(field: str) -> int:
    """A byte count from ``/proc/self/status`` (``VmRSS``, ``VmHWM``: the peak RSS).

    Example:
        >>> proc_status("VmHWM") >= proc_status("VmRSS") > 0
        True
    """
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    assert match is not None, field
    return int(match.group(1)) * 1024


def reset_peak() -> None:
    """Resets the process's peak RSS (``VmHWM``) to its current RSS (``/proc/self/clear_refs``).

    Example:
        >>> reset_peak(); proc_status("VmHWM") - proc_status("VmRSS") < 1 << 20
        True
    """
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
