"""The library on every storage backend (local disk, memory, a real GCS emulator): item save/restore with
resharding, the manager's commit/retention/latest/cleanup and root lock, async saves and the command line. (The
storage operations themselves: backend_contract.py, run by test_backends.py.)"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import sharded
from helpers import assert_trees_equal

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import cli, storage
from xla_tensorstore_ckpt.core import layout


@pytest.mark.xla
def test_item_round_trip_with_resharding(storage_root, mesh_4x2, mesh_2x4):
    src = torch.randn(16, 12)
    state = {"w": sharded(src, mesh_4x2, ("x", "y")), "b": torch.arange(5).to(torch.bfloat16), "step": 3,
             "small": sharded(torch.randn(8, 4), mesh_4x2, ("x", None))}
    path = f"{storage_root}/item"
    xtc.save(path, state)
    target = dict(state, w=sharded(torch.zeros(16, 12), mesh_2x4, ("b", "a")))
    out = xtc.restore(path, target)
    assert torch.equal(out["w"].cpu(), src) and out["step"] == 3
    assert_trees_equal(xtc.restore(path), {k: v.cpu() if isinstance(v, torch.Tensor) else v
                                           for k, v in state.items()})
    assert xtc.metadata(path)["w"].chunk_shape == (4, 6)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_manager_commit_retention_latest_and_cleanup(storage_root, async_save):
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=2, async_save=async_save)
    with xtc.CheckpointManager(storage_root, options) as mgr:
        for step in range(1, 5):
            mgr.save(step, model={"w": torch.full((4, 4), float(step))}, extra={"step": step})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [3, 4] and mgr.latest_step() == 4
    root = storage.location(storage_root)
    assert sorted(root.list()) == ["3", "4"]  # retention really deleted steps 1 and 2
    root.child("5", "model").write(layout.ITEM_METADATA, b"{}")  # a save that never committed
    with xtc.CheckpointManager(storage_root, options) as mgr:
        assert mgr.all_steps() == [3, 4]
        model = {"w": torch.zeros(4, 4)}
        assert mgr.restore("latest", model=model) == 4 and torch.equal(model["w"], torch.full((4, 4), 4.0))
    assert sorted(root.list()) == ["3", "4"]  # the partial step was removed


def test_command_line(storage_root, capsys):
    with xtc.CheckpointManager(storage_root, xtc.CheckpointManagerOptions(save_interval_steps=1)) as mgr:
        mgr.save(7, model={"w": torch.ones(3, 2)}, metrics={"loss": 0.25})
    assert cli.main(["steps", storage_root, "--json"]) == 0
    steps = json.loads(capsys.readouterr().out)
    assert [(s["step"], s["status"], s["metrics"]) for s in steps] == [(7, "committed", {"loss": 0.25})]
    assert cli.main(["tree", f"{storage_root}/7", "model"]) == 0
    assert "model/w" in capsys.readouterr().out
    assert cli.main(["verify", storage_root]) == 0
    assert "OK: " in capsys.readouterr().out


def race_two_managers(root) -> list[str]:
    """Two managers on one root, each saving step 1 at the same instant: what each saw."""
    barrier = threading.Barrier(2)

    def run(value):
        options = xtc.CheckpointManagerOptions(save_interval_steps=1, async_save=False, save_rng=False)
        try:
            with xtc.CheckpointManager(root, options) as mgr:
                barrier.wait()
                try:
                    mgr.save(1, model={"w": torch.full((4,), value)})
                    outcome = "saved"
                except xtc.CheckpointError as exc:
                    outcome = "refused" if "owned by another checkpoint manager" in str(exc) else repr(exc)
                barrier.wait()  # the winner keeps the lock until the loser has tried
                return outcome
        except BaseException:
            barrier.abort()  # never leave the other thread waiting
            raise

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(run, (1.0, 2.0)))


@pytest.mark.parametrize("stale", [False, True], ids=["free-root", "stale-lock"])
def test_two_managers_started_at_once_exactly_one_saves(storage_root, stale):
    for attempt in range(20):
        root = f"{storage_root}/race{attempt}"
        if stale:  # a crashed manager's lock from another host, long expired
            storage.location(root).write(layout.MANAGER_LOCK, json.dumps(
                {"host": "gone-host", "pid": 1, "token": f"dead{attempt}", "heartbeat": 0}).encode())
        outcomes = race_two_managers(root)
        assert sorted(outcomes) == ["refused", "saved"], (attempt, outcomes)
        model = {"w": torch.zeros(4)}
        with xtc.CheckpointManager(root, xtc.CheckpointManagerOptions(save_interval_steps=1)) as mgr:
            assert mgr.restore(1, model=model) == 1
        assert torch.equal(model["w"], torch.full((4,), 1.0 if outcomes[0] == "saved" else 2.0))
