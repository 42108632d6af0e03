"""Runs checkpointed by torch_xla's own CheckpointManager (its `save` and `save_async`, 8 CPU devices, a 2D mesh,
AdamW and a scheduler; tests/scripts/torch_xla_manager.py) resume through this library: the manager's
``restore(init_from=TORCH_XLA_ROOT)`` restores model, optimizer (keyed by index or by parameter name), scheduler
and step from the newest complete step, and the loss curve continues bit for bit; its steps restore onto other
meshes and device counts; incomplete and hostile steps are skipped without running anything."""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import make_mesh
from gcs_emulator import free_port
from xla_stack import torch_xla

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import cli
from xla_tensorstore_ckpt.core.errors import CheckpointNotFoundError, ItemNotFoundError

pytestmark = pytest.mark.xla  # every test here needs torch_xla

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "scripts", "torch_xla_manager.py")
RESTORE_ELSEWHERE = os.path.join(HERE, "scripts", "restore_elsewhere.py")
sys.path.insert(0, os.path.dirname(SCRIPT))


def build(mesh):
    from torch_xla_manager import build  # imports torch_xla: the xla stack's only

    return build(mesh)


def train_step(*args):
    from torch_xla_manager import train_step

    return train_step(*args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[str, str, dict[int, float]]]:
    """Two torch_xla runs (optimizer state keyed by index; by parameter name): root, expected state after step
    6, and the losses of steps 1-8."""
    base = tmp_path_factory.mktemp("torch_xla")
    out = {}
    for kind, flags in (("index", []), ("fqn", ["--fqn"])):
        root, expected = str(base / kind), str(base / f"{kind}-expected")
        # A process of its own, not a fork (`forked.launch_job`): the script imports torch_xla.
        env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        env.pop("PJRT_DEVICE", None)
        proc = subprocess.run([sys.executable, SCRIPT, root, expected, *flags], env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
        losses = {int(k): v for k, v in result["losses"].items()}
        out[kind] = root, expected, losses
    return out


def assert_state(net, opt, expected: str) -> None:
    want = xtc.restore(expected)
    for key, value in want["model"].items():
        got = net.state_dict()[key]
        assert got.dtype == value.dtype and torch.equal(got.cpu(), value), key
    state = opt.state_dict()["state"]
    assert sorted(state) == sorted(int(k) for k in want["optim"])
    for index, entries in want["optim"].items():
        for name, value in entries.items():
            assert torch.equal(state[int(index)][name].cpu(), value), (index, name)


def test_a_torch_xla_run_resumes_and_its_loss_curve_continues_bit_for_bit(runs, tmp_path, mesh_4x2):
    root, expected, losses = runs["index"]
    assert sorted(os.listdir(root)) == ["2", "4", "6"]
    net, opt, sched = build(mesh_4x2)  # fresh: the optimizer has never stepped
    run = tmp_path / "run"
    with xtc.CheckpointManager(run, xtc.CheckpointManagerOptions(save_interval_steps=1)) as manager:
        step = manager.restore("latest", model=net, optimizer=opt, lr_scheduler=sched, init_from=root)
        assert step == 6
        torch_xla.sync()
        assert_state(net, opt, expected)
        assert torch_xla._XLAC._get_xla_sharding_spec(net.a.weight) != ""  # restored in place, sharding kept
        assert sched.last_epoch == 6 and sched.get_last_lr() == [0.01 * 0.5 ** 2]
        assert {s: train_step(net, opt, sched, s) for s in (7, 8)} == {7: losses[7], 8: losses[8]}
        manager.save(8, model=net, optimizer=opt, lr_scheduler=sched)
    net, opt, sched = build(mesh_4x2)
    with xtc.CheckpointManager(run) as manager:  # its own step wins over init_from
        assert manager.restore("latest", model=net, optimizer=opt, lr_scheduler=sched, init_from=root) == 8


def test_optimizer_state_keyed_by_name_onto_another_mesh(runs, tmp_path):
    root, expected, losses = runs["fqn"]
    mesh = make_mesh((2, 4), ("a", "b"))
    net, opt, sched = build(mesh)
    with xtc.CheckpointManager(tmp_path / "run") as manager:
        assert manager.restore("latest", model=net, optimizer=opt, lr_scheduler=sched, init_from=root) == 6
    torch_xla.sync()
    assert_state(net, opt, expected)
    assert opt.state_dict()["param_groups"][0]["params"] == [0, 1, 2, 3]
    assert sched.last_epoch == 6
    # Named entries (items=) and a missing one: told before anything is restored.
    net, opt, sched = build(mesh)
    with xtc.CheckpointManager(tmp_path / "other") as manager:
        with pytest.raises(ItemNotFoundError, match=r"has no 'nope' entry for optimizer=.*holds lr_scheduler, "
                                                    r"model, optimizer"):
            manager.restore("latest", model=net, optimizer=opt, init_from=root, items={"optimizer": "nope"})
        assert opt.state_dict()["state"] == {}


def test_incomplete_and_hostile_steps_are_skipped_and_nothing_runs(runs, tmp_path, mesh_4x2, caplog, capsys):
    source, _, _ = runs["index"]
    assert cli.main(["steps", source, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(s["step"], s["status"]) for s in listed] == [(2, "committed"), (4, "committed"), (6, "committed")]
    assert all(s["bytes"] > 0 and s["committed_at"] for s in listed)
    root = str(tmp_path / "copy")
    shutil.copytree(source, root)
    os.remove(os.path.join(root, "6", ".manager_metadata"))  # a save that never finished
    sentinel = tmp_path / "ran"

    class RunsCode:
        def __reduce__(self):
            return os.system, (f"touch {sentinel}",)

    with open(os.path.join(root, "4", ".manager_metadata"), "wb") as f:
        f.write(pickle.dumps(RunsCode(), protocol=2))
    net, opt, sched = build(mesh_4x2)
    with caplog.at_level(logging.WARNING, "xla_tensorstore_ckpt"), \
            xtc.CheckpointManager(tmp_path / "run") as manager:
        assert manager.restore("latest", model=net, optimizer=opt, lr_scheduler=sched, init_from=root) == 2
    assert "refusing to load class posix.system" in caplog.text
    assert cli.main(["steps", root, "--json"]) == 0
    listed = {s["step"]: s for s in json.loads(capsys.readouterr().out)}
    assert [listed[s]["status"] for s in (2, 4, 6)] == ["committed", "partial", "partial"]
    assert "posix.system" in listed[4]["problem"] and ".manager_metadata" in listed[6]["problem"]
    assert not sentinel.exists()
    assert sched.last_epoch == 2
    os.remove(os.path.join(root, "2", ".manager_metadata"))
    shutil.rmtree(os.path.join(root, "4"))
    with xtc.CheckpointManager(tmp_path / "run2") as manager, \
            pytest.raises(CheckpointNotFoundError, match="no complete step"):
        manager.restore("latest", model=net, init_from=root)


def test_a_step_restores_directly_onto_4_devices_in_another_process(runs, tmp_path):
    root, expected, _ = runs["index"]
    out = str(tmp_path / "on4")
    env = dict(os.environ, CPU_NUM_DEVICES="4", PJRT_DEVICE="CPU")
    proc = subprocess.run([sys.executable, RESTORE_ELSEWHERE, os.path.join(root, "6"), out, "xla"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "devices=4" in proc.stdout
    got, want = xtc.restore(out), xtc.restore(expected)
    for key, value in want["model"].items():
        assert torch.equal(got["model"][key], value), key
    for index, entries in want["optim"].items():
        for name, value in entries.items():
            assert torch.equal(got["optim"]["state"][index][name], value), (index, name)
    assert got["step"] == 6 and got["scheduler"]["last_epoch"] == 6


def test_views_of_a_torch_xla_manager_root(runs, tmp_path, capsys):
    """The report, stats, layouts and the step-to-step diff read a torch_xla CheckpointManager root."""
    source, _, _ = runs["index"]
    out = tmp_path / "report.html"
    assert cli.main(["report", source, "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    data = json.loads(out.read_text().split('id="report-data">', 1)[1].split("</script>", 1)[0])
    assert [s["step"] for s in data["steps"]] == [2, 4, 6] and (data["diff"]["a"], data["diff"]["b"]) == (4, 6)
    assert data["stats"] and any(layer["changed"] for layer in data["diff"]["layers"])
    key = data["stats"][0]["key"]
    assert cli.main(["stats", os.path.join(source, "6"), key, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["count"] == data["stats"][0]["count"]
    assert cli.main(["show", os.path.join(source, "6"), key, "--layout"]) == 0
