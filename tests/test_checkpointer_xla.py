"""Item save/restore of torch_xla SPMD tensors on 8 CPU devices: chunk grid = shard grid, resharding restores,
uneven and partially replicated shards, no XLA work caused by a save."""

from __future__ import annotations

import json
import os

import pytest
import torch
import zarr
from conftest import make_mesh, sharded
from helpers import assert_trees_equal, random_tensor
from xla_stack import met, torch_xla, xs

import xla_tensorstore_ckpt as xtc

pytestmark = pytest.mark.xla  # every test here needs torch_xla


def chunk_files(array_dir):
    return sorted(os.path.relpath(os.path.join(r, f), array_dir)
                  for r, _, fs in os.walk(os.path.join(array_dir, "c")) for f in fs)


def inner_chunk_shape(array_dir):
    """The chunk grid of a stored array: zarr's chunk grid, or the inner grid of a single-file array."""
    doc = json.loads((array_dir / "zarr.json").read_text())
    codec = doc["codecs"][0]
    if codec["name"] == "sharding_indexed":
        assert [c["name"] for c in codec["configuration"]["codecs"]] == ["bytes", "crc32c"]
        return tuple(codec["configuration"]["chunk_shape"])
    return tuple(doc["chunk_grid"]["configuration"]["chunk_shape"])


def spec_of(t):
    return torch_xla._XLAC._get_xla_sharding_spec(t)


def test_chunk_grid_is_the_shard_grid_and_metadata_names_mesh_and_spec(tmp_path, mesh_4x2):
    xs.set_global_mesh(mesh_4x2)
    try:
        w = sharded(torch.randn(16, 8), mesh_4x2, ("x", "y"))
        xtc.save(tmp_path / "ck", {"w": w}, options=xtc.SaveOptions(use_ocdbt=False))
    finally:
        xs.set_global_mesh(None)
    info = xtc.metadata(tmp_path / "ck")["w"]
    assert info.chunk_shape == (4, 4)
    assert info.sharding.tiles == (4, 2) and info.sharding.replicas == 1
    assert info.sharding.mesh_shape == (4, 2) and info.sharding.partition_spec == ("x", "y")
    assert inner_chunk_shape(tmp_path / "ck" / "w") == (4, 4)
    assert chunk_files(tmp_path / "ck" / "w") == ["c/0/0"]  # all 8 chunks in one file: one writer holds them


def test_replicas_are_written_once(tmp_path, mesh_4x2):
    from xla_tensorstore_ckpt.core import events

    heard = []
    src = torch.randn(8, 6)
    state = {"rows": sharded(src, mesh_4x2, ("x", None)), "full": sharded(src, mesh_4x2, (None, None)),
             "plain": sharded(src, None, None)}
    xtc.save(tmp_path / "ck", state, options=xtc.SaveOptions(listeners=(heard.append,)))
    (written,) = [e for e in heard if e.kind == events.SAVE_WRITTEN]
    assert written.details["chunks"] == 4 + 1 + 1  # rows' four shards; one of each replicated array
    assert written.details["chunk_bytes"] == 3 * src.nbytes == written.nbytes
    assert xtc.metadata(tmp_path / "ck")["rows"].chunk_shape == (2, 6)
    assert_trees_equal(xtc.restore(tmp_path / "ck"), {"rows": src, "full": src, "plain": src})


@pytest.mark.parametrize("fsync", [True, False], ids=["fsync", "no-fsync"])
def test_finished_chunk_files_are_handed_to_the_disk_during_a_fsync_save(tmp_path, mesh_4x2, monkeypatch, fsync):
    """A save that fsyncs starts the disk writes of each chunk file as soon as it is written (so the final
    sync finds little left): every chunk file, and only real files, are named, at every save (also when a
    save overwrites the same item, written beside it and swapped in)."""
    from xla_tensorstore_ckpt import arrays
    from xla_tensorstore_ckpt.storage import local

    if local._SYNC_FILE_RANGE is None:
        pytest.skip("no sync_file_range on this platform")
    started = []

    def recording_sync_file_range(fd, offset, nbytes, flags):
        started.append(os.readlink(f"/proc/self/fd/{fd}"))
        return 0

    monkeypatch.setattr(local, "_SYNC_FILE_RANGE", recording_sync_file_range)
    state = {"big": sharded(torch.randn(4096, 512), mesh_4x2, ("x", "y")),  # one file per chunk
             "small": sharded(torch.randn(16, 8), mesh_4x2, ("x", "y")),  # one file for all chunks
             "scalar": torch.tensor(3.0)}
    for overwrite in (False, True):
        started.clear()
        xtc.save(tmp_path / "ck", state, options=xtc.SaveOptions(fsync=fsync, use_ocdbt=False), overwrite=overwrite)
        arrays.tensorstore_io._WRITEBACK.submit(lambda: None).result()  # the writeback thread has run every request
        files = sorted(os.path.join(root, f) for name in state
                       for root, _, fs in os.walk(tmp_path / "ck" / name) for f in fs if f != "zarr.json")
        assert len(files) == 8 + 1 + 1

        def within(path: str) -> str:  # below the item directory: an overwrite writes beside it, then swaps
            return os.path.relpath(path, tmp_path).split(os.sep, 1)[1]

        assert sorted(map(within, started)) == (sorted(map(within, files)) if fsync else [])


@pytest.mark.parametrize("fsync", [True, False], ids=["fsync", "no-fsync"])
def test_a_save_syncs_exactly_what_it_wrote(tmp_path, mesh_4x2, monkeypatch, fsync):
    """Every file and directory of a committed step (and the root's entry for it) is fsync'ed, and nothing else
    on the file system: a commit does not wait for other writers' dirty data (as syncfs made it)."""
    synced = set()
    real_fsync = os.fsync

    def recording_fsync(fd):
        info = os.fstat(fd)
        synced.add((info.st_dev, info.st_ino))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    with open(tmp_path / "another-writer.log", "wb") as f:
        f.write(b"dirty pages of someone else" * 1000)
    state = {"big": sharded(torch.randn(4096, 512), mesh_4x2, ("x", "y")),
             "small": sharded(torch.randn(16, 8), mesh_4x2, ("x", "y")), "scalar": torch.tensor(3.0), "n": 1}
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, async_save=False,
                                           save_options=xtc.SaveOptions(fsync=fsync))
    with xtc.CheckpointManager(tmp_path / "root", options) as mgr:
        mgr.save(1, model=state, extra={"position": 3})
    step = tmp_path / "root" / "1"
    paths = [step, tmp_path / "root"] + [os.path.join(r, n) for r, dirs, files in os.walk(step) for n in dirs + files]
    unsynced = [str(p) for p in paths if (os.stat(p).st_dev, os.stat(p).st_ino) not in synced]
    assert unsynced == [] if fsync else len(unsynced) > 10, unsynced
    other = os.stat(tmp_path / "another-writer.log")
    assert (other.st_dev, other.st_ino) not in synced


def test_save_causes_no_compilation_or_execution(tmp_path, mesh_4x2, mesh_8):
    state = {"a": sharded(torch.randn(16, 8), mesh_4x2, ("x", "y")),
             "b": sharded(torch.randn(10, 3), mesh_4x2, (None, "y")),
             "c": sharded(torch.randn(5), mesh_8, (None,)), "d": sharded(torch.randn(3, 3), None, None)}
    met.clear_all()
    xtc.save(tmp_path / "ck", state)
    names = set(met.metric_names())
    assert not {"CompileTime", "ExecuteTime", "ExecuteReplicatedTime"} & names, names
    assert "TransferFromDeviceTime" in names  # it did read the shards from the devices


def test_shards_are_fetched_in_batches(tmp_path, mesh_4x2, xla_calls):
    state = {f"t{i}": sharded(torch.randn(8, 4), mesh_4x2, ("x", "y")) for i in range(20)}
    state.update({f"u{i}": sharded(torch.randn(3), None, None) for i in range(10)})
    xla_calls.clear()
    xtc.save(tmp_path / "ck", state)
    fetches = [(name, len(args[0])) for name, args, _ in xla_calls
               if name in ("_get_local_shards", "_xla_get_cpu_tensors")]
    assert fetches == [("_get_local_shards", 20), ("_xla_get_cpu_tensors", 10)]


RESHARD_CASES = [
    # (saved mesh, saved spec, target mesh, target spec)
    (((4, 2), ("x", "y")), ("x", "y"), ((2, 4), ("a", "b")), ("a", "b")),
    (((8,), ("d",)), ("d", None), ((8,), ("d",)), (None, "d")),
    (((4, 2), ("x", "y")), ("x", "y"), ((8,), ("d",)), ("d", None)),
    (((4, 2), ("x", "y")), ("y", "x"), None, None),
    (None, None, ((4, 2), ("x", "y")), ("x", "y")),
    (((4, 2), ("x", "y")), ("x", "y"), ((4, 2), ("x", "y")), (None, None)),
    (((4, 2), ("x", "y")), (None, None), ((2, 4), ("a", "b")), ("b", "a")),
    (((4, 2), ("x", "y")), (("x", "y"), None), ((2, 4), ("a", "b")), (None, ("b", "a"))),
]


def _mesh(desc, order=None):
    return None if desc is None else make_mesh(*desc, order=order)


@pytest.mark.parametrize("saved_mesh,saved_spec,target_mesh,target_spec", RESHARD_CASES,
                         ids=["4x2-to-2x4", "8-transposed", "2d-to-1d", "sharded-to-unsharded",
                              "unsharded-to-sharded", "sharded-to-replicated", "replicated-to-sharded",
                              "multi-axis"])
@pytest.mark.parametrize("shape", [(16, 8), (13, 7)], ids=["even", "uneven"])
def test_restore_onto_another_mesh_is_exact(tmp_path, saved_mesh, saved_spec, target_mesh, target_spec, shape):
    src = torch.randn(*shape)
    xtc.save(tmp_path / "ck", {"w": sharded(src, _mesh(saved_mesh), saved_spec)})
    target = {"w": sharded(torch.zeros(*shape), _mesh(target_mesh), target_spec)}
    met.clear_all()
    out = xtc.restore(tmp_path / "ck", target)
    assert not {"CompileTime", "ExecuteTime"} & set(met.metric_names())
    assert spec_of(out["w"]) == spec_of(target["w"])
    assert torch.equal(out["w"].cpu(), src)
    assert torch.equal(target["w"].cpu(), torch.zeros(*shape))


def test_restore_reads_each_element_once(tmp_path, mesh_4x2, mesh_2x4):
    """Through tensorstore (here memory://), a small array whose local shards tile it is read in one region;
    from local files, each stored chunk is read once, whichever target shards it feeds."""
    from xla_tensorstore_ckpt.core import events

    def restored_with_paths(path):
        heard = []
        out = xtc.restore(path, target, options=xtc.RestoreOptions(listeners=(heard.append,)))
        (finished,) = [e for e in heard if e.kind == events.RESTORE_FINISHED]
        return out, finished.details["paths"]

    src = torch.randn(16, 8)
    target = {"w": sharded(torch.zeros(16, 8), mesh_2x4, ("b", "a"))}
    xtc.save("memory://reads-once/ck", {"w": sharded(src, mesh_4x2, ("x", "y"))})
    out, paths = restored_with_paths("memory://reads-once/ck")
    assert torch.equal(out["w"].cpu(), src)
    assert paths["tensorstore_regions"] == 1  # the whole array, once
    assert paths["chunks_inline"] + paths["chunks_on_workers"] == 0

    xtc.save(tmp_path / "ck", {"w": sharded(src, mesh_4x2, ("x", "y"))})
    out, paths = restored_with_paths(tmp_path / "ck")
    assert torch.equal(out["w"].cpu(), src)
    assert paths["chunks_inline"] + paths["chunks_on_workers"] == 4 * 2  # each stored chunk once
    assert paths["tensorstore_regions"] == 0


def test_reads_cover_exactly_the_local_shards():
    """On a multi-host pod a process holds only some shards; it reads their regions and nothing else."""
    from xla_tensorstore_ckpt.core.records import ArrayMetadata
    from xla_tensorstore_ckpt.core.tensor_layout import LocalShard, TensorLayout
    from xla_tensorstore_ckpt.restores.read_jobs import ReadJob

    meta = ArrayMetadata("w", (16, 8), "float32", (4, 4))

    def job(indices):
        shards = tuple(LocalShard(i, f"d{i}", idx, 0) for i, idx in enumerate(indices))
        return ReadJob(("w",), meta, None, torch.float32, TensorLayout((16, 8), "xla", (4, 4), shards))

    # Two shards forming a box are read as that box.
    assert job([((0, 4), (0, 4)), ((0, 4), (4, 8))]).reads == (((0, 4), (0, 8)),)
    # Two shards that do not tile their bounding box are read separately.
    assert job([((0, 4), (0, 4)), ((8, 12), (4, 8))]).reads == (((0, 4), (0, 4)), ((8, 12), (4, 8)))
    # Replicas of one shard: one read.
    assert job([((4, 8), (0, 4)), ((4, 8), (0, 4))]).reads == (((4, 8), (0, 4)),)


def test_large_shards_are_read_into_their_own_buffers():
    """Shards of a large array are read one by one (each straight into the buffer that goes to its device)
    unless that would fetch a chunk more than twice; small arrays are read as one box."""
    from xla_tensorstore_ckpt import storage
    from xla_tensorstore_ckpt.core.records import ArrayMetadata
    from xla_tensorstore_ckpt.core.tensor_layout import LocalShard, TensorLayout
    from xla_tensorstore_ckpt.restores.read_jobs import SMALL_READ_BYTES, ReadJob

    rows = 4096
    assert rows * 8192 * 4 > 8 * SMALL_READ_BYTES

    def job(chunk_shape, grid, shape=(rows, 8192), max_amplification=2.0):
        r, c = shape[0] // grid[0], shape[1] // grid[1]
        indices = [((i * r, (i + 1) * r), (j * c, (j + 1) * c)) for i in range(grid[0]) for j in range(grid[1])]
        shards = tuple(LocalShard(k, f"d{k}", idx, 0) for k, idx in enumerate(indices))
        meta = ArrayMetadata("w", shape, "float32", chunk_shape)
        lay = TensorLayout(shape, "xla", (r, c), shards)
        return ReadJob(("w",), meta, None, torch.float32, lay, max_amplification), indices

    same_mesh, indices = job((rows // 4, 4096), (4, 2))
    assert same_mesh.reads == tuple(indices)  # each chunk fetched once
    other_mesh, indices = job((rows // 4, 4096), (2, 4))
    assert other_mesh.reads == tuple(indices)  # each chunk fetched twice: still shard by shard
    over_network, _ = job((rows // 4, 4096), (2, 4), max_amplification=1.0)
    assert over_network.reads == (((0, rows), (0, 8192)),)  # gs://: each chunk fetched once
    assert not storage.location("gs://b/x").capabilities.cheap_refetch
    assert storage.location("/tmp/x").capabilities.cheap_refetch
    unsharded, _ = job((rows, 8192), (4, 2))
    assert unsharded.reads == (((0, rows), (0, 8192)),)  # one chunk feeding 8 shards: fetched once, as a box
    small, _ = job((4, 4), (2, 4), shape=(16, 8))
    assert small.reads == (((0, 16), (0, 8)),)


def test_uneven_shards_store_only_real_values(tmp_path, mesh_4x2):
    src = torch.arange(10 * 5, dtype=torch.float32).reshape(10, 5) + 1
    xtc.save(tmp_path / "ck", {"w": sharded(src, mesh_4x2, ("x", "y"))}, options=xtc.SaveOptions(use_ocdbt=False))
    info = xtc.metadata(tmp_path / "ck")["w"]
    assert info.shape == (10, 5) and info.chunk_shape == (3, 3)
    z = zarr.open_array(str(tmp_path / "ck" / "w"), mode="r")
    assert z.shape == (10, 5)
    assert torch.equal(torch.from_numpy(z[:]), src)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8,
                                   torch.int32, torch.int64, torch.uint8, torch.bool, torch.float8_e4m3fn,
                                   torch.float8_e5m2], ids=str)
def test_xla_dtypes_round_trip(tmp_path, mesh_4x2, mesh_2x4, dtype):
    src = random_tensor((8, 6), dtype)
    xtc.save(tmp_path / "ck", {"w": sharded(src, mesh_4x2, ("x", "y")),
                               "s": sharded(random_tensor((), dtype), None, None)})
    out = xtc.restore(tmp_path / "ck", {"w": sharded(torch.zeros(8, 6, dtype=dtype), mesh_2x4, ("a", "b")),
                                        "s": sharded(torch.zeros((), dtype=dtype), None, None)})
    assert out["w"].dtype == dtype and torch.equal(out["w"].cpu(), src)
    assert torch.equal(xtc.restore(tmp_path / "ck")["w"], src)


def test_zero_length_dimension_and_scalars(tmp_path, mesh_4x2):
    state = {"empty": sharded(torch.zeros(0, 4), mesh_4x2, ("x", None)),
             "scalar": sharded(torch.tensor(2.5), mesh_4x2, ())}
    xtc.save(tmp_path / "ck", state)
    out = xtc.restore(tmp_path / "ck", state)
    assert out["empty"].shape == (0, 4) and float(out["scalar"].cpu()) == 2.5


def test_cast_to_target_dtype_on_devices(tmp_path, mesh_4x2, mesh_2x4):
    src = torch.randn(8, 8)
    xtc.save(tmp_path / "ck", {"w": sharded(src, mesh_4x2, ("x", "y"))})
    out = xtc.restore(tmp_path / "ck", {"w": sharded(torch.zeros(8, 8, dtype=torch.bfloat16), mesh_2x4, ("a", "b"))})
    assert out["w"].dtype == torch.bfloat16 and torch.equal(out["w"].cpu(), src.to(torch.bfloat16))


def test_restore_into_cpu_target_from_sharded_save(tmp_path, mesh_4x2):
    src = torch.randn(12, 4)
    xtc.save(tmp_path / "ck", {"w": sharded(src, mesh_4x2, ("x", "y"))})
    out = xtc.restore(tmp_path / "ck", {"w": torch.zeros(12, 4)})
    assert out["w"].device.type == "cpu" and torch.equal(out["w"], src)


def test_pending_computations_are_materialized_before_save(tmp_path, mesh_4x2):
    base = sharded(torch.ones(8, 8), mesh_4x2, ("x", "y"))
    lazy = base * 3  # not yet executed
    xtc.save(tmp_path / "ck", {"w": lazy})
    assert torch.equal(xtc.restore(tmp_path / "ck")["w"], torch.full((8, 8), 3.0))


def test_permuted_device_mesh(tmp_path):
    mesh = make_mesh((4, 2), ("x", "y"), order=[3, 1, 7, 5, 0, 2, 4, 6])
    src = torch.randn(8, 6)
    xtc.save(tmp_path / "ck", {"w": sharded(src, mesh, ("x", "y"))})
    target = sharded(torch.zeros(8, 6), make_mesh((2, 4), ("a", "b"), order=[7, 6, 5, 4, 3, 2, 1, 0]), ("b", "a"))
    assert torch.equal(xtc.restore(tmp_path / "ck", {"w": target})["w"].cpu(), src)
