"""Peak CPU allocation of a call, from torch's profiler: every temporary counted.

The CPU ledger (:mod:`wrapped_optim.ledger`) sees only what the staging engine records; the
profiler's memory events see every allocation the CPU allocator makes, including those
inside a holder's own code, so a "one chunk" bound is checked with all temporaries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

SLACK = 2048  # the per-tensor amax, scale and multiplier scalars


def peak_cpu_bytes(fn: Callable[[], Any]) -> int:
    """Peak bytes the CPU allocator held at once during ``fn()`` (torch's profiler events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak
