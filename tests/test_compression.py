"""zstd-compressed saves (`SaveOptions.compression`): Orbax's codec chain with this library's CRC32C after it, written
by the direct OCDBT lanes and by tensorstore alike, read back bit for bit by every reader (this library's direct
chunk reads decompress them too), damage still found, and bad options refused."""

from __future__ import annotations

import json
import math
import os
import struct
from collections import Counter

import crc32c
import numpy as np
import pytest
import tensorstore as ts
import torch
import zarr
from conftest import make_mesh, sharded
from helpers import DTYPES, assert_trees_equal, ocdbt_data_files, options, random_tensor
from numcodecs import Zstd

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import cli
from xla_tensorstore_ckpt.arrays import direct_ocdbt
from xla_tensorstore_ckpt.core import events

ZSTD = xtc.SaveOptions(compression="zstd")
LAYOUTS = {"direct-ocdbt": ZSTD, "tensorstore-ocdbt": xtc.SaveOptions(compression="zstd", direct_io=False),
           "directories": xtc.SaveOptions(compression="zstd", use_ocdbt=False)}
ORBAX_CODECS = [{"configuration": {"endian": "little"}, "name": "bytes"},
                {"configuration": {"checksum": False, "level": 3}, "name": "zstd"}, {"name": "crc32c"}]
ZSTD_MAGIC = bytes.fromhex("28b52ffd")


def _state():
    state = {f"{str(d).split('.')[-1]}": random_tensor((5, 7), d) for d in DTYPES}
    state.update(scalar=random_tensor((), torch.float32), empty=random_tensor((0, 3), torch.bfloat16),
                 repeated=torch.arange(1 << 16, dtype=torch.float32) % 97, position=17, name="run")
    return state


def _zarr_json(item, name, layout_name) -> dict:
    if layout_name == "directories":
        return json.loads((item / name / "zarr.json").read_text())
    store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item}/"}).result()
    return json.loads(store.read(f"{name}/zarr.json").result().value)


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_every_dtype_round_trips_compressed_in_orbax_codec_chain(tmp_path, layout_name):
    state = _state()
    xtc.save(tmp_path / "ck", state, options=LAYOUTS[layout_name])
    assert_trees_equal(xtc.restore(tmp_path / "ck"), state)
    assert _zarr_json(tmp_path / "ck", "float32", layout_name)["codecs"] == ORBAX_CODECS
    assert _zarr_json(tmp_path / "ck", "int8", layout_name)["codecs"][1:] == ORBAX_CODECS[1:]
    xtc.save(tmp_path / "raw", state, options=xtc.SaveOptions(use_ocdbt=layout_name != "directories"))
    assert _size(tmp_path / "ck") < _size(tmp_path / "raw") - 200_000  # `repeated` (256 KiB) takes ~1 KiB


def _size(path) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def test_a_direct_chunk_is_a_zstd_frame_then_the_crc32c_of_the_frame(tmp_path):
    value = torch.arange(70, dtype=torch.float32).reshape(10, 7)
    frame, checksum = (bytes(p) for p in direct_ocdbt.encode_chunk(value[8:].numpy(), (4, 7), 3))
    assert frame[:4] == ZSTD_MAGIC and checksum == struct.pack("<I", crc32c.crc32c(frame))
    padded = np.zeros((4, 7), np.float32)
    padded[:2] = value[8:].numpy()  # the edge chunk is padded to the whole chunk before it is compressed
    assert Zstd().decode(frame) == padded.tobytes()


@pytest.mark.xla
def test_direct_and_tensorstore_compressed_saves_decode_alike(tmp_path):
    """The two writers' zstd frames may differ byte for byte (two builds of zstd); what they decode to may not."""
    mesh = make_mesh((4, 2), ("x", "y"))
    w = torch.arange(16 * 12, dtype=torch.float32).reshape(16, 12) / 7
    state = {"w": sharded(w, mesh, ("x", "y")), "b": (torch.arange(10.0) - 3).to(torch.bfloat16)}
    for name, opts in (("direct", LAYOUTS["direct-ocdbt"]), ("tensorstore", LAYOUTS["tensorstore-ocdbt"])):
        xtc.save(tmp_path / name, state, options=opts)
    for name in ("direct", "tensorstore"):
        spec = {"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": f"file://{tmp_path / name}/", "path": "w/"}}
        assert torch.equal(torch.from_numpy(ts.open(spec).result().read().result()), w)
    target = {"w": sharded(torch.zeros(16, 12), make_mesh((2, 4), ("a", "b")), ("b", "a")),
              "b": torch.zeros(10, dtype=torch.bfloat16)}
    out = xtc.restore(tmp_path / "direct", target)  # resharded onto another mesh
    assert torch.equal(out["w"].cpu(), w) and torch.equal(out["b"], state["b"])


def test_compressed_chunks_are_read_directly_single_file_arrays_by_tensorstore_and_zarr_python(tmp_path):
    full = torch.arange(64.0).reshape(8, 8)
    single_file = xtc.ShardedArray.from_tensor(full, (4, 4), xtc.ShardedArray.grid((8, 8), (4, 4)))
    xtc.save(tmp_path / "ck", {"a": single_file, "b": full}, options=LAYOUTS["directories"])
    assert json.loads((tmp_path / "ck" / "a" / "zarr.json").read_text())["codecs"][0]["configuration"]["codecs"] \
        == ORBAX_CODECS  # zarr's sharding codec around the same chain: Orbax's layout
    paths = Counter()

    def listener(event):
        if event.kind == events.RESTORE_FINISHED:
            paths.update(event.details["paths"])

    out = xtc.restore(tmp_path / "ck", options=xtc.RestoreOptions(listeners=(listener,)))
    assert torch.equal(out["a"], full) and torch.equal(out["b"], full)
    chunks_of_b = math.prod(-(-n // c) for n, c in zip((8, 8), xtc.metadata(tmp_path / "ck")["b"].chunk_shape))
    assert paths["chunks_inline"] + paths["chunks_on_workers"] == chunks_of_b  # b's zstd chunks, read here
    assert paths["tensorstore_regions"] == 1  # a, the single-file array
    assert np.array_equal(zarr.open_array(str(tmp_path / "ck" / "b"), mode="r")[:], full.numpy())


@pytest.mark.parametrize("layout_name", ["direct-ocdbt", "directories"])
def test_a_damaged_compressed_chunk_is_found_by_its_crc32c(tmp_path, capsys, layout_name):
    state = {"a": random_tensor((1 << 14,), torch.float32)}  # a stored value too large to be inline in OCDBT
    xtc.save(tmp_path / "ck", state, options=LAYOUTS[layout_name])
    path = str(tmp_path / "ck" / "a" / "c" / "0") if layout_name == "directories" else \
        ocdbt_data_files(tmp_path / "ck")[0]
    data = bytearray(open(path, "rb").read())
    at = data.find(ZSTD_MAGIC) + 30_000  # inside the frame's data: the frame still decodes, to other values
    data[at] ^= 0x01
    open(path, "wb").write(bytes(data))
    with pytest.raises(xtc.CorruptCheckpointError, match=f"{tmp_path / 'ck' / 'a'}: chunk c/0 fails its CRC32C"):
        xtc.restore(tmp_path / "ck")  # read directly; tensorstore (xtckpt verify) says "Digest mismatch"
    assert cli.main(["verify", str(tmp_path / "ck")]) == 1
    assert "a" in capsys.readouterr().out


def _rle_frame(nbytes: int, declared: int | None = None) -> bytes:
    """A zstd frame of run-length blocks decoding to `nbytes` zero bytes from a few bytes per 128 KiB; its header
    declares `declared` bytes (8 bytes wide), or no size."""
    head = b"\x28\xb5\x2f\xfd" + (bytes([0xC0, 0x38]) + declared.to_bytes(8, "little") if declared is not None
                                     else bytes([0x00, 0x38]))
    blocks = nbytes // (128 << 10)
    return head + b"".join(((128 << 10) << 3 | 1 << 1 | (i == blocks - 1)).to_bytes(3, "little") + b"\x00"
                           for i in range(blocks))


@pytest.mark.parametrize("declared", [None, 1 << 40])
def test_a_hostile_frame_is_refused_without_decoding_beyond_its_chunk(tmp_path, declared):
    """A crafted chunk (valid CRC32C) whose frame expands far beyond the chunk, declared or not, is a
    `CorruptCheckpointError` naming the chunk, and no more than the chunk's bytes are ever decoded."""
    import tracemalloc

    xtc.save(tmp_path / "ck", {"w": torch.arange(64, dtype=torch.float32)},
             options=xtc.SaveOptions(compression="zstd", use_ocdbt=False))
    frame = _rle_frame(64 << 20, declared)
    chunk = tmp_path / "ck" / "w" / "c" / "0"
    chunk.write_bytes(frame + struct.pack("<I", crc32c.crc32c(frame)))
    tracemalloc.start()
    try:
        with pytest.raises(xtc.CorruptCheckpointError, match=r"w: chunk c/0 does not decompress to the 256 bytes"):
            xtc.restore(tmp_path / "ck")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20  # the 64 MiB the frame expands to were never allocated


@pytest.mark.xla
def test_a_manager_saves_compressed_steps_and_restores_them_in_place(tmp_path):
    mesh = make_mesh((4, 2), ("x", "y"))
    w = torch.arange(128.0).reshape(16, 8) % 5
    opts = options(save_options=xtc.SaveOptions(compression="zstd", compression_level=9))
    with xtc.CheckpointManager(tmp_path / "root", opts) as manager:
        manager.save(1, model={"w": sharded(w, mesh, ("x", "y"))})
        target = {"w": sharded(torch.zeros(16, 8), mesh, ("y", "x"))}
        assert manager.restore(1, model=target) == 1
    assert torch.equal(target["w"].cpu(), w)
    assert _zarr_json(tmp_path / "root" / "1" / "model", "w", "ocdbt")["codecs"][1]["configuration"]["level"] == 9


def test_the_command_line_converts_into_and_out_of_compressed_items(tmp_path, capsys):
    state = {"w": torch.arange(4096.0).reshape(64, 64) % 11, "b": random_tensor((9,), torch.bfloat16)}
    xtc.save(tmp_path / "raw", state)
    assert cli.main(["convert", str(tmp_path / "raw"), str(tmp_path / "zstd"), "--compression", "zstd",
                     "--compression-level", "5", "--mesh", "2x2"]) == 0
    assert _zarr_json(tmp_path / "zstd", "w", "ocdbt")["codecs"][1] == {"configuration": {"checksum": False,
                                                                                          "level": 5}, "name": "zstd"}
    assert cli.main(["convert", str(tmp_path / "zstd"), str(tmp_path / "back")]) == 0  # read by tensorstore
    for name in ("zstd", "back"):
        assert_trees_equal(xtc.restore(tmp_path / name), state)
    assert _zarr_json(tmp_path / "back", "w", "ocdbt")["codecs"] == [ORBAX_CODECS[0], ORBAX_CODECS[2]]
    capsys.readouterr()
    assert cli.main(["convert", str(tmp_path / "raw"), str(tmp_path / "x"), "--compression-level", "5"]) == 2
    assert "compression_level=5 needs compression='zstd'" in capsys.readouterr().err
    assert cli.main(["convert", str(tmp_path / "raw"), str(tmp_path / "x.pt"), "--to", "torch", "--compression",
                     "zstd"]) == 2
    assert "--compression applies to items and steps of ours" in capsys.readouterr().err
    assert not (tmp_path / "x.pt").exists()


@pytest.mark.parametrize("kwargs, message", [
    ({"compression": "gzip"}, "compression must be None or 'zstd', got 'gzip'"),
    ({"compression": "zstd", "compression_level": 0}, "compression_level must be an integer from 1 to 22, got 0"),
    ({"compression": "zstd", "compression_level": 23}, "from 1 to 22, got 23"),
    ({"compression": "zstd", "compression_level": True}, "from 1 to 22, got True"),
    ({"compression_level": 5}, "compression_level=5 needs compression='zstd'"),
])
def test_bad_compression_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        xtc.SaveOptions(**kwargs)
    assert xtc.SaveOptions().zstd_level is None and xtc.SaveOptions(compression="zstd").zstd_level == 3
