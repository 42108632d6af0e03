"""A two-tier saving process killed (SIGKILL, like kill -9) while it copies a step to the persistent tier.

usage: crash_multi_tier.py ROOT LOCAL OPERATION:N
Saves steps 1 and 2 of a deterministic CPU state (tests/scripts/crash_save.py's) asynchronously to both tiers:
persistent ROOT, seen through a hooked storage backend (tests/fault_backends.py), and local LOCAL. In step 2,
the N-th storage operation OPERATION on ROOT waits until the step is committed in the local tier, then kills the
process before it runs. Exits 0 if the point was never reached.
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


def main() -> None:
    root, local, point = sys.argv[1:4]
    operation, count = point.rsplit(":", 1)
    armed, local_commits = threading.Event(), {}
    step_2_local = threading.Event()

    def on_local_commit(step: int) -> None:
        local_commits[step] = True
        if step == 2:
            step_2_local.set()

    def hook(op: str, path: str, n: int) -> None:
        if armed.is_set() and op == operation:
            hook.calls += 1
            if hook.calls == int(count):
                step_2_local.wait()  # the event, not a delay: the local copy is committed, the persistent one not
                os.kill(os.getpid(), signal.SIGKILL)

    hook.calls = 0
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, local_directory=local, local_save_interval_steps=1,
                                           on_local_commit=on_local_commit)
    manager = xtc.CheckpointManager(hooked(root, hook), options)
    manager.save(1, model=state_for(1))
    manager.wait_until_finished()
    armed.set()
    manager.save(2, model=state_for(2))
    manager.close()


if __name__ == "__main__":
    main()
