"""Hugging Face safetensors checkpoints restore straight onto sharded torch_xla models: each shard reads only its
byte ranges, from local files (memory-mapped) and object stores (ranged reads); dtype casts, key maps, key and
shape errors as for our own format; the manager initialises a run from them; the offline tools read them; and
hostile files fail clearly, naming file and key, before anything is allocated from their numbers."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest
import torch
from conftest import GCS_BUCKET, S3_BUCKET, sharded
from helpers import Paths
from hf_files import hf_tensors, write_hf_dir
from safetensors.torch import save_file
from xla_stack import torch_xla

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import cli, storage
from xla_tensorstore_ckpt.core import tunables
from xla_tensorstore_ckpt.core.errors import (
    CorruptCheckpointError,
    KeyMismatchError,
    ShapeMismatchError,
    UnsupportedValueError,
)
from xla_tensorstore_ckpt.core.sharded_array import ShardedArray

RESTORE_ELSEWHERE = os.path.join(os.path.dirname(__file__), "scripts", "restore_elsewhere.py")


@pytest.fixture
def hf_dir(tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    return str(tmp_path / "hf"), write_hf_dir(str(tmp_path / "hf"))


def mesh_target(expected: dict[str, torch.Tensor], mesh, *, dtype: torch.dtype | None = None) -> dict:
    """Zeros of each tensor's shape (in `dtype` if given) on `mesh`, cycling through row, column and 2D specs."""
    x, y = mesh.axis_names
    specs_by_rank = {2: [(x, y), (y, x), (None, y), (x, None)], 1: [(x,), (y,), (None,)], 0: [()]}
    target = {}
    for i, (key, value) in enumerate(sorted(expected.items())):
        specs = specs_by_rank[value.dim()]
        spec = specs[i % len(specs)]
        zeros = torch.zeros(value.shape, dtype=dtype or value.dtype)
        target[key] = sharded(zeros, mesh, spec) if value.dim() else zeros.to("xla")
    return target


def assert_restored(restored: dict, expected: dict, dtype: torch.dtype | None = None) -> None:
    assert sorted(restored) == sorted(expected)
    for key, value in expected.items():
        got = restored[key].cpu()
        want = value.to(dtype) if dtype is not None else value
        assert got.dtype == want.dtype and torch.equal(got, want), key


@pytest.mark.xla
def test_directory_restores_onto_a_2d_mesh_bit_exact(hf_dir, mesh_4x2, mesh_2x4):
    path, expected = hf_dir
    for mesh in (mesh_4x2, mesh_2x4):
        target = mesh_target(expected, mesh)
        restored = xtc.restore(path, target)
        torch_xla.sync()
        assert_restored(restored, expected)
        for key in expected:  # the target's sharding is kept
            assert torch_xla._XLAC._get_xla_sharding_spec(restored[key]) == \
                torch_xla._XLAC._get_xla_sharding_spec(target[key])


@pytest.mark.xla
def test_dtype_casts_both_ways(hf_dir, mesh_4x2):
    path, expected = hf_dir
    assert_restored(xtc.restore(path, mesh_target(expected, mesh_4x2, dtype=torch.float32)), expected, torch.float32)
    assert_restored(xtc.restore(path, mesh_target(expected, mesh_4x2, dtype=torch.bfloat16)), expected,
                    torch.bfloat16)


@pytest.mark.xla
def test_single_file_onto_cpu_unsharded_xla_and_sharded_targets(tmp_path, mesh_8):
    first, _ = hf_tensors()
    path = str(tmp_path / "model.safetensors")
    save_file(first, path)
    assert_restored(xtc.restore(path, {k: torch.empty_like(v) for k, v in first.items()}), first)
    assert_restored(xtc.restore(path, {k: torch.zeros_like(v).to("xla") for k, v in first.items()}), first)
    assert_restored(xtc.restore(path), first)  # no target: the file's own tensors on the CPU
    target = {k: sharded(torch.zeros_like(v), mesh_8, ("d",) + (None,) * (v.dim() - 1)) for k, v in first.items()}
    assert_restored(xtc.restore(path, target), first)
    # A directory holding a lone model.safetensors is a checkpoint too.
    assert_restored(xtc.restore(str(tmp_path), {k: torch.empty_like(v) for k, v in first.items()}), first)


@pytest.mark.xla
def test_restores_onto_4_devices_in_another_process(hf_dir, tmp_path):
    path, expected = hf_dir
    out = str(tmp_path / "on4")
    env = dict(os.environ, CPU_NUM_DEVICES="4", PJRT_DEVICE="CPU")
    proc = subprocess.run([sys.executable, RESTORE_ELSEWHERE, path, out, "xla"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "devices=4" in proc.stdout
    assert_restored(xtc.restore(out), expected)


@pytest.mark.parametrize("scheme", ["memory", "gs", "s3"])
@pytest.mark.xla
def test_object_stores_serve_ranged_reads(hf_dir, mesh_4x2, scheme, request):
    path, expected = hf_dir
    if scheme == "gs":
        request.getfixturevalue("gcs_emulator_server")
        remote = storage.location(f"gs://{GCS_BUCKET}/hf-{os.getpid()}")
    elif scheme == "s3":
        request.getfixturevalue("s3_server_process")
        remote = storage.location(f"s3://{S3_BUCKET}/hf-{os.getpid()}")
    else:
        remote = storage.location(f"memory://hf-{os.getpid()}")
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb") as f:
            remote.write(name, f.read())
    paths = Paths()
    assert_restored(paths.restore(str(remote), mesh_target(expected, mesh_4x2)), expected)
    assert paths["whole_reads"] == 0  # never a whole file: every tensor's bytes came in ranged reads
    assert paths["ranged_reads"] and paths["ranged_read_bytes"] >= sum(v.nbytes for v in expected.values())


def test_each_shard_reads_only_its_byte_ranges(tmp_path):
    """A column shard of a row-major matrix is one range per row; with merging off, exactly its bytes are read."""
    g = torch.Generator().manual_seed(1)
    matrix = torch.randn(64, 256, generator=g)
    data = tmp_path / "model.safetensors"
    save_file({"w": matrix}, str(data))
    remote = storage.location(f"memory://ranges-{os.getpid()}")
    remote.write("model.safetensors", data.read_bytes())
    column = ((0, 64), (64, 128))  # the second of four column shards
    target = {"w": ShardedArray.target((64, 256), torch.float32, (64, 64), [column])}
    paths = Paths()
    with tunables.overridden(merge_gap_bytes=0):
        restored = paths.restore(str(remote), target)
    assert paths["ranged_reads"] == 64 and paths["ranged_read_bytes"] == 64 * 64 * 4  # a request per row
    assert paths["whole_reads"] == 0
    (index, shard), = restored["w"].shards
    assert index == column and torch.equal(shard, matrix[:, 64:128])
    # With merging (the default), the rows come in one request of the span they cover.
    paths = Paths()
    paths.restore(str(remote), target)
    assert paths["ranged_reads"] == 1 and paths["ranged_read_bytes"] == (63 * 256 + 64) * 4


def test_key_map_renames_and_reports_key_and_shape_mismatches(hf_dir):
    path, expected = hf_dir
    torch_names = {k: k.removeprefix("model.") for k in expected}
    target = {torch_names[k]: torch.empty_like(v) for k, v in expected.items()}
    restored = xtc.restore(path, target, key_map=torch_names)
    assert_restored({k: restored[torch_names[k]] for k in expected}, expected)
    partial = {k: torch.empty_like(v) for k, v in expected.items() if k != "lm_head.weight"}
    partial["extra.bias"] = torch.zeros(3)
    with pytest.raises(KeyMismatchError) as info:
        xtc.restore(path, partial)
    assert "lm_head.weight" in str(info.value) and "extra.bias" in str(info.value)
    with pytest.warns(UserWarning, match="lm_head.weight"):
        restored = xtc.restore(path, partial, strict=False)
    assert torch.equal(restored["model.norm.weight"], expected["model.norm.weight"])
    assert torch.equal(restored["extra.bias"], torch.zeros(3))
    wrong = {k: torch.empty_like(v) for k, v in expected.items()}
    wrong["model.norm.weight"] = torch.empty(47)
    with pytest.raises(ShapeMismatchError, match=r"model\.norm\.weight.*\(48,\).*\(47,\)"):
        xtc.restore(path, wrong)


@pytest.mark.xla
def test_manager_initialises_a_run_from_hf_weights_until_a_step_is_committed(hf_dir, tmp_path, mesh_4x2):
    path, expected = hf_dir

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for key, value in mesh_target(expected, mesh_4x2).items():
                self.register_buffer(key.replace(".", "_"), value)

    renamed = {k: k.replace(".", "_") for k in expected}
    model = Model()
    root = tmp_path / "run"
    with xtc.CheckpointManager(root, xtc.CheckpointManagerOptions(save_interval_steps=1)) as manager:
        assert manager.restore("latest", model=model, init_from=path, key_map=renamed) is None
        torch_xla.sync()
        assert_restored({k: getattr(model, renamed[k]) for k in expected}, expected)
        with torch.no_grad():
            model.model_norm_weight.add_(1.0)
        manager.save(5, model=model)
        manager.wait_until_finished()
    model = Model()
    with xtc.CheckpointManager(root) as manager:  # a committed step wins over init_from
        assert manager.restore("latest", model=model, init_from=path, key_map=renamed) == 5
    assert torch.equal(model.model_norm_weight.cpu(), expected["model.norm.weight"] + 1.0)


def test_checkpoints_are_told_apart_by_content_not_by_name(tmp_path, capsys):
    """A directory called x.safetensors may be an item of ours or a Hugging Face directory; a safetensors file
    may be called anything."""
    first, _ = hf_tensors()
    xtc.save(tmp_path / "ours.safetensors", first, options=xtc.SaveOptions(use_ocdbt=False))
    assert xtc.metadata(tmp_path / "ours.safetensors")["model.embed_tokens.weight"].chunk_shape == (100, 48)
    assert_restored(xtc.restore(tmp_path / "ours.safetensors"), first)
    assert cli.main(["verify", str(tmp_path / "ours.safetensors"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["notes"] == []  # our item: checksums verified, no note
    expected = write_hf_dir(str(tmp_path / "hf.safetensors"))
    assert_restored(xtc.restore(tmp_path / "hf.safetensors"), expected)
    save_file(first, str(tmp_path / "weights.bin"))
    assert_restored(xtc.restore(tmp_path / "weights.bin"), first)
    assert cli.main(["tree", str(tmp_path / "weights.bin"), "--json"]) == 0
    assert {r["key"] for r in json.loads(capsys.readouterr().out)} == set(first)
    (tmp_path / "empty.safetensors").mkdir()
    with pytest.raises(xtc.CheckpointNotFoundError):
        xtc.metadata(tmp_path / "empty.safetensors")


def test_offline_tools_read_hf_checkpoints(hf_dir, capsys):
    path, expected = hf_dir
    assert cli.main(["tree", path, "--json"]) == 0
    rows = {r["key"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["model.embed_tokens.weight"]["shape"] == [100, 48]
    assert rows["model.embed_tokens.weight"]["dtype"] == "bfloat16"
    assert cli.main(["show", path, "lm_head.weight[3, ::16]", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["values"] == expected["lm_head.weight"][3, ::16].float().tolist()
    assert cli.main(["stats", path, "model.norm.weight", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)[0]
    assert stats["max"] == pytest.approx(expected["model.norm.weight"].max().item())
    assert cli.main(["diff", path, path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert cli.main(["verify", path, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["arrays"] == len(expected) and report["problems"] == []
    assert report["notes"] == ["item: Hugging Face safetensors files carry no checksums: checked that every "
                               "tensor's bytes are present and read"]
    # A file cut short (the last tensor's bytes gone) is reported, naming file and key.
    shard = os.path.join(path, "model-00002-of-00002.safetensors")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 4)
    assert cli.main(["verify", path, "--json"]) == cli.EXIT_DATA
    (problem,) = json.loads(capsys.readouterr().out)["problems"]
    assert "model-00002-of-00002.safetensors: truncated" in problem["message"]
    assert "'lm_head.weight' ends past the end of the file" in problem["message"]


# ------------------------------------------------------------------------------------------- hostile files


def _file(path, header: bytes, data: bytes, *, length: int | None = None) -> str:
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return str(path)


def _header(entries: dict) -> bytes:
    return json.dumps(entries).encode()


HOSTILE = {
    "truncated": (lambda p: _file(p, _header({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}),
                                  b"\0" * 40), r"truncated.*'w'"),
    "offsets beyond the file": (
        lambda p: _file(p, _header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                    "w": {"dtype": "F32", "shape": [2], "data_offsets": [4096, 4104]}}),
                        b"\0" * 16), r"'w' ends past the end"),
    "dtype lie": (lambda p: _file(p, _header({"w": {"dtype": "F64", "shape": [4, 4], "data_offsets": [0, 64]}}),
                                  b"\0" * 64), r"'w'.*F64\[4, 4\] takes 128 bytes.*span 64"),
    "shape lie": (lambda p: _file(p, _header({"w": {"dtype": "F32", "shape": [10**12, 10**12],
                                                    "data_offsets": [0, 64]}}), b"\0" * 64), r"'w'.*takes"),
    "overlap": (lambda p: _file(p, _header({"a": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]},
                                            "b": {"dtype": "F32", "shape": [8], "data_offsets": [16, 48]}}),
                                b"\0" * 48), r"'a' and 'b' overlap"),
    "huge header": (lambda p: _file(p, b"{}", b"", length=1 << 40), r"header of 1099511627776 bytes exceeds"),
    "header past the end": (lambda p: _file(p, b"{}", b"", length=4096), r"truncated: the header"),
    "not json": (lambda p: _file(p, b"{not json", b""), r"not valid JSON"),
    "duplicate key": (lambda p: _file(p, b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
                                         b'"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
                                      b"\0" * 4), r"'w' appears twice"),
    "negative offsets": (lambda p: _file(p, _header({"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}),
                                         b""), r"'w'.*data_offsets"),
    "too short": (lambda p: (open(p, "wb").write(b"\x01\x02"), str(p))[1], r"shorter than the 8-byte"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_files_fail_clearly_naming_file_and_key(tmp_path, case):
    make, message = HOSTILE[case]
    path = make(tmp_path / "model.safetensors")
    with pytest.raises(CorruptCheckpointError, match=message) as info:
        xtc.restore(path, {"w": torch.empty(4, 4)})
    assert "model.safetensors" in str(info.value)
    assert cli.main(["tree", path]) == 1  # the command line reports damaged data the same way


def test_unknown_dtypes_and_indexes_naming_missing_files_or_keys(tmp_path):
    _file(tmp_path / "odd.safetensors", _header({"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}),
          b"\0" * 8)
    with pytest.raises(UnsupportedValueError, match=r"odd\.safetensors.*'w'.*C64"):
        xtc.metadata(str(tmp_path / "odd.safetensors"))
    directory = tmp_path / "hf"
    directory.mkdir()
    save_file({"w": torch.zeros(2)}, str(directory / "a.safetensors"))
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "a.safetensors", "v": "b.safetensors"}}))
    with pytest.raises(CorruptCheckpointError, match=r"b\.safetensors: missing, but model\.safetensors\.index\.json "
                                                     r"places 'v' in it$"):
        xtc.metadata(str(directory))
    many = {"w": "a.safetensors", **{f"layers.{i}.weight": "b.safetensors" for i in range(5)}}
    index.write_text(json.dumps({"weight_map": many}))
    with pytest.raises(CorruptCheckpointError, match=r"b\.safetensors: missing, but .* places 'layers\.0\.weight', "
                                                     r"'layers\.1\.weight', 'layers\.2\.weight' and 2 more in it$"):
        xtc.restore(str(directory), {"w": torch.zeros(2)}, strict=False)
    index.write_text(json.dumps({"weight_map": {"w": "a.safetensors", "v": "a.safetensors"}}))
    with pytest.raises(CorruptCheckpointError, match=r"places 'v' in a\.safetensors, which does not hold it"):
        xtc.metadata(str(directory))
    index.write_text(json.dumps({"weight_map": {"w": "../a.safetensors"}}))
    with pytest.raises(CorruptCheckpointError, match=r"not a plain name"):
        xtc.metadata(str(directory))
