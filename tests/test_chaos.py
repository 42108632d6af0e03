"""The chaos harness (tests/chaos.py), short: one fixed seed, three cycles of a four-process job with the manager's
full configuration (asynchronous saves, local tiers replicated to a peer, the persistent tier on the GCS emulator
behind the fault proxy): a fault-free start, then the whole job killed while it replicates a local step with a
host's local tier wiped (its step fetched from its peer), then a truncated file in a host's newest local step
(replaced from the peer's copy). Every resume is the model's step, every value the
reference run's bit for bit, nothing committed lost or changed, every failure raised on every process. The long
run is `python tests/chaos.py --seeds 3 --cycles 100` (docs/reliability.md)."""

from __future__ import annotations

import chaos
import chaos_jobs
import pytest


@pytest.fixture(scope="module")
def chaos_bucket(gcs_emulator_server):
    gcs_emulator_server.create_bucket(chaos_jobs.BUCKET)
    return gcs_emulator_server


def test_a_short_chaos_run_keeps_every_guarantee(chaos_bucket, tmp_path):
    lines: list[str] = []
    summary = chaos.run_seeds([7907], 3, ["gcs"], {"gcs": chaos_bucket.port}, str(tmp_path), timeout=30, steps=2,
                              log=lambda line, verbose=False: lines.append(line))
    assert summary["problems"] == [], "\n".join(lines)
    assert summary["cycles"] == 3
    assert dict(summary["faults"]) == {"none": 1, "kill_job": 1, "wipe": 1, "damage": 1}, lines
    assert summary["outcomes"]["killed"] == 1 and summary["outcomes"]["clean"] == 2, (summary["outcomes"], lines)


@pytest.mark.xla
def test_a_short_chaos_run_of_a_torch_xla_spmd_job(chaos_bucket, tmp_path):
    """The torch_xla variant (one process, a model sharded on a 4x2 mesh): a clean start, the process killed while
    its chunks are written, a deleted file in its newest local step."""
    lines: list[str] = []
    summary = chaos.run_seeds([682], 3, ["gcs"], {"gcs": chaos_bucket.port}, str(tmp_path), timeout=30,
                              steps=2, xla=True, log=lambda line, verbose=False: lines.append(line))
    assert summary["problems"] == [], "\n".join(lines)
    assert dict(summary["faults"]) == {"none": 1, "kill": 1, "damage": 1}, lines
    assert summary["outcomes"]["killed"] == 1 and summary["outcomes"]["clean"] == 2, (summary["outcomes"], lines)
