"""Item save/restore of CPU state trees: every dtype and layout, JSON leaves, optimizer state, bad input."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import DTYPES, assert_trees_equal, ocdbt_data_files, random_tensor
from memory_maps import vm_flags

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt.core import layout


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_exactly(tmp_path, dtype):
    state = {"x": random_tensor((5, 7), dtype), "scalar": random_tensor((), dtype),
             "empty": random_tensor((0, 3), dtype)}
    xtc.save(tmp_path / "ck", state)
    assert_trees_equal(xtc.restore(tmp_path / "ck"), state)


def test_optimizer_state_dict_round_trips_exactly(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    xtc.save(tmp_path / "ck", state)
    restored = xtc.restore(tmp_path / "ck")
    assert_trees_equal(restored["optimizer"], state["optimizer"])
    assert_trees_equal(restored["model"], dict(state["model"]))
    fresh = torch.optim.AdamW(model.parameters(), lr=1.0)
    fresh.load_state_dict(restored["optimizer"])
    assert fresh.param_groups[0]["betas"] == (0.9, 0.95) and fresh.param_groups[0]["lr"] == 1e-3


def test_json_leaves_and_structure(tmp_path):
    state = {"a": [1, 2.5, "s", True, None, float("inf")], "nested": {"t": (1, (2, 3)), 5: {}}, "empty": []}
    xtc.save(tmp_path / "ck", state)
    assert_trees_equal(xtc.restore(tmp_path / "ck"), state)


@pytest.mark.parametrize("use_ocdbt", [True, False], ids=["ocdbt", "directories"])
def test_hostile_keys_are_stored_inside_the_item_and_round_trip(tmp_path, use_ocdbt):
    keys = ["..", "../escape", "/abs/path", "a/b", "nul\x00", "ünï", "x" * 600, "_METADATA", "0", "", "d",
            "manifest.ocdbt", "ocdbt.process_0"]
    state = {k: torch.full((2,), float(i)) for i, k in enumerate(keys)}
    with pytest.warns(UserWarning, match=r"Orbax cannot restore \('\.\.',\), \('\.\./escape',\), \('/abs/path',\) "
                                         r"and 8 more"):  # all but "ünï" and "0" get escaped names
        xtc.save(tmp_path / "ck", state, options=xtc.SaveOptions(use_ocdbt=use_ocdbt))
    assert_trees_equal(xtc.restore(tmp_path / "ck"), state)
    item = os.path.realpath(tmp_path / "ck")
    for root, _dirs, _files in os.walk(item):
        assert os.path.realpath(root).startswith(item)
    assert sorted(os.listdir(tmp_path)) == ["ck"] and not os.path.exists("/abs")
    if not use_ocdbt:  # one directory per key, each one path segment, plus _METADATA and commit_success.txt
        assert len(os.listdir(item)) == len(keys) + 2


def test_metadata_describes_arrays_and_values(tmp_path):
    xtc.save(tmp_path / "ck", {"w": torch.zeros(4, 6, dtype=torch.bfloat16), "step": 7})
    info = xtc.metadata(tmp_path / "ck")
    assert info["step"] == 7
    assert info["w"] == xtc.ArrayMetadata("w", (4, 6), "bfloat16", (4, 6), None)
    assert info["w"].torch_dtype == torch.bfloat16 and info["w"].nbytes == 48


def test_cast_on_restore_to_target_dtype(tmp_path):
    src = torch.randn(6, 3)
    xtc.save(tmp_path / "ck", {"w": src})
    out = xtc.restore(tmp_path / "ck", {"w": torch.zeros(6, 3, dtype=torch.bfloat16)})
    assert out["w"].dtype == torch.bfloat16 and torch.equal(out["w"], src.to(torch.bfloat16))


def test_non_json_leaf_fails_before_anything_is_written(tmp_path):
    with pytest.raises(xtc.UnsupportedValueError, match="opt/fn"):
        xtc.save(tmp_path / "ck", {"w": torch.zeros(2), "opt": {"fn": object()}})
    assert not (tmp_path / "ck").exists()


def test_shape_mismatch_names_key_shapes_and_path(tmp_path):
    xtc.save(tmp_path / "ck", {"layer": {"w": torch.zeros(4, 6)}})
    with pytest.raises(xtc.ShapeMismatchError) as err:
        xtc.restore(tmp_path / "ck", {"layer": {"w": torch.zeros(6, 4)}})
    message = str(err.value)
    assert "layer/w" in message and "(4, 6)" in message and "(6, 4)" in message and str(tmp_path) in message


def test_missing_and_unexpected_keys(tmp_path):
    xtc.save(tmp_path / "ck", {"a": torch.ones(2), "b": torch.ones(3)})
    target = {"a": torch.zeros(2), "c": torch.zeros(4)}
    with pytest.raises(xtc.KeyMismatchError) as err:
        xtc.restore(tmp_path / "ck", target)
    assert err.value.missing == ("c",) and err.value.unexpected == ("b",)
    assert isinstance(err.value, KeyError) and "strict=False" in str(err.value)
    with pytest.warns(UserWarning, match="missing from the checkpoint: c"):
        out = xtc.restore(tmp_path / "ck", target, strict=False)
    assert torch.equal(out["a"], torch.ones(2)) and out["c"] is target["c"] and "b" not in out


def test_target_is_not_modified(tmp_path):
    xtc.save(tmp_path / "ck", {"a": torch.ones(2)})
    target = {"a": torch.zeros(2)}
    out = xtc.restore(tmp_path / "ck", target)
    assert torch.equal(target["a"], torch.zeros(2)) and torch.equal(out["a"], torch.ones(2))


def test_existing_checkpoint_is_not_overwritten_without_consent(tmp_path):
    xtc.save(tmp_path / "ck", {"a": torch.ones(2)})
    with pytest.raises(xtc.CheckpointExistsError):
        xtc.save(tmp_path / "ck", {"a": torch.zeros(2)})
    assert torch.equal(xtc.restore(tmp_path / "ck")["a"], torch.ones(2))
    xtc.save(tmp_path / "ck", {"b": torch.zeros(3)}, overwrite=True)
    assert list(xtc.restore(tmp_path / "ck")) == ["b"]
    assert not (tmp_path / "ck" / "a").exists()


PLAIN = xtc.SaveOptions(use_ocdbt=False)


def _chunk_file(item, array):
    chunk_dir = item / array / "c"
    files = [os.path.join(r, f) for r, _, fs in os.walk(chunk_dir) for f in fs]
    return sorted(files)[0]


def _largest_data_file(item):
    return ocdbt_data_files(item)[0]


def test_flipped_byte_is_detected_naming_array_and_chunk(tmp_path):
    xtc.save(tmp_path / "ck", {"w": torch.randn(8, 8)}, options=PLAIN)
    chunk = _chunk_file(tmp_path / "ck", "w")
    data = bytearray(open(chunk, "rb").read())
    data[10] ^= 0x01
    open(chunk, "wb").write(data)
    with pytest.raises(xtc.CorruptCheckpointError) as err:
        xtc.restore(tmp_path / "ck")
    assert "w" in str(err.value) and chunk in str(err.value)


def test_flipped_byte_in_an_ocdbt_store_is_detected_naming_the_array(tmp_path):
    xtc.save(tmp_path / "ck", {"w": torch.randn(64, 64)})  # 16 KiB: stored in a data file, not inline
    data_file = _largest_data_file(tmp_path / "ck")
    data = bytearray(open(data_file, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(data_file, "wb").write(data)
    with pytest.raises(xtc.CorruptCheckpointError) as err:
        xtc.restore(tmp_path / "ck")
    assert str(tmp_path / "ck" / "w") in str(err.value)


def test_missing_chunk_is_an_error_not_zeros(tmp_path):
    xtc.save(tmp_path / "ck", {"w": torch.zeros(8, 8)}, options=PLAIN)
    chunk = _chunk_file(tmp_path / "ck", "w")
    os.remove(chunk)
    with pytest.raises(xtc.CorruptCheckpointError, match="missing"):
        xtc.restore(tmp_path / "ck")


def test_missing_ocdbt_data_is_an_error_not_zeros(tmp_path):
    xtc.save(tmp_path / "ck", {"w": torch.zeros(64, 64)})
    os.remove(_largest_data_file(tmp_path / "ck"))
    with pytest.raises(xtc.CheckpointError):
        xtc.restore(tmp_path / "ck")


def _edit_ours(item, edit):
    """Change this library's part of an item's _METADATA, dropping its checksum (a file without one has nothing
    to verify, so the checks behind it are what is tested)."""
    meta = item / layout.ITEM_METADATA
    doc = json.loads(meta.read_text())
    edit(doc["xla_tensorstore_ckpt"])
    doc["xla_tensorstore_ckpt"].pop("crc32c", None)
    meta.write_text(json.dumps(doc))


def test_newer_format_version_is_refused(tmp_path):
    xtc.save(tmp_path / "ck", {"w": torch.zeros(2)})
    _edit_ours(tmp_path / "ck", lambda ours: ours.update(format_version=99))
    with pytest.raises(xtc.FormatVersionError, match="99"):
        xtc.restore(tmp_path / "ck")


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(xtc.CheckpointNotFoundError):
        xtc.restore(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError):
        xtc.metadata(tmp_path / "nothing")


def test_manifest_disagreeing_with_zarr_json_is_corrupt(tmp_path):
    xtc.save(tmp_path / "ck", {"w": torch.zeros(4)})
    _edit_ours(tmp_path / "ck", lambda ours: ours["tree"]["dict"][0][1]["array"].update(shape=[5]))
    with pytest.raises(xtc.CorruptCheckpointError, match="records"):
        xtc.restore(tmp_path / "ck")


def test_memory_storage_round_trip():
    state = {"w": torch.randn(3, 3), "n": 1}
    xtc.save("memory://core-test/ck", state)
    assert_trees_equal(xtc.restore("memory://core-test/ck"), state)


@pytest.mark.xla
def test_flipped_byte_in_a_single_file_array_names_the_chunk(tmp_path):
    pytest.importorskip("torch_xla")
    from conftest import make_mesh, sharded

    xtc.save(tmp_path / "ck", {"w": sharded(torch.randn(16, 8), make_mesh((4, 2), ("x", "y")), ("x", "y"))},
             options=PLAIN)
    chunk = _chunk_file(tmp_path / "ck", "w")
    data = bytearray(open(chunk, "rb").read())
    data[200] ^= 0x01  # inside the second inner chunk
    open(chunk, "wb").write(data)
    with pytest.raises(xtc.CorruptCheckpointError) as err:
        xtc.restore(tmp_path / "ck")
    assert chunk in str(err.value)


@pytest.mark.xla
def test_truncated_single_file_array_is_corrupt(tmp_path):
    from conftest import make_mesh, sharded

    xtc.save(tmp_path / "ck", {"w": sharded(torch.randn(16, 8), make_mesh((4, 2), ("x", "y")), ("x", "y"))},
             options=PLAIN)
    chunk = _chunk_file(tmp_path / "ck", "w")
    data = open(chunk, "rb").read()
    open(chunk, "wb").write(data[: len(data) // 2])
    with pytest.raises(xtc.CorruptCheckpointError):
        xtc.restore(tmp_path / "ck")


def test_restore_pauses_the_garbage_collector_and_restores_its_state(tmp_path):
    """Planning thousands of reads creates many small live records; the cyclic collector is paused meanwhile
    (it would walk every object of the process again and again) and left as it was found."""
    import gc

    from xla_tensorstore_ckpt.core import events

    xtc.save(tmp_path / "ck", {"a": torch.ones(4), "b": torch.zeros(3)})
    seen = []

    def watching(event):  # listeners run on the thread doing the work, as the reads are started
        if event.kind == events.RESTORE_BATCH_ISSUED:
            seen.append(gc.isenabled())

    watched = xtc.RestoreOptions(listeners=(watching,))
    assert gc.isenabled()
    xtc.restore(tmp_path / "ck", options=watched)
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        xtc.restore(tmp_path / "ck")
        assert not gc.isenabled()  # a caller that had disabled it keeps it disabled
    finally:
        gc.enable()

    def failing(event):  # fails the restore while its reads are under way
        if event.kind == events.RESTORE_BATCH_ISSUED:
            raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        xtc.restore(tmp_path / "ck", options=xtc.RestoreOptions(listeners=(failing,)))
    assert gc.isenabled()


@pytest.mark.parametrize("use_ocdbt", [True, False], ids=["ocdbt", "directories"])
def test_new_tensors_are_not_advised_to_use_huge_pages(tmp_path, use_ocdbt):
    # numpy advises MADV_HUGEPAGE (VmFlags "hg") for 4 MiB and more; on a VM that reports free memory to its
    # hypervisor such pages cost 2-3x the system time to touch first (host_memory.empty).
    state = {"big": torch.randn(1024, 2048), "small": torch.randn(64)}  # 8 MiB, and 256 bytes
    xtc.save(tmp_path / "ck", state, options=xtc.SaveOptions(use_ocdbt=use_ocdbt))
    restored = xtc.restore(tmp_path / "ck")
    assert_trees_equal(restored, state)
    middle = restored["big"].data_ptr() + restored["big"].nbytes // 2  # numpy advises from the first whole page
    assert "hg" not in vm_flags(middle)


def test_new_tensors_are_cpu_tensors_under_another_default_device(tmp_path):
    state = {"big": torch.randn(1024, 2048).to(torch.bfloat16), "small": torch.randn(64)}  # 4 MiB, and 256 bytes
    xtc.save(tmp_path / "ck", state)
    with torch.device("meta"):
        restored = xtc.restore(tmp_path / "ck")
    assert restored["big"].device.type == "cpu"
    assert_trees_equal(restored, state)
