"""Single-replica reads with 4 processes over gloo: each stored chunk is read from storage by one process and
sent to the others that need it. Layouts: DP=2 x FSDP=2, DP=4 x FSDP=1 (fully replicated), partially
replicated, uneven, and resharded onto other layouts; local disk, gs:// (emulator) and s3:// (moto). Checked:
every value bit for bit, the bytes the processes fetched from storage add up to the item's stored chunks once
(and R times without the option), readers balanced, and a dead or damaged reader raises on every process."""

from __future__ import annotations

import math
import os
import sys

import pytest
from forked import launch_job
from helpers import CHECKSUM_BYTES, stored_chunk_bytes

from xla_tensorstore_ckpt import formats, storage
from xla_tensorstore_ckpt.core import dtypes, grid

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "replica_reads.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
import replica_reads  # noqa: E402

WORLD = 4


def launch(*args: str, env: dict | None = None) -> list[dict]:
    """Run the script as the 4 processes of one job."""
    return launch_job(SCRIPT, WORLD, *args, env=env)


def fetched_alone(path: str, rank: int) -> int:
    """What process `rank` fetches reading on its own: every saved chunk its shards overlap."""
    total = 0
    for name, meta in formats.read_item(storage.location(path)).leaves().items():
        shape, chunk_shape = meta.shape, meta.chunk_shape
        _, dtype, _, (_, indices) = replica_reads.layouts(rank)[name[0]]
        touched = {position for index in indices for position, _ in grid.chunks_in(index, chunk_shape, shape)}
        total += len(touched) * (math.prod(chunk_shape) * dtypes.by_torch(dtype).itemsize + CHECKSUM_BYTES)
    return total


def saved(path: str, **env) -> str:
    for r in launch("save", path, env=env):
        assert r["returncode"] == 0, r["stderr"][-3000:]
    return path


def restored(path: str, *modes: str, env: dict | None = None) -> dict[str, list[dict]]:
    results = launch("restore", path, *modes, env=env)
    for r in results:
        assert r["returncode"] == 0, r["stderr"][-3000:]
    return {mode: [r["lines"][i] for r in results] for i, mode in enumerate(modes)}


@pytest.fixture(scope="module")
def local_item(tmp_path_factory) -> str:
    return saved(str(tmp_path_factory.mktemp("replica_reads") / "item"))


def test_every_chunk_is_read_once_and_values_are_exact(local_item):
    runs = restored(local_item, "on", "off")
    stored = stored_chunk_bytes(local_item)
    for mode, lines in runs.items():
        assert all(line["ok"] for line in lines), (mode, lines)
    on, off = runs["on"], runs["off"]
    assert sum(line["storage_bytes"] for line in on) == stored  # each chunk once, in the whole job
    assert [line["storage_bytes"] for line in off] == [fetched_alone(local_item, rank) for rank in range(WORLD)]
    assert sum(line["storage_bytes"] for line in off) > 1.8 * stored  # each replica fetched its own
    received = [line["received"] for line in on]
    assert sum(received) == sum(line["sent"] for line in on) > 0
    per_process = [line["storage_bytes"] for line in on]
    assert max(per_process) <= 1.1 * (sum(per_process) / WORLD), per_process  # readers balanced by bytes


def test_small_transfer_batches_give_the_same_values(local_item):
    runs = restored(local_item, "on", env={"XTC_BROADCAST_MAX_BYTES": str(16 << 10)})  # a batch per array or less
    assert all(line["ok"] for line in runs["on"]), runs
    assert sum(line["storage_bytes"] for line in runs["on"]) == stored_chunk_bytes(local_item)


@pytest.mark.parametrize("scheme", ["gcs", "s3"])
def test_object_stores_serve_each_chunk_once(request, scheme):
    """Counted by the storage's side too: a proxy in front of the emulator (GCS) or moto (S3) counts the bodies
    of the GET responses to the restoring processes."""
    import gcs_emulator
    from conftest import object_store

    path, port, clients = object_store(request, scheme, "replica-reads")
    saved(path, XTC_OCDBT="0")  # an object per chunk: what is served is the chunks and the metadata files
    stored = stored_chunk_bytes(path)
    served = {}
    counted = {}
    for mode in ("on", "off"):
        proxy = gcs_emulator.FaultProxy(port, error_rate=0.0, drop_rate=0.0).start()
        try:
            runs = restored(path, mode, env=clients.client_environment(proxy.url))
        finally:
            proxy.stop()
        assert all(line["ok"] for line in runs[mode]), runs
        served[mode] = proxy.served_bytes
        counted[mode] = [line["storage_bytes"] for line in runs[mode]]
    loc = storage.location(path)
    opened = WORLD * sum(len(loc.child(meta.path).read("zarr.json"))  # every process opens every array
                         for meta in formats.read_item(loc).leaves().values() if hasattr(meta, "chunk_shape"))
    assert sum(counted["on"]) == stored + opened  # each chunk once, in the whole job
    assert sum(counted["off"]) > 1.8 * stored  # (tensorstore fetches a chunk two shards cut once per shard)
    manifests = served["off"] - sum(counted["off"])  # the item's metadata, read before the arrays
    assert served["on"] == stored + opened + manifests
    assert max(counted["on"]) <= 1.1 * sum(counted["on"]) / WORLD, counted


def test_the_manager_resumes_and_initialises_with_single_replica_reads(tmp_path):
    results = launch("manager", str(tmp_path))
    for r in results:
        assert r["returncode"] == 0, r["stderr"][-3000:]
    stored = stored_chunk_bytes(str(tmp_path / "run" / "1" / "model"))
    for how, step in (("resume", 1), ("init_from", None)):
        lines = [next(line for line in r["lines"] if line["mode"] == how) for r in results]
        assert all(line["ok"] and line["step"] == step for line in lines), lines  # in place, bit for bit
        assert sum(line["storage_bytes"] for line in lines) == stored, lines
        assert all(line["received"] > 0 for line in lines), lines


def test_a_reader_that_dies_makes_every_process_raise(local_item):
    results = launch("die", local_item, "2")  # process 2 dies as it starts reading (a hang: launch's timeout)
    assert results[2]["returncode"] == 9
    for rank in (0, 1, 3):
        r = results[rank]
        assert r["returncode"] == 0, r["stderr"][-3000:]
        (line,) = r["lines"]
        assert line["error"] == "CoordinationError" and not line["ok"], line
        assert "process 2 died or did not answer" in line["message"], line  # the dead reader is named
        assert "it was to send this process" in line["message"], line  # and what it reads for this process


def test_a_damaged_chunk_raises_the_same_error_on_every_process(tmp_path):
    path = saved(str(tmp_path / "item"), XTC_OCDBT="0")  # a file per chunk
    meta = formats.read_item(storage.location(path)).leaves()[("dp2",)]
    chunk = os.path.join(path, meta.path, "c", "1", "0")  # rows 32-64: needed by processes 1 and 3
    with open(chunk, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    lines = restored(path, "on")["on"]
    assert all(line["error"] == "CorruptCheckpointError" for line in lines), lines
    readers = [line for line in lines if "process" not in line["message"].split(":")[0]]
    assert len(readers) == 1 and "c/1/0" in readers[0]["message"], lines  # its reader names the chunk file
    reader = lines.index(readers[0])
    assert reader in (1, 3)
    for rank, line in enumerate(lines):
        if rank != reader:  # the others name the process that read it and its error
            assert f"process {reader} failed reading" in line["message"] and "c/1/0" in line["message"], line
