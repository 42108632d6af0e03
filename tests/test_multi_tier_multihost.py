"""Multi-tier checkpoints with two processes over gloo, each with its own local tier: they agree on one step;
a restarted job whose processes sit on other hosts (swapped indices) still resumes from the local tier; one
host's local tier wiped, a damaged local step on one host, or shards a process now needs missing from its local
steps make every process fall back to the same persistent step."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from forked import launch_job

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "multitier.py")


def launch(mode: str, root, local_base, hosts: list[int], shards: list[int] | None = None) -> list[dict]:
    """Run one process per entry of `hosts` (rank r on host hosts[r], holding the shard of host shards[r]; by
    default its host's); their JSON lines, rank order."""
    results = launch_job(SCRIPT, len(hosts), mode, str(root), str(local_base),
                         rank_args=[[str(host), *([] if shards is None else [str(shards[rank])])]
                                    for rank, host in enumerate(hosts)])
    for r in results:
        assert r["returncode"] == 0, r["stderr"][-3000:]
    return [r["lines"][-1] for r in results]


def draw_after_seed(seed: int) -> float:
    return torch.rand(1, generator=torch.Generator().manual_seed(seed)).item()


@pytest.fixture
def saved(tmp_path):
    root, local_base = tmp_path / "persistent", tmp_path / "local"
    results = launch("save", root, local_base, [0, 1])
    for r in results:
        assert r["local"] == [2, 3] and r["persistent"] == [2]
    return root, local_base


def test_processes_on_other_hosts_resume_from_their_hosts_local_tier(saved):
    root, local_base = saved
    results = launch("restore", root, local_base, [1, 0])  # rank 0 now runs on host 1, rank 1 on host 0
    for r in results:
        assert r["step"] == 3 and r["equal"] and r["position"] == 30
        assert r["draw"] == draw_after_seed(300 + r["host"])  # the host's generators, whatever its index now
        assert any("restored step 3 from the local tier" in line for line in r["logs"]), r["logs"]


def test_one_wiped_local_tier_makes_everyone_fall_back(saved):
    root, local_base = saved
    shutil.rmtree(local_base / "host1")  # a replaced VM
    results = launch("restore", root, local_base, [0, 1])
    for r in results:
        assert r["step"] == 2 and r["equal"] and r["position"] == 20
        assert r["draw"] == draw_after_seed(200 + r["rank"])  # the persistent tier's generators, by index
        assert any("restored step 2 from the persistent tier" in line for line in r["logs"]), r["logs"]
    # and the job goes on: steps 3 and 4 saved again (process 0's old local step 3 was discarded at the resume)
    for r in launch("resume_save", root, local_base, [0, 1]):
        assert r["local"] == [3, 4] and r["persistent"] == [2, 4]
    for r in launch("restore", root, local_base, [0, 1]):
        assert r["step"] == 4 and r["equal"] and r["position"] == 40


def test_a_damaged_local_step_on_one_host_makes_everyone_fall_back(saved):
    root, local_base = saved
    step_dir = local_base / "host0" / "3" / "model"
    files = sorted((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(files[-1].read_bytes())
    data[len(data) // 2] ^= 0xFF
    files[-1].write_bytes(bytes(data))
    results = launch("restore", root, local_base, [0, 1])
    for r in results:
        assert r["step"] == 2 and r["equal"], r  # local step 2 is intact everywhere and as new as persistent
        assert any("skipping step 3 of the local tier" in w and "process 0" in w for w in r["warnings"]), r


def test_shards_a_process_now_needs_missing_from_its_local_step_make_everyone_fall_back(saved):
    """The restart gives each host the other host's rows (another device assignment): its local steps hold only
    the rows it wrote, so no local step is intact anywhere and every process restores the persistent step."""
    root, local_base = saved
    results = launch("restore", root, local_base, [0, 1], shards=[1, 0])
    for r in results:
        assert r["step"] == 2 and r["equal"] and r["position"] == 20, r  # rows of the other host, persistent
        for step in (3, 2):
            assert any(f"skipping step {step} of the local tier" in w and "process 0" in w and "process 1" in w
                       for w in r["warnings"]), r["warnings"]
        assert any("restored step 2 from the persistent tier" in line for line in r["logs"]), r["logs"]
