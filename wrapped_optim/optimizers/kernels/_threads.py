"""How many threads a CPU kernel call uses by default: the cores this process may use, and of
those only the ones the rest of the machine leaves free.

The kernel's threads are OpenMP's (torch's own runtime). On oversubscribed cores they lose
their time slices mid-call, and the others spin at the region's closing barrier for them:
CPU time grows with the machine's load while the step gets no faster. So the default is

* at most the cores the process may run on: its CPU affinity (``os.sched_getaffinity``),
  capped by a cgroup CPU quota (cgroup v2 ``cpu.max`` up the process's cgroup path, or v1
  ``cpu.cfs_quota_us``), never the host's core count;
* fewer when the machine is busy: the 1-minute load average less this process's own torch
  threads, scaled to the share of the host's cores the process may use, is taken as cores
  held by others; a call uses what is left (at least the calling thread).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

__all__ = ["cgroup_cpu_limit", "default_threads", "usable_cores"]

_CGROUP_ROOT = Path("/sys/fs/cgroup")
_PROC_CGROUP = Path("/proc/self/cgroup")
#: How long this process's own quota is reused (seconds): reading it takes tens of
#: microseconds and a multi-threaded step asks each time; a resized quota is seen this late.
_OWN_LIMIT_TTL = 1.0
_own_limit: tuple[float, float | None] | None = None  # (read at, quota)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _v2_limit(root: Path, relative: str) -> float | None:
    """The smallest ``cpu.max`` quota (in cores) from the cgroup ``relative`` up to ``root``."""
    limits = []
    directory = root / relative.strip("/")
    while True:
        text = _read(directory / "cpu.max")
        if text is not None:
            quota, _, period = text.strip().partition(" ")
            if quota != "max" and period:
                limits.append(int(quota) / int(period))
        if directory == root or root not in directory.parents:
            break
        directory = directory.parent
    return min(limits, default=None)


def _v1_limit(root: Path) -> float | None:
    for directory in (root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"):
        quota = _read(directory / "cpu.cfs_quota_us")
        period = _read(directory / "cpu.cfs_period_us")
        if quota is not None and period is not None and int(quota) > 0 and int(period) > 0:
            return int(quota) / int(period)
    return None


def cgroup_cpu_limit(root: Path = _CGROUP_ROOT, proc_cgroup: Path = _PROC_CGROUP) -> float | None:
    """The CPU quota of this process's cgroup in cores (``1.5`` for ``150000 100000``), or
    None when there is none (or no cgroup file system).

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> root = Path(tempfile.mkdtemp())
        >>> (root / "job").mkdir()
        >>> _ = (root / "job" / "cpu.max").write_text("150000 100000\\n")
        >>> _ = (root / "cgroup").write_text("0::/job\\n")
        >>> cgroup_cpu_limit(root, root / "cgroup")
        1.5
    """
    global _own_limit
    if root != _CGROUP_ROOT or proc_cgroup != _PROC_CGROUP:
        return _read_limit(root, proc_cgroup)
    now = time.monotonic()
    if _own_limit is None or now - _own_limit[0] >= _OWN_LIMIT_TTL:
        _own_limit = (now, _read_limit(root, proc_cgroup))
    return _own_limit[1]


def _read_limit(root: Path, proc_cgroup: Path) -> float | None:
    text = _read(proc_cgroup) or ""
    for line in text.splitlines():
        hierarchy, _, path = line.partition("::")
        if hierarchy == "0" and path:
            limit = _v2_limit(root, path)
            if limit is not None:
                return limit
    return _v1_limit(root)  # cgroup v1, or a hybrid layout whose quota is v1's


def usable_cores() -> int:
    """The cores this process may run on: its affinity, capped by a cgroup CPU quota (a quota
    of 1.5 cores gives 1: a second thread would be throttled half the time).

    Example:
        >>> 1 <= usable_cores() <= (os.cpu_count() or 1)
        True
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        cores = min(cores, max(1, math.floor(limit)))
    return max(1, cores)


def default_threads(
    wanted: int, own_threads: int, cores: int | None = None, load: float | None = None
) -> int:
    """The threads a call should use: at most ``wanted`` and the usable ``cores``, fewer by
    the cores others hold (the 1-minute ``load`` less ``own_threads``, this process's share,
    scaled to the usable share of the host's cores).

    Example:
        >>> default_threads(2, own_threads=2, cores=2, load=2.1)  # alone on the cores
        2
        >>> default_threads(2, own_threads=2, cores=2, load=6.0)  # 4 busy processes besides
        1
        >>> default_threads(16, own_threads=16, cores=4, load=0.5)  # affinity: 4 cores
        4
    """
    if wanted <= 1:
        return 1  # one thread needs no look at the cores (a step calls this each time)
    cores = usable_cores() if cores is None else cores
    threads = max(1, min(wanted, cores))
    if threads == 1:
        return 1
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:
            return threads
    host = max(os.cpu_count() or cores, cores)
    others = max(0.0, load - own_threads) * cores / host
    return max(1, min(threads, math.floor(cores - others + 0.5)))
