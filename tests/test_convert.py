"""`xtckpt convert`: Hugging Face safetensors into our items and steps and back bit for bit, Orbax's items and our
version-1 items into the current format (which Orbax then restores), all without torch_xla, streaming under the
host-memory budget (peak RSS measured in a process of its own), and bad input failing clearly with nothing lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import tensorstore as ts
import torch
from conftest import sharded
from hf_files import hf_tensors, write_hf_dir
from orbax_process import leaf, orbax, same
from safetensors.torch import load_file, save_file

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import cli, formats, storage
from xla_tensorstore_ckpt.core import tree
from xla_tensorstore_ckpt.core.errors import CheckpointExistsError, UsageError
from xla_tensorstore_ckpt.tools import convert

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")
GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
sys.path.insert(0, GOLDEN)
sys.path.insert(0, os.path.dirname(__file__))
import make_v1  # noqa: E402
import orbax_trees  # noqa: E402


def without_torch_xla(*commands: list[str]) -> list[dict]:
    """Run xtckpt commands in one process where importing torch_xla fails; each command's status and output."""
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "no_xla_cli.py"), json.dumps(list(commands))],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    assert len(results) == len(commands) and not any(r["torch_xla_imported"] for r in results)
    return results


@pytest.mark.xla
def test_hf_to_our_item_and_back_is_bit_exact_without_torch_xla(tmp_path, mesh_4x2):
    expected = write_hf_dir(str(tmp_path / "hf"))
    item, again, sharded_again = tmp_path / "item", tmp_path / "again", tmp_path / "again-split"
    results = without_torch_xla(
        ["convert", str(tmp_path / "hf"), str(item), "--mesh", "4x2", "--max-host-bytes", "64KiB"],
        ["convert", str(item), str(again), "--to", "safetensors"],
        ["convert", str(item), str(sharded_again), "--to", "safetensors", "--max-file-size", "20KB"])
    assert [r["status"] for r in results] == [0, 0, 0], [r["stderr"] for r in results]
    # Stored in the chunks of a 4x2 mesh's shards: dimension 0 in 4, dimension 1 in 2.
    info = xtc.metadata(item)
    assert info["model.layers.0.self_attn.q_proj.weight"].chunk_shape == (12, 24)
    assert info["model.embed_tokens.weight"].chunk_shape == (25, 24)
    assert info["model.norm.weight"].chunk_shape == (12,) and info["model.rotary.scale"].shape == ()
    assert info["lm_head.weight"].dtype == "bfloat16"
    # Our item restores onto a mesh, and the safetensors written from it hold the very same tensors.
    target = {k: sharded(torch.zeros_like(v), mesh_4x2, ("x", "y")[:v.dim()]) if v.dim() else torch.zeros_like(v)
              for k, v in expected.items()}
    restored = xtc.restore(item, target)
    for key, value in expected.items():
        assert restored[key].dtype == value.dtype and torch.equal(restored[key].cpu(), value), key
    back = load_file(str(again / "model.safetensors"))
    assert sorted(back) == sorted(expected)
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in expected.items())
    index = json.loads((sharded_again / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and sorted(index["weight_map"]) == sorted(expected)
    merged = {k: v for name in files for k, v in load_file(str(sharded_again / name)).items()}
    assert all(torch.equal(merged[k], v) for k, v in expected.items())


def test_chunk_shapes_given_chosen_by_budget_or_refused(tmp_path):
    first, _ = hf_tensors()
    path = storage.location(str(tmp_path / "model.safetensors"))
    save_file(first, str(tmp_path / "model.safetensors"))
    convert.convert_item(path, storage.location(str(tmp_path / "given")),
                         options=convert.ConvertOptions(chunk_shape=(16, 16)))
    info = xtc.metadata(tmp_path / "given")
    assert info["model.embed_tokens.weight"].chunk_shape == (16, 16)
    assert info["model.layers.0.input_layernorm.weight"].chunk_shape == (16,)
    # No shape given: the source's row blocks, cut along the first dimension to fit a quarter of the budget.
    progress = []
    convert.convert_item(path, storage.location(str(tmp_path / "budget")),
                         options=convert.ConvertOptions(max_host_bytes=4 * 48 * 2 * 10),
                         progress=lambda done, total: progress.append((done, total)))
    info = xtc.metadata(tmp_path / "budget")
    assert info["model.embed_tokens.weight"].chunk_shape == (10, 48)  # rows of 96 bytes, 960 bytes per chunk
    assert info["model.layers.0.self_attn.q_proj.weight"].chunk_shape == (5, 48)  # rows of 192 bytes
    total = sum(v.numel() * v.element_size() for v in first.values())
    assert progress[-1] == (total, total) and [d for d, _ in progress] == sorted(d for d, _ in progress)
    assert all(torch.equal(xtc.restore(tmp_path / "budget")[k], v) for k, v in first.items())
    with pytest.raises(UsageError, match=r"weight: chunks of \[\d+, 48\] take \d+ bytes, more than a quarter"):
        convert.convert_item(path, storage.location(str(tmp_path / "refused")),
                             options=convert.ConvertOptions(max_host_bytes=4096, chunk_shape=(100, 48)))


@pytest.mark.xla
def test_hf_to_a_step_the_manager_resumes(tmp_path, mesh_2x4, capsys):
    expected = write_hf_dir(str(tmp_path / "hf"))
    root = tmp_path / "run"
    assert cli.main(["convert", str(tmp_path / "hf"), str(root / "0"), "--to", "step"]) == 0
    capsys.readouterr()  # the converted step's path
    assert cli.main(["steps", str(root), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(s["step"], s["status"]) for s in listed] == [(0, "committed")]
    with xtc.CheckpointManager(root, xtc.CheckpointManagerOptions(save_rng=False)) as manager:
        assert manager.all_steps() == [0] and manager.metadata(0).items == ("model",)
        model = {k: sharded(torch.zeros_like(v), mesh_2x4, mesh_2x4.axis_names[:v.dim()]) if v.dim() else
                 torch.zeros_like(v) for k, v in expected.items()}
        assert manager.restore("latest", model=model) == 0
    assert all(torch.equal(model[k].cpu(), v) for k, v in expected.items())


def test_orbax_items_and_steps_convert_to_ours(tmp_path):
    item = os.path.join(GOLDEN, "orbax-0.11", "item")
    convert.convert_item(storage.location(item), storage.location(str(tmp_path / "ours")))
    expected = orbax_trees.tree()
    restored = xtc.restore(tmp_path / "ours")
    assert same(restored["params"]["w"], torch.from_numpy(expected["params"]["w"]))
    assert restored["params"]["layers"][1]["k"].tolist() == expected["params"]["layers"][1]["k"].tolist()
    # One item of an Orbax manager's step, chosen by name.
    step = os.path.join(GOLDEN, "orbax-0.11", "root", "2")
    assert cli.main(["convert", step, str(tmp_path / "from-step"), "--item", "model"]) == 0
    model = xtc.restore(tmp_path / "from-step")
    assert torch.equal(model["embed"], torch.from_numpy(orbax_trees.model(2)["embed"]))
    assert cli.main(["convert", step, str(tmp_path / "missing"), "--item", "nope"]) == cli.EXIT_USAGE


def test_orbax_sources_and_new_steps_convert_without_torch_xla(tmp_path):
    weights = write_hf_dir(str(tmp_path / "hf"))
    item = os.path.join(GOLDEN, "orbax-0.11", "item")
    step = os.path.join(GOLDEN, "orbax-0.11", "root", "2")
    results = without_torch_xla(
        ["convert", item, str(tmp_path / "from-item"), "--mesh", "2x2"],
        ["convert", step, str(tmp_path / "from-step"), "--item", "model"],
        ["convert", step, str(tmp_path / "run" / "7"), "--item", "model", "--to", "step"],
        ["convert", str(tmp_path / "hf"), str(tmp_path / "run" / "8"), "--to", "step", "--mesh", "4x2"],
        ["steps", str(tmp_path / "run"), "--json"])
    assert [r["status"] for r in results] == [0] * 5, [r["stderr"] for r in results]
    assert [(s["step"], s["status"]) for s in json.loads(results[-1]["stdout"])] == [(7, "committed"), (8, "committed")]
    expected = orbax_trees.tree()
    restored = xtc.restore(tmp_path / "from-item")
    assert same(restored["params"]["w"], torch.from_numpy(expected["params"]["w"]))
    assert xtc.metadata(tmp_path / "from-item")["params"]["w"].chunk_shape == (8, 4)
    assert (restored["step"], restored["name"]) == (7, "run-a")
    model = {k: torch.from_numpy(v.view("uint16")).view(torch.bfloat16) if v.dtype.itemsize == 2 else
             torch.from_numpy(v) for k, v in orbax_trees.model(2).items()}
    for converted in (tmp_path / "from-step", tmp_path / "run" / "7" / "model"):
        assert all(same(xtc.restore(converted)[k], v) for k, v in model.items()), converted
    with xtc.CheckpointManager(tmp_path / "run", xtc.CheckpointManagerOptions(save_rng=False)) as manager:
        assert manager.all_steps() == [7, 8]
        target = {k: torch.zeros_like(v) for k, v in model.items()}
        assert manager.restore(7, model=target) == 7 and all(torch.equal(target[k], v) for k, v in model.items())
        hf = {k: torch.zeros_like(v) for k, v in weights.items()}
        assert manager.restore(8, model=hf) == 8
    assert all(torch.equal(hf[k], v) for k, v in weights.items())


def test_a_version_1_item_becomes_one_orbax_restores(tmp_path):
    source = os.path.join(GOLDEN, "v1", "1", "model")
    assert xtc.metadata(source)  # the fixture is format 1
    convert.convert_item(storage.location(source), storage.location(str(tmp_path / "v2")))
    expected = make_v1.model_state()
    assert all(same(v, expected[k]) for k, v in xtc.restore(tmp_path / "v2").items())
    restored = orbax("restore", tmp_path / "v2")
    for key, value in expected.items():
        assert same(leaf(restored[key]), value), key


def peak_rss(argv: list[str], *, status: int = 0) -> dict:
    """Run an xtckpt command in a process of its own; its exit status, stderr, and resident memory before and at
    its peak."""
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "convert_peak_rss.py"), json.dumps(argv)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["status"] == status and not result["torch_xla_imported"], proc.stderr[-4000:]
    return {**result, "stderr": proc.stderr}


def test_the_host_memory_budget_holds_both_ways(tmp_path):
    budget = 64 << 20
    g = torch.Generator().manual_seed(1)
    tensors = {f"layers.{i}.weight": torch.randn(2048, 4096, generator=g) for i in range(6)}  # 192 MiB
    save_file(tensors, str(tmp_path / "model.safetensors"))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert total >= 3 * budget  # ignoring the budget would show
    into = peak_rss(["convert", str(tmp_path / "model.safetensors"), str(tmp_path / "item"),
                     "--max-host-bytes", str(budget)])
    back = peak_rss(["convert", str(tmp_path / "item"), str(tmp_path / "st"), "--to", "safetensors",
                     "--max-host-bytes", str(budget)])
    # Item to item, from stored chunks of a quarter of the budget (16 MiB, 1024 rows: the budget's cut of the
    # tensors) into the chunks of a 8x2 mesh's shards, cut along both dimensions: each stored chunk is read once.
    assert xtc.metadata(tmp_path / "item")["layers.0.weight"].chunk_shape == (1024, 4096)
    recut = peak_rss(["convert", str(tmp_path / "item"), str(tmp_path / "recut"), "--mesh", "8x2",
                      "--max-host-bytes", str(budget)])
    for result in (into, back, recut):
        assert result["peak"] - result["baseline"] <= budget, result
    # Under half the budget, a stored chunk (which is decoded whole) no longer fits: refused up front, naming the
    # array, its chunks and the budget needed, instead of decoding the chunk again for every piece.
    refused = peak_rss(["convert", str(tmp_path / "item"), str(tmp_path / "refused"),
                        "--max-host-bytes", str(budget // 2)], status=cli.EXIT_USAGE)
    assert "layers.0.weight: its stored chunks of [1024, 4096] take 16777216 bytes" in refused["stderr"]
    assert f"at least {budget}" in refused["stderr"] and not (tmp_path / "refused").exists()
    del tensors
    again = load_file(str(tmp_path / "st" / "model.safetensors"))
    original = load_file(str(tmp_path / "model.safetensors"))
    assert all(torch.equal(again[k], v) for k, v in original.items())
    assert xtc.metadata(tmp_path / "recut")["layers.0.weight"].chunk_shape == (256, 2048)
    recut_values = xtc.restore(tmp_path / "recut")
    assert sorted(recut_values) == sorted(original)
    assert all(torch.equal(recut_values[k], v) for k, v in original.items())


def test_the_host_memory_budget_holds_from_orbax_chunks(tmp_path):
    """Orbax's chunks are its shards: an array on one device is one chunk, however large."""
    budget = 64 << 20
    gib = 0.1875  # 16 arrays of (384, 8192) float32: 12 MiB each, 192 MiB
    orbax("large", tmp_path / "orbax", gib, "--one-device", "1")
    item = tmp_path / "orbax" / "1" / "model"
    shapes = orbax_trees.large_shapes(gib)
    assert len(shapes) == 16 and set(shapes.values()) == {(384, 8192)}
    assert xtc.metadata(item)["w0"].chunk_shape == (384, 8192)
    into = peak_rss(["convert", str(item), str(tmp_path / "ours"), "--mesh", "4x2", "--max-host-bytes", str(budget)])
    assert into["peak"] - into["baseline"] <= budget, into
    refused = peak_rss(["convert", str(item), str(tmp_path / "refused"), "--max-host-bytes", str(budget // 2)],
                       status=cli.EXIT_USAGE)
    assert "w0: its stored chunks of [384, 8192] take 12582912 bytes" in refused["stderr"]
    assert f"at least {12582912 * convert.COPIES_IN_FLIGHT}" in refused["stderr"]
    assert not (tmp_path / "refused").exists()
    assert xtc.metadata(tmp_path / "ours")["w3"].chunk_shape == (96, 4096)
    restored = xtc.restore(tmp_path / "ours")
    expected = orbax_trees.large(gib)
    assert sorted(restored) == sorted(expected)
    assert all(torch.equal(restored[k], torch.from_numpy(v)) for k, v in expected.items())


def chunk_reads() -> int:
    """Chunks tensorstore has read in this process so far (its chunk cache's read counter; each read of a
    region counts every chunk it touches)."""
    return sum(int(v["value"]) for m in ts.experimental_collect_matching_metrics("/tensorstore/cache/chunk_cache/reads")
               for v in m["values"])


@pytest.mark.parametrize("chunking", [dict(chunk_shape=(4, 48)), dict(mesh=(4, 2)), dict(chunk_shape=(96, 48)), {}],
                         ids=["rows", "rows-and-columns", "merged", "kept"])
@pytest.mark.parametrize("kind", ["ours", "orbax"])
def test_a_zarr_source_is_read_once_per_stored_chunk(tmp_path, kind, chunking):
    """A zarr chunk is decoded whole whatever part of it is read: however the destination is chunked, every
    stored chunk is read exactly once."""
    if kind == "ours":  # stored chunks of 16 rows, from a Hugging Face directory; in memory, read by tensorstore
        expected = write_hf_dir(str(tmp_path / "hf"))  # (local chunk reads count themselves: test_local_chunks.py)
        source = storage.location(f"memory://read-once/{tmp_path.name}/{'-'.join(chunking) or 'kept'}")
        convert.convert_item(storage.location(str(tmp_path / "hf")), source,
                             options=convert.ConvertOptions(chunk_shape=(16, 48)))
    else:  # an item Orbax wrote: the chunks of a 4x2 mesh's shards
        source = storage.location(os.path.join(GOLDEN, "orbax-0.11", "item"))
        expected = dict(tree.flatten(xtc.restore(source.path)))
    before = chunk_reads()
    manifest = formats.read_item(source)
    reading_the_manifest = chunk_reads() - before  # Orbax's scalars are read with it
    before = chunk_reads()
    convert.convert_item(source, storage.location(str(tmp_path / "copy")),
                         options=convert.ConvertOptions(max_host_bytes=128 << 10, **chunking))
    stored_chunks = sum(meta.num_chunks for _, meta in manifest.arrays())
    assert stored_chunks > len(manifest.arrays())
    assert chunk_reads() - before - reading_the_manifest == stored_chunks
    copied = xtc.restore(tmp_path / "copy")
    copied = copied if kind == "ours" else dict(tree.flatten(copied))
    assert sorted(copied) == sorted(expected) and all(same(copied[k], v) for k, v in expected.items())


def test_chunks_that_do_not_line_up_with_the_stored_ones_are_refused_up_front(tmp_path):
    write_hf_dir(str(tmp_path / "hf"))
    source = storage.location(str(tmp_path / "source"))
    convert.convert_item(storage.location(str(tmp_path / "hf")), source,
                         options=convert.ConvertOptions(chunk_shape=(16, 48)))
    # Chunks of 24 rows from chunks of 16: regions of 48 rows are read at once. A budget of 24,000 bytes holds
    # 6,000 in flight: stored chunks (16 x 48 float32: 3,072 bytes) and new ones (4,608) fit, 48 x 48 (9,216) not.
    with pytest.raises(UsageError, match=r"q_proj\.weight: copying its stored chunks of \[16, 48\] into chunks of "
                                         r"\[24, 48\] reads regions of \[48, 48\] at once .* which take 9216 bytes"):
        convert.convert_item(source, storage.location(str(tmp_path / "refused")),
                             options=convert.ConvertOptions(max_host_bytes=24_000, chunk_shape=(24, 48)))
    assert not (tmp_path / "refused").exists()
    convert.convert_item(source, storage.location(str(tmp_path / "fits")),
                         options=convert.ConvertOptions(max_host_bytes=64 << 10, chunk_shape=(24, 48)))
    assert xtc.metadata(tmp_path / "fits")["model.embed_tokens.weight"].chunk_shape == (24, 48)
    assert torch.equal(xtc.restore(tmp_path / "fits")["lm_head.weight"], xtc.restore(source.path)["lm_head.weight"])


def test_bad_input_fails_clearly_and_loses_nothing(tmp_path, capsys):
    write_hf_dir(str(tmp_path / "hf"))
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    assert cli.main(["convert", str(tmp_path / "hf"), str(existing)]) == cli.EXIT_USAGE
    assert "already holds files" in capsys.readouterr().err and (existing / "keep.txt").read_text() == "mine"
    with pytest.raises(CheckpointExistsError):
        convert.convert_item(storage.location(str(tmp_path / "hf")), storage.location(str(existing)))
    # A truncated shard: the error names the file and the key, and no destination appears.
    shard = tmp_path / "hf" / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    assert cli.main(["convert", str(tmp_path / "hf"), str(tmp_path / "out")]) == cli.EXIT_DATA
    err = capsys.readouterr().err
    assert "model-00002-of-00002.safetensors" in err and not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as exit_:
        cli.main(["convert", str(tmp_path / "hf"), str(tmp_path / "out"), "--chunk-shape", "0,4"])
    assert exit_.value.code == cli.EXIT_USAGE and "invalid shape '0,4'" in capsys.readouterr().err
