"""torch.distributed.checkpoint through this library's storage: an FSDP2 model + AdamW saved by 4 gloo processes
with ``dcp.save`` / ``dcp.async_save`` and `DCPStorageWriter` is an item of ours (xtc.restore, xtckpt, Orbax read
it; DCP's byte-IO values opaque), loaded by 2 processes with ``dcp.load`` and `DCPStorageReader` bit for bit, as
are an Orbax item JAX wrote and a FileSystemWriter checkpoint converted by ``xtckpt convert``; single-process
saves and loads on every storage backend and from Hugging Face weights; bad input refused by key and path. The
jobs never import torch_xla."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from forked import launch_job
from hf_files import write_hf_dir
from orbax_process import leaf, orbax, same
from torch.distributed.checkpoint import LoadPlan, ReadItem, SavePlan, WriteItem
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import LoadItemType, TensorWriteData, WriteItemType

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import cli
from xla_tensorstore_ckpt.core import dtypes
from xla_tensorstore_ckpt.dcp_storage.plans import plan_global

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "dcp_storage_job.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
import dtensor_job  # noqa: E402
import orbax_trees  # noqa: E402


def launch(world: int, *args) -> list[dict]:
    results = launch_job(SCRIPT, world, *map(str, args))
    for r in results:
        assert r["returncode"] == 0, r["stderr"][-3000:]
        assert r["lines"] and not any(line["torch_xla"] for line in r["lines"]), r["lines"]
    return results


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """4 processes save (ours, async, FileSystemWriter); JAX writes an Orbax item; ``xtckpt convert`` converts
    the FileSystemWriter checkpoint; 2 processes load all of them."""
    root = tmp_path_factory.mktemp("dcp_storage")
    saved = [r["lines"][0] for r in launch(4, "save", root)]
    orbax("write", root / "orbax", "--ocdbt", "1", "--zarr3", "1")
    assert cli.main(["convert", str(root / "fs"), str(root / "converted")]) == 0
    loaded = [r["lines"][:-1] for r in launch(2, "load", root, root / "orbax")]
    return root, saved, loaded


def test_fsdp2_state_saved_through_the_writer_restores_with_xtc_restore_bit_exact(job, capsys):
    root, saved, _ = job
    assert all(line["digests"] == saved[0]["digests"] for line in saved)
    # An overwrite of "ours" that failed on the last rank: every rank saw it, no temporary sibling is left, and
    # the item it was replacing is intact (restored below).
    assert all(line["failed"] == [3] for line in saved)
    assert sorted(os.listdir(root)) == ["async", "converted", "fs", "orbax", "ours"]
    for name in ("ours", "async"):
        restored = dict(dtensor_job.leaves(xtc.restore(root / name)))
        tensors = {k: dtensor_job.digest(v) for k, v in restored.items() if k in saved[0]["digests"]}
        assert tensors == saved[0]["digests"], name
        opaque = {k for k, v in dtensor_job.leaves(xtc.metadata(root / name)) if v.opaque == "dcp-bytes"}
        assert opaque == set(restored) - set(saved[0]["digests"]) and "optim.param_groups.0.lr" in opaque
        assert all(restored[k].dtype == torch.uint8 for k in opaque)  # handed back as bytes, never decoded
    assert cli.main(["tree", str(root / "ours")]) == 0
    shown = capsys.readouterr().out
    assert "optim.param_groups.0.lr" in shown and "opaque (dcp-bytes)" in shown
    assert cli.main(["verify", str(root / "ours")]) == 0


def test_a_save_through_the_writer_is_an_orbax_checkpoint_jax_restores(job):
    root, saved, _ = job
    dumped = orbax("restore", root / "ours")
    torch_values = dict(dtensor_job.leaves(xtc.restore(root / "ours")))
    for key in saved[0]["digests"]:
        assert same(leaf(dumped[key]), torch_values[key]), key


def test_dcp_load_through_the_reader_onto_two_processes_bit_exact(job):
    _, saved, loaded = job
    for lines in loaded:
        by_source = {line["source"]: line for line in lines}
        for name in ("ours", "async", "converted"):
            assert by_source[name]["digests"] == saved[0]["digests"], name
            assert by_source[name]["param_groups"] == saved[0]["param_groups"], name


def test_single_replica_reads_read_each_region_once_for_replicated_targets(job):
    root, saved, loaded = job
    lines = [next(x for x in rank_lines if x["source"] == "replicated") for rank_lines in loaded]
    model = {k: v for k, v in saved[0]["digests"].items() if k.startswith("model.")}
    assert all(line["digests"] == model for line in lines)
    stored = sum(meta.nbytes for meta in xtc.metadata(root / "ours")["model"].values())
    assert sum(line["read_bytes"] for line in lines) == stored  # each region read by one of the two ranks
    assert all(0 < line["read_bytes"] < stored for line in lines)


def test_an_orbax_checkpoint_loads_through_dcp_load_onto_dtensors(job):
    _, _, loaded = job
    expected = dict(dtensor_job.leaves(orbax_trees.tree()))
    for lines in loaded:
        line = next(x for x in lines if x["source"] == "orbax")
        for key, digest in line["digests"].items():
            value = expected[key]
            want = dtensor_job.digest(dtypes.numpy_to_tensor(value)) if isinstance(value, np.ndarray) else value
            assert digest == want, key
        assert line["sharded"] == ["params.b", "params.layers.0.k", "params.layers.1.k", "params.w"]


def _state() -> dict:
    g = torch.Generator().manual_seed(5)
    return {"model": {"w": torch.randn(6, 4, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16)},
            "step": 3, "groups": [{"lr": 0.1}], "count": torch.tensor(7)}


def _zeros() -> dict:
    return {"model": {"w": torch.zeros(6, 4), "b": torch.zeros(5, dtype=torch.bfloat16)}, "step": 0,
            "groups": [{"lr": 0.0}], "count": torch.tensor(0)}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_writer_and_reader_on_every_backend(storage_root):
    path = f"{storage_root}/item"
    dcp.save(_state(), storage_writer=xtc.DCPStorageWriter(path), no_dist=True)
    target = _zeros()
    dcp.load(target, storage_reader=xtc.DCPStorageReader(path), no_dist=True)
    expected = _state()
    assert torch.equal(target["model"]["w"], expected["model"]["w"])
    assert torch.equal(target["model"]["b"], expected["model"]["b"])
    assert target["step"] == 3 and target["groups"] == [{"lr": 0.1}] and torch.equal(target["count"], torch.tensor(7))
    assert torch.equal(xtc.restore(path)["model"]["w"], expected["model"]["w"])
    with pytest.raises(dcp.api.CheckpointException) as caught:  # never over an item without overwrite=True
        dcp.save(_state(), storage_writer=xtc.DCPStorageWriter(path), no_dist=True)
    assert isinstance(_cause(caught.value), xtc.CheckpointExistsError)
    changed = {**_state(), "model": {"w": torch.ones(6, 4), "b": expected["model"]["b"]}}
    dcp.save(changed, storage_writer=xtc.DCPStorageWriter(path, overwrite=True), no_dist=True)
    assert torch.equal(xtc.restore(path)["model"]["w"], torch.ones(6, 4))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_hugging_face_weights_load_through_dcp_load_with_a_key_map(tmp_path):
    tensors = write_hf_dir(str(tmp_path / "hf"))
    target = {k.removeprefix("model."): torch.zeros_like(v) for k, v in tensors.items()}
    reader = xtc.DCPStorageReader(tmp_path / "hf", key_map=lambda name: name.removeprefix("model."))
    dcp.load(target, storage_reader=reader, no_dist=True)
    for key, value in tensors.items():
        assert torch.equal(target[key.removeprefix("model.")], value), key


def _cause(exc: BaseException) -> BaseException:
    """The error a rank raised inside DCP (its CheckpointException keeps each rank's)."""
    failures = getattr(exc, "failures", None)
    return next(iter(failures.values()))[0] if failures else exc


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_damaged_chunk_fails_the_load_naming_key_and_path(tmp_path):
    path = tmp_path / "item"
    options = xtc.SaveOptions(use_ocdbt=False)
    dcp.save(_state(), storage_writer=xtc.DCPStorageWriter(path, options=options), no_dist=True)
    chunk = next(os.path.join(d, f) for d, _, files in os.walk(path / "model.w") for f in files if f != "zarr.json")
    data = bytearray(open(chunk, "rb").read())
    data[3] ^= 0xFF
    open(chunk, "wb").write(bytes(data))
    with pytest.raises(dcp.api.CheckpointException) as caught:
        dcp.load(_zeros(), storage_reader=xtc.DCPStorageReader(path), no_dist=True)
    error = _cause(caught.value)
    assert isinstance(error, xtc.CorruptCheckpointError), error
    assert "model.w" in str(error) and str(path) in str(error) and "\n" not in str(error)


def _read_item(fqn: str, kind: LoadItemType, n: int = 1) -> ReadItem:
    index = MetadataIndex(fqn, torch.Size([0] * n) if kind != LoadItemType.BYTE_IO else None)
    zeros = torch.Size([0] * n)
    return ReadItem(type=kind, dest_index=index, dest_offsets=zeros, storage_index=index, storage_offsets=zeros,
                    lengths=torch.Size([1] * n))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_reads_the_plan_cannot_satisfy_are_refused_by_key_and_path(tmp_path):
    path = tmp_path / "item"
    dcp.save(_state(), storage_writer=xtc.DCPStorageWriter(path), no_dist=True)
    reader = xtc.DCPStorageReader(path)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    cases = [(_read_item("nope", LoadItemType.BYTE_IO), xtc.KeyMismatchError),
             (_read_item("model.w", LoadItemType.BYTE_IO), xtc.UnsupportedValueError),
             (_read_item("step", LoadItemType.TENSOR), xtc.UnsupportedValueError)]
    shifted = _read_item("model.w", LoadItemType.TENSOR, 2)
    cases.append((ReadItem(type=shifted.type, dest_index=shifted.dest_index, dest_offsets=shifted.dest_offsets,
                           storage_index=shifted.storage_index, storage_offsets=torch.Size([5, 3]),
                           lengths=torch.Size([2, 2])), xtc.ShapeMismatchError))
    for item, error in cases:  # refused while planning, before anything is read
        with pytest.raises(error) as caught:
            reader.prepare_local_plan(LoadPlan([item]))
        _one_line(caught.value, item.storage_index.fqn, path)
    # DCP's own planner checks keys and shapes before a storage reader sees the plan; ours names the path too.
    wrong = [({"model": {"missing": torch.zeros(2)}}, xtc.KeyMismatchError, "model.missing"),
             ({"model": {"w": torch.zeros(4, 6)}}, xtc.ShapeMismatchError, "model.w")]
    for state, error, key in wrong:
        with pytest.raises(dcp.api.CheckpointException) as caught:
            dcp.load(state, storage_reader=xtc.DCPStorageReader(path), planner=xtc.DCPLoadPlanner(), no_dist=True)
        _one_line(_cause(caught.value), key, path, error)
    partial = {"model": {"missing": torch.zeros(2), "w": torch.zeros(6, 4)}}
    dcp.load(partial, storage_reader=xtc.DCPStorageReader(path), planner=xtc.DCPLoadPlanner(allow_partial_load=True),
             no_dist=True)
    assert torch.equal(partial["model"]["w"], _state()["model"]["w"])
    # No item there: DCP swallows read_metadata's error (torch 2.9 into a bare AssertionError); ours comes through.
    with pytest.raises(dcp.api.CheckpointException) as caught:
        dcp.load(_zeros(), storage_reader=xtc.DCPStorageReader(tmp_path / "absent"), no_dist=True)
    _one_line(_cause(caught.value), "", tmp_path / "absent", xtc.CheckpointNotFoundError)
    assert sorted(os.listdir(tmp_path)) == ["item"]


def _one_line(error: BaseException, key: str, path, kind: type = Exception) -> None:
    message = str(error)
    assert isinstance(error, kind), repr(error)
    assert key in message and str(path) in message and "\n" not in message, message


class _FailingPlanner(dcp.DefaultSavePlanner):
    """DCP's default planner whose data cannot be resolved: a write that fails part-way."""

    def resolve_data(self, write_item):
        if write_item.index.fqn == "model.b":
            raise OSError("injected failure")
        return super().resolve_data(write_item)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_failed_overwrite_leaves_the_old_item_and_no_temporary_directory(tmp_path):
    path = tmp_path / "item"
    dcp.save(_state(), storage_writer=xtc.DCPStorageWriter(path), no_dist=True)
    changed = {**_state(), "model": {"w": torch.ones(6, 4), "b": torch.ones(5, dtype=torch.bfloat16)}}
    with pytest.raises(dcp.api.CheckpointException) as caught:
        dcp.save(changed, storage_writer=xtc.DCPStorageWriter(path, overwrite=True), planner=_FailingPlanner(),
                 no_dist=True)
    assert "injected failure" in str(_cause(caught.value))
    assert os.listdir(tmp_path) == ["item"]
    assert torch.equal(xtc.restore(path)["model"]["w"], _state()["model"]["w"])


def _write_item(fqn: str, offsets, sizes, shape, dtype=torch.float32) -> WriteItem:
    data = TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                           properties=TensorProperties(dtype=dtype), size=torch.Size(shape))
    return WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD, tensor_data=data)


def test_the_global_plan_chooses_chunk_grids_and_refuses_inconsistent_shards():
    uneven = [SavePlan([_write_item("w", (0, 0), (4, 48), (13, 48))]),
              SavePlan([_write_item("w", (4, 0), (4, 48), (13, 48))]),
              SavePlan([_write_item("w", (8, 0), (4, 48), (13, 48))]),
              SavePlan([_write_item("w", (12, 0), (1, 48), (13, 48))])]
    ranks, plan = plan_global(uneven, None, "/ckpt")
    assert plan.tensors["w"].chunk_shape == (4, 48)
    assert [[a.regions for a in r.arrays] for r in ranks] == [
        [(((0, 4), (0, 48)),)], [(((4, 8), (0, 48)),)], [(((8, 12), (0, 48)),)], [(((12, 13), (0, 48)),)]]
    replicated = [SavePlan([_write_item("r", (0,), (8,), (8,))]) for _ in range(2)]
    ranks, _ = plan_global(replicated, None, "/ckpt")
    assert sum(len(a.regions) for r in ranks for a in r.arrays) == 1  # one writer per chunk
    disagree = [SavePlan([_write_item("w", (0, 0), (4, 4), (8, 4))]),
                SavePlan([_write_item("w", (4, 0), (4, 4), (8, 5))])]
    bad = [(disagree, xtc.ShapeMismatchError),
           ([SavePlan([_write_item("w", (6, 0), (4, 4), (8, 4))])], xtc.ShapeMismatchError),
           ([SavePlan([_write_item("w", (0, 0), (4, 4), (8, 4))])], xtc.UnsupportedValueError)]
    for plans, error in bad:
        with pytest.raises(error) as caught:
            plan_global(plans, None, "/ckpt")
        assert "'w'" in str(caught.value) and "/ckpt" in str(caught.value) and "\n" not in str(caught.value)
