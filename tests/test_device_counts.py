"""A checkpoint saved on 8 devices restores in processes with 4, 2 and 1 devices and in one without torch_xla."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import sharded

import xla_tensorstore_ckpt as xtc

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "restore_elsewhere.py")


@pytest.mark.xla
def test_restore_with_other_device_counts_and_without_torch_xla(tmp_path, mesh_4x2, mesh_8):
    torch.manual_seed(0)
    expected = {"w": torch.randn(16, 12), "b": torch.randn(10, 6).to(torch.bfloat16), "u": torch.randn(7, 5)}
    xtc.save(tmp_path / "ck", {"w": sharded(expected["w"], mesh_4x2, ("x", "y")),
                               "b": sharded(expected["b"], mesh_8, ("d", None)),
                               "u": sharded(expected["u"], mesh_4x2, ("y", "x"))})
    runs = {}
    for label, devices, mode in [("d4", "4", "xla"), ("d2", "2", "xla"), ("d1", "1", "xla"), ("cpu", "8", "no-xla")]:
        env = dict(os.environ, CPU_NUM_DEVICES=devices, PJRT_DEVICE="CPU")
        runs[label] = subprocess.Popen([sys.executable, SCRIPT, str(tmp_path / "ck"), str(tmp_path / label), mode],
                                       env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for label, proc in runs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{label} failed:\n{err[-3000:]}"
        expected_devices = {"d4": 4, "d2": 2, "d1": 1, "cpu": 0}[label]
        assert f"devices={expected_devices}" in out
        restored = xtc.restore(tmp_path / label)
        for key, value in expected.items():
            assert restored[key].dtype == value.dtype and torch.equal(restored[key], value), (label, key)
