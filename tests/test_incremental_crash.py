"""kill -9 at each point of an incremental or delta save (tests/scripts/crash_save.py --incremental, the machinery of
test_manager_crash.py): every committed step stays restorable bit for bit, its bases included; retention never
leaves a step whose base is gone; the next manager removes the partial step and saves incrementally again."""

from __future__ import annotations

import os
import sys

import pytest
from forked import run_forked
from helpers import assert_trees_equal

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt.core import layout

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "crash_save.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
from crash_save import delta_state_for, incremental_state_for  # noqa: E402

# Storage operations counted from the start of step 3's save, whose base is step 2 (`w` and `layers` stored in
# step 1, referenced by both): read:1-2 the base item's manifest and chunk table; open_array:1-7 the arrays'
# metadata; write:1 this process's chunk table; sync_files:1 durability; list_dir:2 and read:3 the commit reading
# the tables; write:2 the item manifest, write:4 the step marker, rename_dir:1 the commit. With --max-to-keep 1,
# retention lets step 2 go and keeps step 1 (a base of step 3): rename_dir:2 renames step 2 away, delete:1 follows.
# With --delta (`b` moves a few elements a step), step 3's save also reads what it XORs with, the anchor's chunk
# (every delta is taken against the anchor): read:3 step 2's manifest, read:4 step 1's (the anchor); write:1 is
# its delta file, write:2 its table, write:5 the marker. With --max-chain 1, step 3 writes `b` whole and
# references step 1 only, so retention lets step 2 (a delta on step 1) go.
KEEP1 = ["--max-to-keep", "1"]
DELTA = ["--delta"]
DELTA_KEEP1 = ["--delta", "--max-chain", "1", *KEEP1]
POINTS = [
    ("read:1", [], [1, 2]),
    ("read:2", [], [1, 2]),
    ("open_array:4", [], [1, 2]),
    ("write:1", [], [1, 2]),
    ("write:1", ["--async"], [1, 2]),
    ("sync_files:1", [], [1, 2]),
    ("list_dir:2", [], [1, 2]),
    ("read:3", [], [1, 2]),
    ("write:2", [], [1, 2]),
    ("write:4", [], [1, 2]),
    ("rename_dir:1", [], [1, 2]),
    ("rename_dir:1", ["--async"], [1, 2]),
    ("rename_dir:2", KEEP1, [1, 2, 3]),
    ("delete:1", KEEP1, [1, 3]),
    ("read:3", DELTA, [1, 2]),
    ("read:4", DELTA, [1, 2]),
    ("write:1", DELTA, [1, 2]),
    ("write:2", ["--async", *DELTA], [1, 2]),
    ("write:5", DELTA, [1, 2]),
    ("rename_dir:1", DELTA, [1, 2]),
    ("rename_dir:2", DELTA_KEEP1, [1, 2, 3]),
    ("delete:1", DELTA_KEEP1, [1, 3]),
]


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    base = tmp_path_factory.mktemp("crash-incr")
    procs = run_forked(SCRIPT, [[base / str(index), "--kill-at", point, "--incremental", *extra]
                                for index, (point, extra, _) in enumerate(POINTS)], parallel=2)
    return base, procs


@pytest.mark.parametrize("index", range(len(POINTS)),
                         ids=[f"{p[0]}{''.join(a for a in p[1] if a in ('--async', '--delta'))}" for p in POINTS])
def test_kill_mid_incremental_save_loses_nothing_committed(crashed, index):
    base, procs = crashed
    point, extra, expected = POINTS[index]
    assert procs[index].returncode == -9, f"{point} was never reached:\n{procs[index].stderr[-2000:]}"
    root = base / str(index)
    delta = "--delta" in extra
    state = delta_state_for if delta else incremental_state_for
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=None, async_save=False,
                                           save_rng=False, incremental=True, delta=delta)
    with xtc.CheckpointManager(root, options) as mgr:
        assert mgr.all_steps() == expected
        for step in expected:
            assert set(mgr.metadata(step).bases) <= set(expected)  # no committed step lost a base
            assert_trees_equal(xtc.restore(root / str(step) / "model"), state(step))
        assert sorted(int(n) for n in os.listdir(root) if not n.startswith(layout.MANAGER_LOCK)) == expected
        assert mgr.save(4, model=state(4))
        # `w` and `layers` referenced from step 1; with deltas, `b` a delta on its anchor: step 1, or step 3 where
        # step 3 (--max-chain 1) wrote it whole
        rewrote = "--max-chain" in extra and 3 in expected
        assert mgr.metadata(4).bases == ((1, 3) if rewrote else (1,))
    assert_trees_equal(xtc.restore(root / "4" / "model"), state(4))
