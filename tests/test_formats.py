"""The format registry (formats/): every document is claimed by exactly one format, a newer version of ours is a
`FormatVersionError`, `SaveOptions.format` names a format this library writes, and a new format plugs in as one
module in the registry without touching its callers."""

from __future__ import annotations

import json
import os
import types

import pytest
import torch

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import formats, storage
from xla_tensorstore_ckpt.core import layout
from xla_tensorstore_ckpt.core.bounds import load_json
from xla_tensorstore_ckpt.core.records import ArrayStore, ItemManifest
from xla_tensorstore_ckpt.formats import v2
from xla_tensorstore_ckpt.tools import inspection

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


def _claimants(item_dir: str) -> list[str]:
    loc = storage.location(item_dir)
    data = loc.read(layout.ITEM_METADATA)
    doc = None if data is None else load_json(data, where=item_dir)
    return [f.NAME for f in formats.ITEM_FORMATS if f.claims_item(loc, doc)]


def _step_claimants(step_dir: str) -> list[str]:
    doc = json.loads(open(os.path.join(step_dir, layout.CHECKPOINT_METADATA)).read())
    return [f.NAME for f in formats.STEP_FORMATS if f.claims_step(doc)]


def test_every_document_is_claimed_by_exactly_one_format(tmp_path):
    root = tmp_path / "run"
    with xtc.CheckpointManager(root) as manager:
        manager.save(1, model=torch.nn.Linear(2, 2), force=True)
    assert _claimants(str(root / "1" / "model")) == ["v2"]
    assert _step_claimants(str(root / "1")) == ["v2"]
    assert _claimants(os.path.join(GOLDEN, "v1", "1", "model")) == ["v1"]
    assert _step_claimants(os.path.join(GOLDEN, "v1", "1")) == ["v1"]
    assert _claimants(os.path.join(GOLDEN, "orbax-0.11", "item")) == ["orbax"]
    assert _step_claimants(os.path.join(GOLDEN, "orbax-0.11", "root", "1")) == ["orbax"]
    # Without our object, our item is an Orbax document, and read as one (by Orbax's rules).
    item = root / "1" / "model"
    doc = json.loads((item / layout.ITEM_METADATA).read_text())
    doc.pop(v2.KEY)
    (item / layout.ITEM_METADATA).write_text(json.dumps(doc))
    assert _claimants(str(item)) == ["orbax"]
    assert formats.read_item(storage.location(str(item))).format == "orbax"


@pytest.mark.parametrize("step", [False, True], ids=["item", "step"])
def test_a_newer_version_of_ours_is_a_format_version_error_not_an_orbax_document(tmp_path, step):
    root = tmp_path / "run"
    with xtc.CheckpointManager(root) as manager:
        manager.save(1, model=torch.nn.Linear(2, 2), force=True)
    path = root / "1" / (layout.CHECKPOINT_METADATA if step else f"model/{layout.ITEM_METADATA}")
    doc = json.loads(path.read_text())
    (doc["custom_metadata"] if step else doc)[v2.KEY]["format_version"] = 3
    path.write_text(json.dumps(doc))
    with pytest.raises(xtc.FormatVersionError, match="version 3"):
        if step:
            formats.read_step(storage.location(str(root / "1")))
        else:
            formats.read_item(storage.location(str(root / "1" / "model")))


@pytest.mark.parametrize("name", ["v1", "orbax", "safetensors", "v3"])
def test_save_options_name_a_format_this_library_writes(name):
    with pytest.raises(ValueError, match="writes v2"):
        xtc.SaveOptions(format=name)
    assert xtc.SaveOptions().format == "v2"


def test_a_new_format_plugs_in_through_the_registry(tmp_path, request):
    """A toy format (its item one JSON file, ``toy.json``) added as one entry of the registry is read by restore,
    metadata and the tools, none of which know of it."""
    def claims_item(loc, doc):
        return doc is None and loc.read(TOY_FILE) is not None

    def decode_item(loc, _doc, *, where):
        values = json.loads(loc.read(TOY_FILE))
        return ItemManifest(values, "toy", ArrayStore(checksums=False))

    TOY_FILE = "toy.json"
    toy = types.SimpleNamespace(NAME="toy", DESCRIPTION="a toy format", FILE_SUFFIX=None, claims_item=claims_item,
                                decode_item=decode_item,
                                array_names=lambda paths: ["/".join(map(str, p)) for p in paths])
    formats.register(toy)
    request.addfinalizer(lambda: formats.unregister(toy.NAME))
    item = tmp_path / "toy_item"
    item.mkdir()
    (item / TOY_FILE).write_text(json.dumps({"step": 7, "nested": {"lr": 0.5}}))
    assert xtc.restore(item) == {"step": 7, "nested": {"lr": 0.5}}
    assert xtc.metadata(item) == {"step": 7, "nested": {"lr": 0.5}}
    rows = inspection.tree_rows(inspection.open_checkpoint(str(item)))
    assert [(r.key, r.value) for r in rows] == [("step", 7), ("nested/lr", 0.5)]
    assert "a toy format" in xtc.plan_restore(item).source
