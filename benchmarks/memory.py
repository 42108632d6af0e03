"""Peak host memory of a call: Linux's RSS high-water mark, reset before the call (/proc/self/clear_refs)."""

from __future__ import annotations

import time
from collections.abc import Callable


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(fn: Callable[[], object]) -> tuple[float, int, object]:
    """(seconds, peak RSS above the RSS before the call in bytes, result)."""
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM")
    return seconds, max(0, peak - before) * 1024, result
