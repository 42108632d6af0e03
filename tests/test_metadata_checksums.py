"""Checksums of the JSON metadata files (formats/checksums.py): a flipped digit in an item's ``_METADATA`` (a data
loader's position, an `extra` value), in its ``_strings.json`` or in a step's marker (metrics, items) is a
`CorruptCheckpointError` naming the file, never a wrong value; the checksum is over the bytes as written."""

from __future__ import annotations

import json
import os

import pytest
import torch

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import cli
from xla_tensorstore_ckpt.core import layout
from xla_tensorstore_ckpt.formats import checksums


def replace_once(path, old: str, new: str) -> None:
    """Change one spot of a file, as a flipped digit would, leaving its recorded checksum as it was."""
    text = path.read_text()
    assert text.count(old) == 1, (old, text[:400])
    path.write_text(text.replace(old, new))


@pytest.fixture
def item(tmp_path):
    path = tmp_path / "item"
    xtc.save(path, {"w": torch.arange(6.0), "position": 60, "name": "run-a", "lr": 0.25})
    return path


def test_a_flipped_digit_in_an_items_metadata_is_an_error_naming_the_file(item, capsys):
    assert xtc.restore(item)["position"] == 60
    replace_once(item / layout.ITEM_METADATA, '{"value":60}', '{"value":61}')
    with pytest.raises(xtc.CorruptCheckpointError, match="damaged") as err:
        xtc.restore(item)
    assert str(item / layout.ITEM_METADATA) in str(err.value)
    with pytest.raises(xtc.CorruptCheckpointError):
        xtc.metadata(item)
    assert cli.main(["verify", str(item)]) == cli.EXIT_DATA
    out = capsys.readouterr().out
    assert f"FAIL item: {item / layout.ITEM_METADATA}" in out and "damaged" in out


def test_a_changed_strings_file_is_an_error_naming_it(item, capsys):
    strings = item / layout.STRINGS
    assert json.loads(strings.read_text()) == {"name": "run-a"}  # Orbax's copy of the string leaves
    replace_once(strings, "run-a", "run-b")
    with pytest.raises(xtc.CorruptCheckpointError, match="damaged") as err:
        xtc.restore(item)
    assert str(strings) in str(err.value)
    assert cli.main(["verify", str(item)]) == cli.EXIT_DATA
    assert str(strings) in capsys.readouterr().out
    os.remove(strings)
    with pytest.raises(xtc.CorruptCheckpointError, match="is missing"):
        xtc.restore(item)


def test_a_flipped_digit_in_a_step_marker_uncommits_the_step_with_a_warning(tmp_path, capsys):
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=None)
    with xtc.CheckpointManager(tmp_path, options) as manager:
        for step in (1, 2):
            manager.save(step, model={"w": torch.full((4,), float(step))}, metrics={"loss": 0.25 * step})
    marker = tmp_path / "2" / layout.CHECKPOINT_METADATA
    replace_once(marker, '"loss": 0.5', '"loss": 0.6')
    with pytest.warns(UserWarning, match=r"ignoring step 2: .*_CHECKPOINT_METADATA: the file is damaged"):
        manager = xtc.CheckpointManager(tmp_path, options)
    with manager:
        assert manager.all_steps() == [1]
    assert os.path.isdir(tmp_path / "2")  # invalid, not partial: never deleted behind the user's back
    assert cli.main(["verify", str(tmp_path)]) == cli.EXIT_DATA
    assert "FAIL step 2:" in capsys.readouterr().out
    assert cli.main(["verify", str(tmp_path / "2")]) == cli.EXIT_DATA
    assert str(marker) in capsys.readouterr().out
    assert cli.main(["steps", str(tmp_path)]) == 0
    assert [line.split()[:2] for line in capsys.readouterr().out.splitlines()[1:]] == [["1", "committed"],
                                                                                      ["2", "invalid"]]


@pytest.mark.parametrize("name, indent", [(layout.ITEM_METADATA, None), (layout.CHECKPOINT_METADATA, 1)],
                         ids=["item", "step"])
def test_the_checksum_is_over_the_bytes_as_written(tmp_path, name, indent):
    """The rule a reader in any language can follow: the last field of our object holds the CRC32C of the file
    with that value replaced by eight zeros."""
    with xtc.CheckpointManager(tmp_path, xtc.CheckpointManagerOptions(save_interval_steps=1)) as manager:
        manager.save(1, extra={"name": "ünï", "lr": 1e-3}, metrics={"loss": 0.125},
                     custom_metadata={"run": "a"})
    path = tmp_path / "1" / ("extra" if name == layout.ITEM_METADATA else "") / name
    data = path.read_bytes()
    doc = json.loads(data)
    ours = doc["xla_tensorstore_ckpt"] if name == layout.ITEM_METADATA else \
        doc["custom_metadata"]["xla_tensorstore_ckpt"]
    recorded = ours[checksums.FIELD]
    assert list(ours)[-1] == checksums.FIELD
    at = data.rfind(recorded.encode())
    assert data[at + 8:].strip(b"\n }") == b'"'  # nothing but closing brackets after it
    assert checksums.of(data[:at] + b"00000000" + data[at + 8:]) == recorded
    assert checksums.dumps(doc, indent=indent) == data  # re-serialising the parsed file gives its bytes
    if name == layout.ITEM_METADATA:
        strings = (tmp_path / "1" / "extra" / layout.STRINGS).read_bytes()
        assert ours[checksums.STRINGS_FIELD] == checksums.of(strings)


def test_custom_metadata_cannot_take_our_key(tmp_path):
    with xtc.CheckpointManager(tmp_path, xtc.CheckpointManagerOptions(save_interval_steps=1)) as manager:
        manager.save(1, extra={"a": 1}, custom_metadata={"xla_tensorstore_ckpt": "mine", "run": "a"})
    with xtc.CheckpointManager(tmp_path) as manager:
        assert manager.metadata(1).custom == {"run": "a"}  # the marker verifies; the user's entry was dropped
