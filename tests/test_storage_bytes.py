"""Bytes fetched from storage, per restore: each reader counts what it fetches (`ArrayReader.fetched_bytes`) and
the restore reports it in its ``restore_finished`` event (``details["storage_bytes"]``), checked here against
the stored chunks themselves: each chunk a restore needs is fetched once, whole, with its checksum."""

from __future__ import annotations

import math
import os

import pytest
import torch
from conftest import make_mesh, sharded
from helpers import Recorder

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import arrays, formats, storage
from xla_tensorstore_ckpt.core import dtypes, events

CHECKSUM_BYTES = 4  # crc32c after each chunk's elements


def _storage_bytes(path, target, **options) -> int | None:
    recorder = Recorder()
    xtc.restore(path, target, options=xtc.RestoreOptions(listeners=(recorder,), **options))
    (finished,) = [e for e in recorder.events if e.kind == events.RESTORE_FINISHED]
    return finished.details["storage_bytes"]


def _stored_bytes(path) -> int:
    """The bytes of every stored chunk of the item at `path`, checksums included (from its manifest)."""
    manifest = formats.read_item(storage.location(path))
    total = 0
    for meta in manifest.leaves().values():
        if hasattr(meta, "chunk_shape"):
            chunks = math.prod(-(-n // c) for n, c in zip(meta.shape, meta.chunk_shape))
            total += chunks * (math.prod(meta.chunk_shape) * dtypes.by_name(meta.dtype).itemsize + CHECKSUM_BYTES)
    return total


@pytest.mark.parametrize("use_ocdbt", [True, False], ids=["ocdbt", "directories"])
@pytest.mark.xla
def test_a_restore_onto_another_mesh_fetches_each_stored_chunk_once(tmp_path, use_ocdbt):
    torch.manual_seed(0)
    # Chunks of a few KiB: smaller ones sit inline in the OCDBT B-tree or share one file (tensorstore reads those).
    state = {"w": torch.randn(64, 48), "b": torch.randn(8192).to(torch.bfloat16)}
    saved = {"w": sharded(state["w"], make_mesh((4, 2), ("x", "y")), ("x", "y")),
             "b": sharded(state["b"], make_mesh((8,), ("x",)), ("x",))}
    # (Not one file per small array: tensorstore reads those, counting their shard index too.)
    xtc.save(tmp_path / "ck", saved, options=xtc.SaveOptions(use_ocdbt=use_ocdbt, single_file_max_bytes=0))
    stored = _stored_bytes(tmp_path / "ck")
    assert stored == 8 * (16 * 24 * 4 + 4) + 8 * (1024 * 2 + 4)  # chunks of 16x24 float32, of 1024 bfloat16
    other = make_mesh((2, 4), ("x", "y"))  # every target shard cuts across two stored chunks
    target = {"w": sharded(torch.zeros(64, 48), other, ("y", "x")), "b": sharded(torch.zeros(8192).to(torch.bfloat16),
                                                                                    other, (("x", "y"),))}
    assert _storage_bytes(tmp_path / "ck", target) == stored
    assert _storage_bytes(tmp_path / "ck", None) == stored  # whole CPU tensors: the same chunks, once each


def test_a_restore_of_part_of_an_item_fetches_only_its_chunks(tmp_path):
    state = {f"w{i}": torch.full((16, 16), float(i)) for i in range(4)}
    xtc.save(tmp_path / "ck", state)
    one = _stored_bytes(tmp_path / "ck") // 4
    recorder = Recorder()
    out = xtc.restore(tmp_path / "ck", {"w2": torch.zeros(16, 16)}, strict=False,
                      options=xtc.RestoreOptions(listeners=(recorder,)))
    assert torch.equal(out["w2"], state["w2"])
    (finished,) = [e for e in recorder.events if e.kind == events.RESTORE_FINISHED]
    assert finished.details["storage_bytes"] == one


@pytest.mark.xla
def test_a_safetensors_restore_counts_exactly_the_bytes_of_its_regions(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    tensors = {"a": torch.randn(64, 32), "b": torch.randn(16).to(torch.bfloat16)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert _storage_bytes(tmp_path / "model.safetensors", None) == 64 * 32 * 4 + 16 * 2
    mesh = make_mesh((4, 2), ("x", "y"))  # each process's shards: here all eight, so every byte once
    target = {"a": sharded(torch.zeros(64, 32), mesh, ("x", "y")), "b": torch.zeros(16).to(torch.bfloat16)}
    assert _storage_bytes(tmp_path / "model.safetensors", target) == 64 * 32 * 4 + 16 * 2


def test_tensorstore_counts_what_its_key_value_stores_read(tmp_path):
    torch.manual_seed(0)
    xtc.save(tmp_path / "ck", {"w": torch.randn(256, 64)})
    loc = storage.location(str(tmp_path / "ck"))
    manifest = formats.read_item(loc)
    (meta,) = manifest.leaves().values()
    reader = arrays.TensorstoreReader(loc, manifest.store)
    data = reader.open(meta).result().read([((0, 256), (0, 64))])[((0, 256), (0, 64))].result()
    assert torch.equal(torch.from_numpy(data), xtc.restore(tmp_path / "ck")["w"])
    fetched = reader.fetched_bytes()
    stored = _stored_bytes(tmp_path / "ck")
    assert stored <= fetched <= stored + (64 << 10), (fetched, stored)  # the chunk, and the OCDBT nodes
    reader.close()


def test_an_unknown_count_is_reported_as_none():
    xtc.save("memory://storage-bytes/ck", {"w": torch.ones(8, 8)})
    assert _storage_bytes("memory://storage-bytes/ck", None) is None  # tensorstore keeps no metric for memory


@pytest.mark.parametrize("scheme", ["gcs", "s3"])
def test_object_stores_count_the_chunks_they_serve(request, scheme):
    from conftest import object_store

    path, _, _ = object_store(request, scheme, "storage-bytes")
    torch.manual_seed(0)
    state = {"w": torch.randn(256, 64)}
    xtc.save(path, state)
    stored = _stored_bytes(path)
    fetched = _storage_bytes(path, None)
    assert stored <= fetched <= stored + (64 << 10), (fetched, stored)  # the chunk, and the OCDBT nodes


@pytest.mark.parametrize("scheme", ["gcs", "s3"])
def test_the_count_is_what_the_storage_served(request, scheme):
    """Seen from the storage's side: a proxy in front of the emulator (GCS) or moto (S3) counts the bodies of the
    GET responses it forwards to a restoring process. The storage served exactly the bytes the restore counts,
    plus the manifest (read before the arrays, outside the count)."""
    import json
    import subprocess
    import sys

    import gcs_emulator
    from conftest import object_store

    path, port, clients = object_store(request, scheme, "storage-bytes")
    torch.manual_seed(0)
    xtc.save(path, {"w": torch.randn(512, 64), "b": torch.randn(4096)})
    stored = _stored_bytes(path)
    manifest_bytes = len(storage.location(path).read("_METADATA"))
    proxy = gcs_emulator.FaultProxy(port, error_rate=0.0, drop_rate=0.0).start()
    try:
        env = dict(os.environ, **clients.client_environment(proxy.url))
        env.pop("PJRT_DEVICE", None)
        script = os.path.join(os.path.dirname(__file__), "scripts", "storage_bytes.py")
        proc = subprocess.run([sys.executable, script, path], env=env, capture_output=True, text=True, timeout=600)
    finally:
        proxy.stop()
    assert proc.returncode == 0, proc.stderr[-3000:]
    counted = json.loads(proc.stdout.strip().splitlines()[-1])["storage_bytes"]
    assert stored < counted < stored + (64 << 10)  # the chunks, and the OCDBT manifest and nodes tensorstore read
    assert proxy.served_bytes == counted + manifest_bytes  # and the manifest, read through the backend


def _bytes_read_by_this_process() -> int:
    """What the operating system counts as read by this process (``rchar``: every read and pread)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="Linux only")
def test_on_local_disk_the_count_is_what_the_process_read(tmp_path):
    torch.manual_seed(0)
    xtc.save(tmp_path / "ck", {"w": torch.randn(512, 64), "b": torch.randn(4096)})
    stored = _stored_bytes(tmp_path / "ck")
    xtc.restore(tmp_path / "ck")  # once first: nothing imported or cached on first use is counted below
    before = _bytes_read_by_this_process()
    counted = _storage_bytes(tmp_path / "ck", None)
    read = _bytes_read_by_this_process() - before
    assert counted == stored  # each chunk, whole, once
    # The process read the chunks and the item's metadata files (a few KiB), nothing more.
    metadata = sum(p.stat().st_size for p in (tmp_path / "ck").rglob("*") if p.is_file() and p.parent.name != "d")
    assert counted <= read <= counted + metadata + (16 << 10), (counted, read, metadata)
