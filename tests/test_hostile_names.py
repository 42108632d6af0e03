"""Every name read from a file is input: each kind of file whose strings become paths or item names, given hostile
names (leaving the directory, absolute, a drive, NUL, backslash, over-long), is refused with a one-line library
error naming the file and the name (`layout.relative_path`, the one validator), and nothing outside the checkpoint
is read, created or changed. A peer copy whose marker names such a file is not a copy (the resume falls back as
for a damaged one); a torch_xla root's directory that merely looks numeric is not a step."""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hf_files import write_hf_dir

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import storage
from xla_tensorstore_ckpt.arrays import ocdbt
from xla_tensorstore_ckpt.checkpoint_manager import foreign_runs, peer_copies
from xla_tensorstore_ckpt.core import layout

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
NAMES = {"parent": "../outside", "deep-parent": "a/../../outside", "absolute": "/tmp/outside", "drive": "C:/outside",
         "backslash": "..\\outside", "nul": "out\x00side", "long": "x" * 5000, "empty": ""}


def _edit(path: str, edit) -> None:
    doc = json.load(open(path))
    edit(doc)
    json.dump(doc, open(path, "w"))


def _index(case: str, name: str) -> str:
    write_hf_dir(case)
    _edit(os.path.join(case, "model.safetensors.index.json"),
          lambda d: d["weight_map"].update({"lm_head.weight": name}))
    return os.path.join(case, "model.safetensors.index.json")


def _orbax_key(case: str, name: str) -> str:
    xtc.save(case, {"w": torch.ones(2, 3)}, options=xtc.SaveOptions(use_ocdbt=False))

    def edit(doc):
        del doc["xla_tensorstore_ckpt"]  # read as Orbax's: its keys name the arrays' directories
        doc["tree_metadata"][str(("w",))]["key_metadata"][0]["key"] = name
    _edit(os.path.join(case, "_METADATA"), edit)
    return os.path.join(case, "_METADATA")


def _array_path(case: str, name: str) -> str:
    shutil.copytree(os.path.join(GOLDEN, "v2-unchecked", "1", "model"), case)
    _edit(os.path.join(case, "_METADATA"),
          lambda d: d["xla_tensorstore_ckpt"]["tree"]["dict"][0][1]["array"].update(path=name))
    return os.path.join(case, "_METADATA")


def _step_items(case: str, name: str) -> str:
    shutil.copytree(os.path.join(GOLDEN, "v2-unchecked", "1"), case)
    _edit(os.path.join(case, "_CHECKPOINT_METADATA"),
          lambda d: d["custom_metadata"]["xla_tensorstore_ckpt"]["items"].append(name))
    return os.path.join(case, "_CHECKPOINT_METADATA")


def _dcp_file(case: str, name: str) -> str:
    dcp.save({"w": torch.arange(6.0)}, checkpoint_id=case, no_dist=True)
    path = os.path.join(case, ".metadata")
    with open(path, "rb") as f:
        meta = pickle.load(f)  # noqa: S301 - the test's own file: trusted
    for index, info in list(meta.storage_data.items()):
        meta.storage_data[index] = type(info)(name, info.offset, info.length)
    with open(path, "wb") as f:
        pickle.dump(meta, f)
    return path


def _read_item(case: str) -> None:
    xtc.metadata(case)


def _read_step(case: str) -> None:
    from xla_tensorstore_ckpt import formats
    formats.read_step(storage.location(case), 1)


# kind: (make the hostile file in the case directory, read it)
KINDS = {
    "safetensors-index": (_index, _read_item),
    "orbax-_METADATA-key": (_orbax_key, _read_item),
    "our-array-path": (_array_path, _read_item),
    "step-item-list": (_step_items, _read_step),
    "dcp-relative_path": (_dcp_file, _read_item),
}


def _snapshot(root) -> dict[str, bytes | None]:
    return {os.path.join(r, n): open(os.path.join(r, n), "rb").read() if n in files else None
            for r, dirs, files in os.walk(root) for n in dirs + files}


@pytest.mark.parametrize("name", list(NAMES.values()), ids=list(NAMES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_hostile_names_are_refused_in_every_file_kind(tmp_path, kind, name):
    make, read = KINDS[kind]
    (tmp_path / "outside").write_text("not the checkpoint's")
    case = str(tmp_path / "sub" / "case")
    os.makedirs(os.path.dirname(case))
    where = make(case, name)
    before = _snapshot(tmp_path)
    with pytest.raises(xtc.CorruptCheckpointError) as err:
        read(case)
    message = str(err.value)
    assert "\n" not in message and where in message and repr(name[:200]) in message, message
    assert _snapshot(tmp_path) == before  # nothing read into place, created or changed, outside or inside


@pytest.mark.parametrize("name", list(NAMES.values()), ids=list(NAMES))
def test_hostile_ocdbt_data_file_references_are_refused(tmp_path, name):
    """An OCDBT B-tree's value reference (compressed on disk: decoded here as `ocdbt.dump` gives it)."""
    with pytest.raises(xtc.CorruptCheckpointError, match="data file"):
        ocdbt._indirect(storage.location(tmp_path), f"value::{name}:0:16")


@pytest.mark.parametrize("name", list(NAMES.values()), ids=list(NAMES))
def test_a_peer_copy_naming_a_file_outside_it_is_no_copy(tmp_path, caplog, name):
    """A copy marker whose file (or shared item) lies outside the copy: the copy is ignored, with a warning naming
    the marker and the name, so the resume fetches from another peer or falls back to another tier."""
    root = tmp_path / "local"
    good, bad = peer_copies.copy_dir(str(root), 1, "3"), peer_copies.copy_dir(str(root), 1, "4")
    for directory, step, files in ((good, 3, [["model/_METADATA", 2, 0]]), (bad, 4, [[name, 2, 0]])):
        os.makedirs(directory)
        with open(os.path.join(directory, peer_copies.COPY_MARKER), "w") as f:
            json.dump({"writer": 1, "step": step, "files": files, "shared": []}, f)
    shared = peer_copies.copy_dir(str(root), 1, "5")
    os.makedirs(shared)
    with open(os.path.join(shared, peer_copies.COPY_MARKER), "w") as f:
        json.dump({"writer": 1, "step": 5, "files": [], "shared": [[name, 0]]}, f)
    os.makedirs(os.path.join(peer_copies.copies_root(str(root)), "²"))  # a look-alike writer: passed by
    with caplog.at_level(logging.WARNING, logger="xla_tensorstore_ckpt"):
        held = peer_copies.held_copies(str(root), lambda n: int(n) if n.isascii() and n.isdigit() else None)
    assert sorted(held) == [(1, 3)]
    warned = [r.getMessage() for r in caplog.records]
    for directory in (bad, shared):
        assert any(directory in w and repr(name[:200]) in w for w in warned), warned


def test_a_torch_xla_root_passes_by_look_alike_step_names(tmp_path):
    """Step directories of a torch_xla manager root are ASCII digits: ``²`` is a digit to `str.isdigit` (and
    `int` refused it with a ValueError that escaped)."""
    for step in ("2", "²"):
        dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / step), no_dist=True)
    steps = foreign_runs.torch_xla_steps(storage.location(tmp_path))
    assert [s.name for s in steps] == ["2"]


def test_the_one_validator():
    """What `layout.relative_path` accepts: relative paths that stay inside; one name with `single`."""
    for good in ("a", "a/b", "model.safetensors", "%2E%2E", "C:x", "a:b", "日本語/x", "x" * 1024):
        assert layout.relative_path(good, where="f") == good
    for bad in NAMES.values():
        assert not layout.is_safe_relative_path(bad)
    for bad in ("C:", "a/", "./a", "a/./b", "a//b", "/", "x" * 1025, "/".join(["x"] * 2100), 3, None):
        assert not layout.is_safe_relative_path(bad)
    assert not layout.is_safe_relative_path("a/b", single=True) and layout.is_safe_relative_path("a", single=True)
    with pytest.raises(xtc.CorruptCheckpointError, match=r"^f: file '\.\./x', which leaves its directory"):
        layout.relative_path("../x", where="f", what="file")
