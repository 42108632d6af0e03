"""Faults and hostile input: storage failures, damaged files, concurrent managers, hostile checkpoints. Nothing
committed is ever lost, errors name the array, chunk and step, `verify` reports damage, and no input runs code or
escapes the root. (Crashes at 33 points of a save: test_manager_crash.py; a long soak: scripts/soak.py.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import helpers
import pytest
import torch
from fault_backends import fail_on, hooked
from helpers import assert_trees_equal

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import cli
from xla_tensorstore_ckpt.core import layout

PACKAGE = os.path.join(os.path.dirname(__file__), "..", "xla_tensorstore_ckpt")


def state_for(step):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(32, 16, generator=g), "v": torch.randn(8, generator=g).to(torch.bfloat16),
            "step": step}


def options(**kw):
    """The shared manager options (`helpers.options`) with arrays in plain directories, whose files the tests
    damage, and no RNG item."""
    kw.setdefault("save_options", xtc.SaveOptions(use_ocdbt=False))
    kw.setdefault("save_rng", False)
    return helpers.options(**kw)


@pytest.fixture
def root_with_two_steps(tmp_path):
    root = tmp_path / "root"
    with xtc.CheckpointManager(root, options()) as mgr:
        mgr.save(1, model=state_for(1))
        mgr.save(2, model=state_for(2))
    return root


def assert_intact(root, steps):
    with xtc.CheckpointManager(root, options()) as mgr:
        assert mgr.all_steps() == steps
    for step in steps:
        assert_trees_equal(xtc.restore(root / str(step) / "model"), state_for(step))


# ----------------------------------------------------------------------------------------------- storage


def put_a_file_in_the_way(array: str, blocked: str):
    """A hook that, when the array `array` is opened for writing, puts a regular file at `blocked` (relative to
    the array directory) where a directory must go: every write below it then fails with a real OS error."""
    def hook(operation, path, count):
        target = os.path.normpath(os.path.join(path, blocked))
        if operation == "open_array" and path.endswith(array) and not os.path.exists(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "w") as f:
                f.write("in the way")
    return hook


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_unwritable_item_directory_fails_cleanly(root_with_two_steps, async_save):
    root = hooked(root_with_two_steps, put_a_file_in_the_way("model/w", ".."))  # the item directory
    mgr = xtc.CheckpointManager(root, options(async_save=async_save))
    with pytest.raises((xtc.StorageError, xtc.AsyncSaveError)) as err:
        mgr.save(3, model=state_for(3))
        mgr.wait_until_finished()
    message = str(err.value) + str(err.value.__cause__ or "")
    # written under a temporary name, renamed into place at the commit
    assert re.search(re.escape(str(root_with_two_steps)) + r"/3\.orbax-checkpoint-tmp-[0-9]+/model", message)
    assert mgr.all_steps() == [1, 2]
    mgr.close()
    assert_intact(root_with_two_steps, [1, 2])


def test_disk_full_during_sync_fails_cleanly(root_with_two_steps):
    full = fail_on("sync_files", xtc.StorageError("cannot sync: [Errno 28] No space left on device"))
    with xtc.CheckpointManager(hooked(root_with_two_steps, full), options()) as mgr:
        with pytest.raises(xtc.StorageError, match="No space left"):
            mgr.save(3, model=state_for(3))
        assert mgr.all_steps() == [1, 2]
    assert_intact(root_with_two_steps, [1, 2])


@pytest.mark.parametrize("use_ocdbt", [True, False], ids=["ocdbt", "directories"])
def test_a_failed_overwrite_of_an_item_keeps_the_old_one(tmp_path, use_ocdbt):
    """`xtc.save(..., overwrite=True)` writes the new item beside the old one and swaps it in once committed: a
    save that fails on the way leaves the old item whole, and nothing beside it."""
    old = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(2)}
    xtc.save(tmp_path / "item", old)
    full = fail_on("sync_files", xtc.StorageError("cannot sync: [Errno 28] No space left on device"))
    with pytest.raises(xtc.StorageError, match="No space left"):
        xtc.save(hooked(tmp_path / "item", full), {"w": torch.zeros(5)}, overwrite=True,
                 options=xtc.SaveOptions(use_ocdbt=use_ocdbt))
    restored = xtc.restore(tmp_path / "item")
    assert torch.equal(restored["w"], old["w"]) and torch.equal(restored["b"], old["b"])
    assert os.listdir(tmp_path) == ["item"]
    xtc.save(tmp_path / "item", {"w": torch.zeros(5)}, overwrite=True, options=xtc.SaveOptions(use_ocdbt=use_ocdbt))
    assert list(xtc.metadata(tmp_path / "item")) == ["w"] and os.listdir(tmp_path) == ["item"]


def test_chunk_write_error_names_the_array(root_with_two_steps):
    # The chunk directory of one array is a file: its chunk write fails inside tensorstore.
    with xtc.CheckpointManager(hooked(root_with_two_steps, put_a_file_in_the_way("model/w", "c")), options()) as mgr:
        with pytest.raises(xtc.StorageError) as err:
            mgr.save(3, model=state_for(3))
    assert re.search(r"/3\.orbax-checkpoint-tmp-[0-9]+/model/w", str(err.value))
    assert "cannot write region" in str(err.value)
    assert_intact(root_with_two_steps, [1, 2])


DAMAGE = {
    "flipped byte": lambda d: _flip(d / "w" / "c" / "0" / "0"),
    "truncated chunk": lambda d: _truncate(d / "w" / "c" / "0" / "0"),
    "missing chunk": lambda d: os.remove(d / "w" / "c" / "0" / "0"),
    "deleted zarr.json": lambda d: os.remove(d / "w" / "zarr.json"),
    "truncated zarr.json": lambda d: _truncate(d / "w" / "zarr.json"),
    "zarr.json of another shape": lambda d: _edit_json(d / "w" / "zarr.json", "shape", [64, 16]),
}


def _flip(path):
    data = bytearray(path.read_bytes())
    data[17] ^= 0x04
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[: max(1, len(path.read_bytes()) // 2)])


def _edit_json(path, key, value):
    doc = json.loads(path.read_text())
    doc[key] = value
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("damage", list(DAMAGE), ids=list(DAMAGE))
def test_damaged_files_give_clear_errors_and_verify_reports_them(root_with_two_steps, capsys, damage):
    root = root_with_two_steps
    DAMAGE[damage](root / "2" / "model")
    with xtc.CheckpointManager(root, options()) as mgr:
        target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state_for(2).items()}
        with pytest.raises(xtc.CorruptCheckpointError) as err:
            mgr.restore(2, model=target)
        assert str(root / "2" / "model" / "w") in str(err.value)
        assert mgr.restore(1, model=target) == 1  # the other step is intact
    assert cli.main(["verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert "step 2: model/w" in out and "FAILED" in out and "step 1" not in out


# ------------------------------------------------------------------------------------------- concurrency


def test_a_second_manager_on_the_same_root_cannot_save(tmp_path):
    script = f"""
import sys, time, torch, xla_tensorstore_ckpt as xtc
mgr = xtc.CheckpointManager({str(tmp_path)!r}, xtc.CheckpointManagerOptions(save_interval_steps=1, async_save=False))
mgr.save(1, model={{"w": torch.ones(4)}})
print("saved", flush=True)
time.sleep(60)
"""
    env = dict(os.environ)
    env.pop("PJRT_DEVICE", None)
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert owner.stdout.readline().strip() == "saved"
        with xtc.CheckpointManager(tmp_path, options()) as mgr:
            assert mgr.all_steps() == [1]  # reading is fine
            with pytest.raises(xtc.CheckpointError, match=f"owned by another checkpoint manager.*{owner.pid}"):
                mgr.save(2, model={"w": torch.zeros(4)})
            model = {"w": torch.zeros(4)}
            assert mgr.restore("latest", model=model) == 1 and torch.equal(model["w"], torch.ones(4))
    finally:
        owner.kill()
        owner.wait()
    with xtc.CheckpointManager(tmp_path, options()) as mgr:  # the owner is gone: its lock is stale
        assert mgr.save(2, model={"w": torch.zeros(4)})


def test_a_lock_naming_a_reused_pid_is_stale(tmp_path):
    # As after a container restart: the lock names this host and a live pid, but a process that started at
    # another time. With the start of the process that really has that pid, it is live.
    import socket
    import time

    from xla_tensorstore_ckpt.core.processes import process_start

    holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": "another-boot:1", "token": "ab12",
              "heartbeat": time.time()}
    (tmp_path / layout.MANAGER_LOCK).write_text(json.dumps(holder))
    with xtc.CheckpointManager(tmp_path, options()) as mgr:
        assert mgr.save(1, model={"w": torch.ones(4)})
    holder["started"] = process_start(os.getpid())
    (tmp_path / layout.MANAGER_LOCK).write_text(json.dumps(holder))
    with xtc.CheckpointManager(tmp_path, options()) as mgr:
        with pytest.raises(xtc.CheckpointError, match="owned by another checkpoint manager"):
            mgr.save(2, model={"w": torch.ones(4)})


def test_a_lock_write_killed_midway_leaves_nothing_after_the_next_open(tmp_path):
    # A writer killed between writing the lock's temporary file and renaming it into place: the next manager of
    # the root removes that file (its writer is dead), and keeps the temporary file of a live writer.
    from xla_tensorstore_ckpt.core.processes import host_tag

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    stale = tmp_path / f".{layout.MANAGER_LOCK}.{host_tag()}-{int(dead.stdout)}.a1b2c3d4.tmp"
    live = tmp_path / f".{layout.MANAGER_LOCK}.{host_tag()}-{os.getpid()}.e5f6g7h8.tmp"
    stale.write_text("{}")
    live.write_text("{}")
    with xtc.CheckpointManager(tmp_path, options()) as mgr:
        assert mgr.save(1, model={"w": torch.ones(4)})
    assert not stale.exists() and live.exists()
    assert sorted(os.listdir(tmp_path)) == sorted(["1", live.name])

def test_restoring_while_another_process_saves(tmp_path):
    # The saver keeps saving (async, retention on) until the reader has restored two steps while it runs: the
    # overlap is guaranteed by the protocol, not by how fast either process happens to be.
    script = f"""
import sys, torch, xla_tensorstore_ckpt as xtc
opts = xtc.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=3, save_rng=False,
                                    on_commit=lambda step: print(step, flush=True))
with xtc.CheckpointManager({str(tmp_path)!r}, opts) as mgr:
    for step in range(1, 41):
        mgr.save(step, model={{"w": torch.full((256, 256), float(step))}}, extra={{"step": step}})
        if step == 30:
            sys.stdin.readline()  # the reader says when it has restored twice
"""
    env = dict(os.environ)
    env.pop("PJRT_DEVICE", None)
    saver = subprocess.Popen([sys.executable, "-c", script], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    restored: set[int] = set()
    released = False
    try:
        for line in saver.stdout:  # one line per commit; steps 28 and 29 outlive the saver's pause
            step = int(line)
            with xtc.CheckpointManager(tmp_path, options()) as reader:
                if step in reader.all_steps():
                    model, extra = {"w": torch.zeros(256, 256)}, {"step": 0}
                    try:
                        reader.restore(step, model=model, extra=extra)
                        assert extra["step"] == step
                        assert torch.equal(model["w"], torch.full((256, 256), float(step)))
                        restored.add(step)
                    except (xtc.CheckpointNotFoundError, xtc.CorruptCheckpointError, xtc.StorageError):
                        pass  # retention deleted it meanwhile: it is never read half-deleted as valid
            if len(restored) >= 2 and not released:
                saver.stdin.write("go\n")
                saver.stdin.flush()
                released = True
    finally:
        if not released:
            saver.kill()
        saver.wait(timeout=600)
    assert saver.returncode == 0 and len(restored) >= 2


# --------------------------------------------------------------------------------------- hostile inputs


def _manifest(item):
    """This library's part of an item's _METADATA (the rest is Orbax's)."""
    return json.loads((item / layout.ITEM_METADATA).read_text())["xla_tensorstore_ckpt"]


def _write_manifest(item, ours):
    """Write `ours` back without its checksum, as a hostile writer would (a file without one has nothing to
    verify), so that the checks behind the checksum are what is tested."""
    doc = json.loads((item / layout.ITEM_METADATA).read_text())
    ours.pop("crc32c", None)
    doc["xla_tensorstore_ckpt"] = ours
    (item / layout.ITEM_METADATA).write_text(json.dumps(doc))


def _array_node(doc):
    return doc["tree"]["dict"][0][1]["array"]


HOSTILE = {
    "path with ..": lambda d: _array_node(d).update(path="../../outside"),
    "path with a slash": lambda d: _array_node(d).update(path="a/w"),
    "absolute path": lambda d: _array_node(d).update(path="/etc/passwd"),
    "path with NUL": lambda d: _array_node(d).update(path="w\x00"),
    "path with backslash": lambda d: _array_node(d).update(path="..\\w"),
    "huge number": lambda d: _array_node(d).update(shape=[10**30, 16]),
    "negative dimension": lambda d: _array_node(d).update(shape=[-1, 16]),
    "bool as number": lambda d: _array_node(d).update(shape=[True, 16]),
    "string shape": lambda d: _array_node(d).update(shape="32,16"),
    "absurd size": lambda d: _array_node(d).update(shape=[2**40, 2**20], chunk_shape=[1, 1]),
    "chunk larger than the array": lambda d: _array_node(d).update(chunk_shape=[2**40, 16]),
    "unknown dtype": lambda d: _array_node(d).update(dtype="object"),
    "rank mismatch": lambda d: _array_node(d).update(chunk_shape=[32]),
    "wrong node type": lambda d: d["tree"]["dict"][0].__setitem__(1, {"pickle": "cos\nsystem\n"}),
    "tree is a list of junk": lambda d: d.__setitem__("tree", [1, 2, 3]),
    "format version as text": lambda d: d.__setitem__("format_version", "1"),
    "duplicate array paths": lambda d: d["tree"]["dict"].append(["w2", {"array": dict(_array_node(d))}]),
}


@pytest.mark.parametrize("case", list(HOSTILE), ids=list(HOSTILE))
def test_hostile_manifest_is_rejected_before_reading_data(tmp_path, case):
    item = tmp_path / "item"
    xtc.save(item, {"w": torch.randn(32, 16)}, options=xtc.SaveOptions(use_ocdbt=False))
    doc = _manifest(item)
    HOSTILE[case](doc)
    _write_manifest(item, doc)
    with pytest.raises(xtc.CorruptCheckpointError) as err:
        xtc.restore(item)
    assert str(item) in str(err.value)
    assert sorted(os.listdir(tmp_path)) == ["item"]


def test_deep_nesting_and_giant_json_are_rejected(tmp_path):
    item = tmp_path / "item"
    xtc.save(item, {"w": torch.ones(2)})
    (item / layout.ITEM_METADATA).write_text('{"format_version": 1, "tree": ' + '{"list": [' * 5000 + "]}" * 5000
                                             + "}")
    with pytest.raises(xtc.CorruptCheckpointError):
        xtc.restore(item)
    (item / layout.ITEM_METADATA).write_text('{"format_version": 1, "tree": {"value": ' + "9" * 100000 + "}}")
    with pytest.raises(xtc.CorruptCheckpointError):
        xtc.restore(item)


def test_hostile_zarr_json_chunk_shape_is_rejected(tmp_path):
    item = tmp_path / "item"
    xtc.save(item, {"w": torch.randn(32, 16)}, options=xtc.SaveOptions(use_ocdbt=False))
    original = (item / "w" / "zarr.json").read_text()
    _edit_json(item / "w" / "zarr.json", "chunk_grid", {"name": "regular",
                                                         "configuration": {"chunk_shape": [2**31 - 1, 2**31 - 1]}})
    with pytest.raises(xtc.CorruptCheckpointError, match="does not fit the shape"):  # refused before tensorstore
        xtc.restore(item)
    (item / "w" / "zarr.json").write_text(original)
    _edit_json(item / "w" / "zarr.json", "chunk_grid", {"name": "regular", "configuration": {"chunk_shape": [4, 4]}})
    with pytest.raises(xtc.CorruptCheckpointError, match="in chunks"):  # disagrees with the manifest
        xtc.restore(item)


def test_hostile_keys_never_escape_the_root(tmp_path):
    keys = ["..", "../../etc", "/abs", "a/../../b", "\x00", "é" * 300, "C:\\windows", "~", "$HOME", ""]
    with xtc.CheckpointManager(tmp_path / "root", options()) as mgr:
        mgr.save(1, model={k: torch.ones(1) * i for i, k in enumerate(keys)})
    written = {os.path.realpath(os.path.join(r, n)) for r, _, files in os.walk(tmp_path) for n in files}
    assert all(p.startswith(os.path.realpath(tmp_path / "root" / "1")) or p.endswith(layout.MANAGER_LOCK)
               for p in written)
    restored = xtc.restore(tmp_path / "root" / "1" / "model")
    assert list(restored) == keys


def test_no_pickle_eval_or_exec_in_the_package():
    offenders = []
    # every module, in every folder of the package
    names = sorted(os.path.relpath(os.path.join(d, n), PACKAGE) for d, _, files in os.walk(PACKAGE) for n in files)
    for name in names:
        if not name.endswith(".py"):
            continue
        source = open(os.path.join(PACKAGE, name)).read()
        for pattern in (r"^\s*(import|from)\s+(pickle|cPickle|dill|marshal|shelve)\b", r"\beval\(", r"\bexec\(",
                        r"torch\.load\((?![^)]*weights_only=True)", r"np\.load\([^)]*allow_pickle=True"):
            offenders += [f"{name}: {m.group(0)}" for m in re.finditer(pattern, source, re.M)]
    # The one exception: the restricted unpicklers that read the pickles other tools write (DCP's metadata,
    # torch.save blobs) and run nothing (tests/test_dcp_import.py); our format holds no pickle.
    assert offenders == ["core/torch_pickle.py: import pickle"]


def test_soak_short(tmp_path):
    """The soak script, shortened: cycles of saves and restores with retention and async saves, random crashes."""
    script = os.path.join(os.path.dirname(__file__), "scripts", "soak.py")
    env = dict(os.environ)
    env.pop("PJRT_DEVICE", None)
    proc = subprocess.run([sys.executable, script, str(tmp_path / "soak"), "--cycles", "40", "--crash-every", "10",
                           "--seed", "3"], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["crashes"] >= 2 and summary["kept_steps_verified"] == summary["expected_steps"]
    shutil.rmtree(tmp_path / "soak")
