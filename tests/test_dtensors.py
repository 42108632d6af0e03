"""DTensor leaves (PyTorch's native sharded tensors, FSDP2): saved by 4 gloo processes on CPU, one chunk per
shard (uneven, empty and nested shards too), replicated data written once; restored onto other meshes,
placements and process counts, as CPU tensors here, onto torch_xla SPMD and back, bit for bit; Partial refused
by key; an FSDP2 model + AdamW + scheduler resumed by the manager after a kill with its loss curve continuing bit
for bit, and resharded 4 -> 2 processes and onto an HSDP mesh; a peer dying mid-save commits nothing. The jobs
never import torch_xla (each reports it)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from conftest import make_mesh, sharded
from forked import launch_job
from helpers import stored_chunk_bytes
from hf_files import write_hf_dir
from orbax_process import leaf, orbax, same
from safetensors.torch import load_file

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import cli
from xla_tensorstore_ckpt.core import dtypes

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "dtensor_job.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
import dtensor_job  # noqa: E402
import orbax_trees  # noqa: E402


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


def test_four_processes_save_dtensors_as_one_global_array_each(saved, capsys):
    root, lines = saved
    for line in lines:  # the writers derived from the shardings (one reduction), no chunk lists gathered
        phases = line["agreements"]
        assert "agreeing on the writers of the chunks" in phases and "choosing the writers of the chunks" not in \
            phases, phases
        assert all(cost["collectives"] >= 1 and cost["rounds"] >= 1 and cost["bytes"] > 0 for cost in
                   phases.values()), phases
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
    assert cli.main(["tree", str(root / "item")]) == 0
    shown = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "dtensor mesh (2, 2) ('dp', 'tp') placements (Replicate(), Shard(dim=0))" in shown["hsdp"]


def test_replicated_dtensors_are_written_once_and_spread(saved):
    _, lines = saved
    per_process = [line["bytes"] for line in sorted(lines, key=lambda x: x["rank"])]
    total = sum(dtensor_job.global_value(n).numel() * dtensor_job.global_value(n).element_size()
                for n in dtensor_job.ARRAYS)
    assert sum(per_process) == total + 8  # each chunk once (meta.step: a 0-d int64 for Orbax)
    assert max(per_process) <= 1.25 * total / 4, per_process


@pytest.fixture(scope="module")
def restored(saved):
    """The item restored by 2 and by 4 processes (these also with single-replica reads), by process count."""
    return {world: launch(world, "restore", saved[0]) for world in (2, 4)}


@pytest.mark.parametrize("world", [2, 4], ids=["2-processes", "4-processes"])
def test_restore_onto_other_placements_and_process_counts(restored, world):
    for line in lines_with(restored[world], "equal"):
        assert all(line["equal"].values()) and all(line["laid_out"].values()), line
        assert line["meta"] == {"step": 3}
        rows = -(-1024 // world)  # 'replicated' restored as Shard(0): this rank's rows only
        assert line["local"]["replicated"] == [min(rows, 1024 - rows * line["rank"]), 512]


def test_single_replica_reads_fetch_each_stored_chunk_once(saved, restored):
    root, _ = saved
    results = restored[4]
    on, off = ([line for r in results for line in r["lines"] if line.get("single") is single]
               for single in (True, False))
    assert all(line["equal"] for line in on + off) and len(on) == len(off) == 4, results
    seen = []  # one process reading the whole item: each stored chunk once (small ones inline in OCDBT's index)
    xtc.restore(root / "item", options=xtc.RestoreOptions(listeners=(seen.append,)))
    once = next(e for e in seen if e.kind == "restore_finished").details["storage_bytes"]
    assert once >= 2 << 20 and once <= stored_chunk_bytes(str(root / "item"))
    assert sum(line["storage_bytes"] for line in on) == once and sum(line["received"] for line in on) > 0
    assert all(line["plan"] == "derived" for line in on), on  # from the shardings: no gather of regions
    phases = on[0]["agreements"]  # one reduction for the plan, one per batch and the last, each with its costs
    assert phases["agreeing on the plan of the single-replica reads"]["collectives"] == 1, phases
    assert phases["reading its chunks"]["collectives"] >= 1 and phases["placing the restored arrays"]["rounds"] >= 1
    assert sum(line["storage_bytes"] for line in off) > 1.5 * once  # each replica fetched its own


def test_partial_dtensors_are_refused_by_key(tmp_path):
    for line in lines_with(launch(2, "partial", tmp_path), "error"):
        assert line["error"] and "layer/grad" in line["error"] and "Partial" in line["error"], line
        assert "reduce" in line["error"] and not line["exists"]


@pytest.mark.xla
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


def test_a_dtensor_save_is_an_orbax_checkpoint_jax_restores(saved):
    root, _ = saved
    for mode in ("restore", "restore_sharded"):  # the saved shardings alone, then JAX's NamedShardings on a mesh
        dumped = orbax(mode, root / "item")
        tree = dumped["tree"] if mode == "restore_sharded" else dumped
        for name in dtensor_job.ARRAYS:
            assert same(leaf(tree[name]), dtensor_job.global_value(name)), (mode, name)
        assert int(leaf(tree["meta.step"])) == 3


def test_an_orbax_save_restores_as_dtensors(tmp_path):
    orbax("write", tmp_path / "orbax", "--ocdbt", "1", "--zarr3", "1")
    arrays = {k: dtensor_job.digest(dtypes.numpy_to_tensor(v)) for k, v in dtensor_job.leaves(orbax_trees.tree())
              if isinstance(v, np.ndarray)}
    values = {k: v for k, v in dtensor_job.leaves(orbax_trees.tree()) if not isinstance(v, np.ndarray)}
    for line in lines_with(launch(4, "foreign", tmp_path / "orbax"), "digests"):
        assert line["digests"] == {**arrays, **values} and line["dtensors"] == sorted(arrays), line


def test_dtensor_checkpoints_export_to_safetensors_and_hf_weights_start_an_fsdp2_model(saved, tmp_path):
    root, _ = saved
    assert cli.main(["convert", str(root / "item"), str(tmp_path / "hf-out"), "--to", "safetensors"]) == 0
    exported = {}
    for name in os.listdir(tmp_path / "hf-out"):
        if name.endswith(".safetensors"):
            exported.update(load_file(tmp_path / "hf-out" / name))
    for name in dtensor_job.ARRAYS:
        assert torch.equal(exported[name], dtensor_job.global_value(name)), name
    weights = write_hf_dir(str(tmp_path / "hf"))
    expected = {name: dtensor_job.digest(value) for name, value in weights.items()}
    for line in lines_with(launch(2, "from_hf", tmp_path / "hf", tmp_path / "run"), "digests"):
        assert line["digests"] == expected and line["start"] is None and line["kept"] and line["dtensors"], line


def test_a_peer_dying_mid_save_commits_nothing(tmp_path):
    results = launch_job(SCRIPT, 4, "die", str(tmp_path / "root"), "1")
    assert results[1]["returncode"] == -9
    for rank in (0, 2, 3):
        r = results[rank]
        assert r["returncode"] == 0, r["stderr"][-3000:]
        step2 = next(line for line in r["lines"] if "step2" in line)
        assert step2["step2"] in ("CoordinationError", "CoordinationTimeoutError"), step2
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


def test_fsdp2_state_of_four_processes_reshards_onto_two(tmp_path):
    reference = lines_with(launch(4, "train", tmp_path / "four", 2), "digests")[0]
    for line in lines_with(launch(2, "state", tmp_path / "four", 2), "digests"):
        assert line["digests"] == reference["digests"] and line["lr"] == reference["lr"], line
        assert line["position"] == 2


def test_fsdp2_training_resumes_from_the_local_tier(fsdp_run, tmp_path):
    """Every step to a local tier per process, every third to the persistent one: killed after step 4's
    commit, the run resumes from local step 4 (the persistent tier has step 3) and continues bit for bit."""
    _, whole, _, _ = fsdp_run
    first = launch(2, "train", tmp_path / "root", 6, "--stop-at", 4, "--local")
    with xtc.CheckpointManager(tmp_path / "root", xtc.CheckpointManagerOptions()) as manager:
        assert manager.all_steps() == [3]
    second = launch(2, "train", tmp_path / "root", 6, "--resume", "latest", "--local")
    for line in lines_with(second, "restored"):
        assert line["restored"] == 4 and line["position"] == 4 and line["same_parameters"], line
    for rank in range(2):
        assert losses(first)[rank] + losses(second)[rank] == losses(whole)[rank], rank
    assert lines_with(second, "digests") == lines_with(whole, "digests")


def _torch_regions(shape, mesh_shape, placements, point):
    """The region torch itself computes for a mesh coordinate (a private function, fine in a test: the library
    computes it from public placement attributes, and this checks it agrees on the torch installed)."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(point), placements)
    return tuple((o, o + s) if s else (n, n) for o, s, n in zip(offset, local, shape))


def test_dtensor_regions_agree_with_torch_for_every_coordinate():
    """Even, uneven, empty and nested splits, replication, and FSDP-over-TP strided shards (whose meaning differs
    between torch 2.9 and newer releases): the region of every mesh coordinate is the one torch computes."""
    import itertools

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from xla_tensorstore_ckpt.targets import dtensors

    checked = 0
    for rows, cols in itertools.product(range(0, 11), (1, 3, 8)):
        for mesh_shape in [(2,), (3,), (2, 2), (2, 3), (3, 2), (2, 2, 2)]:
            layouts = list(itertools.product([Replicate(), Shard(0), Shard(1)], repeat=len(mesh_shape)))
            if len(mesh_shape) == 2:
                layouts += [(_StridedShard(d, split_factor=mesh_shape[1]), Shard(d)) for d in (0, 1)]
            for placements in layouts:
                for point in itertools.product(*(range(n) for n in mesh_shape)):
                    expected = _torch_regions((rows, cols), mesh_shape, placements, point)
                    for box in (dtensors._box, dtensors._indexed_box):  # the arithmetic and the general rule
                        assert box((rows, cols), mesh_shape, placements, point) == expected, \
                            (rows, cols, mesh_shape, placements, point)
                    checked += 1
    assert checked > 10_000
