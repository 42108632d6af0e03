"""Runs one xtckpt command and reports how much the process's resident memory grew at its peak, for the memory
budget tests (a process of its own: the peak RSS of a shared test process says nothing).

usage: convert_peak_rss.py JSON_ARGV  -> one JSON line: {"status", "baseline", "peak", "torch_xla_imported"}
"""

from __future__ import annotations

import json
import sys

from xla_tensorstore_ckpt import cli
from xla_tensorstore_ckpt.core import host_memory


def status_bytes(field: str) -> int:
    """A size from /proc/self/status. VmHWM is this address space's peak, reset at exec: unlike getrusage's
    ru_maxrss, it does not count the parent's memory that the fork before the exec copied."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise SystemExit(f"no {field} in /proc/self/status")


host_memory.release_large_buffers_at_once()  # as the console script does: the command owns this process
baseline = status_bytes("VmRSS")
status = cli.main(json.loads(sys.argv[1]))
peak = status_bytes("VmHWM")
print(json.dumps({"status": status, "baseline": baseline, "peak": peak,
                  "torch_xla_imported": "torch_xla" in sys.modules}))
