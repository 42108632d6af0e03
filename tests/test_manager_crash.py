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

# (kill point, extra arguments, steps committed afterwards). Points are storage operations counted from the start of
# the last save (tests/fault_backends.py): open_array:n creates the n-th of the state's 6 arrays (in sync mode
# before its shards are staged, in async mode after), file_written:n follows the n-th finished chunk file (the
# others still in flight), write:1 is the item manifest, write:2 the commit marker, write:3 the lock heartbeat.
KEEP2 = ["--max-to-keep", "2"]
POINTS = [
    ("list_dir:1", [], [1, 2]),  # preparing the step directory
    *[(f"open_array:{n}", [], [1, 2]) for n in (1, 2, 3, 4, 5, 6)],  # array metadata (zarr.json)
    *[(f"open_array:{n}", ["--async"], [1, 2]) for n in (1, 3, 6)],
    *[(f"file_written:{n}", [], [1, 2]) for n in (1, 2, 3, 4, 5, 6)],  # chunk files (later ones in flight)
    *[(f"file_written:{n}", ["--async"], [1, 2]) for n in (1, 3, 5)],
    ("sync_files:1", [], [1, 2]),  # chunks written, not yet durable
    ("sync_files:1", ["--async"], [1, 2]),
    ("write:1", [], [1, 2]),  # the item manifest
    ("write:1", ["--async"], [1, 2]),
    ("write:2", [], [1, 2]),  # the commit marker
    ("write:2", ["--async"], [1, 2]),
    ("write:3", KEEP2, [1, 2, 3]),  # committed; the lock heartbeat (retention not yet decided)
    ("write:3", KEEP2 + ["--async"], [1, 2, 3]),
    ("delete:1", KEEP2, [1, 2, 3]),  # retention: before step 1's marker is removed
    ("delete_tree:1", KEEP2, [2, 3]),  # retention: step 1 uncommitted, its files not yet deleted
    ("delete:1", KEEP2 + ["--async"], [1, 2, 3]),
    ("delete_tree:1", KEEP2 + ["--async"], [2, 3]),
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
