"""A two-tier saving process killed (SIGKILL, like kill -9) while it copies a step to the persistent tier.

usage: crash_multi_tier.py ROOT LOCAL PHASE:OPERATION[:FILE]
Saves steps 1 and 2 of a deterministic CPU state (tests/scripts/crash_save.py's) asynchronously to both tiers:
persistent ROOT, seen through a hooked storage backend (tests/fault_backends.py), and local LOCAL. The kill point
is chosen by path, not by counting: the first storage operation OPERATION (write, rename_dir, sync_files, ...) on
step 2's directory in ROOT (its final name or its temporary one) whose path relative to that directory is FILE
(any path when FILE is left out), killed "before" it runs or "after" it returned. At that point the process
first waits until step 2 is committed in the local tier (an event, not a delay). Exits 0 if the point was never
reached. Examples: before:write:_CHECKPOINT_METADATA (the step's marker), after:write:commit_success.txt (the
step's completion mark, not an item's), before:rename_dir (the commit where the storage renames).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from crash_save import state_for  # noqa: E402
from fault_backends import hooked  # noqa: E402

import xla_tensorstore_ckpt as xtc  # noqa: E402
from xla_tensorstore_ckpt import storage  # noqa: E402
from xla_tensorstore_ckpt.core import layout  # noqa: E402

STEP = 2


class KillPoint:
    """The hook pair that kills the process at one operation on one file of step `STEP`'s directory."""

    def __init__(self, root: str, point: str, ready: threading.Event):
        self.phase, self.operation, *rest = point.split(":", 2)
        if self.phase not in ("before", "after"):
            raise SystemExit(f"the phase of {point!r} must be before or after")
        self.file = rest[0] if rest else None
        self.root = storage.location(root).path.rstrip("/") + "/"
        self.ready = ready
        self.armed = threading.Event()

    def matches(self, operation: str, path: str) -> bool:
        if not self.armed.is_set() or operation != self.operation or not path.startswith(self.root):
            return False
        directory, _, rest = path[len(self.root):].partition("/")
        name = directory.split(layout.TMP_STEP_SUFFIX, 1)[0]
        return layout.parse_step_name(name, None) == STEP and (self.file is None or rest.rstrip("/") == self.file)

    def before(self, operation: str, path: str, count: int) -> None:
        if self.phase == "before" and self.matches(operation, path):
            self.kill()

    def after(self, operation: str, path: str, count: int) -> None:
        if self.phase == "after" and self.matches(operation, path):
            self.kill()

    def kill(self) -> None:
        self.ready.wait()  # the local copy is committed, the persistent one is at the chosen point
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    root, local, point = sys.argv[1:4]
    local_committed = threading.Event()

    def on_local_commit(step: int) -> None:
        if step == STEP:
            local_committed.set()

    kill = KillPoint(root, point, local_committed)
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, local_directory=local, local_save_interval_steps=1,
                                           on_local_commit=on_local_commit)
    manager = xtc.CheckpointManager(hooked(root, kill.before, kill.after), options)
    manager.save(1, model=state_for(1))
    manager.wait_until_finished()
    kill.armed.set()
    manager.save(STEP, model=state_for(STEP))
    manager.close()


if __name__ == "__main__":
    main()
