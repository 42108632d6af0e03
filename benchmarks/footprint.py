"""What a call costs beyond wall time, in the terms the library controls (issue 36): user and system CPU seconds
of the whole process (every thread), the fresh host memory it touched (the growth of the resident set at its
peak, plus the growth of the page cache), and the bytes it read from and wrote to storage (the block layer's
count: a read the page cache answered is not one), or for an object store on this machine the bytes that crossed
its network interfaces (machine-wide, like the page cache). On this VM the wall time of a fresh process mostly measures
how much fresh memory it touches and how quickly the hypervisor hands it over; these figures do not depend on
that. Linux only; plain standard library (the Orbax worker imports it in its own environment too)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import memory
from harness import median


def _page_cache_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Cached in /proc/meminfo")


def _io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def _network_bytes() -> int:
    """Bytes received on every network interface of this machine's namespace (loopback included: a local object
    store server's answers). Machine-wide: meaningful on a quiet machine."""
    with open("/proc/net/dev") as f:
        return sum(int(line.split(":", 1)[1].split()[0]) for line in f if ":" in line)


def measure(fn: Callable[[], Any]) -> tuple[dict, Any]:
    """Call `fn` and return (measures, its result). Measures: ``wall_s``, ``user_s``, ``system_s``,
    ``rss_growth_bytes`` (peak resident set above the one before the call; the high-water mark is reset first),
    ``page_cache_growth_bytes`` (machine-wide: meaningful on a quiet machine), ``fresh_bytes`` (their sum),
    ``read_bytes`` / ``written_bytes`` (from storage, this process) and ``read_calls_bytes`` (through read
    system calls, page cache hits included), ``network_bytes`` (received on this machine's interfaces, machine-wide:
    an object store's answers; sockets are not in ``read_calls_bytes``)."""
    cache, io, usage, net = _page_cache_bytes(), _io(), resource.getrusage(resource.RUSAGE_SELF), _network_bytes()
    wall, rss_growth, result = memory.measure(fn)
    after_usage, after_io, after_net = resource.getrusage(resource.RUSAGE_SELF), _io(), _network_bytes()
    cache_growth = max(0, _page_cache_bytes() - cache)
    return {"wall_s": wall, "user_s": after_usage.ru_utime - usage.ru_utime,
            "system_s": after_usage.ru_stime - usage.ru_stime, "rss_growth_bytes": rss_growth,
            "page_cache_growth_bytes": cache_growth, "fresh_bytes": rss_growth + cache_growth,
            "read_bytes": after_io["read_bytes"] - io["read_bytes"],
            "written_bytes": after_io["write_bytes"] - io["write_bytes"],
            "read_calls_bytes": after_io["rchar"] - io["rchar"], "network_bytes": after_net - net}, result


def summary(measured: Sequence[dict], nbytes: int, *, read: bool) -> str:
    """Medians of `measure`'s figures over runs: CPU user + sys seconds, fresh memory (peak resident set growth +
    page cache growth) and bytes read (`read`) or written per byte of state, and where an object store answered,
    the bytes received over the network."""
    def med(key: str) -> float:
        return median(m[key] for m in measured)

    io = "read_bytes" if read else "written_bytes"
    network = med("network_bytes") / nbytes
    return (f"CPU {median(m['user_s'] + m['system_s'] for m in measured):.2f} s ({med('user_s'):.2f} "
            f"user + {med('system_s'):.2f} sys), fresh {med('fresh_bytes') / nbytes:.2f} B/B "
            f"({med('rss_growth_bytes') / nbytes:.2f} resident + {med('page_cache_growth_bytes') / nbytes:.2f} page "
            f"cache), {'read' if read else 'written'} {med(io) / nbytes:.2f} B/B"
            + (f", network {network:.2f} B/B" if network >= 0.01 else ""))


def touch_memory(nbytes: int) -> None:
    """Warm-memory mode: touch `nbytes` of fresh memory in this (throwaway) process, so that the hypervisor has
    handed the pages to the VM before the timed process that comes next asks for them."""
    block = b"\x01" * nbytes
    del block


def warm_memory(nbytes: int) -> None:
    """Warm-memory mode, from the measuring side: run a throwaway process that touches `nbytes` (`touch_memory`)
    and wait for it. Raises CalledProcessError if it fails."""
    here = os.path.dirname(os.path.abspath(__file__))
    subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {here!r}); import footprint; "
                    f"footprint.touch_memory({nbytes})"], check=True)
