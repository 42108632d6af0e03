"""Nothing a user points the tools at is lost: converts and exports never write into their source, never delete an
existing destination before the new output is complete, and leave it untouched when they fail or are killed; a
step directory that is a symbolic link is never deleted or renamed through."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from conftest import GCS_BUCKET
from hf_files import write_hf_dir
from safetensors.torch import load_file

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import cli, storage
from xla_tensorstore_ckpt.core.errors import CheckpointExistsError, UsageError
from xla_tensorstore_ckpt.tools import convert


def tree_digest(path) -> dict[str, str]:
    """Every file below `path` (or `path` itself) by relative path, with a digest of its content."""
    path = str(path)
    if os.path.isfile(path):
        return {"": hashlib.sha1(open(path, "rb").read()).hexdigest()}
    return {os.path.relpath(os.path.join(root, f), path): hashlib.sha1(open(os.path.join(root, f), "rb").read())
            .hexdigest() for root, _, files in os.walk(path) for f in files}


@pytest.fixture
def item(tmp_path):
    xtc.save(tmp_path / "item", {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4), "n": 3})
    return tmp_path / "item"


def run(*argv) -> tuple[int, str]:
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = cli.main([str(a) for a in argv])
    return status, err.getvalue()


# --------------------------------------------------------------------------------------------- convert


def test_convert_refuses_a_destination_that_is_in_or_around_its_source(tmp_path, item):
    before = tree_digest(item)
    (tmp_path / "alias").symlink_to(item)
    root = tmp_path / "root"
    assert run("convert", item, root / "5", "--to", "step")[0] == 0
    step_before = tree_digest(root / "5")
    for source, destination, extra in ((item, item, ()), (item, item / "sub", ()), (item, tmp_path, ()),
                                       (item, tmp_path / "alias", ()), (tmp_path / "alias", item / "x", ()),
                                       (root / "5" / "model", root / "5", ("--to", "step")),
                                       (root / "5", root / "5" / "model", ())):
        status, err = run("convert", source, destination, "--overwrite", *extra)
        assert status == cli.EXIT_USAGE and "is, holds or lies inside the source" in err, (source, destination)
        assert len(err.strip().splitlines()) == 1
    assert tree_digest(item) == before and tree_digest(root / "5") == step_before
    assert xtc.CheckpointManager(root).all_steps() == [5]


@pytest.mark.parametrize("backend", ["memory", "gcs"])
def test_the_source_rule_holds_on_object_stores(request, backend, item):
    base = "memory://safe" if backend == "memory" else f"gs://{GCS_BUCKET}/safe"
    if backend == "gcs":
        request.getfixturevalue("gcs_emulator_server")
    source = storage.location(f"{base}/item")
    convert.convert_item(storage.location(str(item)), source)
    for destination in (source, source.child("inner"), storage.location(base)):
        with pytest.raises(UsageError, match="lies inside the source"):
            convert.convert_item(source, destination, overwrite=True)
    assert torch.equal(xtc.restore(str(source))["w"], torch.arange(12.0).reshape(3, 4))


def _flip_chunk_byte(item_dir) -> None:
    """Damage one stored chunk of an item saved with use_ocdbt=False (its array "w")."""
    chunk = item_dir / "w" / "c" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0xFF
    chunk.write_bytes(bytes(data))


@pytest.mark.parametrize("to", ["item", "step"])
def test_a_failed_convert_leaves_the_old_destination_as_it_was(tmp_path, to):
    good, bad = tmp_path / "good", tmp_path / "bad"
    xtc.save(good, {"b": torch.ones(4), "w": torch.arange(12.0).reshape(3, 4)})
    xtc.save(bad, {"b": torch.zeros(4), "w": torch.ones(3, 4)}, options=xtc.SaveOptions(use_ocdbt=False))
    _flip_chunk_byte(bad)
    destination = tmp_path / "root" / "7" if to == "step" else tmp_path / "out"
    assert run("convert", good, destination, "--to", to)[0] == 0
    before = tree_digest(destination)
    status, err = run("convert", bad, destination, "--to", to, "--overwrite")
    assert status == cli.EXIT_DATA and ("digest mismatch" in err.lower() or "crc32c checksum" in err.lower()), err
    assert tree_digest(destination) == before
    assert not [n for n in os.listdir(destination.parent) if "tmp" in n]  # no temporary directory left behind


def test_a_killed_convert_leaves_the_old_destination_and_the_next_run_cleans_up(tmp_path, item):
    destination = tmp_path / "out"
    assert run("convert", item, destination)[0] == 0
    before = tree_digest(destination)
    # Killed (SIGKILL, no cleanup) after its first chunk is written into the new copy.
    script = ("import os, signal, sys\nfrom xla_tensorstore_ckpt import storage\n"
              "from xla_tensorstore_ckpt.tools import convert\n"
              "kill = lambda done, total: done and os.kill(os.getpid(), signal.SIGKILL)\n"
              "convert.convert_item(storage.location(sys.argv[1]), storage.location(sys.argv[2]), overwrite=True, "
              "progress=kill, options=convert.ConvertOptions(max_host_bytes=192))\n")
    proc = subprocess.run([sys.executable, "-c", script, str(item), str(destination)], capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert tree_digest(destination) == before
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith(".out.xtckpt-tmp-")]
    assert len(leftovers) == 1
    assert run("convert", item, destination, "--overwrite")[0] == 0
    assert sorted(os.listdir(tmp_path)) == ["item", "out"]
    assert torch.equal(xtc.restore(destination)["w"], torch.arange(12.0).reshape(3, 4))


def test_overwrite_replaces_an_item_and_a_step_only_once_the_new_one_is_complete(tmp_path, item):
    other = tmp_path / "other"
    xtc.save(other, {"w": torch.full((2, 2), 7.0)})
    out, root = tmp_path / "out", tmp_path / "root"
    for source in (item, other):
        assert run("convert", source, out, "--overwrite")[0] == 0
        assert run("convert", source, root / "3", "--to", "step", "--overwrite")[0] == 0
    assert torch.equal(xtc.restore(out)["w"], torch.full((2, 2), 7.0)) and "b" not in xtc.metadata(out)
    with xtc.CheckpointManager(root) as manager:
        assert manager.all_steps() == [3]
        assert torch.equal(manager.restore(3, extra=None, model={"w": torch.zeros(2, 2)}) and
                           xtc.restore(root / "3" / "model")["w"], torch.full((2, 2), 7.0))
    # A step written by convert carries Orbax's completion mark too (the commit protocol of every step).
    assert (root / "3" / "commit_success.txt").is_file() and (root / "3" / "model" / "commit_success.txt").is_file()
    assert run("convert", item, out)[0] == cli.EXIT_USAGE  # without --overwrite: refused, one line


def test_overwrite_on_an_object_store_swaps_marker_last(request, item):
    request.getfixturevalue("gcs_emulator_server")
    step = storage.location(f"gs://{GCS_BUCKET}/safe-swap/root/4")
    convert.convert_to_step(storage.location(str(item)), step)
    xtc.save(str(item) + "-2", {"w": torch.full((2, 2), 2.0)})
    convert.convert_to_step(storage.location(str(item) + "-2"), step, overwrite=True)
    assert torch.equal(xtc.restore(str(step.child("model")))["w"], torch.full((2, 2), 2.0))
    assert step.parent.list() == ["4"] and "b" not in xtc.metadata(str(step.child("model")))


# ---------------------------------------------------------------------------------------------- export


def test_export_never_writes_into_its_source(tmp_path):
    hf = tmp_path / "hf"
    write_hf_dir(str(hf))
    before = tree_digest(hf)
    status, err = run("convert", hf, hf, "--to", "safetensors")
    assert status == cli.EXIT_USAGE and "lies inside the source" in err
    torch_file = tmp_path / "state.pt"
    assert run("convert", hf, torch_file, "--to", "torch")[0] == 0
    pt_before = tree_digest(torch_file)
    status, err = run("convert", torch_file, torch_file, "--to", "torch", "--overwrite")
    assert status != 0 and len(err.strip().splitlines()) == 1
    assert tree_digest(hf) == before and tree_digest(torch_file) == pt_before


def test_export_refuses_an_existing_export_and_overwrite_leaves_exactly_the_new_one(tmp_path, item):
    hf, out = tmp_path / "hf", tmp_path / "out"
    write_hf_dir(str(hf))
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"someone else's file")
    (out / "config.json").write_text("{}")
    status, err = run("convert", hf, out, "--to", "safetensors")
    assert status == cli.EXIT_USAGE and "already holds an export" in err
    assert (out / "model.safetensors").read_bytes() == b"someone else's file"
    # Sharded export over it, then a single-file export over that: no stale shard or index remains.
    assert run("convert", hf, out, "--to", "safetensors", "--max-file-size", "20KB", "--overwrite")[0] == 0
    shards = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    assert len(shards) > 1 and "model.safetensors" not in shards
    assert run("convert", item, out, "--to", "safetensors", "--overwrite")[0] == 0
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert sorted(load_file(str(out / "model.safetensors"))) == ["b", "w"]
    assert sorted(k for k, _ in xtc.metadata(out).items()) == ["b", "w"]


def test_a_failed_export_leaves_no_file_behind(tmp_path):
    bad = tmp_path / "bad"
    xtc.save(bad, {"b": torch.zeros(4), "w": torch.ones(3, 4)}, options=xtc.SaveOptions(use_ocdbt=False))
    _flip_chunk_byte(bad)
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"the previous export")
    status, _ = run("convert", bad, out, "--to", "safetensors", "--overwrite")
    assert status == cli.EXIT_DATA
    assert os.listdir(out) == ["model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == b"the previous export"
    status, _ = run("convert", bad, tmp_path / "new-dir", "--to", "safetensors")
    assert status == cli.EXIT_DATA and not (tmp_path / "new-dir").exists()
    status, _ = run("convert", bad, tmp_path / "x.pt", "--to", "torch")
    assert status == cli.EXIT_DATA and sorted(os.listdir(tmp_path)) == ["bad", "out"]


def test_torch_export_into_a_directory_or_elsewhere_is_one_line(tmp_path, item):
    (tmp_path / "dir").mkdir()
    for destination, message in ((tmp_path / "dir", "is a directory"), ("gs://bucket/x.pt", "not on the local")):
        status, err = run("convert", item, destination, "--to", "torch")
        assert status == cli.EXIT_USAGE and message in err and len(err.strip().splitlines()) == 1
    assert run("convert", item, tmp_path / "x.pt", "--to", "torch")[0] == 0
    assert run("convert", item, tmp_path / "x.pt", "--to", "torch")[0] == cli.EXIT_USAGE
    assert run("export", item, tmp_path / "x.pt", "--format", "torch", "--overwrite")[0] == 0
    assert set(torch.load(tmp_path / "x.pt", weights_only=True)) == {"w", "b"}


def test_export_functions_refuse_before_writing(tmp_path, item):
    from xla_tensorstore_ckpt.tools import export, inspection

    checkpoint = inspection.open_checkpoint(str(item))
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../item"}}))
    with pytest.raises(CheckpointExistsError):
        export.export_safetensors(checkpoint, ("",), str(tmp_path / "e"), max_file_bytes=1 << 30)
    export.export_safetensors(checkpoint, ("",), str(tmp_path / "e"), max_file_bytes=1 << 30, overwrite=True)
    assert sorted(os.listdir(tmp_path / "e")) == ["model.safetensors"] and (item / "_METADATA").is_file()


# ---------------------------------------------------------------------------------------- symlinked steps


def _manager(root, **kw):
    kw.setdefault("save_interval_steps", 1)
    kw.setdefault("async_save", False)
    return xtc.CheckpointManager(root, xtc.CheckpointManagerOptions(**kw))


def test_a_symlinked_step_is_listed_restored_and_only_unlinked(tmp_path):
    other, root = tmp_path / "other-run", tmp_path / "run"
    with _manager(other) as manager:
        manager.save(1, extra={"x": torch.ones(3)})
    other_before = tree_digest(other)
    root.mkdir()
    (root / "1").symlink_to(other / "1")
    # A partial step linked in (another run's save under way): left alone, with what it points to.
    (tmp_path / "elsewhere-partial").mkdir()
    (tmp_path / "elsewhere-partial" / "data").write_text("x")
    (root / "0").symlink_to(tmp_path / "elsewhere-partial")
    status, _ = run("steps", root)
    assert status == 0 and run("verify", root)[0] == 0
    with _manager(root, max_to_keep=1) as manager:
        assert manager.all_steps() == [1]
        extra = {"x": torch.zeros(3)}
        manager.restore("latest", extra=extra)
        assert torch.equal(extra["x"], torch.ones(3))
        manager.save(2, extra={"x": torch.full((3,), 2.0)})  # retention lets step 1 go: only the link goes
        assert manager.all_steps() == [2]
    assert not (root / "1").exists() and (root / "0").is_symlink()
    assert (tmp_path / "elsewhere-partial" / "data").read_text() == "x"
    assert tree_digest(other) == other_before
    assert not [n for n in os.listdir(other) if "tmp" in n] and not [n for n in os.listdir(root) if "tmp" in n]
    with _manager(other) as manager:  # the other run still has its step, committed
        assert manager.all_steps() == [1]


def test_saving_over_a_symlinked_step_replaces_the_link_not_its_target(tmp_path):
    other, root = tmp_path / "other-run", tmp_path / "run"
    with _manager(other) as manager:
        manager.save(1, extra={"x": torch.ones(3)})
    other_before = tree_digest(other)
    root.mkdir()
    (root / "1").symlink_to(other / "1")
    with _manager(root) as manager:
        manager.save(1, extra={"x": torch.zeros(3)}, force=True)
    assert not (root / "1").is_symlink() and tree_digest(other) == other_before
