"""The offline command line on real checkpoints written by the library: golden tables, JSON output, slices,
statistics, diffs, verification, exports, bad input; and all of it without torch_xla."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import make_mesh, sharded
from helpers import ocdbt_data_files
from safetensors.torch import load_file
from xla_stack import xs

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import cli
from xla_tensorstore_ckpt.core import layout

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "no_xla_cli.py")


def weights(step):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(8, 4, generator=g).to(torch.bfloat16), "b": torch.arange(4.0) * step,
            "emb": torch.randn(16, 6, generator=g)}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli") / "ckpt"
    mesh = make_mesh((4, 2), ("data", "model"))
    xs.set_global_mesh(mesh)
    try:
        options = xtc.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=None, async_save=False,
                                               save_rng=False, save_options=xtc.SaveOptions(use_ocdbt=False))
        with xtc.CheckpointManager(root, options) as mgr:
            for step in (1, 2):
                w = weights(step)
                model = {"w": sharded(w["w"], mesh, ("data", "model")), "b": w["b"],
                         "emb": sharded(w["emb"], mesh, (("data", "model"), None))}
                mgr.save(step, model=model, extra={"position": 10 * step, "name": "run"},
                         metrics={"loss": 1.0 / step})
    finally:
        xs.set_global_mesh(None)
    for step in (1, 2):  # fixed commit times for golden output
        marker = root / str(step) / layout.CHECKPOINT_METADATA
        doc = json.loads(marker.read_text())
        doc["commit_timestamp_nsecs"] = (1_790_000_000 + step) * 10**9
        doc["custom_metadata"]["xla_tensorstore_ckpt"].pop("crc32c")  # edited by hand: no checksum to verify
        marker.write_text(json.dumps(doc))
    (root / "3" / "model").mkdir(parents=True)  # a partial step
    return root


def run(*argv, capsys):
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.xla
def test_steps_golden(root, capsys):
    status, out, _ = run("steps", root, capsys=capsys)
    assert status == 0
    assert out == (
        "step  status     committed                 size  metrics\n"
        "   1  committed  2026-09-21 14:13:21 UTC  464 B  loss=1\n"
        "   2  committed  2026-09-21 14:13:22 UTC  464 B  loss=0.5\n"
        "   3  partial    -                            -  no commit marker\n")
    status, out, _ = run("steps", root, "--json", capsys=capsys)
    doc = json.loads(out)
    assert [(s["step"], s["status"], s["bytes"]) for s in doc] == [(1, "committed", 464), (2, "committed", 464),
                                                                   (3, "partial", None)]


@pytest.mark.xla
def test_tree_golden(root, capsys):
    status, out, _ = run("tree", root / "2", capsys=capsys)
    assert status == 0
    spec_w = "mesh (4, 2) ('data', 'model') spec ('data', 'model')"
    spec_emb = "mesh (4, 2) ('data', 'model') spec (('data', 'model'), None)"
    assert out == (
        "key             shape    dtype     chunk   bytes  sharding / value\n"
        f"model/w         [8, 4]   bfloat16  [2, 2]   64 B  {spec_w}\n"
        "model/b         [4]      float32   [4]      16 B  unsharded\n"
        f"model/emb       [16, 6]  float32   [2, 6]  384 B  {spec_emb}\n"
        "extra/position           value                    20\n"
        'extra/name               value                    "run"\n'
        "3 arrays, 464 B; 2 values\n")
    status, out, _ = run("tree", root / "2", "extra", "--json", capsys=capsys)
    assert json.loads(out) == [{"key": "extra/position", "value": 20}, {"key": "extra/name", "value": "run"}]


@pytest.mark.xla
def test_show_reads_a_slice(root, capsys, monkeypatch):
    status, out, _ = run("show", root / "2", "model/emb[1:3, ::2]", "--json", capsys=capsys)
    assert status == 0
    doc = json.loads(out)
    expected = weights(2)["emb"][1:3, ::2]
    assert doc["shape"] == [2, 3] and np.allclose(doc["values"], expected.reshape(-1).tolist())
    status, out, _ = run("show", root / "2", "model/w[-1]", capsys=capsys)
    assert status == 0 and out.startswith("model/w[-1]: bfloat16 [4]")
    status, out, _ = run("show", root / "2", "model/b", capsys=capsys)
    assert "[0. 2. 4. 6.]" in out


@pytest.mark.xla
def test_stats_match_numpy(root, capsys):
    status, out, _ = run("stats", root / "1", "model/emb", "model/b", "--json", capsys=capsys)
    assert status == 0
    stats = {s["key"]: s for s in json.loads(out)}
    emb = weights(1)["emb"].double().numpy()
    assert stats["model/emb"]["count"] == 96 and stats["model/emb"]["nan"] == 0
    assert stats["model/emb"]["min"] == pytest.approx(emb.min()) and stats["model/emb"]["max"] == pytest.approx(
        emb.max())
    assert stats["model/emb"]["mean"] == pytest.approx(emb.mean()) and stats["model/emb"]["std"] == pytest.approx(
        emb.std())
    status, out, _ = run("stats", root / "1", "model/b", capsys=capsys)
    assert out == ("key      finite  min  p1  p25      p50      p75  p99  max  mean      std   zeros  nan  inf\n"
                   "model/b       4    0   0    0  1.00391  2.00781    3    3   1.5  1.11803  25.00%    0    0\n"
                   "quantiles: nearest rank; values within 0.39% (relative; below 1.2e-38, within 9.2e-41), exact "
                   "for bfloat16/8-bit types\n")


@pytest.mark.xla
def test_layout_of_a_sharded_array(root, capsys):
    """model/w was saved on a (4, 2) mesh ("data", "model") with spec ("data", "model"): one chunk per device."""
    status, out, _ = run("show", root / "2", "model/w", "--layout", "--json", capsys=capsys)
    view = json.loads(out)
    assert status == 0 and view["grid"] == [4, 2] and view["notes"] == []
    holders = {(b["rows"][0], b["cols"][0]): b["holders"] for b in view["boxes"]}
    assert holders == {(2 * r, 2 * c): [2 * r + c] for r in range(4) for c in range(2)}
    assert {b["bytes"] for b in view["boxes"]} == {2 * 2 * 2}
    status, out, _ = run("show", root / "2", "model/emb", "--layout", capsys=capsys)
    assert status == 0 and "d0" in out and "d7" in out and "mesh (4, 2)" in out


@pytest.mark.xla
def test_diff_golden(root, capsys):
    status, out, _ = run("diff", root / "1", root / "2", "--json", capsys=capsys)
    assert status == 0
    entries = {e["key"]: e for e in json.loads(out)}
    assert set(entries) == {"model/w", "model/b", "model/emb", "extra/position"}
    w1, w2 = weights(1)["w"].double(), weights(2)["w"].double()
    assert entries["model/w"]["max_abs_diff"] == pytest.approx(float((w2 - w1).abs().max()))
    assert entries["model/w"]["relative_l2"] == pytest.approx(float((w2 - w1).norm() / w1.norm()))
    assert entries["extra/position"] == {"key": "extra/position", "change": "value", "group": "extra", "a": 10,
                                         "b": 20}
    assert (entries["model/w"]["differing"], entries["model/w"]["elements"]) == (int((w2 != w1).sum()), 32)
    status, out, _ = run("diff", root / "2", root / "2", capsys=capsys)
    assert out == "no differences\n"


@pytest.mark.xla
def test_export_safetensors_split_and_torch(root, tmp_path, capsys):
    status, out, _ = run("export", root / "2", tmp_path / "st", "--format", "safetensors", "--max-file-size",
                         "300B", capsys=capsys)
    assert status == 0
    index = json.loads((tmp_path / "st" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 2 and index["metadata"]["total_size"] == 464
    loaded = {}
    for name in files:
        loaded.update(load_file(tmp_path / "st" / name))
    expected = weights(2)
    assert set(loaded) == {"w", "b", "emb"} and loaded["w"].dtype == torch.bfloat16
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key
    status, _, _ = run("export", root / "2", tmp_path / "one", "--format", "safetensors", capsys=capsys)
    assert sorted(os.listdir(tmp_path / "one")) == ["model.safetensors"]
    status, _, _ = run("export", root / "2", tmp_path / "model.pt", "--format", "torch", "--items", "model,extra",
                       capsys=capsys)
    assert status == 0
    pt = torch.load(tmp_path / "model.pt", weights_only=True)
    assert set(pt) == {"w", "b", "emb"}  # extra holds no tensors
    for key, value in expected.items():
        assert torch.equal(pt[key], value), key
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".xtckpt")]


def _corrupt_copy(root, tmp_path, how):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    chunk = copy / "2" / "model" / "emb" / "c" / "0" / "0"
    if how == "flip":
        data = bytearray(chunk.read_bytes())
        data[40] ^= 0x10
        chunk.write_bytes(bytes(data))
    else:
        chunk.unlink()
    return copy


@pytest.mark.parametrize("how", ["flip", "delete"])
@pytest.mark.xla
def test_verify_catches_damage(root, tmp_path, capsys, how):
    status, out, _ = run("verify", root, capsys=capsys)
    assert status == 0 and out.endswith("OK: 6 arrays checked, 0 problems\n")
    copy = _corrupt_copy(root, tmp_path, how)
    status, out, _ = run("verify", copy, capsys=capsys)
    assert status == 1
    problems = [line for line in out.splitlines() if line.startswith("FAIL ")]
    # The 8 chunks of this small array share one file: a flipped byte damages one chunk, a deleted file all.
    assert len(problems) == (1 if how == "flip" else 8)
    assert all("step 2: model/emb c/" in p and str(copy) in p for p in problems)
    assert all(("Digest mismatch" if how == "flip" else "missing") in p for p in problems)
    status, out, err = run("show", copy / "2", "model/emb", capsys=capsys)
    assert status == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_verify_catches_damage_in_an_ocdbt_store(tmp_path, capsys):
    with xtc.CheckpointManager(tmp_path / "root", xtc.CheckpointManagerOptions(save_interval_steps=1)) as mgr:
        mgr.save(1, model={"w": torch.randn(64, 64), "b": torch.ones(3)})
    assert run("verify", tmp_path / "root", capsys=capsys)[0] == 0
    largest = pathlib.Path(ocdbt_data_files(tmp_path / "root" / "1" / "model")[0])
    data = bytearray(largest.read_bytes())
    data[len(data) // 2] ^= 0x10
    largest.write_bytes(bytes(data))
    status, out, _ = run("verify", tmp_path / "root", capsys=capsys)
    assert status == 1 and "FAIL step 1: model/w" in out and "model/b" not in out


@pytest.mark.parametrize("argv,status,message", [
    (["tree", "{tmp}"], 2, "not a checkpoint"),
    (["tree", "{root}/9"], 2, "not a checkpoint"),
    (["tree", "{root}/3"], 2, "uncommitted"),
    (["show", "{root}/2", "model/nope"], 2, "unknown array"),
    (["show", "{root}/2", "optim/w"], 2, "unknown item"),
    (["show", "{root}/2", "model/w[0:2"], 2, "malformed"),
    (["show", "{root}/2", "model/w[0:2, 1, 3]"], 2, "3 indices"),
    (["show", "{root}/2", "model/w[9]"], 2, "out of range"),
    (["steps", "{tmp}"], 2, "no checkpoint steps"),
    (["bogus"], 2, "invalid choice"),
], ids=["not-a-checkpoint", "missing-step", "partial-step", "unknown-key", "unknown-item", "malformed-slice",
        "too-many-indices", "out-of-range", "no-steps", "bad-command"])
@pytest.mark.xla
def test_bad_input_is_one_line_and_the_right_status(root, tmp_path, capsys, argv, status, message):
    argv = [a.format(tmp=tmp_path, root=root) for a in argv]
    with pytest.raises(SystemExit) if argv == ["bogus"] else _nothing() as raised:
        code = cli.main(argv)
    code = raised.value.code if argv == ["bogus"] else code
    _, err = capsys.readouterr()
    assert code == status and message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.xla
def test_open_array_returns_a_tensorstore_array(root):
    array = xtc.open_array(str(root / "2"), "model/emb")
    assert array.shape == (16, 6)
    assert np.array_equal(array[2:4, 1:3].read().result(), weights(2)["emb"][2:4, 1:3].numpy())


@pytest.mark.xla
def test_every_command_runs_without_torch_xla(root, tmp_path):
    commands = [["steps", root], ["tree", root / "2"], ["show", root / "2", "model/w[0:2]"],
                ["stats", root / "2"], ["diff", root / "1", root / "2"], ["verify", root],
                ["show", root / "2", "model/w", "--layout"], ["report", root, "-o", tmp_path / "report.html"],
                ["export", root / "2", tmp_path / "x", "--format", "safetensors"],
                ["export", root / "2", tmp_path / "x.pt", "--format", "torch"]]
    env = dict(os.environ)
    env.pop("PJRT_DEVICE", None)
    proc = subprocess.run([sys.executable, SCRIPT, json.dumps([[str(a) for a in c] for c in commands])],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["status"] for r in results] == [0] * len(commands), [r["stderr"] for r in results]
    assert not any(r["torch_xla_imported"] for r in results)
    assert "model/w" in results[1]["stdout"]


@pytest.mark.xla
def test_module_entry_point(root):
    proc = subprocess.run([sys.executable, "-m", "xla_tensorstore_ckpt", "steps", str(root), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and [s["step"] for s in json.loads(proc.stdout)] == [1, 2, 3]


@pytest.mark.xla
def test_progress_bar_only_on_a_terminal(root, capsys, monkeypatch):
    _, _, err = run("stats", root / "2", capsys=capsys)
    assert err == ""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    status = cli.main(["verify", str(root)])
    err = capsys.readouterr().err
    assert status == 0 and "verify [" in err and "6/6" in err
