"""Peak CPU allocation of a call, from torch's profiler: every temporary counted.

The CPU ledger (:mod:`wrapped_optim._staging.ledger`) sees only what the staging engine records; the
profiler's memory events see every allocation the CPU allocator makes, including those
inside a holder's own code, so a "one chunk" bound is checked with all temporaries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

SLACK = 2048  # the per-tensor amax, scale and multiplier scalars
SENTINEL_BYTES = 12345  # an allocation of a size nothing else makes


def peak_cpu_bytes(fn: Callable[[], Any]) -> int:
    """Peak bytes the CPU allocator held at once during ``fn()`` (torch's profiler events)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        sentinel = torch.empty(SENTINEL_BYTES, dtype=torch.uint8)  # proves events are seen
        del sentinel
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    sizes = [e.nbytes() for e in events[:2]]
    if sizes != [SENTINEL_BYTES, -SENTINEL_BYTES]:
        raise AssertionError(f"the profiler did not report the sentinel allocation: {sizes}")
    live = peak = 0
    for event in events[2:]:
        live += event.nbytes()
        peak = max(peak, live)
    return peak
