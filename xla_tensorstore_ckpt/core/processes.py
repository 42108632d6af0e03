"""Facts about the processes of this host: is one alive, and when did it start. Used by the manager lock (is
its owner gone?) and by the local backend (whose temporary files were left by a writer that died?)."""

from __future__ import annotations

import hashlib
import os
import socket


def host_tag() -> str:
    """A short, file-name-safe name of this host (8 hex digits of its hostname's hash)."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def pid_alive(pid: object) -> bool:
    """True if a process with id `pid` exists on this host (it may be another one than meant: pids are reused)."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_start(pid: int) -> str | None:
    """When process `pid` started, as ``<boot id>:<start time in clock ticks>`` (Linux), or None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # after the command name, which may hold spaces
    return f"{boot}:{fields[19]}" if len(fields) > 19 else None
