"""kill -9 at points of a save: every earlier committed step stays restorable bit for bit, the partial step is
never listed (by our manager, nor by Orbax's), and the next manager start removes it and saves again."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

import pytest
from forked import run_forked
from helpers import assert_trees_equal
from orbax_process import orbax

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt.core import layout

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "crash_save.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
from crash_save import state_for  # noqa: E402

# (kill point, extra arguments, steps committed afterwards). Points are storage operations counted from the start of
# the last save (tests/fault_backends.py). With arrays in an OCDBT store (the default), for the 7 arrays of the
# state (6 tensors and a scalar): open_array:1-7 create their metadata in one transaction; the chunks go to the
# process's own stores around the storage backend (arrays/direct_ocdbt.py), killed in the middle by fsize:N (the
# first write taking a file past N bytes); sync_files:1 makes this process's stores durable, list_dir:2 and
# open_array:8-11 merge them, sync_files:2 makes the merge durable; write:1 is the item manifest, write:2 its
# commit_success.txt, write:3 the step's marker, write:4 its commit_success.txt, rename_dir:1 puts the step in
# place (the commit), write:5 refreshes the lock. Retention (step 1, with --max-to-keep 2): rename_dir:2 renames
# it away (uncommitted from then on), then delete and delete_tree. With --plain (a directory per array),
# file_written:n follows the n-th finished chunk file, the others in flight.
KEEP2 = ["--max-to-keep", "2"]
PLAIN = ["--plain"]
POINTS = [
    ("list_dir:1", [], [1, 2]),  # preparing the step directory
    *[(f"open_array:{n}", [], [1, 2]) for n in (1, 4, 7)],
    ("open_array:1", ["--async"], [1, 2]),
    ("fsize:8192", [], [1, 2]),  # writing a data file of chunks
    ("fsize:8192", ["--async"], [1, 2]),
    ("sync_files:1", [], [1, 2]),  # chunks written, not yet durable
    ("sync_files:1", ["--async"], [1, 2]),
    ("list_dir:2", [], [1, 2]),  # about to merge the per-process stores
    ("open_array:8", [], [1, 2]),  # merging
    ("open_array:10", ["--async"], [1, 2]),
    ("sync_files:2", [], [1, 2]),  # merged, not yet durable
    ("write:1", [], [1, 2]),  # the item manifest
    ("write:2", ["--async"], [1, 2]),
    ("write:3", [], [1, 2]),  # the step marker, in the temporary directory
    ("write:4", [], [1, 2]),
    ("rename_dir:1", [], [1, 2]),  # everything written, not yet in place
    ("rename_dir:1", ["--async"], [1, 2]),
    ("write:5", KEEP2, [1, 2, 3]),  # committed; the lock heartbeat (retention not yet decided)
    ("write:5", KEEP2 + ["--async"], [1, 2, 3]),
    ("rename_dir:2", KEEP2, [1, 2, 3]),  # retention: step 1 about to be renamed away
    ("delete:1", KEEP2, [2, 3]),  # retention: step 1 renamed away, its files not yet deleted
    ("delete_tree:1", KEEP2 + ["--async"], [2, 3]),
    *[(f"file_written:{n}", PLAIN, [1, 2]) for n in (1, 3, 6)],  # chunk files (later ones in flight)
    ("file_written:2", PLAIN + ["--async"], [1, 2]),
    ("open_array:3", PLAIN, [1, 2]),
    ("sync_files:1", PLAIN, [1, 2]),
    ("write:3", PLAIN, [1, 2]),
    ("rename_dir:1", PLAIN + KEEP2, [1, 2]),
    ("delete:1", PLAIN + KEEP2, [2, 3]),
]


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    base = tmp_path_factory.mktemp("crash")
    # Each kill point in a process of its own, forked from one that imported everything once.
    procs = run_forked(SCRIPT, [[base / str(index), "--kill-at", point, *extra]
                                for index, (point, extra, _) in enumerate(POINTS)], parallel=3)
    # What Orbax's own CheckpointManager sees of each crashed root, before any manager of ours has cleaned up.
    seen_by_orbax = orbax("steps", *[base / str(index) for index in range(len(POINTS))])
    return base, procs, seen_by_orbax


@pytest.mark.parametrize("index", range(len(POINTS)), ids=[p[0] for p in POINTS])
def test_kill_mid_save_loses_nothing_committed(crashed, index):
    base, procs, seen_by_orbax = crashed
    point, _, expected = POINTS[index]
    killed_by = signal.SIGXFSZ if point.startswith("fsize:") else signal.SIGKILL
    assert procs[index].returncode == -killed_by, f"{point} was never reached:\n{procs[index].stderr[-2000:]}"
    root = base / str(index)
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=None, async_save=False,
                                           save_rng=False)
    # Orbax sees the same committed steps: a step that is not committed never looks finalized to it
    assert seen_by_orbax[str(root)] == {"all_steps": expected, "latest": expected[-1]}
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


def _dead_record(token: str) -> str:
    """A lock record of a process of this host that is gone: our pid, but started at another time."""
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": "another-boot:0",
                       "token": token, "heartbeat": 0.0})


@pytest.mark.parametrize("killed", ["releasing", "taking over"])
def test_a_process_killed_inside_the_lock_protocol_leaves_nothing_behind(tmp_path, killed):
    """An owner that took the root over and was killed between deleting the lock and its takeover marker left the
    marker, which no later manager removed (test_soak_short flaked on it: its kills can land in a saver's close);
    a contender killed between creating its takeover marker and writing the lock kept the stale lock from ever
    being taken over. The next manager owns the root, saves, and leaves no lock file."""
    takeover = f"{layout.MANAGER_LOCK}.takeover."
    if killed == "releasing":
        (tmp_path / f"{takeover}{'a' * 32}").write_text(_dead_record("b" * 32))
    else:
        (tmp_path / layout.MANAGER_LOCK).write_text(_dead_record("a" * 32))
        (tmp_path / f"{takeover}{'a' * 32}").write_text(_dead_record("c" * 32))
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, async_save=False, save_rng=False)
    with xtc.CheckpointManager(tmp_path, options) as mgr:
        assert mgr.save(1, model=state_for(1))
    assert_trees_equal(xtc.restore(tmp_path / "1" / "model"), state_for(1))
    assert sorted(os.listdir(tmp_path)) == ["1"]
