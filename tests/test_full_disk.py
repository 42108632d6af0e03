"""A file system that is really full (ENOSPC for every write and directory, not a file-size limit): a small
tmpfs of its own, filled by a file beside the checkpoints. A save into it fails with an error naming the step or
path, leaves nothing half-written that a later run would read, keeps every committed checkpoint whole, and works
again once there is room. Mounting needs root (as on the test machines and in CI)."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import fill_file_system, small_file_system

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt.core import layout

STATE_BYTES = 1 << 20


@pytest.fixture
def small_fs(tmp_path):
    """A 32 MiB file system of its own at tmp_path/fs."""
    with small_file_system(tmp_path / "fs") as path:
        yield path


def state(step: int) -> dict:
    generator = torch.Generator().manual_seed(step)
    return {"w": torch.randn(STATE_BYTES // 4, generator=generator), "step": torch.tensor(step)}


def manager_options(**kwargs) -> xtc.CheckpointManagerOptions:
    return xtc.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=3, **kwargs)


def leftovers(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if not n.isdigit() and n != layout.MANAGER_LOCK) if os.path.isdir(
        root) else []


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_into_a_full_file_system_fails_naming_the_step_and_keeps_the_committed_ones(small_fs, async_save):
    root = small_fs / "ckpt"
    with xtc.CheckpointManager(root, manager_options(async_save=async_save)) as mgr:
        mgr.save(1, extra=state(1))
        mgr.wait_until_finished()
        ballast = fill_file_system(small_fs)
        with pytest.raises(xtc.CheckpointError) as err:
            mgr.save(2, extra=state(2))
            mgr.wait_until_finished()
        assert "step 2" in str(err.value) and str(root) in str(err.value), err.value
        assert mgr.all_steps() == [1]
        restored = {"w": torch.empty(STATE_BYTES // 4), "step": torch.tensor(0)}
        assert mgr.restore("latest", extra=restored) == 1
        assert torch.equal(restored["w"], state(1)["w"]) and int(restored["step"]) == 1
        os.remove(ballast)  # room again: the same step saves, and nothing of the failed attempt is left
        mgr.save(2, extra=state(2))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 2]
    assert leftovers(root) == []
    with xtc.CheckpointManager(root, manager_options()) as mgr:
        restored = {"w": torch.empty(STATE_BYTES // 4), "step": torch.tensor(0)}
        assert mgr.restore("latest", extra=restored) == 2
        assert torch.equal(restored["w"], state(2)["w"])


def test_a_full_file_system_never_replaces_an_item_and_leaves_no_temporary_copy(small_fs):
    path = small_fs / "item"
    xtc.save(path, state(1))
    before = sorted(os.listdir(small_fs))
    ballast = fill_file_system(small_fs)
    with pytest.raises(xtc.CheckpointError) as err:
        xtc.save(path, state(2), overwrite=True)
    assert str(path) in str(err.value), err.value
    os.remove(ballast)
    assert sorted(os.listdir(small_fs)) == before  # no temporary directory of the failed save
    restored = xtc.restore(path, {"w": torch.empty(STATE_BYTES // 4), "step": torch.tensor(0)})
    assert torch.equal(restored["w"], state(1)["w"]) and int(restored["step"]) == 1
