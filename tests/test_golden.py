"""Checkpoints of format version 1 keep restoring bit for bit: a root written by the version-1 writer is committed
under tests/golden/v1 (by golden/make_v1.py), and read here by today's readers."""

from __future__ import annotations

import math
import os
import random
import shutil
import sys

import numpy as np
import pytest
import torch
from conftest import make_mesh, sharded
from helpers import assert_trees_equal

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import cli

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "v1")
sys.path.insert(0, os.path.dirname(GOLDEN))
import make_v1  # noqa: E402


@pytest.fixture
def root(tmp_path):
    shutil.copytree(GOLDEN, tmp_path / "root")  # a manager may clean up: never touch the fixture itself
    return tmp_path / "root"


def test_items_restore_bit_for_bit_without_a_target():
    assert_trees_equal(xtc.restore(os.path.join(GOLDEN, "1", "model")), make_v1.model_state())
    assert_trees_equal(xtc.restore(os.path.join(GOLDEN, "1", "optimizer")), make_v1.optimizer_state())
    extra = xtc.restore(os.path.join(GOLDEN, "1", "extra"))
    expected = make_v1.extra_state()
    assert math.isnan(extra.pop("nan")) and math.isnan(expected.pop("nan"))
    assert_trees_equal(extra, expected)
    assert isinstance(extra["pair"], tuple) and extra["inf"] == -math.inf and extra[7] == "integer key"


@pytest.mark.xla
def test_arrays_restore_onto_another_mesh_with_their_saved_metadata():
    path = os.path.join(GOLDEN, "2", "model")
    info = xtc.metadata(path)
    assert info["w"].chunk_shape == (2, 3) and info["w"].sharding.mesh_shape == (4, 2)
    assert info["w"].sharding.partition_spec == ("x", "y") and info["b"].dtype == "bfloat16"
    expected = make_v1.model_state()
    target = dict(expected, w=sharded(torch.zeros(8, 6), make_mesh((2, 4), ("a", "b")), ("b", "a")))
    out = xtc.restore(path, target)
    assert torch.equal(out["w"].cpu(), expected["w"])
    assert_trees_equal({k: v for k, v in out.items() if k != "w"}, {k: v for k, v in expected.items() if k != "w"})


def test_the_manager_lists_and_resumes_them_rng_included(root):
    with xtc.CheckpointManager(root, xtc.CheckpointManagerOptions(save_interval_steps=1)) as manager:
        assert manager.all_steps() == [1, 2] and manager.metadata(1).metrics == {"loss": 0.25}
        assert manager.metadata(1).items == ("model", "optimizer", "extra", "rng")
        make_v1.legacy_rng()
        expected = (torch.rand(3), np.random.rand(), random.random())
        torch.manual_seed(0)
        extra = {k: v for k, v in make_v1.extra_state().items() if k != "nan"}
        extra["t"] = torch.zeros(2, 3)
        with pytest.warns(UserWarning, match="not in the target: nan"):
            assert manager.restore(1, extra=extra, strict=False) == 1  # the legacy single-state RNG layout
        assert torch.equal(torch.rand(3), expected[0]) and (np.random.rand(), random.random()) == expected[1:]
        assert torch.equal(extra["t"], torch.ones(2, 3)) and extra["position"] == 17
        model = {k: torch.zeros_like(v) for k, v in make_v1.model_state().items()}
        torch.manual_seed(21)
        after_save = torch.rand(2)
        torch.manual_seed(0)
        assert manager.restore("latest", model=model) == 2  # per-process RNG rows
        assert torch.equal(torch.rand(2), after_save)
        assert_trees_equal(model, make_v1.model_state())


def test_the_command_line_verifies_them(root, capsys):
    assert cli.main(["verify", str(root)]) == 0
    assert "OK: " in capsys.readouterr().out


# ------------------------------------------------------------- format 2, written before metadata checksums

GOLDEN_V2 = os.path.join(os.path.dirname(__file__), "golden", "v2-unchecked")  # golden/make_v2.py unchecked
import make_v2  # noqa: E402


@pytest.fixture
def unchecked_root(tmp_path):
    shutil.copytree(GOLDEN_V2, tmp_path / "root")
    return tmp_path / "root"


def test_format_2_steps_without_checksums_still_restore(unchecked_root):
    with open(unchecked_root / "1" / "_CHECKPOINT_METADATA") as f:
        assert '"crc32c"' not in f.read()  # the fixture predates the checksums: nothing to verify
    with xtc.CheckpointManager(unchecked_root, xtc.CheckpointManagerOptions(save_interval_steps=1)) as manager:
        assert manager.all_steps() == [1, 2] and manager.metadata(1).metrics == {"loss": 0.5}
        model = {k: torch.zeros_like(v) for k, v in make_v2.model_state("unchecked", 1).items()}
        loader, extra = {"position": 0, "epoch": 0}, {"name": "", "tokens": 0, "lr": 0.0, "pair": [0, ""]}
        assert manager.restore(1, model=model, data_loader=loader, extra=extra) == 1
        assert_trees_equal(model, make_v2.model_state("unchecked", 1))
        assert loader == make_v2.loader_state(1)
        assert extra == dict(make_v2.extra_state(), pair=[1, "two"])  # a tuple is updated as a list
        assert manager.restore("latest", model=model, data_loader=loader) == 2
        assert_trees_equal(model, make_v2.model_state("unchecked", 2))
        assert loader == make_v2.loader_state(2)


def test_the_command_line_verifies_format_2_steps_without_checksums(unchecked_root, capsys):
    assert cli.main(["verify", str(unchecked_root)]) == 0
    assert "OK: " in capsys.readouterr().out


# ------------------------------------------------------------------------------ format 2, zstd-compressed chunks

GOLDEN_ZSTD = os.path.join(os.path.dirname(__file__), "golden", "v2-zstd")  # golden/make_v2.py zstd


@pytest.fixture
def zstd_root(tmp_path):
    shutil.copytree(GOLDEN_ZSTD, tmp_path / "root")
    assert '"level":9},"name":"zstd"' in (tmp_path / "root" / "2" / "model" / "w" / "zarr.json").read_text()
    return tmp_path / "root"


def test_zstd_compressed_steps_restore_bit_for_bit_and_verify(zstd_root, capsys):
    with xtc.CheckpointManager(zstd_root, xtc.CheckpointManagerOptions(save_interval_steps=1)) as manager:
        assert manager.all_steps() == [1, 2]
        for step in (1, 2):
            expected = make_v2.model_state("zstd", step)
            model = {k: torch.zeros_like(v) for k, v in expected.items()}
            assert manager.restore(step, model=model) == step
            assert_trees_equal(model, expected)
    assert_trees_equal(xtc.restore(zstd_root / "1" / "data_loader"), {"position": 60, "epoch": 1})
    assert cli.main(["verify", str(zstd_root)]) == 0
    assert "OK: " in capsys.readouterr().out


@pytest.mark.xla
def test_zstd_compressed_steps_restore_onto_another_mesh(zstd_root):
    mesh = make_mesh((2, 4), ("a", "b"))
    for step in (1, 2):
        w = sharded(torch.zeros(10, 6), mesh, ("b", "a"))  # resharded: chunks read in parts
        out = xtc.restore(zstd_root / str(step) / "model", {**make_v2.model_state("zstd", step), "w": w})
        assert torch.equal(out["w"].cpu(), make_v2.model_state("zstd", step)["w"])
