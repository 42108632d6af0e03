"""A restore planned without reading data: per key present/missing/unexpected, shapes, dtypes and lossy casts,
the bytes and chunks each process reads (equal to what the restore then reads, counted through its events), and
what a strict restore would refuse; `xtckpt plan` prints it and exits 1 on a refusal."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import sharded
from hf_files import write_hf_dir

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import cli
from xla_tensorstore_ckpt.core import events
from xla_tensorstore_ckpt.core.sharded_array import ShardedArray
from xla_tensorstore_ckpt.restores import restore_plan
from xla_tensorstore_ckpt.tools import inspection


class Bytes:
    def __init__(self):
        self.read = 0

    def __call__(self, event):
        if event.kind == events.RESTORE_FINISHED:
            self.read += event.nbytes


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g).to(torch.bfloat16), "n": 7}


@pytest.mark.parametrize("use_ocdbt", [True, False], ids=["ocdbt", "directories"])
@pytest.mark.xla
def test_the_plan_predicts_the_bytes_the_restore_reads(tmp_path, mesh_4x2, mesh_2x4, use_ocdbt):
    saved = {"w": sharded(state()["w"], mesh_4x2, ("x", "y")), "b": state()["b"], "n": 7}
    xtc.save(tmp_path / "ck", saved, options=xtc.SaveOptions(use_ocdbt=use_ocdbt))
    targets = {
        "another mesh": {"w": sharded(torch.zeros(64, 32), mesh_2x4, ("a", "b")), "b": torch.zeros(32), "n": 0},
        "cpu": None,
        "half the shards": {"w": ShardedArray.target((64, 32), torch.float32, (16, 32),
                                                     [((0, 16), (0, 32)), ((16, 32), (0, 32))]),
                            "b": torch.zeros(32, dtype=torch.bfloat16), "n": 0},
    }
    for name, target in targets.items():
        plan = xtc.plan_restore(tmp_path / "ck", target)
        counted = Bytes()
        xtc.restore(tmp_path / "ck", target, options=xtc.RestoreOptions(listeners=(counted,)))
        assert plan.ok and plan.read_bytes == counted.read > 0, name
    half = xtc.plan_restore(tmp_path / "ck", targets["half the shards"])
    by_key = {k.key: k for k in half.keys}
    assert by_key["w"].read_bytes == 32 * 32 * 4 and by_key["w"].chunks_per_shard == (2, 2)  # chunks of 16x16
    assert by_key["b"].lossy_cast is False and by_key["n"].status == "present"
    cpu = {k.key: k for k in xtc.plan_restore(tmp_path / "ck").keys}
    assert cpu["w"].read_bytes == 64 * 32 * 4 and cpu["w"].chunks == 8 and cpu["b"].chunks == 1


def test_the_plan_reports_what_a_strict_restore_refuses(tmp_path):
    xtc.save(tmp_path / "ck", state())
    target = {"w": torch.zeros(64, 16), "b": torch.zeros(32, dtype=torch.float16), "extra": torch.zeros(2)}
    plan = xtc.plan_restore(tmp_path / "ck", target)
    keys = {k.key: k for k in plan.keys}
    assert not plan.ok and len(plan.problems) == 3
    assert keys["w"].problem.startswith("checkpoint shape (64, 32) does not match target shape (64, 16)")
    assert keys["extra"].status == "missing" and keys["n"].status == "unexpected"
    assert keys["b"].lossy_cast and keys["b"].problem is None  # bfloat16 -> float16 loses range
    assert restore_plan._lossy("float32", "bfloat16") and not restore_plan._lossy("bfloat16", "float32")
    assert restore_plan._lossy("int64", "float32") and not restore_plan._lossy("int8", "float32")
    with pytest.raises(xtc.KeyMismatchError):
        xtc.restore(tmp_path / "ck", target)


def test_xtckpt_plan_per_process_and_against_another_model(tmp_path, capsys):
    hf = tmp_path / "hf"
    expected = write_hf_dir(str(hf))
    assert cli.main(["plan", str(hf), "--mesh", "4x2", "--processes", "2", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert [p["process"] for p in plans] == [0, 1]
    total = sum(t.numel() * t.element_size() for t in expected.values())
    assert sum(p["read_bytes"] for p in plans) == total  # every byte read by exactly one process
    for process, plan in enumerate(plans):  # the same as restoring onto that process's shards
        target = inspection.plan_target(inspection.open_checkpoint(str(hf)), "", None, mesh=(4, 2),
                                        process=process, processes=2)
        counted = Bytes()
        xtc.restore(hf, target, options=xtc.RestoreOptions(listeners=(counted,)))
        assert counted.read == plan["read_bytes"]
    xtc.save(tmp_path / "other", {"model.norm.weight": torch.zeros(48), "lm_head.weight": torch.zeros(10, 48)})
    assert cli.main(["plan", str(hf), "--target", str(tmp_path / "other")]) == cli.EXIT_DATA
    out = capsys.readouterr().out
    assert "does not match target shape" in out and "unexpected" in out and "refuses it" in out
