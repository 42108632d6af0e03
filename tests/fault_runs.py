"""Object-store fault runs shared by the gs:// and s3:// fault tests: the fault script (tests/scripts/store_faults.py)
saves steps 1-4 in a subprocess whose clients go through a `FaultProxy`; afterwards, seen directly, exactly the
committed steps must exist and restore bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

import torch
from gcs_emulator import FaultProxy

import xla_tensorstore_ckpt as xtc

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "store_faults.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
from store_faults import state_for  # noqa: E402


def save_four_steps_through(proxy: FaultProxy, root: str, clients: Callable[[str], dict]) -> dict:
    """Run the fault script (saves of steps 1-4, then restores) in a subprocess whose object-store clients go
    through `proxy` (`clients` gives their environment); return what it reports: committed, restored and failed
    steps."""
    proxy.start()
    try:
        env = dict(os.environ, **clients(proxy.url))
        env.pop("PJRT_DEVICE", None)
        proc = subprocess.run([sys.executable, SCRIPT, root, "4"], env=env, capture_output=True, text=True,
                              timeout=600)
    finally:
        proxy.stop()
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_exactly_committed_steps_restore(root: str, committed: list[int]) -> None:
    """Seen directly (no proxy): the manager lists exactly `committed`, and each restores bit for bit."""
    with xtc.CheckpointManager(root, xtc.CheckpointManagerOptions(save_interval_steps=1)) as mgr:
        assert mgr.all_steps() == committed
        for step in committed:
            model = {"w": torch.zeros(256, 128), "layers": [torch.zeros(64, 64) for _ in range(6)], "step": 0}
            mgr.restore(step, model=model)
            assert torch.equal(model["w"], state_for(step)["w"])
