"""s3:// through a flaky network: a proxy in front of the S3 server answers 10% of requests with 503 SlowDown (S3's
throttling) and drops 5% of connections. Saves and restores still succeed (bounded retries with backoff), or
fail cleanly with nothing committed; whatever is committed restores bit for bit. An object that keeps failing
fails its save cleanly, naming it."""

from __future__ import annotations

from conftest import S3_BUCKET, S3_PORT
from fault_runs import assert_exactly_committed_steps_restore, save_four_steps_through
from gcs_emulator import FaultProxy
from s3_server import client_environment

import xla_tensorstore_ckpt as xtc

SLOW_DOWN = ("application/xml", b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                                b"<Message>Please reduce your request rate.</Message></Error>")


def test_saves_and_restores_survive_slow_downs_and_dropped_connections(s3_server_process):
    proxy = FaultProxy(S3_PORT, error_rate=0.10, drop_rate=0.05, seed=2, error=SLOW_DOWN)
    root = f"s3://{S3_BUCKET}/faults/run"
    result = save_four_steps_through(proxy, root, client_environment)
    assert proxy.counts["503"] >= 5 and proxy.counts["dropped"] >= 5, proxy.counts  # faults really happened
    assert result["committed"] == result["restored"]
    assert sorted(result["committed"] + [int(s) for s in result["failed"]]) == [1, 2, 3, 4]
    assert len(result["committed"]) >= 3, result["failed"]  # retries absorb almost every fault
    for message in result["failed"].values():
        assert f"s3://{S3_BUCKET}/faults/run" in message
    assert_exactly_committed_steps_restore(root, result["committed"])


def test_an_object_that_keeps_failing_fails_its_save_cleanly_naming_it(s3_server_process):
    proxy = FaultProxy(S3_PORT, error_rate=0.0, drop_rate=0.0, always_fail="3/_CHECKPOINT_METADATA",
                       error=SLOW_DOWN)
    root = f"s3://{S3_BUCKET}/faults/hard"
    result = save_four_steps_through(proxy, root, client_environment)
    assert result["committed"] == [1, 2, 4] and list(result["failed"]) == ["3"]
    assert "step 3" in result["failed"]["3"] and "3/_CHECKPOINT_METADATA" in result["failed"]["3"]
    with xtc.CheckpointManager(root, xtc.CheckpointManagerOptions(save_interval_steps=1)) as mgr:
        assert mgr.all_steps() == [1, 2, 4]
