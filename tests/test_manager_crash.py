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
from xla_tensorstore_ckpt import layout

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "crash_save.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
from crash_save import state_for  # noqa: E402

# (kill point, extra arguments, steps committed afterwards). The state has 6 arrays, staged one batch each; the
# last save's calls are counted, so e.g. arrays.write:4 is the fourth array's chunk writes.
KEEP2 = ["--max-to-keep", "2"]
POINTS = [
    *[(f"saving.stage:{n}", [], [1, 2]) for n in (1, 3, 6)],  # copying shards to host
    *[(f"saving.stage:{n}", ["--async"], [1, 2]) for n in (2, 5)],
    *[(f"arrays.create:{n}", [], [1, 2]) for n in (1, 2, 4, 6)],  # array metadata (zarr.json)
    *[(f"arrays.create:{n}", ["--async"], [1, 2]) for n in (3,)],
    *[(f"arrays.write:{n}", [], [1, 2]) for n in (1, 2, 4, 6)],  # chunk writes (earlier ones in flight)
    *[(f"arrays.write:{n}", ["--async"], [1, 2]) for n in (1, 5)],
    ("arrays.wait_all:1", [], [1, 2]),  # waiting for the chunk writes
    ("arrays.wait_all:1", ["--async"], [1, 2]),
    ("storage.sync_files:1", [], [1, 2]),  # chunks written, not yet durable
    ("storage.sync_files:1", ["--async"], [1, 2]),
    ("saving.write_manifest:1", [], [1, 2]),  # before the item manifest
    ("saving.write_manifest:1", ["--async"], [1, 2]),
    ("os.replace:1", [], [1, 2]),  # the manifest's temporary file is written, not yet in place
    ("storage.write:1", [], [1, 2]),  # the manifest
    ("storage.write:2", [], [1, 2]),  # the commit marker
    ("os.replace:2", [], [1, 2]),  # the marker's temporary file written, not yet in place
    ("storage.write:2", ["--async"], [1, 2]),
    ("os.replace:2", ["--async"], [1, 2]),
    ("storage.write:3", KEEP2, [1, 2, 3]),  # committed; the lock heartbeat (retention not yet decided)
    ("storage.delete:1", KEEP2, [1, 2, 3]),  # retention: before step 1's marker is removed
    ("storage.delete_tree:1", KEEP2, [2, 3]),  # retention: step 1 uncommitted, its files not yet deleted
    ("storage.delete:1", KEEP2 + ["--async"], [1, 2, 3]),
    ("storage.delete_tree:1", KEEP2 + ["--async"], [2, 3]),
]


def run(root, point, extra):
    env = dict(os.environ)
    env.pop("PJRT_DEVICE", None)
    return subprocess.run([sys.executable, SCRIPT, str(root), "--kill-at", point, *extra], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    base = tmp_path_factory.mktemp("crash")
    with ThreadPoolExecutor(3) as pool:
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
        leftovers = sorted(int(n) for n in os.listdir(root) if not n.startswith(layout.MANAGER_LOCK))
        assert leftovers == expected  # the partial step is gone
        assert mgr.save(4, model=state_for(4))
        assert mgr.all_steps() == [*expected, 4]
    assert_trees_equal(xtc.restore(root / "4" / "model"), state_for(4))
    # the dead process's stale lock was taken over (through a takeover marker), then freed with the marker
    assert not any(n.startswith(layout.MANAGER_LOCK) for n in os.listdir(root))
    assert not any(n.endswith(".tmp") for _, _, files in os.walk(root) for n in files)
