"""Orbax interop both ways, with real Orbax and real JAX (in subprocesses, never beside torch_xla): checkpoints
Orbax writes restore onto torch_xla meshes bit for bit, and the checkpoints this library writes are Orbax
checkpoints that Orbax's StandardCheckpointer and CheckpointManager restore."""

from __future__ import annotations

import json
import os
import re
import sys

import numpy as np
import pytest
import torch
from conftest import make_mesh, sharded
from orbax_process import leaf, orbax, orbax_all, same

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import cli
from xla_tensorstore_ckpt.core import dtypes
from xla_tensorstore_ckpt.core.tree import flatten as flatten_tree

sys.path.insert(0, os.path.dirname(__file__))
import orbax_trees  # noqa: E402


def as_torch(tree):
    """orbax_trees' numpy values as torch tensors (Python scalars and strings unchanged)."""
    if isinstance(tree, dict):
        return {k: as_torch(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [as_torch(v) for v in tree]
    if isinstance(tree, np.ndarray):
        return dtypes.numpy_to_tensor(tree.copy())
    return tree


def flat(tree, prefix=()):
    if isinstance(tree, dict) and tree:
        for k, v in tree.items():
            yield from flat(v, (*prefix, str(k)))
    elif isinstance(tree, (list, tuple)) and tree:
        for i, v in enumerate(tree):
            yield from flat(v, (*prefix, str(i)))
    else:
        yield ".".join(prefix), tree


# ------------------------------------------------------------------------------------------- JAX -> us

VARIANTS = {"ocdbt-zarr3": (1, 1), "dirs-zarr3": (0, 1), "ocdbt-zarr2": (1, 0), "dirs-zarr2": (0, 0)}


@pytest.fixture(scope="module")
def written_by_orbax(tmp_path_factory):
    base = tmp_path_factory.mktemp("orbax-items")
    orbax_all([("write", base / name, "--ocdbt", ocdbt, "--zarr3", zarr3) for name, (ocdbt, zarr3) in VARIANTS.items()])
    return base


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.xla
def test_orbax_items_restore_bit_for_bit_onto_another_mesh(written_by_orbax, variant):
    item = written_by_orbax / variant
    expected = as_torch(orbax_trees.tree())
    restored = xtc.restore(item)
    assert dict(flat(restored)).keys() == dict(flat(expected)).keys()
    for key, value in flat(expected):
        assert same(dict(flat(restored))[key], value), key
    info = xtc.metadata(item)
    assert info["params"]["w"].shape == (16, 8) and info["params"]["b"].dtype == "bfloat16"
    mesh = make_mesh((2, 4), ("a", "b"))
    target = {"params": {"w": sharded(torch.zeros(16, 8), mesh, ("b", "a")),
                         "b": sharded(torch.zeros(8, dtype=torch.bfloat16), mesh, ("b",)),
                         "layers": [{"k": sharded(torch.zeros(4, 3, dtype=torch.int32), mesh, (None, "a"))},
                                    {"k": torch.zeros(4, 3, dtype=torch.int32)}]},
              "step": 0, "lr": 0.0, "flag": False, "name": "", "nothing": None, "empty": {}}
    out = xtc.restore(item, target)
    assert torch.equal(out["params"]["w"].cpu(), expected["params"]["w"])
    assert torch.equal(out["params"]["b"].cpu(), expected["params"]["b"])
    assert torch.equal(out["params"]["layers"][0]["k"].cpu(), expected["params"]["layers"][0]["k"])
    assert torch.equal(out["params"]["layers"][1]["k"], expected["params"]["layers"][1]["k"])
    assert (out["step"], out["lr"], out["flag"], out["name"]) == (7, 0.25, True, "run-a")


def test_torch_names_through_key_map(written_by_orbax):
    item = written_by_orbax / "ocdbt-zarr3"
    renames = {"params.w": "decoder.weight", "params.b": "decoder.bias"}
    target = {"decoder.weight": torch.zeros(16, 8), "decoder.bias": torch.zeros(8, dtype=torch.float32)}
    with pytest.warns(UserWarning, match="not in the target: .*params.layers.0.k"):
        out = xtc.restore(item, target, key_map=renames, strict=False)
    expected = as_torch(orbax_trees.tree())["params"]
    assert torch.equal(out["decoder.weight"], expected["w"])
    assert torch.equal(out["decoder.bias"], expected["b"].to(torch.float32))  # cast on restore
    drop_the_rest = lambda name: renames.get(name, name) if name.startswith("params.") else None  # noqa: E731
    with pytest.raises(xtc.KeyMismatchError) as err:
        xtc.restore(item, dict(target, extra=torch.zeros(1)), key_map=drop_the_rest)
    assert err.value.missing == ("extra",) and err.value.unexpected == ("params.layers.0.k", "params.layers.1.k")
    flat_named = xtc.restore(item, key_map=drop_the_rest)
    assert set(flat_named) == {"decoder.weight", "decoder.bias", "params.layers.0.k", "params.layers.1.k"}


@pytest.mark.parametrize("use_ocdbt", [1, 0], ids=["ocdbt", "directories"])
def test_a_key_with_a_slash_restores_as_orbax_stores_it(tmp_path, use_ocdbt):
    orbax("write", tmp_path / "item", "--ocdbt", use_ocdbt, "--zarr3", 1, "--tree", "slashed")
    if not use_ocdbt:  # Orbax's directory for the key "a/b"
        assert (tmp_path / "item" / "a" / "b" / "zarr.json").is_file()
    restored = xtc.restore(tmp_path / "item")
    expected = as_torch(orbax_trees.slashed())
    assert sorted(restored) == ["a/b", "c"]
    assert same(restored["a/b"], expected["a/b"]) and same(restored["c"]["d"], expected["c"]["d"])


def hostile_orbax_item(item, key: str):
    """An item whose _METADATA, in Orbax's schema (no OCDBT), names one array by the single key `key`; beside the
    item, at ../secret/w, a real array that a name escaping the item would reach."""
    import tensorstore as ts

    ts.open({"driver": "zarr3", "kvstore": f"file://{item.parent}/secret/w", "create": True,
             "metadata": {"shape": [2], "data_type": "float32"}}).result().write(np.ones(2, np.float32)).result()
    item.mkdir()
    entry = {"key_metadata": [{"key": key, "key_type": 2}],
             "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False, "write_shape": [2]}}
    (item / "_METADATA").write_text(json.dumps({
        "tree_metadata": {str((key,)): entry}, "use_ocdbt": False, "use_zarr3": True,
        "store_array_data_equal_to_fill_value": True, "custom_metadata": None}))


@pytest.mark.parametrize("damage", ["deleted", "corrupted"])
@pytest.mark.parametrize("variant", ["dirs-zarr3", "dirs-zarr2"])
def test_verify_reports_a_deleted_or_corrupted_chunk_of_an_orbax_item(written_by_orbax, tmp_path, capsys, variant,
                                                                       damage):
    import shutil

    from xla_tensorstore_ckpt import cli

    item = tmp_path / "item"
    shutil.copytree(written_by_orbax / variant, item)
    chunk = item / "params.w" / ("c/1/0" if variant == "dirs-zarr3" else "1.0")
    assert chunk.is_file()
    if damage == "deleted":
        chunk.unlink()
    else:  # every byte changed, the length kept: zstd's frame, or the shard index's crc32c, no longer holds
        chunk.write_bytes(bytes(b ^ 0x5A for b in chunk.read_bytes()))
    assert cli.main(["verify", str(item), "--json"]) == cli.EXIT_DATA
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and report["arrays"] == 4
    (problem,) = report["problems"]
    assert problem["where"] == "params.w c/1/0"  # the chunk at grid position (1, 0)
    assert str(chunk) in problem["message"], problem  # the file at fault
    assert report["notes"] == ["item: written by Orbax, whose chunks carry no checksums: checked that every chunk "
                               "is present and decodes"]


def test_verify_says_when_missing_chunks_cannot_be_found(written_by_orbax, tmp_path, capsys):
    """Orbax written without store_array_data_equal_to_fill_value leaves out chunks of zeros: a missing chunk is
    no error, to Orbax or to us, and the note says so."""
    import shutil

    from xla_tensorstore_ckpt import cli

    item = tmp_path / "item"
    shutil.copytree(written_by_orbax / "dirs-zarr3", item)
    doc = json.loads((item / "_METADATA").read_text())
    doc["store_array_data_equal_to_fill_value"] = False
    (item / "_METADATA").write_text(json.dumps(doc))
    (item / "params.w" / "c" / "1" / "0").unlink()
    assert cli.main(["verify", str(item), "--json"]) == 0
    (note,) = json.loads(capsys.readouterr().out)["notes"]
    assert "written without store_array_data_equal_to_fill_value" in note and "cannot be found" in note
    assert torch.equal(xtc.restore(item)["params"]["w"][4:8, :4], torch.zeros(4, 4))


@pytest.mark.parametrize("key", ["../secret/w", "/tmp/w", "a/../../secret/w", "a//w", "./w", "a\\w", "a\x00w"],
                         ids=["parent", "absolute", "parent-inside", "empty-component", "dot", "backslash", "nul"])
def test_orbax_keys_that_would_leave_the_item_are_refused(tmp_path, key):
    item = tmp_path / "item"
    hostile_orbax_item(item, key)
    where = re.escape(f"{item / '_METADATA'}: the array of key {(key,)}")
    for read in (xtc.metadata, xtc.restore):
        with pytest.raises(xtc.CorruptCheckpointError, match=where + r" would be read from .*, which "):
            read(item)


# Orbax's step naming options by root: step_prefix, step_format_fixed_length (zero-padded step numbers)
NAMING = {"plain": (), "prefixed": ("--prefix", "checkpoint"), "padded": ("--fixed-length", "5"),
          "padded-prefixed": ("--prefix", "checkpoint", "--fixed-length", "3")}


@pytest.fixture(scope="module")
def orbax_roots(tmp_path_factory):
    base = tmp_path_factory.mktemp("orbax-roots")
    orbax_all([("manager", base / name, *flags) for name, flags in NAMING.items()])
    return base


@pytest.mark.parametrize("naming", list(NAMING))
def test_an_orbax_root_is_resumed_by_our_manager_and_orbax_sees_our_step(orbax_roots, naming, capsys):
    root = orbax_roots / naming
    prefix = dict(zip(NAMING[naming][::2], NAMING[naming][1::2])).get("--prefix")
    names = {"plain": ["1", "2"], "prefixed": ["checkpoint_1", "checkpoint_2"], "padded": ["00001", "00002"],
             "padded-prefixed": ["checkpoint_001", "checkpoint_002"]}[naming]
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith("_")) == names  # as Orbax named them
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, step_prefix=prefix, save_rng=False)
    with xtc.CheckpointManager(root, options) as manager:
        assert manager.all_steps() == [1, 2] and manager.latest_step() == 2
        assert manager.metadata(2).items == ("extra", "model") and manager.metadata(2).format_version == 0
        model = {"embed": torch.zeros(32, 16), "head": torch.zeros(16, 4, dtype=torch.bfloat16)}
        extra = {"position": 0, "epoch": ""}
        assert manager.restore("latest", model=model, extra=extra) == 2
        assert_model(model, 2) and extra == {"position": 20, "epoch": "one"}
        model = {name: value * 0 + 3 for name, value in model.items()}
        manager.save(3, model=model, extra={"position": 30, "epoch": "two"})
    assert (root / names[-1].replace("2", "3")).is_dir()  # our step is named as Orbax names its steps there
    with xtc.CheckpointManager(root, options) as manager:
        assert manager.all_steps() == [1, 2, 3]
    assert cli.main(["steps", str(root), "--json"]) == 0  # the command line lists them too
    listed = json.loads(capsys.readouterr().out)
    assert [(s["step"], s["name"], s["status"]) for s in listed] == \
        [(n, name, "committed") for n, name in zip((1, 2, 3), [*names, names[-1].replace("2", "3")])]
    steps = orbax("steps", root, *NAMING[naming])[str(root)]  # Orbax, with the same naming options
    assert steps == {"all_steps": [1, 2, 3], "latest": 3}
    restored = orbax("manager_restore", root, "model", *NAMING[naming])
    assert restored["step"] == 3
    assert all(torch.equal(leaf(restored["tree"][k]), v) for k, v in model.items())


def assert_model(model, step) -> bool:
    expected = as_torch(orbax_trees.model(step))
    return all(torch.equal(model[k], v) for k, v in expected.items())


# ------------------------------------------------------------------------------------------- us -> JAX


def our_state():
    mesh = make_mesh((4, 2), ("x", "y"))
    return {"params": {"w": sharded(torch.arange(128.0).reshape(16, 8) / 7, mesh, ("x", "y")),
                       "b": (torch.arange(8.0) - 4).to(torch.bfloat16),
                       "layers": [{"k": torch.arange(12, dtype=torch.int32).reshape(4, 3)}]},
            "step": 7, "lr": 0.5, "flag": True, "name": "run", "nothing": None, "empty": {}, "big": 2**70,
            "nan": float("nan"), "pair": (1, 2)}


@pytest.mark.parametrize("use_ocdbt", [True, False], ids=["ocdbt", "directories"])
@pytest.mark.xla
def test_our_items_restore_in_orbax_with_and_without_a_target(tmp_path, use_ocdbt):
    state = our_state()
    xtc.save(tmp_path / "item", state, options=xtc.SaveOptions(use_ocdbt=use_ocdbt))
    plain = orbax("restore", tmp_path / "item")
    expected = {"params.w": state["params"]["w"].cpu(), "params.b": state["params"]["b"],
                "params.layers.0.k": state["params"]["layers"][0]["k"], "step": 7, "lr": 0.5, "flag": True,
                "name": "run", "nothing": None, "big": None, "nan": float("nan"), "pair.0": 1, "pair.1": 2}
    assert set(plain) == set(expected)
    for key, value in expected.items():
        assert same(leaf(plain[key]), value), key
    onto_mesh = orbax("restore_sharded", tmp_path / "item")["tree"]
    for key in ("params.w", "params.b", "params.layers.0.k"):
        assert same(leaf(onto_mesh[key]), expected[key]), key
    assert "NamedSharding" in onto_mesh["params.w"]["sharding"] and "'b', 'a'" in onto_mesh["params.w"]["sharding"]


@pytest.mark.parametrize("use_ocdbt", [True, False], ids=["ocdbt", "directories"])
@pytest.mark.xla
def test_our_zstd_compressed_items_restore_in_orbax(tmp_path, use_ocdbt):
    """Orbax's own codec chain (bytes, zstd) with our crc32c after it: Orbax decodes it as tensorstore does."""
    state = our_state()
    state["params"]["repeated"] = torch.arange(4096, dtype=torch.float32) % 7  # compressible: 16 KiB -> ~100 B
    xtc.save(tmp_path / "item", state, options=xtc.SaveOptions(use_ocdbt=use_ocdbt, compression="zstd"))
    plain = orbax("restore", tmp_path / "item")
    for key, value in {"params.w": state["params"]["w"].cpu(), "params.b": state["params"]["b"],
                       "params.layers.0.k": state["params"]["layers"][0]["k"],
                       "params.repeated": state["params"]["repeated"], "step": 7, "lr": 0.5}.items():
        assert same(leaf(plain[key]), value), key


@pytest.mark.parametrize("use_ocdbt", [True, False], ids=["ocdbt", "directories"])
def test_keys_orbax_cannot_name_are_none_to_orbax_never_another_keys_value(tmp_path, use_ocdbt):
    """Orbax names a value by its keys joined with '.': for {"a.b": x, "a": {"b": y}} it would read x for both,
    and a key with a '/' it would look for in a directory of that name. Such keys are stored under escaped names,
    are None to Orbax (which restores everything else), and the save warns."""
    state = {"a.b": torch.full((2, 3), 1.0), "a": {"b": torch.full((2, 3), 2.0)}, "s.t": 1, "s": {"t": 2},
             "u.v": "first", "u": {"v": "second"}, "x/y": torch.full((4,), 5.0), "ok": torch.arange(6.0)}
    with pytest.warns(UserWarning, match=r"Orbax cannot restore \('a', 'b'\), \('s', 't'\), \('u', 'v'\) and 1 "
                                         r"more: .* Orbax restores None for it"):
        xtc.save(tmp_path / "item", state, options=xtc.SaveOptions(use_ocdbt=use_ocdbt))
    restored = xtc.restore(tmp_path / "item")  # ours: every key, each its own value
    assert [k for k, _ in flatten_tree(restored)] == [k for k, _ in flatten_tree(state)]
    assert all(same(a, b) for (_, a), (_, b) in zip(flatten_tree(restored), flatten_tree(state)))
    by_orbax = {tuple(json.loads(k)): v for k, v in orbax("restore", tmp_path / "item", "--paths", 1).items()}
    assert set(by_orbax) == {("a.b",), ("a", "b"), ("s.t",), ("s", "t"), ("u.v",), ("u", "v"), ("x/y",), ("ok",)}
    for first, hidden in [(("a.b",), ("a", "b")), (("s.t",), ("s", "t")), (("u.v",), ("u", "v"))]:
        assert same(leaf(by_orbax[first]), state[first[0]]), first
        assert by_orbax[hidden] == {"value": None}, hidden
    assert by_orbax[("x/y",)] == {"value": None} and same(leaf(by_orbax[("ok",)]), state["ok"])
    raw = json.loads((tmp_path / "item" / "_METADATA").read_text())["tree_metadata"]
    for key in ("('a', 'b')", "('s', 't')", "('u', 'v')", "('x/y',)"):
        assert raw[key]["value_metadata"] == {"value_type": "None", "skip_deserialize": True}, key
    for key in ("('a.b',)", "('s.t',)", "('u.v',)", "('ok',)"):
        assert raw[key]["value_metadata"]["skip_deserialize"] is False, key


def test_orbax_manager_lists_only_our_committed_steps_and_restores_them(tmp_path):
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=None)
    with xtc.CheckpointManager(tmp_path / "root", options) as manager:
        for step in (1, 2):
            manager.save(step, model={"w": torch.full((4, 4), float(step))}, extra={"position": step})
    (tmp_path / "root" / "3.orbax-checkpoint-tmp-1234" / "model").mkdir(parents=True)  # a save that crashed
    assert orbax("steps", tmp_path / "root")[str(tmp_path / "root")] == {"all_steps": [1, 2], "latest": 2}
    restored = orbax("manager_restore", tmp_path / "root", "model")
    assert restored["step"] == 2 and torch.equal(leaf(restored["tree"]["w"]), torch.full((4, 4), 2.0))


# ------------------------------------------------------------------------------- the other Orbax minor version

GOLDEN_0_11 = os.path.join(os.path.dirname(__file__), "golden", "orbax-0.11")  # golden/make_orbax_0_11.sh


def test_a_checkpoint_of_orbax_0_11_restores_bit_for_bit(tmp_path):
    restored = xtc.restore(os.path.join(GOLDEN_0_11, "item"))  # no use_ocdbt in its _METADATA: found by content
    for key, value in flat(as_torch(orbax_trees.tree())):
        assert same(dict(flat(restored))[key], value), key
    import shutil

    shutil.copytree(os.path.join(GOLDEN_0_11, "root"), tmp_path / "root")
    with xtc.CheckpointManager(tmp_path / "root", xtc.CheckpointManagerOptions(save_rng=False)) as manager:
        assert manager.all_steps() == [1, 2]
        model = {"embed": torch.zeros(32, 16), "head": torch.zeros(16, 4, dtype=torch.bfloat16)}
        assert manager.restore("latest", model=model) == 2 and assert_model(model, 2)


def test_the_command_line_reads_orbax_checkpoints(written_by_orbax, orbax_roots, tmp_path, capsys):
    from xla_tensorstore_ckpt import cli

    item = written_by_orbax / "ocdbt-zarr3"
    assert cli.main(["verify", str(item)]) == 0
    out = capsys.readouterr().out
    assert "no checksums" in out and "OK: 4 arrays checked, 0 problems" in out
    assert cli.main(["tree", str(item)]) == 0
    assert re.search(r"params\.w +\[16, 8\] +float32", capsys.readouterr().out)
    assert cli.main(["show", str(item), "params.layers.1.k[1]", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["values"] == [15, 20, 25]
    assert cli.main(["stats", str(item), "params.w", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["max"] == pytest.approx(127 / 3)
    assert cli.main(["steps", str(orbax_roots / "plain"), "--json"]) == 0
    assert {1, 2} <= {s["step"] for s in json.loads(capsys.readouterr().out) if s["status"] == "committed"}
    assert cli.main(["export", str(item), str(tmp_path / "st"), "--format", "safetensors"]) == 0
    from safetensors.torch import load_file

    exported = load_file(capsys.readouterr().out.split()[0])
    assert torch.equal(exported["params.w"], as_torch(orbax_trees.tree())["params"]["w"])
