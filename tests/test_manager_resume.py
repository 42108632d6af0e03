"""Resume of the whole training state in a new process: N straight steps equal k steps → save → new process →
restore("latest") → the remaining steps, bit for bit; on another mesh, equal within float tolerance."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import xla_tensorstore_ckpt as xtc

pytestmark = pytest.mark.xla  # every test here needs torch_xla

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "train.py")
STEPS, STOP = 6, 3


def start(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="8")
    return subprocess.Popen([sys.executable, SCRIPT, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> list[dict]:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("resume")
    straight = start("--root", str(base / "straight"), "--steps", str(STEPS), "--out", str(base / "straight.out"))
    stopped = start("--root", str(base / "ckpt"), "--steps", str(STEPS), "--save-every", "1", "--stop-at",
                    str(STOP), "--async")
    straight_log, stopped_log = finish(straight), finish(stopped)
    assert {"stopped": STOP} in stopped_log
    os.system(f"cp -r {base / 'ckpt'} {base / 'ckpt-other-mesh'}")
    same = start("--root", str(base / "ckpt"), "--steps", str(STEPS), "--resume", "latest", "--save-every", "1",
                 "--out", str(base / "same.out"))
    other = start("--root", str(base / "ckpt-other-mesh"), "--steps", str(STEPS), "--resume", "latest",
                  "--mesh", "2x4", "--out", str(base / "other.out"))
    same_log, other_log = finish(same), finish(other)
    return {"straight": (straight_log, xtc.restore(base / "straight.out")),
            "stopped": (stopped_log, None),
            "same": (same_log, xtc.restore(base / "same.out")),
            "other": (other_log, xtc.restore(base / "other.out"))}


def test_resumed_run_matches_straight_run_bit_for_bit(runs):
    straight_log, straight = runs["straight"]
    stopped_log, _ = runs["stopped"]
    same_log, same = runs["same"]
    assert {"restored": STOP} in same_log and same["start"] == STOP
    straight_losses = [e["loss"] for e in straight_log if "loss" in e]
    stopped_losses = [e["loss"] for e in stopped_log if "loss" in e]
    assert stopped_losses == straight_losses[:STOP]
    assert same["losses"] == straight_losses[STOP:]  # every loss, exactly
    for key, value in straight["weights"].items():
        assert torch.equal(same["weights"][key], value), key


def test_resume_on_another_mesh_matches_within_tolerance(runs):
    _, straight = runs["straight"]
    other_log, other = runs["other"]
    assert {"restored": STOP} in other_log
    torch.testing.assert_close(torch.tensor(other["losses"]), torch.tensor(straight["losses"][STOP:]),
                               rtol=1e-4, atol=1e-5)
    for key, value in straight["weights"].items():
        torch.testing.assert_close(other["weights"][key], value, rtol=1e-4, atol=1e-5)
