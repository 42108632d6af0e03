"""gs:// through a flaky network: a proxy in front of the emulator answers 10% of requests with 503 and drops
5% of connections. Saves and restores still succeed (bounded retries with backoff), or fail cleanly with
nothing committed; whatever is committed restores bit for bit."""

from __future__ import annotations

from conftest import GCS_BUCKET, GCS_PORT
from fault_runs import assert_exactly_committed_steps_restore, save_four_steps_through
from gcs_emulator import FaultProxy, client_environment

import xla_tensorstore_ckpt as xtc


def test_saves_and_restores_survive_503s_and_dropped_connections(gcs_emulator_server):
    proxy = FaultProxy(GCS_PORT, error_rate=0.10, drop_rate=0.05, seed=1)
    root = f"gs://{GCS_BUCKET}/faults/run"
    result = save_four_steps_through(proxy, root, client_environment)
    assert proxy.counts["503"] >= 5 and proxy.counts["dropped"] >= 5, proxy.counts  # faults really happened
    assert result["committed"] == result["restored"]
    assert sorted(result["committed"] + [int(s) for s in result["failed"]]) == [1, 2, 3, 4]
    assert len(result["committed"]) >= 3, result["failed"]  # retries absorb almost every fault
    for message in result["failed"].values():  # a failure names what failed
        assert f"gs://{GCS_BUCKET}/faults/run" in message or "gs://" in message
    # Seen directly (no proxy): exactly the committed steps exist and restore bit for bit.
    assert_exactly_committed_steps_restore(root, result["committed"])


def test_a_write_that_keeps_failing_fails_cleanly_naming_the_object(gcs_emulator_server):
    # Every upload of step 3's commit marker fails: the retries give up, the save fails, step 3 is not committed,
    # the other steps are, and the error names the object.
    proxy = FaultProxy(GCS_PORT, error_rate=0.0, drop_rate=0.0, always_fail="3%2F_CHECKPOINT_METADATA")
    root = f"gs://{GCS_BUCKET}/faults/hard"
    result = save_four_steps_through(proxy, root, client_environment)
    assert result["committed"] == [1, 2, 4] and list(result["failed"]) == ["3"]
    assert "step 3" in result["failed"]["3"] and "3/_CHECKPOINT_METADATA" in result["failed"]["3"]
    with xtc.CheckpointManager(root, xtc.CheckpointManagerOptions(save_interval_steps=1)) as mgr:
        assert mgr.all_steps() == [1, 2, 4]
