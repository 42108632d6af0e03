"""Asynchronous saves: the caller blocks only for the copy off the devices, values are those at save() time,
background errors are never lost, bounded pending saves and host memory, save on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from fault_backends import hooked, wait_for
from helpers import assert_trees_equal, cpu_state, train_steps, xla_net
from xla_stack import torch_xla

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt.core import events, layout


def async_options(**kw):
    kw.setdefault("save_interval_steps", 1)
    kw.setdefault("max_to_keep", None)
    return xtc.CheckpointManagerOptions(**kw)


def test_async_is_the_default():
    assert xtc.CheckpointManagerOptions().async_save is True


@pytest.mark.xla
def test_written_values_are_those_at_save_time(tmp_path, mesh_4x2):
    net = xla_net(mesh_4x2)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    train_steps(net, opt, 2)
    extra = {"buf": torch.arange(6.0), "position": 5, "nested": [torch.ones(2)]}
    expected_model = cpu_state(net)
    expected_opt = {i: {k: v.cpu().clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())}
    gate = threading.Event()  # the background writes open no array (and so write nothing) until it is set
    with xtc.CheckpointManager(hooked(tmp_path, wait_for("open_array", gate)), async_options()) as mgr:
        try:
            assert mgr.save(2, model=net, optimizer=opt, extra=extra)
            assert mgr.all_steps() == []  # returned before the commit
            train_steps(net, opt, 3, seed=7)  # parameters and optimizer state change on the devices
            extra["buf"].add_(100)
            extra["position"] = 99
            extra["nested"][0].mul_(-1)
        finally:
            gate.set()
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2]
        fresh = xla_net(mesh_4x2, seed=3)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        fresh_extra = {"buf": torch.zeros(6), "position": 0, "nested": [torch.zeros(2)]}
        mgr.restore("latest", model=fresh, optimizer=fresh_opt, extra=fresh_extra)
    for key, value in expected_model.items():
        assert torch.equal(cpu_state(fresh)[key], value), key
    for i, state in enumerate(fresh_opt.state.values()):
        for name, value in state.items():
            assert torch.equal(value.cpu(), expected_opt[i][name]), name
    assert_trees_equal(fresh_extra, {"buf": torch.arange(6.0), "position": 5, "nested": [torch.ones(2)]})


@pytest.mark.parametrize("where", ["save", "wait_until_finished", "restore", "close"])
def test_background_error_is_reraised_with_step_and_cause(tmp_path, where):
    disk_full = threading.Event()

    def hook(operation, path, count):
        if operation == "sync_files" and disk_full.is_set():
            raise xtc.StorageError(f"disk full while syncing {path}")

    mgr = xtc.CheckpointManager(hooked(tmp_path, hook), async_options())
    mgr.save(1, extra={"v": torch.ones(2)})
    mgr.wait_until_finished()
    disk_full.set()
    assert mgr.save(2, extra={"v": torch.ones(2)})  # returns: the failure happens in the background
    with pytest.raises(xtc.AsyncSaveError, match="step 2") as err:
        if where == "save":
            mgr.save(3, extra={"v": torch.ones(2)})  # waits for the slot of save 2, then reports its failure
        elif where == "restore":
            mgr.restore("latest", extra={"v": torch.zeros(2)})
        else:
            getattr(mgr, where)()
    assert isinstance(err.value.__cause__, xtc.StorageError) and "disk full" in str(err.value)
    assert err.value.step == 2
    disk_full.clear()
    if where == "close":
        mgr = xtc.CheckpointManager(tmp_path, async_options())
    assert mgr.all_steps() == [1]  # the failed step is not committed; the earlier one is intact
    extra = {"v": torch.zeros(2)}
    assert mgr.restore("latest", extra=extra) == 1 and torch.equal(extra["v"], torch.ones(2))
    assert mgr.save(4, extra={"v": torch.ones(2)})  # the error was reported once; saving works again
    mgr.close()
    assert 2 not in xtc.CheckpointManager(tmp_path, async_options()).all_steps()


def test_a_failed_copy_off_the_devices_is_reported_by_the_commit(tmp_path, monkeypatch):
    # An asynchronous save returns once this process's copies are made, without an agreement on the others'
    # (what a training step waits for): a failed copy is raised by the commit's agreement, on every process.
    from xla_tensorstore_ckpt.saves import staging

    mgr = xtc.CheckpointManager(tmp_path, async_options())
    mgr.save(1, extra={"v": torch.ones(2)})
    mgr.wait_until_finished()

    def failing(*args, **kwargs):
        raise xtc.StorageError("out of host memory while staging")

    monkeypatch.setattr(staging, "fetch_sources", failing)
    assert mgr.save(2, extra={"v": torch.full((2,), 2.0)})
    with pytest.raises(xtc.AsyncSaveError, match="step 2") as err:
        mgr.wait_until_finished()
    assert isinstance(err.value.__cause__, xtc.StorageError) and "staging" in str(err.value)
    monkeypatch.undo()
    assert mgr.all_steps() == [1]
    assert mgr.save(3, extra={"v": torch.full((2,), 3.0)})
    mgr.close()
    extra = {"v": torch.zeros(2)}
    with xtc.CheckpointManager(tmp_path, async_options()) as fresh:
        assert fresh.restore("latest", extra=extra) == 3
    assert torch.equal(extra["v"], torch.full((2,), 3.0))


def test_a_new_save_waits_for_the_previous_commit_before_staging(tmp_path):
    heard = []

    def commits(operation, path, count):
        if operation == "write" and path.endswith(layout.CHECKPOINT_METADATA):
            time.sleep(0.3)  # a slow commit: a save that did not wait for it would stage meanwhile
            heard.append(("committing", path.split("/")[-2].split(".")[0]))

    def staged(event):  # told on the saving thread once the step's shards are staged
        if event.kind == events.SAVE_STAGED:
            heard.append(("staged", str(event.step)))

    with xtc.CheckpointManager(hooked(tmp_path, commits), async_options(save_rng=False, listeners=(staged,))) as mgr:
        mgr.save(1, extra={"t": torch.ones(4)})
        mgr.save(2, extra={"t": torch.ones(4)})
    assert heard == [("staged", "1"), ("committing", "1"), ("staged", "2"), ("committing", "2")]


def test_max_pending_saves_allows_overlap(tmp_path):
    release = threading.Event()
    root = hooked(tmp_path, wait_for("sync_files", release))
    with xtc.CheckpointManager(root, async_options(max_pending_saves=2, save_rng=False)) as mgr:
        mgr.save(1, extra={"t": torch.ones(4)})
        mgr.save(2, extra={"t": torch.ones(4)})  # returns although save 1 cannot commit until released
        assert mgr.all_steps() == []
        release.set()
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 2]


def test_max_host_bytes_streams_the_save(tmp_path):
    heard = []
    state = {f"t{i}": torch.randn(256, 256) for i in range(16)}  # 16 x 256 KiB = 4 MiB
    cap = 1 << 20
    options = async_options(max_host_bytes=cap, save_rng=False, listeners=(heard.append,),
                            save_options=xtc.SaveOptions(host_batch_bytes=256 << 10))
    with xtc.CheckpointManager(tmp_path, options) as mgr:
        mgr.save(1, model=state)
        mgr.wait_until_finished()
        (written,) = [e for e in heard if e.kind == events.SAVE_WRITTEN]
        assert written.details["chunk_bytes"] == 4 << 20  # all of it written,
        assert 256 << 10 <= written.details["peak_staged_bytes"] <= cap + (256 << 10)  # never more staged than this
        assert_trees_equal(xtc.restore(tmp_path / "1" / "model"), state)


@pytest.mark.xla
def test_sigterm_saves_commits_and_the_run_resumes(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "scripts", "train.py")
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="8")
    root = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, script, "--root", str(root), "--steps", "1000", "--save-every",
                             "1000", "--save-on-preemption", "--async", "--step-delay", "0.2"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = []
    for line in proc.stdout:
        log.append(json.loads(line))
        if log[-1].get("step") == 3:
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=300)
    log.extend(json.loads(line) for line in out.splitlines() if line.startswith("{"))
    assert proc.returncode == 0, err[-3000:]
    preempted = next(e["preempted"] for e in log if "preempted" in e)
    assert preempted >= 3
    with xtc.CheckpointManager(root, async_options()) as mgr:
        assert mgr.all_steps() == [preempted]  # only the preemption save (the interval is 1000)
    straight = subprocess.run([sys.executable, script, "--root", str(tmp_path / "straight"), "--steps",
                               str(preempted + 2)], env=env, capture_output=True, text=True, timeout=300)
    resumed = subprocess.run([sys.executable, script, "--root", str(root), "--steps", str(preempted + 2),
                              "--resume", "latest"], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight_losses = [json.loads(x)["loss"] for x in straight.stdout.splitlines() if '"loss"' in x]
    resumed_log = [json.loads(x) for x in resumed.stdout.splitlines() if x.startswith("{")]
    assert {"restored": preempted} in resumed_log
    assert [e["loss"] for e in resumed_log if "loss" in e] == straight_losses[preempted:]
    torch_xla.sync()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_on_commit_reports_each_committed_step_once(tmp_path, async_save):
    reported = []

    def on_commit(step):
        reported.append((step, step in xtc.CheckpointManager(tmp_path, async_options()).all_steps()))

    options = async_options(async_save=async_save, save_rng=False, max_to_keep=2, on_commit=on_commit)
    with xtc.CheckpointManager(tmp_path, options) as mgr:
        for step in range(1, 4):
            mgr.save(step, extra={"t": torch.full((4,), float(step))})
    assert reported == [(1, True), (2, True), (3, True)]  # each step was on disk, committed, when reported


def test_an_on_commit_error_is_reported_and_the_step_stays_committed(tmp_path):
    def on_commit(step):
        raise RuntimeError(f"callback failed for {step}")

    with xtc.CheckpointManager(tmp_path, async_options(save_rng=False, on_commit=on_commit)) as mgr:
        mgr.save(1, extra={"v": 1})
        with pytest.raises(xtc.AsyncSaveError, match="callback failed for 1"):
            mgr.wait_until_finished()
        assert mgr.all_steps() == [1]
