"""DTensor leaves (PyTorch's native sharded tensors, FSDP2): saved by 4 gloo processes on CPU, one chunk per
shard (uneven, empty and nested shards too), replicated data written once; restored onto other meshes,
placements and process counts, as CPU tensors here, onto torch_xla SPMD and back, bit for bit; Partial refused
by key; an FSDP2 model + AdamW + scheduler resumed by the manager after a kill with its loss curve continuing bit
for bit, and resharded 4 -> 2 processes and onto an HSDP mesh; a peer dying mid-save commits nothing. The jobs
never import torch_xla (each reports it)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from conftest import make_mesh, sharded
from forked import launch_job

import xla_tensorstore_ckpt as xtc

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "dtensor_job.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
import dtensor_job  # noqa: E402


def launch(world: int, *args: str) -> list[dict]:
    results = launch_job(SCRIPT, world, *map(str, args))
    for r in results:
        assert r["returncode"] == 0, r["stderr"][-3000:]
        assert r["lines"] and not any(line["torch_xla"] for line in r["lines"]), r["lines"]
    return results


def lines_with(results: list[dict], field: str) -> list[dict]:
    return [next(line for line in r["lines"] if field in line) for r in results]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("dtensors")
    return root, lines_with(launch(4, "save", root), "bytes")


def test_four_processes_save_dtensors_as_one_global_array_each(saved):
    root, _ = saved
    info = xtc.metadata(root / "item")
    restored = xtc.restore(root / "item")  # CPU tensors, no mesh at all
    for name in dtensor_job.ARRAYS:
        assert torch.equal(restored[name], dtensor_job.global_value(name)), name
    assert restored["meta"] == {"step": 3}
    # one chunk per shard where the shards are even or torch.chunk-uneven; nested uneven splits (10 rows: 5 | 5,
    # then 3 | 2 each) are cut at every boundary any shard has
    chunks = {name: info[name].chunk_shape for name in dtensor_job.ARRAYS}
    assert chunks["even"] == (2, 6) and chunks["uneven"] == (2, 5) and chunks["empty_shard"] == (1, 4)
    assert chunks["columns"] == (4, 3) and chunks["hsdp"] == (5, 4) and chunks["two_dims"] == (3, 4)
    assert chunks["nested"] == (1, 3)
    sharding = info["hsdp"].sharding
    assert sharding.mesh_shape == (2, 2) and sharding.axis_names == ("dp", "tp")
    assert sharding.placements == ("Replicate()", "Shard(dim=0)") and sharding.partition_spec == ("tp", None)
    assert info["two_dims"].sharding.partition_spec == ("dp", "tp")
    assert info["nested"].sharding.partition_spec == (("dp", "tp"), None)


def test_replicated_dtensors_are_written_once_and_spread(saved):
    _, lines = saved
    per_process = [line["bytes"] for line in sorted(lines, key=lambda x: x["rank"])]
    total = sum(dtensor_job.global_value(n).numel() * dtensor_job.global_value(n).element_size()
                for n in dtensor_job.ARRAYS)
    assert sum(per_process) == total + 8  # each chunk once (meta.step: a 0-d int64 for Orbax)
    assert max(per_process) <= 1.25 * total / 4, per_process


@pytest.mark.parametrize("world", [2, 4], ids=["2-processes", "4-processes"])
def test_restore_onto_other_placements_and_process_counts(saved, world):
    root, _ = saved
    for line in lines_with(launch(world, "restore", root), "equal"):
        assert all(line["equal"].values()) and all(line["laid_out"].values()), line
        assert line["meta"] == {"step": 3}
        rows = -(-1024 // world)  # 'replicated' restored as Shard(0): this rank's rows only
        assert line["local"]["replicated"] == [min(rows, 1024 - rows * line["rank"]), 512]


def test_partial_dtensors_are_refused_by_key(tmp_path):
    for line in lines_with(launch(2, "partial", tmp_path), "error"):
        assert line["error"] and "layer/grad" in line["error"] and "Partial" in line["error"], line
        assert "reduce" in line["error"] and not line["exists"]


def test_torch_xla_spmd_save_restores_as_dtensors_and_back(tmp_path):
    mesh = make_mesh((4, 2), ("a", "b"))
    values = {name: dtensor_job.global_value(name) for name in ("even", "uneven", "two_dims", "bf16")}
    xtc.save(tmp_path / "spmd", {name: sharded(v, mesh, ("a", "b")) for name, v in values.items()})
    expected = {name: dtensor_job.digest(v) for name, v in values.items()}
    for world in (2, 4):
        for line in lines_with(launch(world, "from_spmd", tmp_path), "digests"):
            assert line["digests"] == expected, (world, line)
        target = {name: sharded(torch.zeros_like(v), make_mesh((2, 4), ("x", "y")), ("y", None))
                  for name, v in values.items()}
        back = xtc.restore(tmp_path / "back", target)
        for name, value in values.items():
            assert torch.equal(back[name].cpu(), value), (world, name)


def test_a_peer_dying_mid_save_commits_nothing(tmp_path):
    results = launch_job(SCRIPT, 4, "die", str(tmp_path / "root"), "1")
    assert results[1]["returncode"] == -9
    for rank in (0, 2, 3):
        r = results[rank]
        assert r["returncode"] == 0, r["stderr"][-3000:]
        step2 = next(line for line in r["lines"] if "step2" in line)
        assert step2["step2"] == "CoordinationError", step2
        assert next(line for line in r["lines"] if "steps" in line)["steps"] == [1]
    restored = xtc.restore(tmp_path / "root" / "1" / "model")
    for name in dtensor_job.ARRAYS:
        assert torch.equal(restored[name], dtensor_job.global_value(name)), name


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """Six steps of FSDP2 training on 2 processes in one go, and the same run killed after step 3's commit
    (asynchronous saves) and resumed."""
    base = tmp_path_factory.mktemp("fsdp")
    whole = launch(2, "train", base / "whole", 6)
    first = launch(2, "train", base / "resumed", 6, "--stop-at", 3, "--async")
    second = launch(2, "train", base / "resumed", 6, "--resume", "latest", "--async")
    return base, whole, first, second


def losses(results: list[dict]) -> list[list[float]]:
    return [[line["loss"] for line in r["lines"] if "loss" in line] for r in results]


def test_fsdp2_training_resumes_after_a_kill_bit_for_bit(fsdp_run):
    _, whole, first, second = fsdp_run
    assert [line["restored"] for line in lines_with(second, "restored")] == [3, 3]
    for line in lines_with(second, "restored"):
        assert line["same_parameters"] and line["dtensors"], line  # restored in place: identity kept
    for rank in range(2):
        assert losses(first)[rank] + losses(second)[rank] == losses(whole)[rank], rank
    assert lines_with(second, "digests") == lines_with(whole, "digests")


def test_fsdp2_state_reshards_onto_four_processes_and_an_hsdp_mesh(fsdp_run):
    base, whole, _, _ = fsdp_run
    reference = lines_with(whole, "digests")[0]
    for args in ((4, "--mesh", "fsdp"), (4, "--mesh", "hsdp")):
        for line in lines_with(launch(args[0], "state", base / "whole", 6, *args[1:]), "digests"):
            assert line["digests"] == reference["digests"] and line["lr"] == reference["lr"], (args, line)
            assert line["position"] == 6
