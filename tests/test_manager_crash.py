"""kill -9 at points of a save: every earlier committed step stays restorable bit for bit, the partial step is
never listed, and the next manager start removes it and saves again."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_checkpointer_cpu import assert_trees_equal

import xla_tensorstore_ckpt as xtc

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "crash_save.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
from crash_save import state_for  # noqa: E402

# (kill point, extra arguments, steps committed afterwards)
POINTS = [
    ("saving.stage:1", [], [1, 2]),  # copying shards to host
    ("arrays.create:3", [], [1, 2]),  # writing array metadata (zarr.json)
    ("arrays.write:4", [], [1, 2]),  # in the middle of chunk writes
    ("storage.sync:1", [], [1, 2]),  # after the chunk writes, before they are durable
    ("saving.write_manifest:1", [], [1, 2]),  # before the item manifest
    ("storage.write:1", [], [1, 2]),  # first small-file write of the step (a manifest)
    ("storage.write:2", ["--async"], [1, 2]),  # the commit marker, asynchronous save
    ("storage.delete_tree:1", ["--max-to-keep", "2"], [2, 3]),  # retention: step 1 uncommitted, not deleted
]


def run(root, point, extra):
    env = dict(os.environ)
    env.pop("PJRT_DEVICE", None)
    return subprocess.run([sys.executable, SCRIPT, str(root), "--kill-at", point, *extra], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    base = tmp_path_factory.mktemp("crash")
    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(lambda args: run(base / str(args[0]), args[1][0], args[1][1]), enumerate(POINTS)))
    return base, procs


@pytest.mark.parametrize("index", range(len(POINTS)), ids=[p[0] for p in POINTS])
def test_kill_mid_save_loses_nothing_committed(crashed, index):
    base, procs = crashed
    point, _, expected = POINTS[index]
    assert procs[index].returncode == -9, f"{point} was never reached:\n{procs[index].stderr[-2000:]}"
    root = base / str(index)
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=None, async_save=False,
                                           save_rng=False)
    with xtc.CheckpointManager(root, options) as mgr:
        assert mgr.all_steps() == expected and mgr.latest_step() == expected[-1]
        for step in expected:
            assert_trees_equal(xtc.restore(root / str(step) / "model"), state_for(step))
        leftovers = sorted(int(n) for n in os.listdir(root))
        assert leftovers == expected  # the partial step is gone
        assert mgr.save(4, model=state_for(4))
        assert mgr.all_steps() == [*expected, 4]
    assert_trees_equal(xtc.restore(root / "4" / "model"), state_for(4))
    assert not any(n.endswith(".tmp") for _, _, files in os.walk(root) for n in files)
