"""The chaos harness (tests/chaos.py), short: one fixed seed, three cycles of a four-process job with the manager's
full configuration (asynchronous saves, local tiers replicated to a peer, the persistent tier on the GCS emulator
behind the fault proxy): a fault-free start, then a process killed while its chunks are written with a host's local
tier wiped, then a deleted file in a host's newest local step. Every resume is the model's step, every value the
reference run's bit for bit, nothing committed lost or changed, every failure raised on every process. The long
run is `python tests/chaos.py --seeds 3 --cycles 100` (docs/reliability.md)."""

from __future__ import annotations

import chaos


def test_a_short_chaos_run_keeps_every_guarantee(gcs_emulator_server, tmp_path):
    gcs_emulator_server.create_bucket(chaos.BUCKET)
    lines: list[str] = []
    summary = chaos.run_seeds([894], 3, ["gcs"], {"gcs": gcs_emulator_server.port}, str(tmp_path), timeout=8, steps=2,
                              log=lambda line, verbose=False: lines.append(line))
    assert summary["problems"] == [], "\n".join(lines)
    assert summary["cycles"] == 3
    assert dict(summary["faults"]) == {"none": 1, "kill": 1, "wipe": 1, "damage": 1}, lines
    assert summary["outcomes"]["killed"] == 1 and summary["outcomes"]["clean"] == 2, (summary["outcomes"], lines)
