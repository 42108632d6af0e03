"""Local chunk reads (`local_chunks`): this library's arrays on local disk are read straight from their files,
each chunk once, its CRC32C checked; the values equal what was saved for any target grid, and damage is an
error naming the array, the chunk and the file."""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import pytest
import torch
from helpers import Paths

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt.arrays import local_reads, ocdbt
from xla_tensorstore_ckpt.core import events, tunables

PLAIN = xtc.SaveOptions(use_ocdbt=False, single_file_max_bytes=0)  # a file per chunk
LAYOUTS = {"ocdbt": xtc.SaveOptions(), "directories": PLAIN}


def _values(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype == torch.int64:
        return torch.randint(-2**40, 2**40, shape, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


def _slices(index):
    return tuple(slice(a, b) for a, b in index)


def _chunk_count(meta):
    return math.prod(-(-n // c) for n, c in zip(meta.shape, meta.chunk_shape))


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_small_chunks_are_read_on_the_restoring_thread(tmp_path, layout_name):
    """Chunks under ``inline_chunk_bytes`` (`tunables`) are read at once by the thread that restores (worker
    threads would hold the GIL against it); larger ones on the reader's worker threads. Nothing goes through
    tensorstore."""
    state = {"small": _values((64, 64), torch.float32), "large": _values((1024, 512), torch.float32)}
    xtc.save(tmp_path / "ck", state, options=LAYOUTS[layout_name])
    meta = xtc.metadata(tmp_path / "ck")
    assert math.prod(meta["large"].chunk_shape) * 4 >= tunables.get("inline_chunk_bytes")  # else nothing to see
    paths = Paths()
    out = paths.restore(tmp_path / "ck", {k: torch.zeros_like(v) for k, v in state.items()})
    assert all(torch.equal(out[k], v) for k, v in state.items())
    assert paths["chunks_inline"] == _chunk_count(meta["small"])
    assert paths["chunks_on_workers"] == _chunk_count(meta["large"])
    assert paths["tensorstore_regions"] == 0


@pytest.fixture(params=["inline", "workers"])
def reading_thread(request, monkeypatch):
    """Read the (small) chunks of a test on the restoring thread, or on the worker threads as large ones are."""
    if request.param == "workers":
        with tunables.overridden(inline_chunk_bytes=0):
            yield request.param
    else:
        yield request.param


@pytest.fixture
def counted():
    """A `Paths` listener: the chunks read by `local_chunks` and the regions read through tensorstore."""
    return Paths()


def _chunks_read(paths):
    return paths["chunks_inline"] + paths["chunks_on_workers"]


GRIDS = {  # shape, saved chunk grid, restored shard grid
    "same-grid": ((12, 10), (4, 5), (4, 5)),
    "misaligned": ((12, 10), (4, 5), (5, 3)),
    "edge-chunks": ((13, 11), (4, 5), (6, 4)),
    "one-target": ((13, 11), (4, 5), (13, 11)),
    "rows-of-chunks": ((16, 6), (4, 6), (8, 6)),
    "3d": ((6, 5, 7), (2, 5, 3), (3, 2, 7)),
    "1d": ((100,), (30,), (25,)),
}


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float8_e4m3fn],
                         ids=str)
@pytest.mark.parametrize("grid", list(GRIDS))
def test_every_region_holds_the_saved_values(tmp_path, monkeypatch, counted, reading_thread, layout_name,
                                              dtype, grid):
    shape, saved, restored = GRIDS[grid]
    full = _values(shape, dtype)
    xtc.save(tmp_path / "ck", {"a": xtc.ShardedArray.from_tensor(full, saved, xtc.ShardedArray.grid(shape, saved))},
             options=LAYOUTS[layout_name])
    indices = xtc.ShardedArray.grid(shape, restored)
    with tunables.overridden(chunk_piece_bytes=40):  # several pieces per chunk, and rows split across them
        out = counted.restore(tmp_path / "ck", {"a": xtc.ShardedArray.target(shape, dtype, restored, indices)})
    assert [i for i, _ in out["a"].shards] == indices
    for index, data in out["a"].shards:
        assert torch.equal(data, full[_slices(index)]), index
    chunks = len(xtc.ShardedArray.grid(shape, saved))
    assert _chunks_read(counted) == chunks and counted["tensorstore_regions"] == 0  # each chunk once
    assert counted["chunks_inline" if reading_thread == "inline" else "chunks_on_workers"] == chunks


ZSTD_LAYOUTS = {name: dataclasses.replace(options, compression="zstd") for name, options in LAYOUTS.items()}


@pytest.mark.parametrize("layout_name", list(ZSTD_LAYOUTS))
@pytest.mark.parametrize("grid", ["same-grid", "edge-chunks", "one-target", "3d"])
def test_compressed_chunks_are_decompressed_into_every_region(tmp_path, counted, reading_thread, layout_name, grid):
    """zstd chunks (`SaveOptions.compression`) are read here too, each once, into the target where it is one
    block of it (same-grid, one-target) and through a buffer of its own otherwise; not by tensorstore."""
    shape, saved, restored = GRIDS[grid]
    full = _values(shape, torch.bfloat16)
    full.view(-1)[::3] = 1.0  # compressible: the frame is shorter than the chunk
    xtc.save(tmp_path / "ck", {"a": xtc.ShardedArray.from_tensor(full, saved, xtc.ShardedArray.grid(shape, saved)),
                               "s": torch.tensor(2.5)}, options=ZSTD_LAYOUTS[layout_name])
    indices = xtc.ShardedArray.grid(shape, restored)
    out = counted.restore(tmp_path / "ck", {"a": xtc.ShardedArray.target(shape, torch.bfloat16, restored, indices),
                                            "s": torch.zeros(())})
    for index, data in out["a"].shards:
        assert torch.equal(data, full[_slices(index)]), index
    assert torch.equal(out["s"], torch.tensor(2.5))
    assert _chunks_read(counted) == len(xtc.ShardedArray.grid(shape, saved)) + 1
    assert counted["tensorstore_regions"] == 0


def test_a_compressed_chunk_of_another_size_is_an_error_naming_it(tmp_path):
    """A zstd frame that passes its CRC32C but holds other than the chunk's bytes (written so by a broken writer)
    is refused, naming the array, the chunk and its file."""
    from xla_tensorstore_ckpt.arrays import direct_ocdbt

    item = _save(tmp_path, dataclasses.replace(PLAIN, compression="zstd"))
    chunk = _chunk_files(item)[0]
    short = np.zeros((16, 64), np.float32)  # half the chunk's rows
    open(chunk, "wb").write(b"".join(bytes(p) for p in direct_ocdbt.encode_chunk(short, (16, 64), 3)))
    with pytest.raises(xtc.CorruptCheckpointError, match=rf"{item / 'a'}: chunk c/0/0 does not decompress.*{chunk}"):
        xtc.restore(item)


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_scalars_empty_arrays_and_cpu_targets(tmp_path, counted, layout_name):
    state = {"s": torch.tensor(2.5), "i": torch.tensor(7, dtype=torch.int64), "e": torch.zeros(0, 4),
             "w": _values((33, 17), torch.float32), "b": _values((5,), torch.bool)}
    xtc.save(tmp_path / "ck", state, options=LAYOUTS[layout_name])
    for restored in (counted.restore(tmp_path / "ck"), counted.restore(tmp_path / "ck", {k: torch.ones(1).new_empty(
            v.shape, dtype=v.dtype) for k, v in state.items()})):
        assert set(restored) == set(state)
        for key, value in state.items():
            assert restored[key].dtype == value.dtype and torch.equal(restored[key], value), key
    assert _chunks_read(counted) and counted["tensorstore_regions"] == 0


def test_other_arrays_are_read_through_tensorstore(tmp_path, counted):
    """A single-file array (zarr's sharding codec) is not a layout read here: tensorstore reads it."""
    full = _values((8, 8), torch.float32)
    xtc.save(tmp_path / "ck", {"a": xtc.ShardedArray.from_tensor(full, (4, 4), xtc.ShardedArray.grid((8, 8), (4, 4)))},
             options=xtc.SaveOptions(use_ocdbt=False))
    out = counted.restore(tmp_path / "ck")
    assert torch.equal(out["a"], full)
    assert _chunks_read(counted) == 0 and counted["tensorstore_regions"]


def _chunk_files(item):
    return sorted(os.path.join(r, f) for r, _, fs in os.walk(item / "a" / "c") for f in fs)


def _data_files(item):
    return sorted((os.path.join(r, f) for r, _, fs in os.walk(item) for f in fs
                   if os.sep + "d" + os.sep in os.path.join(r, f)), key=os.path.getsize)


def _save(tmp_path, options):
    full = _values((64, 64), torch.float32)  # 16 KiB chunks: never inline in an OCDBT store
    grid = xtc.ShardedArray.grid((64, 64), (32, 64))
    xtc.save(tmp_path / "ck", {"a": xtc.ShardedArray.from_tensor(full, (32, 64), grid)}, options=options)
    return tmp_path / "ck"


def _rewrite(path, edit):
    data = bytearray(open(path, "rb").read())
    open(path, "wb").write(edit(data))


@pytest.mark.parametrize("damage", ["flipped", "truncated", "longer", "removed"])
def test_a_damaged_chunk_file_is_an_error_naming_array_chunk_and_file(tmp_path, reading_thread, damage):
    item = _save(tmp_path, PLAIN)
    chunk = _chunk_files(item)[1]
    edits = {"flipped": lambda d: d[:100] + bytes([d[100] ^ 0x10]) + d[101:], "truncated": lambda d: d[:-10],
             "longer": lambda d: d + b"\0"}
    if damage == "removed":
        os.remove(chunk)
    else:
        _rewrite(chunk, edits[damage])
    with pytest.raises(xtc.CorruptCheckpointError) as err:
        xtc.restore(item)
    message = str(err.value)
    assert str(item / "a") in message and "chunk c/1/0" in message and (chunk in message or damage == "removed")
    if damage == "flipped":
        assert "CRC32C" in message


@pytest.mark.parametrize("damage", ["flipped", "truncated", "removed"])
def test_damaged_ocdbt_data_is_an_error_naming_the_array(tmp_path, reading_thread, damage):
    item = _save(tmp_path, xtc.SaveOptions())
    data_file = _data_files(item)[-1]
    if damage == "removed":
        os.remove(data_file)
    elif damage == "truncated":
        _rewrite(data_file, lambda d: d[: len(d) // 2])
    else:
        _rewrite(data_file, lambda d: d[:len(d) // 2] + bytes([d[len(d) // 2] ^ 0x01]) + d[len(d) // 2 + 1:])
    with pytest.raises(xtc.CorruptCheckpointError) as err:
        xtc.restore(item)
    assert str(item / "a") in str(err.value) and "chunk c/" in str(err.value)


@pytest.mark.parametrize("where", ["value:../:d/0a:0:16", "value::/etc/passwd:0:16", "value:ocdbt.process_0/:../d:0:1",
                                   "btreenode::d/0a:0:16"])
def test_an_ocdbt_reference_outside_the_item_is_refused(tmp_path, where):
    """The B-tree's value references (compressed on disk, so not edited here) must stay inside the item."""
    from xla_tensorstore_ckpt import storage

    with pytest.raises(xtc.CorruptCheckpointError, match="references .*(not a value|leaves its directory|absolute)"):
        ocdbt._indirect(storage.location(tmp_path), where)


def test_a_restore_leaves_no_data_file_open(tmp_path, reading_thread):
    """The data files the reads keep open are closed when the restore ends, also when it fails (the counts of
    `local_reads.COUNTS`, which ``restore_finished`` reports)."""
    item = _save(tmp_path, xtc.SaveOptions())
    before = local_reads.COUNTS.snapshot()
    xtc.restore(item)
    files = local_reads.COUNTS.since(before)
    assert files["files_opened"] and files["files_closed"] == files["files_opened"]
    data_file = _data_files(item)[-1]
    _rewrite(data_file, lambda d: d[:len(d) // 2] + bytes([d[len(d) // 2] ^ 0x01]) + d[len(d) // 2 + 1:])
    before = local_reads.COUNTS.snapshot()
    with pytest.raises(xtc.CorruptCheckpointError):
        xtc.restore(item)
    files = local_reads.COUNTS.since(before)
    assert files["files_opened"] and files["files_closed"] == files["files_opened"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["read-into-targets", "cast"])
def test_a_restore_in_place_that_meets_damage_names_the_targets_it_left_alone(tmp_path, dtype):
    """Targets of the saved dtype are read into directly: a failed read may have written into them, and the
    error says so; targets that take a cast keep their values until their tensor is built."""
    from xla_tensorstore_ckpt import storage
    from xla_tensorstore_ckpt.checkpoint_manager import training_state

    state = {name: torch.full((64, 64), float(i + 1)) for i, name in enumerate(("a", "b", "c"))}
    xtc.save(tmp_path / "ck", state, options=PLAIN)
    (tmp_path / "ck" / "b" / "c" / "0" / "0").write_bytes(b"damaged")
    target = {name: torch.zeros(64, 64, dtype=dtype) for name in state}
    memory = {name: t.data_ptr() for name, t in target.items()}
    with pytest.raises(xtc.CorruptCheckpointError) as err:  # one batch: a is placed, then b's read fails
        training_state.restore_object(storage.location(str(tmp_path / "ck")), target, strict=True,
                                      options=xtc.RestoreOptions())
    assert torch.equal(target["a"], state["a"].to(dtype))
    assert {name: t.data_ptr() for name, t in target.items()} == memory  # in place
    if dtype == torch.float32:
        assert "[not restored, partly overwritten by the failed reads: b, c]" in str(err.value)
        assert "left as they were" not in str(err.value)
    else:
        assert "[not restored, left as they were: b, c]" in str(err.value)
        assert not target["b"].any() and not target["c"].any()


def test_a_restore_in_place_reads_into_the_targets_memory(tmp_path):
    """Host targets of the saved dtype are the reads' buffers (no second copy of the state); tied targets (one
    memory under two keys) are not, and take the last key's values as before."""
    from xla_tensorstore_ckpt import storage
    from xla_tensorstore_ckpt.checkpoint_manager import training_state

    state = {"a": torch.randn(64, 32), "b": torch.randn(16), "c": torch.randn(8, 8).to(torch.bfloat16),
             "x": torch.full((4, 4), 1.0), "y": torch.full((4, 4), 2.0)}
    xtc.save(tmp_path / "ck", state, options=PLAIN)
    tied = torch.zeros(4, 4)
    target = {"a": torch.zeros(64, 32), "b": torch.zeros(16), "c": torch.zeros(8, 8, dtype=torch.bfloat16),
              "x": tied, "y": tied}
    heard = []
    pointers = {k: target[k].data_ptr() for k in ("a", "b", "c")}
    training_state.restore_object(storage.location(str(tmp_path / "ck")), target, strict=True,
                                  options=xtc.RestoreOptions(listeners=(heard.append,)))
    issued = [e for e in heard if e.kind == events.RESTORE_BATCH_ISSUED]
    assert sorted(k for e in issued for k in e.details["into_targets"]) == ["a", "b", "c"]
    (finished,) = [e for e in heard if e.kind == events.RESTORE_FINISHED]
    assert finished.details["paths"]["into_target_bytes"] == sum(state[k].nbytes for k in ("a", "b", "c"))
    assert {k: target[k].data_ptr() for k in ("a", "b", "c")} == pointers  # their own memory, read into
    for key in ("a", "b", "c"):
        assert torch.equal(target[key], state[key]), key
    assert target["x"] is tied and torch.equal(tied, state["y"])


@pytest.mark.parametrize("options", [PLAIN, xtc.SaveOptions()], ids=["chunk-files", "ocdbt"])
@pytest.mark.xla
def test_cold_chunks_are_read_around_the_page_cache(tmp_path, options, mesh_4x2, mesh_2x4):
    """A chunk the page cache does not hold is read with O_DIRECT (a cold restore does not fill the cache with
    bytes it never reads again), bit for bit: whole chunks into their destination, and in pieces onto another
    sharding."""
    from conftest import sharded

    state = {"whole": _values((512, 256), torch.float32), "bf16": _values((304, 4000), torch.bfloat16, seed=1)}
    xtc.save(tmp_path / "ck", {k: sharded(v, mesh_4x2, ("x", "y")) for k, v in state.items()}, options=options)
    others = {k: sharded(torch.zeros_like(v), mesh_2x4, ("b", None)) for k, v in state.items()}
    for target in (None, others):
        os.sync()
        for root, _, names in os.walk(tmp_path / "ck"):
            for name in names:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
        paths = Paths()
        out = paths.restore(tmp_path / "ck", target)
        for key, value in state.items():
            assert torch.equal(out[key].cpu(), value), key
        # Every read was direct (the file system took it), its probe having found the bytes uncached.
        assert paths["direct_reads"] and paths["buffered_reads"] == 0, paths
        assert paths["cache_probes"] and paths["cached_probes"] == 0, paths


def test_a_restore_in_place_copies_into_overlapping_and_lazily_conjugated_targets(tmp_path):
    """Targets that overlap in memory (views of one tensor) and conjugated views are not read into: restored
    one after the other, the last key winning as before, never a race or a false checksum failure."""
    from xla_tensorstore_ckpt import storage
    from xla_tensorstore_ckpt.checkpoint_manager import training_state

    n = 1 << 20
    state = {"a": torch.full((n,), 1.0), "b": torch.full((n,), 2.0),
             "c": torch.arange(8, dtype=torch.float32).view(torch.complex64)}
    xtc.save(tmp_path / "ck", state, options=PLAIN)
    base = torch.zeros(n + n // 2)
    weight = torch.nn.Linear(2, 2).weight
    target = {"a": base[:n], "b": base[n // 2:], "c": torch.zeros(4, dtype=torch.complex64).conj()}
    training_state.restore_object(storage.location(str(tmp_path / "ck")), target, strict=True,
                                  options=xtc.RestoreOptions())
    assert torch.equal(base[:n // 2], state["a"][:n // 2]) and torch.equal(base[n // 2:], state["b"])
    assert torch.equal(target["c"], state["c"])
    version = weight._version
    xtc.save(tmp_path / "w", {"w": torch.ones(2, 2)}, options=PLAIN)
    training_state.restore_object(storage.location(str(tmp_path / "w")), {"w": weight}, strict=True,
                                  options=xtc.RestoreOptions())
    assert torch.equal(weight.detach(), torch.ones(2, 2)) and weight._version > version  # autograd sees it


def test_a_strided_target_over_a_read_targets_memory_keeps_both_out_of_direct_reads(tmp_path):
    """A column view spans more memory than its elements: its span, not its size, decides what it overlaps."""
    from xla_tensorstore_ckpt.restores import restoring

    base = torch.zeros(8, 8)
    wanted = {("row",): base[7], ("column",): base[:, 0], ("apart",): torch.zeros(3)}
    assert set(restoring._readable_into(wanted)) == {("apart",)}
