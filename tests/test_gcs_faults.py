"""gs:// through a flaky network: a proxy in front of the emulator answers 10% of requests with 503 and drops
5% of connections. Saves and restores still succeed (bounded retries with backoff), or fail cleanly with
nothing committed; whatever is committed restores bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from conftest import GCS_BUCKET, GCS_PORT
from gcs_emulator import FaultProxy, client_environment

import xla_tensorstore_ckpt as xtc

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "store_faults.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
from store_faults import state_for  # noqa: E402


def save_four_steps_through(proxy: FaultProxy, root: str, clients=client_environment) -> dict:
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


def test_saves_and_restores_survive_503s_and_dropped_connections(gcs_emulator_server):
    proxy = FaultProxy(GCS_PORT, error_rate=0.10, drop_rate=0.05, seed=1)
    root = f"gs://{GCS_BUCKET}/faults/run"
    result = save_four_steps_through(proxy, root)
    assert proxy.counts["503"] >= 5 and proxy.counts["dropped"] >= 5, proxy.counts  # faults really happened
    assert result["committed"] == result["restored"]
    assert sorted(result["committed"] + [int(s) for s in result["failed"]]) == [1, 2, 3, 4]
    assert len(result["committed"]) >= 3, result["failed"]  # retries absorb almost every fault
    for message in result["failed"].values():  # a failure names what failed
        assert f"gs://{GCS_BUCKET}/faults/run" in message or "gs://" in message
    # Seen directly (no proxy): exactly the committed steps exist and restore bit for bit.
    with xtc.CheckpointManager(root, xtc.CheckpointManagerOptions(save_interval_steps=1)) as mgr:
        assert mgr.all_steps() == result["committed"]
        for step in mgr.all_steps():
            model = {"w": torch.zeros(256, 128), "layers": [torch.zeros(64, 64) for _ in range(6)], "step": 0}
            mgr.restore(step, model=model)
            assert torch.equal(model["w"], state_for(step)["w"])


def test_a_write_that_keeps_failing_fails_cleanly_naming_the_object(gcs_emulator_server):
    # Every upload of step 3's commit marker fails: the retries give up, the save fails, step 3 is not committed,
    # the other steps are, and the error names the object.
    proxy = FaultProxy(GCS_PORT, error_rate=0.0, drop_rate=0.0, always_fail="3%2F_CHECKPOINT_METADATA")
    root = f"gs://{GCS_BUCKET}/faults/hard"
    result = save_four_steps_through(proxy, root)
    assert result["committed"] == [1, 2, 4] and list(result["failed"]) == ["3"]
    assert "step 3" in result["failed"]["3"] and "3/_CHECKPOINT_METADATA" in result["failed"]["3"]
    with xtc.CheckpointManager(root, xtc.CheckpointManagerOptions(save_interval_steps=1)) as mgr:
        assert mgr.all_steps() == [1, 2, 4]
