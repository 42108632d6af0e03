"""Multi-tier checkpoints in one process: a local tier saved more often than the persistent one, each with its own
retention; resume from the newest intact step of either; a damaged or missing local step falls back; a step due
for both tiers is copied off the devices once; the persistent tier on the GCS emulator."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import GCS_BUCKET, make_mesh, sharded
from forked import run_forked
from helpers import fill_file_system, ocdbt_data_files, small_file_system, undeletable
from xla_stack import torch_xla

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import formats, storage
from xla_tensorstore_ckpt.checkpoint_manager import local_tier
from xla_tensorstore_ckpt.core import layout
from xla_tensorstore_ckpt.saves import staging
from xla_tensorstore_ckpt.tools import inspection

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
from crash_save import state_for  # noqa: E402
from orbax_process import orbax  # noqa: E402


class Loader:
    """A data loader's resumable position."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position, "epoch": self.position // 7}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def cpu_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 128, generator=g), "b": torch.randn(64, 32, generator=g).to(torch.bfloat16)}


def place(cpu: dict, mesh) -> dict:
    return {"w": sharded(cpu["w"], mesh, ("x", "y")), "b": sharded(cpu["b"], mesh, (None, "x"))}


def options(local: str, **kw) -> xtc.CheckpointManagerOptions:
    base = dict(save_interval_steps=4, max_to_keep=2, local_directory=local, local_save_interval_steps=1,
                local_max_to_keep=2)
    return xtc.CheckpointManagerOptions(**{**base, **kw})


def train(root: str, local: str, steps: range, mesh, **kw) -> dict[int, float]:
    """Save each step of `steps` (the state of step s is cpu_state(s)); return the torch draw after each save."""
    draws = {}
    loader = Loader()
    with xtc.CheckpointManager(root, options(local, **kw)) as manager:
        for step in steps:
            model = place(cpu_state(step), mesh)
            loader.position = 10 * step
            torch.manual_seed(1000 + step)
            manager.save(step, model=model, data_loader=loader, extra={"step": step})
            draws[step] = torch.rand(1).item()
    return draws


def resume(root: str, local: str, mesh, **kw) -> tuple[int | None, dict, Loader, dict, float, list[str]]:
    model = place({"w": torch.zeros(256, 128), "b": torch.zeros(64, 32, dtype=torch.bfloat16)}, mesh)
    loader, extra = Loader(), {"step": -1}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with xtc.CheckpointManager(root, options(local, **kw)) as manager:
            step = manager.restore("latest", model=model, data_loader=loader, extra=extra)
    return step, model, loader, extra, torch.rand(1).item(), [str(w.message) for w in caught]


def assert_state(model: dict, step: int) -> None:
    expected = cpu_state(step)
    torch_xla.sync()
    for key in ("w", "b"):
        assert torch.equal(model[key].cpu(), expected[key]), key


def flip_byte(step_dir: str) -> str:
    """Flip one byte in the middle of the largest data file of the model item; return its path."""
    files = [os.path.join(d, f) for d, _, names in os.walk(os.path.join(step_dir, "model")) for f in names]
    path = max(files, key=os.path.getsize)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return path


@pytest.fixture
def mesh():
    return make_mesh((4, 2), ("x", "y"))


@pytest.fixture
def trained(tmp_path, mesh):
    root, local = str(tmp_path / "persistent"), str(tmp_path / "local")
    draws = train(root, local, range(1, 7), mesh)
    return root, local, draws


@pytest.mark.xla
def test_each_tier_keeps_its_own_steps(trained):
    root, local, _ = trained
    with xtc.CheckpointManager(root, options(local)) as manager:
        assert manager.all_steps("persistent") == [4]
        assert manager.all_steps("local") == [5, 6]  # local_max_to_keep=2
        assert manager.all_steps() == [4, 5, 6] and manager.latest_step() == 6
        assert manager.metadata(6).tiers == ("local",) and manager.metadata(6).writer == 0
        assert manager.metadata(4).tiers == ("persistent",) and manager.metadata(4).writer is None
        with pytest.raises(xtc.StepNotFoundError):
            manager.metadata(3)
    with xtc.CheckpointManager(root) as plain:  # the persistent tier alone is an ordinary root
        assert plain.all_steps() == [4]


@pytest.fixture(params=["local-disk", "gcs"])
def persistent_root(request, tmp_path):
    """Where the persistent tier goes: a local directory, or a prefix on the GCS emulator."""
    if request.param == "local-disk":
        return str(tmp_path / "persistent")
    request.getfixturevalue("gcs_emulator_server")
    return f"gs://{GCS_BUCKET}/multi-tier/{tmp_path.name}"


def steps_on_disk(root: str, gcs=None) -> list[int]:
    """The step directories under `root` as its storage holds them (raw objects on the emulator)."""
    if root.startswith("gs://"):
        prefix = root.split("/", 3)[3] + "/"
        return sorted({int(name[len(prefix):].split("/")[0]) for name in gcs.objects(GCS_BUCKET, prefix)
                       if name[len(prefix):].split("/")[0].isdigit()})
    return sorted(int(name) for name in os.listdir(root) if name.isdigit())


@pytest.mark.xla
def test_retention_is_per_tier(persistent_root, tmp_path, mesh, request):
    local = str(tmp_path / "local")
    kw = dict(max_to_keep=1, local_max_to_keep=3, save_interval_steps=2)
    train(persistent_root, local, range(1, 9), mesh, **kw)
    with xtc.CheckpointManager(persistent_root, options(local, **kw)) as manager:
        assert manager.all_steps("persistent") == [8]  # max_to_keep=1 of 2, 4, 6, 8
        assert manager.all_steps("local") == [6, 7, 8]  # local_max_to_keep=3 of 1..8
        assert manager.metadata(8).tiers == ("local", "persistent") and manager.metadata(6).tiers == ("local",)
    gcs = request.getfixturevalue("gcs_emulator_server") if persistent_root.startswith("gs://") else None
    assert steps_on_disk(persistent_root, gcs) == [8]
    assert steps_on_disk(local) == [6, 7, 8]


@pytest.mark.xla
def test_the_choice_is_logged(trained, mesh, caplog):
    root, local, _ = trained
    with caplog.at_level(logging.INFO, logger="xla_tensorstore_ckpt"):
        step, *_ = resume(root, local, mesh)
    assert step == 6
    assert f"restored step 6 from the local tier ({os.path.join(local, '6')})" in caplog.messages
    caplog.clear()
    shutil.rmtree(local)
    with caplog.at_level(logging.INFO, logger="xla_tensorstore_ckpt"):
        step, *_ = resume(root, local, mesh)
    assert step == 4
    assert f"restored step 4 from the persistent tier ({os.path.join(root, '4')})" in caplog.messages


@pytest.mark.xla
def test_resume_prefers_the_newer_local_step(trained, mesh):
    root, local, draws = trained
    step, model, loader, extra, draw, _ = resume(root, local, mesh)
    assert step == 6
    assert_state(model, 6)
    assert loader.position == 60 and extra == {"step": 6}
    assert draw == draws[6]  # the RNG state saved with the local step


@pytest.mark.xla
def test_resume_from_persistent_when_local_tier_is_gone(trained, mesh):
    root, local, draws = trained
    shutil.rmtree(local)
    step, model, loader, extra, draw, _ = resume(root, local, mesh)
    assert step == 4
    assert_state(model, 4)
    assert loader.position == 40 and extra == {"step": 4} and draw == draws[4]


@pytest.mark.xla
def test_damaged_local_step_is_skipped(trained, mesh):
    root, local, _ = trained
    flip_byte(os.path.join(local, "6"))
    step, model, loader, _, _, messages = resume(root, local, mesh)
    assert step == 5
    assert_state(model, 5)
    assert loader.position == 50
    assert any("skipping step 6 of the local tier" in m and "not intact" in m for m in messages), messages
    first_messages = messages
    flip_byte(os.path.join(local, "5"))
    step, model, _, _, _, messages = resume(root, local, mesh)
    assert step == 4
    assert_state(model, 4)
    assert sum("skipping step" in m for m in messages) == 1  # step 6 was deleted by the first resume
    assert any("deleting steps [6] of the local tier" in m for m in first_messages), first_messages


MALFORMED_MANIFESTS = {
    "Orbax's, malformed": {"tree_metadata": {"('w',)": 5}},
    "Orbax's, a look-alike index": {"tree_metadata": {"('w',)": {"key_metadata": [{"key": "\u00b2", "key_type": 1}],
                                                                  "value_metadata": {"value_type": "jax.Array"}}}},
    "a newer format": {"format_version": 99, "tree": {}},
    "not an object": [1, 2],
}


@pytest.mark.parametrize("damage", list(MALFORMED_MANIFESTS))
@pytest.mark.xla
def test_a_malformed_local_step_is_skipped_like_a_corrupt_one(trained, mesh, damage):
    root, local, _ = trained
    with open(os.path.join(local, "6", "model", "_METADATA"), "w") as f:
        json.dump(MALFORMED_MANIFESTS[damage], f)
    step, model, _, _, _, messages = resume(root, local, mesh)
    assert step == 5
    assert_state(model, 5)
    assert any("skipping step 6 of the local tier" in m and "_METADATA" in m for m in messages), messages


@pytest.mark.xla
def test_a_flipped_digit_in_a_local_data_loader_position_is_skipped(trained, mesh):
    """The position lives in the item's _METADATA (no array chunk holds it for us): its checksum finds the flip."""
    root, local, _ = trained
    metadata = os.path.join(local, "6", "data_loader", "_METADATA")
    with open(metadata) as f:
        text = f.read()
    assert text.count('{"value":60}') == 1
    with open(metadata, "w") as f:
        f.write(text.replace('{"value":60}', '{"value":61}'))
    with pytest.raises(xtc.CorruptCheckpointError, match="damaged") as err:
        xtc.restore(os.path.join(local, "6", "data_loader"))
    assert metadata in str(err.value)
    step, model, loader, extra, _, messages = resume(root, local, mesh)
    assert step == 5 and loader.position == 50 and extra == {"step": 5}  # never 61
    assert_state(model, 5)
    assert any("skipping step 6 of the local tier" in m and metadata in m and "damaged" in m for m in messages), \
        messages


@pytest.mark.xla
def test_the_command_line_reports_a_flipped_digit_in_a_local_step(trained, capsys):
    from xla_tensorstore_ckpt import cli

    _, local, _ = trained
    metadata = os.path.join(local, "6", "data_loader", "_METADATA")
    with open(metadata) as f:
        text = f.read()
    with open(metadata, "w") as f:
        f.write(text.replace('{"value":60}', '{"value":61}'))
    assert cli.main(["verify", os.path.join(local, "6")]) == cli.EXIT_DATA
    out = capsys.readouterr().out
    assert f"FAIL step 6: data_loader: {metadata}: the file is damaged" in out


@pytest.mark.xla
def test_training_goes_on_after_a_fallback(trained, mesh):
    root, local, _ = trained
    flip_byte(os.path.join(local, "6"))
    flip_byte(os.path.join(local, "5"))
    step, model, _, _, _, _ = resume(root, local, mesh)
    assert step == 4
    with xtc.CheckpointManager(root, options(local)) as manager:  # steps 5 and 6 again, from another timeline
        assert manager.all_steps("local") == []  # the damaged steps were deleted by the resume
        for step in (5, 6):
            assert manager.should_save(step)
            manager.save(step, model=place(cpu_state(100 + step), mesh), data_loader=Loader(), extra={"step": step})
    with xtc.CheckpointManager(root, options(local)) as manager:
        assert manager.all_steps("local") == [5, 6]
        model = place(cpu_state(0), mesh)
        assert manager.restore("latest", model=model, data_loader=Loader(), extra={"step": -1}) == 6
    assert_state(model, 106)


@pytest.mark.xla
def test_a_local_tier_left_by_another_run_is_ignored(trained, tmp_path, mesh):
    _, local, _ = trained
    other_root = str(tmp_path / "another-run")
    with pytest.warns(UserWarning, match=r"ignoring steps \[5, 6\] of the local tier"):
        manager = xtc.CheckpointManager(other_root, options(local))
    with manager:
        assert manager.all_steps() == []
        assert manager.restore("latest", model=place(cpu_state(0), mesh)) is None  # not the other run's step 6
        manager.save(1, model=place(cpu_state(1), mesh))
        manager.save(2, model=place(cpu_state(2), mesh))
        manager.save(3, model=place(cpu_state(3), mesh))
        manager.wait_until_finished()
        assert manager.all_steps("local") == [2, 3]
    assert sorted(n for n in os.listdir(local) if n.isdigit()) == ["2", "3", "5", "6"]  # the other run's kept


@pytest.mark.xla
def test_steps_of_a_plain_manager_in_the_local_directory_are_left_alone(tmp_path, mesh):
    root, local = str(tmp_path / "persistent"), str(tmp_path / "local")
    with xtc.CheckpointManager(local, xtc.CheckpointManagerOptions(save_interval_steps=1)) as plain:
        plain.save(10, model=place(cpu_state(10), mesh))
    with pytest.warns(UserWarning, match=r"ignoring steps \[10\]"):
        manager = xtc.CheckpointManager(root, options(local))
    with manager:
        for step in (1, 2, 3):
            manager.save(step, model=place(cpu_state(step), mesh))
        manager.wait_until_finished()
        assert manager.all_steps("local") == [2, 3]
        assert manager.latest_step() == 3
    assert os.path.isdir(os.path.join(local, "10"))  # retention never touched it


@pytest.mark.xla
def test_a_missing_data_file_is_skipped(trained, mesh):
    root, local, _ = trained
    files = ocdbt_data_files(os.path.join(local, "6", "model"))
    assert len(files) > 1  # deleting one file of several: the others, and every manifest, stay
    os.remove(files[0])
    step, model, loader, _, _, messages = resume(root, local, mesh)
    assert step == 5 and loader.position == 50
    assert_state(model, 5)
    assert any("skipping step 6 of the local tier" in m for m in messages), messages


@pytest.mark.xla
def test_a_missing_item_is_a_user_error_not_damage(trained, mesh):
    """An object the step has no item for fails on every tier alike: raised, no fallback, nothing deleted."""
    root, local, _ = trained
    with xtc.CheckpointManager(root, options(local)) as manager:
        model = place(cpu_state(0), mesh)
        optimizer = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
        with pytest.raises(xtc.ItemNotFoundError, match=r"step 6 at .*local/6 has no 'lr_scheduler' item") as err:
            manager.restore("latest", model=model, lr_scheduler=scheduler)
        assert err.value.item == "lr_scheduler" and "data_loader" in err.value.items
        assert manager.all_steps("local") == [5, 6]
    assert sorted(n for n in os.listdir(local) if n.isdigit()) == ["5", "6"]


@pytest.mark.xla
def test_no_intact_step_and_an_empty_persistent_tier(tmp_path, mesh):
    root, local = str(tmp_path / "persistent"), str(tmp_path / "local")
    train(root, local, range(1, 3), mesh)  # save_interval_steps=4: nothing persistent
    for step in ("1", "2"):
        flip_byte(os.path.join(local, step))
    with xtc.CheckpointManager(root, options(local)) as manager:
        with pytest.warns(UserWarning, match="skipping step 2"):
            with pytest.raises(xtc.CorruptCheckpointError, match=rf"step 2 cannot be resumed: .* not committed in "
                               rf"the persistent tier {root}"):
                manager.restore(2, model=place(cpu_state(0), mesh))
        with pytest.warns(UserWarning, match="skipping step 1"):
            with pytest.raises(xtc.CorruptCheckpointError, match=r"no intact step to resume from: the local steps "
                               rf"\[2, 1\] \({local} here\) .* the persistent tier {root} holds no committed step"):
                manager.restore("latest", model=place(cpu_state(0), mesh))


@pytest.mark.xla
def test_background_errors_name_the_step_and_the_tier(tmp_path, mesh):
    root, local = str(tmp_path / "persistent"), str(tmp_path / "local")
    with small_file_system(local), xtc.CheckpointManager(root, options(local)) as manager:
        manager.save(1, model=place(cpu_state(1), mesh))
        manager.wait_until_finished()
        fill_file_system(local)  # the local tier's disk is full from step 2 on
        manager.save(2, model=place(cpu_state(2), mesh))
        with pytest.raises(xtc.AsyncSaveError, match=rf"asynchronous save of step 2 to the local tier \({local}\) "
                           "failed: writing step 2 at .*No space left on device") as err:
            manager.wait_until_finished()
        assert err.value.step == 2


@pytest.mark.xla
def test_a_local_delete_that_fails_at_restore_only_warns(trained, mesh):
    root, local, _ = trained
    flip_byte(os.path.join(local, "6"))
    with undeletable(os.path.join(local, "6")):
        step, model, _, _, _, messages = resume(root, local, mesh)
    assert step == 5  # the restore stands; step 6 stays behind, uncommitted for this manager only
    assert_state(model, 5)
    assert any(f"could not delete step 6 of the local tier ({os.path.join(local, '6')})" in m
               and "Operation not permitted" in m for m in messages), messages


@pytest.mark.xla
def test_partial_local_steps_are_removed_with_a_warning(trained, mesh):
    root, local, _ = trained
    os.makedirs(os.path.join(local, "7", "model"))  # a save that never committed
    os.makedirs(os.path.join(local, "8.orbax-checkpoint-tmp-123", "model"))
    with pytest.warns(UserWarning, match=rf"removed partial steps \['7', '8.orbax-checkpoint-tmp-123'\] of {local}"):
        xtc.CheckpointManager(root, options(local)).close()
    assert sorted(os.listdir(local)) == ["5", "6"]


@pytest.mark.xla
def test_local_steps_of_this_run_are_recognised_however_the_root_was_spelled(trained, mesh):
    """The persistent root recorded in a local marker is compared through storage.location, not as text."""
    root, local, _ = trained
    marker_path = os.path.join(local, "6", "_CHECKPOINT_METADATA")
    marker = formats.read_step(storage.location(os.path.join(local, "6")))
    with open(marker_path, "wb") as f:  # as another writer might have spelled it; re-sealed, so it verifies
        f.write(formats.encode_step(dataclasses.replace(marker, persistent_root=f"file://{root}/./")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "ignoring steps" warning
        with xtc.CheckpointManager(root, options(local)) as manager:
            assert manager.all_steps("local") == [5, 6]
    assert local_tier.same_root("/a/b/", "/a/./b") and local_tier.same_root("file:///a/b", "/a/b")
    assert local_tier.same_root(f"gs://{GCS_BUCKET}/run/", f"gs://{GCS_BUCKET}/run")
    assert not local_tier.same_root("/a/b", "/a/c") and not local_tier.same_root("nope://x", "/a")


@pytest.mark.xla
def test_local_chunk_missing_is_skipped(trained, mesh):
    root, local, _ = trained
    shutil.rmtree(os.path.join(local, "6", "model"))
    os.makedirs(os.path.join(local, "6", "model"))
    step, model, _, _, _, messages = resume(root, local, mesh)
    assert step == 5
    assert_state(model, 5)
    assert any("skipping step 6" in m for m in messages)


@pytest.mark.xla
def test_older_local_steps_lose_to_a_newer_persistent_step(tmp_path, mesh):
    root, local = str(tmp_path / "persistent"), str(tmp_path / "local")
    train(root, local, range(1, 3), mesh)
    train(root, str(tmp_path / "elsewhere"), [8], mesh)  # step 8 (due for both) from another local directory
    step, model, _, _, _, _ = resume(root, local, mesh)
    assert step == 8
    assert_state(model, 8)


@pytest.mark.xla
def test_a_step_due_for_both_tiers_is_copied_off_the_devices_once(tmp_path, mesh):
    root, local = str(tmp_path / "persistent"), str(tmp_path / "local")
    model = place(cpu_state(4), mesh)
    state_bytes = sum(t.nbytes for t in cpu_state(4).values())
    with xtc.CheckpointManager(root, options(local)) as manager:
        before = staging.FETCHED.snapshot()
        manager.save(4, model=model)
        manager.wait_until_finished()
        assert manager.metadata(4).tiers == ("local", "persistent")
        fetched = staging.FETCHED.since(before)
        assert fetched["device_arrays"] == 2 and fetched["device_bytes"] == state_bytes  # once, not once per tier
        before = staging.FETCHED.snapshot()
        manager.save(5, model=place(cpu_state(5), mesh))
    fetched = staging.FETCHED.since(before)
    assert fetched["device_arrays"] == 2 and fetched["device_bytes"] == state_bytes
    for directory in (root, local):
        with xtc.CheckpointManager(directory) as plain:
            model = place({"w": torch.zeros(256, 128), "b": torch.zeros(64, 32, dtype=torch.bfloat16)}, mesh)
            plain.restore(4, model=model)
            assert_state(model, 4)


@pytest.mark.xla
def test_sync_mode_and_host_memory_cap_save_both_tiers(tmp_path, mesh):
    for name, kw in (("sync", {"async_save": False}), ("capped", {"max_host_bytes": 1 << 16})):
        root, local = str(tmp_path / name / "persistent"), str(tmp_path / name / "local")
        train(root, local, range(3, 5), mesh, **kw)
        with xtc.CheckpointManager(root, options(local, **kw)) as manager:
            assert manager.all_steps("local") == [3, 4] and manager.all_steps("persistent") == [4]
        shutil.rmtree(local)
        step, model, _, _, _, _ = resume(root, local, mesh)
        assert step == 4
        assert_state(model, 4)


@pytest.mark.xla
def test_persistent_tier_on_the_gcs_emulator(tmp_path, mesh, gcs_emulator_server):
    root, local = f"gs://{GCS_BUCKET}/multi-tier/{tmp_path.name}", str(tmp_path / "local")
    train(root, local, range(3, 6), mesh)
    step, model, _, _, _, _ = resume(root, local, mesh)
    assert step == 5
    assert_state(model, 5)
    shutil.rmtree(local)
    step, model, _, _, _, _ = resume(root, local, mesh)
    assert step == 4
    assert_state(model, 4)


@pytest.mark.xla
def test_fallback_to_the_persistent_tier_on_the_gcs_emulator(tmp_path, mesh, gcs_emulator_server):
    root, local = f"gs://{GCS_BUCKET}/multi-tier/{tmp_path.name}", str(tmp_path / "local")
    draws = train(root, local, range(3, 6), mesh)  # persistent [4] on GCS, local [4, 5]
    flip_byte(os.path.join(local, "5"))
    flip_byte(os.path.join(local, "4"))
    step, model, loader, extra, draw, messages = resume(root, local, mesh)
    assert step == 4 and loader.position == 40 and extra == {"step": 4} and draw == draws[4]
    assert_state(model, 4)
    assert any("skipping step 5 of the local tier" in m for m in messages), messages
    assert any("skipping step 4 of the local tier" in m for m in messages), messages


def test_options_are_checked():
    with pytest.raises(ValueError, match="need local_directory"):
        xtc.CheckpointManagerOptions(local_save_interval_steps=5)
    with pytest.raises(ValueError, match="local_max_to_keep"):
        xtc.CheckpointManagerOptions(local_directory="/tmp/x", local_max_to_keep=0)


def test_the_local_tier_needs_its_own_directory(tmp_path):
    with pytest.raises(xtc.UsageError, match="needs a directory of its own"):
        xtc.CheckpointManager(tmp_path, xtc.CheckpointManagerOptions(local_directory=str(tmp_path)))


def test_unknown_tier_name(tmp_path):
    with xtc.CheckpointManager(str(tmp_path / "root")) as manager:
        with pytest.raises(ValueError, match="tier must be"):
            manager.all_steps("local")


@pytest.mark.xla
def test_cli_lists_both_tiers(trained, capsys):
    from xla_tensorstore_ckpt import cli

    root, local, _ = trained
    assert cli.main(["steps", root, "--local", local]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["step", "tier", "status"]
    assert [line.split()[:3] for line in lines[1:]] == [
        ["4", "persistent", "committed"], ["5", "local", "(process"], ["6", "local", "(process"]]
    assert cli.main(["steps", root, "--local", local, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(s["step"], s["tier"], s["writer"]) for s in doc] == [(4, "persistent", None), (5, "local", 0),
                                                                   (6, "local", 0)]


@pytest.mark.xla
def test_cli_marks_the_local_steps_a_manager_would_ignore(trained, tmp_path, mesh, capsys):
    from xla_tensorstore_ckpt import cli

    root, local, _ = trained
    with xtc.CheckpointManager(local, xtc.CheckpointManagerOptions(save_interval_steps=1)) as plain:
        plain.save(10, model=place(cpu_state(10), mesh))  # not a local tier's step
    other = str(tmp_path / "another-run")
    with pytest.warns(UserWarning, match="ignoring steps"):
        train(other, local, [12], mesh)  # a local step of another run
    assert cli.main(["steps", root, "--local", local]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "local (process 0 of 1)  committed" in rows["6"]
    assert "ignored" in rows["10"] and "not written by a local tier" in rows["10"]
    assert "ignored" in rows["12"] and f"another persistent root ({other})" in rows["12"]
    assert cli.main(["steps", root, "--local", local, "--processes", "2", "--json"]) == 0
    doc = {(s["step"], s["tier"]): s for s in json.loads(capsys.readouterr().out)}
    assert doc[(6, "local")]["ignored"] == "written by a job of 1 processes (this one has 2)"
    assert doc[(4, "persistent")]["ignored"] is None and doc[(6, "local")]["status"] == "committed"


CRASH = os.path.join(os.path.dirname(__file__), "scripts", "crash_multi_tier.py")
# Kill points of step 2's copy to the persistent tier, chosen by path (tests/scripts/crash_multi_tier.py), and the
# persistent steps committed afterwards. On local disk the step is written under a temporary name and renamed into
# place, for this library and for Orbax alike: before the rename neither lists it.
LOCAL_DISK_POINTS = {
    "before:sync_files": [1],  # its chunks written, not yet durable
    "before:write:model/_METADATA": [1],  # the item's manifest
    "before:write:_CHECKPOINT_METADATA": [1],  # the step's marker, in the temporary directory
    "after:write:_CHECKPOINT_METADATA": [1],
    "before:write:commit_success.txt": [1],  # the step's completion mark (Orbax's), after the marker
    "after:write:commit_success.txt": [1],
    "before:rename_dir": [1],  # everything written, not yet in place
    "after:rename_dir": [1, 2],  # in place: committed
}
# On an object store (no renames) the step is written in place: our marker, written last of ours, is our commit
# point; Orbax's is commit_success.txt, written after it. (ours, Orbax's) persistent steps afterwards.
OBJECT_STORE_POINTS = {
    "before:write:model/_METADATA": ([1], [1]),
    "before:write:_CHECKPOINT_METADATA": ([1], [1]),
    "after:write:_CHECKPOINT_METADATA": ([1, 2], [1]),  # committed for us; Orbax's mark not yet written
    "before:write:commit_success.txt": ([1, 2], [1]),
    "after:write:commit_success.txt": ([1, 2], [1, 2]),
}


def run_crashes(runs: dict[str, tuple]) -> dict[str, subprocess.CompletedProcess]:
    """The crashing processes, by kill point ((root, local) each), each run to its end (its exit is the event
    waited for), forked from one process that imported everything once."""
    procs = run_forked(CRASH, [[root, local, point] for point, (root, local) in runs.items()])
    return dict(zip(runs, procs))


def directory_of(point: str) -> str:
    return point.replace(":", "-").replace("/", "_")


def committed_steps(root) -> list[int]:
    """The persistent steps this library counts as committed, read without a manager (which would clean up)."""
    return [s.step for s in inspection.list_steps(str(root)) if s.status == "committed"]


def resume_after_the_crash(root, local) -> dict:
    """A restarted run: resumes from local step 2 (redoing its persistent copy if it never committed), waits for
    that copy; returns the restored model."""
    opts = xtc.CheckpointManagerOptions(save_interval_steps=1, local_directory=str(local),
                                        local_save_interval_steps=1)
    with xtc.CheckpointManager(root, opts) as manager:
        assert manager.all_steps("local") == [1, 2]
        model = {"w": torch.zeros(64, 32), "b": torch.zeros(2048, dtype=torch.bfloat16),
                 "layers": [{"k": torch.zeros(32, 32)} for _ in range(4)], "step": 0}
        assert manager.restore("latest", model=model) == 2
        manager.wait_until_finished()  # the redone copy, where the killed one never committed
        assert manager.all_steps("persistent") == [1, 2]
    return model


def assert_step_2(model, root: str) -> None:
    expected = state_for(2)
    assert all(torch.equal(model[k], expected[k]) for k in ("w", "b")) and model["step"] == 2
    restored = xtc.restore(f"{root}/2/model")
    assert torch.equal(restored["w"], expected["w"]) and restored["step"] == 2
    assert torch.equal(restored["layers"][3]["k"], expected["layers"][3]["k"])


@pytest.fixture(scope="module")
def crashed_copies(tmp_path_factory):
    base = tmp_path_factory.mktemp("crash-tiers")
    procs = run_crashes({point: (base / directory_of(point) / "persistent", base / directory_of(point) / "local")
                         for point in LOCAL_DISK_POINTS})
    # What Orbax's own CheckpointManager sees of each crashed root, before any manager of ours has cleaned up.
    seen_by_orbax = orbax("steps", *[base / directory_of(p) / "persistent" for p in LOCAL_DISK_POINTS])
    return base, procs, seen_by_orbax


@pytest.mark.parametrize("point", LOCAL_DISK_POINTS)
def test_kill_during_the_persistent_copy(crashed_copies, point):
    base, procs, seen_by_orbax = crashed_copies
    expected = LOCAL_DISK_POINTS[point]
    assert procs[point].returncode == -signal.SIGKILL, f"{point} never reached:\n{procs[point].stderr[-2000:]}"
    root, local = base / directory_of(point) / "persistent", base / directory_of(point) / "local"
    assert seen_by_orbax[str(root)] == {"all_steps": expected, "latest": expected[-1]}  # no partial step for Orbax
    assert committed_steps(root) == expected
    names = sorted(os.listdir(root))
    in_place = "2" in names
    assert in_place == (2 in expected) and any(layout.is_tmp_step_name(n) for n in names) != in_place, names
    created = formats.read_step(storage.location(root / "2")).created_at if in_place else None
    model = resume_after_the_crash(root, local)
    assert_step_2(model, str(root))
    if in_place:  # committed before the kill: kept, not redone
        assert formats.read_step(storage.location(root / "2")).created_at == created
    assert not any(layout.is_tmp_step_name(n) for n in os.listdir(root))  # the temporary directory is gone


@pytest.fixture(scope="module")
def crashed_copies_on_gcs(tmp_path_factory, gcs_emulator_server):
    base = tmp_path_factory.mktemp("crash-tiers-gcs")
    roots = {point: f"gs://{GCS_BUCKET}/crash-tiers/{base.name}/{directory_of(point)}" for point in OBJECT_STORE_POINTS}
    procs = run_crashes({point: (roots[point], base / directory_of(point)) for point in OBJECT_STORE_POINTS})
    seen_by_orbax = orbax("steps", *roots.values())
    # The raw objects of each step 2, before any manager of ours has cleaned up.
    objects = {point: [name.split("/2/", 1)[1] for name in gcs_emulator_server.objects(
        GCS_BUCKET, f"crash-tiers/{base.name}/{directory_of(point)}/2/")] for point in OBJECT_STORE_POINTS}
    return base, roots, procs, seen_by_orbax, objects


@pytest.mark.parametrize("point", OBJECT_STORE_POINTS)
def test_kill_during_the_persistent_copy_to_an_object_store(crashed_copies_on_gcs, point, gcs_emulator_server):
    base, roots, procs, seen_by_orbax, objects = crashed_copies_on_gcs
    ours, theirs = OBJECT_STORE_POINTS[point]
    root, local = roots[point], base / directory_of(point)
    assert procs[point].returncode == -signal.SIGKILL, f"{point} never reached:\n{procs[point].stderr[-2000:]}"
    assert seen_by_orbax[root] == {"all_steps": theirs, "latest": theirs[-1]}
    assert committed_steps(root) == ours
    files = objects[point]
    assert any(name.startswith("model/") for name in files), files  # the step was under way
    assert ("model/_METADATA" in files) == (point != "before:write:model/_METADATA")
    assert ("_CHECKPOINT_METADATA" in files) == (2 in ours)
    assert ("commit_success.txt" in files) == (2 in theirs)
    model = resume_after_the_crash(root, local)
    assert_step_2(model, root)
    prefix = root.split("/", 3)[3] + "/2/"
    assert {"_CHECKPOINT_METADATA", "commit_success.txt"} <= {
        name[len(prefix):] for name in gcs_emulator_server.objects(GCS_BUCKET, prefix)}
    if ours != theirs:  # committed for us only: the restarted manager finished Orbax's part of the commit
        assert orbax("steps", root)[root] == {"all_steps": [1, 2], "latest": 2}
