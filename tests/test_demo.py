"""The main job, at a reduced size: a broken demo fails the suite."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.xla  # every test here needs torch_xla

DEMO = os.path.join(os.path.dirname(__file__), "..", "examples", "demo.py")


def test_demo_runs_end_to_end_twice_in_a_row(tmp_path):
    """`make demo` is run again and again in one checkout: the second run finds the first's checkpoints and
    export, and must pass all the same (it owns both directories)."""
    for run in (1, 2):
        proc = subprocess.run([sys.executable, DEMO, "--small", "--checkpoint-dir", str(tmp_path / "ckpt"), "--steps",
                               "8", "--save-steps", "3", "--kill-at", "5"], capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, f"run {run}: " + proc.stdout[-3000:] + proc.stderr[-3000:]
        out = proc.stdout
        assert "losses identical to the last bit: True" in out and "all checks passed" in out
        assert "on 4 devices (mesh 2x2)" in out and "loadable with safetensors.torch.load_file" in out
        assert "SIGKILL sent" in out and "nothing was committed" not in out  # the kill waited for a commit
        assert sorted(os.listdir(tmp_path / "ckpt")) == ["3", "6", "8"]  # max_to_keep=3
        assert any(name.endswith(".safetensors") for name in os.listdir(tmp_path / "ckpt-export"))
