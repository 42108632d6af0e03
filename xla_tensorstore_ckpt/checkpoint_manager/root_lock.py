"""Ownership of a checkpoint root: at most one saving manager per root, through ``<root>/_MANAGER_LOCK``.

The lock records its owner (host, pid, when that process started, a random token) and a heartbeat refreshed at
every commit. It is stale, and may be taken over, when its process is gone (same host: no process with that pid,
or one that started at another time, as after a container restart that reuses pids) or its heartbeat is older
than the timeout (other hosts). A free root is taken by an exclusive create; a stale lock through an exclusive create of
``_MANAGER_LOCK.takeover.<stale token>``: of several managers that found the same stale lock at once, exactly one
creates it and overwrites the lock, the others then find a live owner. The marker stays until its owner releases
the root, so that a contender still holding the stale record cannot create it again meanwhile. A process killed
in between leaves a marker of a dead owner: the next owner removes such markers (one killed between giving up
the lock and deleting its marker), and a contender killed between its marker and the lock is stale in turn, its
own marker claimed instead (it would otherwise keep the root from ever being taken over). All of this rests
on `create_exclusive` having one winner (`Capabilities.atomic_create`); on a backend without it the lock is best
effort, and a warning says so. Called by the primary process only; blocks.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import uuid
import warnings

from ..core import layout
from ..core.processes import pid_alive, process_start
from ..storage import Location

_TAKEOVER = f"{layout.MANAGER_LOCK}.takeover."


class RootLock:
    """The lock of one root, as seen by one manager."""

    def __init__(self, root: Location, timeout_s: float):
        self.root = root
        self.timeout_s = timeout_s
        self.owner = {"host": socket.gethostname(), "pid": os.getpid(), "started": process_start(os.getpid()),
                      "token": uuid.uuid4().hex}
        self.owned = False
        self.holder: dict | None = None  # another live owner, when one was found
        self._takeover: str | None = None  # the marker of the stale lock this manager took over

    def live_holder(self) -> dict | None:
        """The manager that owns the root and is alive, or None (a stale lock counts as none)."""
        data = self.root.read(layout.MANAGER_LOCK)
        holder = _decode(data) if data is not None else None
        return holder if holder is not None and self._is_live(holder) else None

    def acquire(self) -> bool:
        """Own the root unless a live manager does (then `holder` says who). True if owned now."""
        if self.owned:
            return True
        if not self.root.capabilities.atomic_create:
            warnings.warn(f"{self.root} cannot create files atomically: the manager lock is best effort",
                          stacklevel=3)
        record = self._record()
        for _ in range(3):
            if self.root.create_exclusive(layout.MANAGER_LOCK, record):
                self._remove_dead_takeovers()
                return self._owned()
            data = self.root.read(layout.MANAGER_LOCK)
            if data is None:
                continue  # released meanwhile: try again
            holder = _decode(data)
            if holder is not None and self._is_live(holder):
                self.holder = holder
                return False
            marker = self._claim(_token(holder, data), record)
            if marker is not None:
                self.root.write(layout.MANAGER_LOCK, record, fsync=False)
                self._takeover = marker
                self._remove_dead_takeovers()
                return self._owned()
        self.holder = self.live_holder()
        return False

    def _claim(self, stale: str, record: bytes) -> str | None:
        """Create the takeover marker of the stale owner `stale`; its name, or None if a live contender holds it.
        A contender that created it and died before writing the lock (killed in between) is stale in turn: its
        own marker is claimed instead, so that no dead process can keep the root from being taken over."""
        for _ in range(8):  # each round follows one more dead contender; real chains are one or two long
            marker = f"{_TAKEOVER}{stale}"
            if self.root.create_exclusive(marker, record):
                return marker
            data = self.root.read(marker)
            if data is None:
                continue  # released meanwhile: claim it again
            contender = _decode(data)
            if contender is not None and self._is_live(contender):
                return None
            stale = _token(contender, data)
        return None

    def _remove_dead_takeovers(self) -> None:
        """Delete the takeover markers of owners that died since (one killed between giving up the lock and
        deleting its marker leaves one, which no later owner would otherwise remove)."""
        for name in self.root.list():
            if name.startswith(_TAKEOVER) and name != self._takeover:
                data = self.root.read(name)
                owner = _decode(data) if data is not None else None
                if owner is None or not self._is_live(owner):
                    self.root.delete(name)

    def heartbeat(self) -> None:
        """Refresh the lock's timestamp (at every commit), so other hosts see the owner alive."""
        self.root.write(layout.MANAGER_LOCK, self._record(), fsync=False)

    def release(self) -> None:
        """Give the root up (idempotent)."""
        if not self.owned:
            return
        self.owned = False
        self.root.delete(layout.MANAGER_LOCK)
        if self._takeover is not None:
            self.root.delete(self._takeover)

    def _owned(self) -> bool:
        self.owned, self.holder = True, None
        return True

    def _record(self) -> bytes:
        return json.dumps({**self.owner, "heartbeat": time.time()}).encode()

    def _is_live(self, holder: dict) -> bool:
        if holder.get("host") == self.owner["host"]:
            pid, started = holder.get("pid"), holder.get("started")
            if not pid_alive(pid):
                return False
            # A live pid is another process if it started at another time (pids are reused, from 1 in containers).
            return not isinstance(started, str) or process_start(pid) in (None, started)  # type: ignore[arg-type]
        heartbeat = holder.get("heartbeat")
        return isinstance(heartbeat, (int, float)) and time.time() - heartbeat < self.timeout_s


def _token(holder: dict | None, data: bytes) -> str:
    """The token a takeover marker of `holder` (the record `data`) is named by; an unreadable record is named by
    its content."""
    token = holder.get("token") if holder is not None else None
    return token if isinstance(token, str) and token.isalnum() else hashlib.sha256(data).hexdigest()[:32]


def _decode(data: bytes) -> dict | None:
    try:
        holder = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None
